"""What the GPU's clocks did while a benchmark ran: NVML's SM clock, board power and the reasons the driver gives
for holding the clocks down, sampled every few ms, so that a timing can say whether it ran at full clock or under
the power cap. A kernel that wins alone can lose that win inside a power-capped workload: faster kernels draw more
power, and the driver lowers the clock of everything around them.

    with ClockSampler(device_index) as s:
        run()
    s.summary()  # {"samples": n, "sm_mhz_mean": ..., "power_cap_share": ..., "sampler": ...}, or None

Where the sampling runs (`where`):
- "process" (the default): a child process (`python benchmarks/gpu_clocks.py --serve`, one per device and
  interval, started on first use and kept for the parent's life) samples between a "start" and a "stop" line on
  its stdin. The timed process only writes those two lines, outside the timed region, so the sampler takes none
  of its interpreter's time. A sampling thread can: each of its NVML reads gives up the GIL and takes it back,
  and an eager 1k prefill, whose host keeps only a few ms ahead of the GPU, may have to win the GIL back from it
  (docs/RESULTS.md, "Reading a prefill record"). `benchmarks.bench_ab` times the two against no sampler; neither
  stood out of the host's own noise, at 1k or at 8k (docs/RESULTS.md, "Notes behind the code").
- "thread": the same reads on a thread of the timed process (how every record before this module's change was
  sampled); kept for that A/B.
- "off": nothing read; `summary()` is None.

`power_cap_share` is the share of samples that carried the SwPowerCap reason. NVML's board power on Hopper is
averaged by the driver over a window (tens of ms to ~1 s), so `power_w_*` lag a short call; the SM clock and the
reason flags are read as they stand at each sample. Two driver counters that would need no sampling are too coarse
for single calls of 0.05 to 0.6 s, and are not read here (errata in records/; `benchmarks.bench_energy` reads the
energy counter over sustained runs of seconds): the board's energy
(`nvmlDeviceGetTotalEnergyConsumption`) gave 117 J over a 137 ms prefill, 855 W on a 700 W board; the time under
the power cap (`nvmlDeviceGetViolationStatus`, power policy) gave 108% of an 8k prefill's GPU time, and 100% of a
1k prefill's whose samples carried the cap in 38% at a 1,974 MHz mean (on the H200). Nor is the mean SM clock
read without sampling: on the H200's driver NVML keeps no SM-clock sample buffer (`nvmlDeviceGetSamples` answers
"Not Found").
"""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading

# nvmlClocksEventReason* bits (nvml.h): the driver holding the clocks below their maximum
POWER_CAP = 0x4           # SwPowerCap: the board's power limit
HW_SLOWDOWN = 0x8         # HwSlowdown: power brake or thermal, in hardware
THERMAL = 0x20 | 0x40     # SwThermalSlowdown | HwThermalSlowdown
POWER_BRAKE = 0x80        # HwPowerBrakeSlowdown

WHERE = ("process", "thread", "off")


class Nvml:
    """The NVML reads, for one device: `limits` and one sample (`read`). Raises when NVML or the device is not
    there (a CPU machine, no driver)."""

    def __init__(self, device_index: int):
        import pynvml
        pynvml.nvmlInit()
        self.n, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(device_index)
        self.limits = {"sm_mhz_max": float(pynvml.nvmlDeviceGetMaxClockInfo(self.h, pynvml.NVML_CLOCK_SM)),
                       "power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(self.h) / 1000.0}

    def read(self) -> tuple[float, float, int]:
        n, h = self.n, self.h
        return (float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)), n.nvmlDeviceGetPowerUsage(h) / 1000.0,
                int(n.nvmlDeviceGetCurrentClocksEventReasons(h)))

    def energy_j(self) -> float:
        """The board's energy since the driver loaded, in J: sound over windows of seconds
        (`benchmarks.bench_energy`), too coarse over single calls (above)."""
        return self.n.nvmlDeviceGetTotalEnergyConsumption(self.h) / 1000.0


def sample_until(read, interval_s: float, stop) -> list:
    """read() every interval_s until stop(interval_s) says so (stop waits up to that long); a failed read is a
    missing sample, not a failed benchmark."""
    rows = []
    while True:
        try:
            rows.append(read())
        except Exception:
            pass
        if stop(interval_s):
            return rows


def serve(nvml, interval_s: float, inp, out) -> None:
    """The child's side (`where="process"`): its first line on `out` is the limits (JSON), or {"error": ...}
    without NVML, after which it exits. Then for each "start" line on `inp`: "ok", samples until a "stop" line,
    and one JSON line {"rows"}. Exits at the end of `inp`."""
    if isinstance(nvml, Exception):
        out.write(json.dumps({"error": f"{type(nvml).__name__}: {nvml}"}) + "\n")
        out.flush()
        return
    out.write(json.dumps(nvml.limits) + "\n")
    out.flush()
    fd = inp.fileno()

    def stop(timeout):  # a line ("stop") has come
        if not select.select([fd], [], [], timeout)[0]:
            return False
        inp.readline()
        return True

    for line in iter(inp.readline, ""):
        if line.strip() != "start":
            continue
        out.write("ok\n")
        out.flush()
        out.write(json.dumps({"rows": sample_until(nvml.read, interval_s, stop)}) + "\n")
        out.flush()


class _Server:
    """A running `serve` child for one (device, interval); the parent talks to it line by line."""

    def __init__(self, device_index: int, interval_s: float):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", str(device_index),
                                      repr(interval_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1)
        hello = json.loads(self.proc.stdout.readline() or '{"error": "the sampler process exited"}')
        self.error = hello.get("error")
        self.limits = {} if self.error else hello

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError("the clock sampler process exited")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


_SERVERS: dict[tuple[int, float], _Server] = {}


def _server(device_index: int, interval_s: float) -> _Server:
    key = (device_index, interval_s)
    if key not in _SERVERS:
        _SERVERS[key] = _Server(device_index, interval_s)
    return _SERVERS[key]


@atexit.register
def _close_servers() -> None:
    for s in _SERVERS.values():
        s.close()
    _SERVERS.clear()


class ClockSampler:
    """Samples NVML every `interval_s` between __enter__ and __exit__, in a child process or on a thread
    (`where`, see the module docstring). Without NVML (no driver, a CPU run) it records nothing and `summary()`
    is None: the caller's timing stands without the clock note."""

    def __init__(self, device_index: int = 0, interval_s: float = 0.002, where: str = "process"):
        if where not in WHERE:
            raise ValueError(f"ClockSampler: where must be one of {WHERE}, got {where!r}")
        self.interval_s, self.where = interval_s, where
        self.rows: list[tuple[float, float, int]] = []  # (sm MHz, power W, reason bits)
        self.limits: dict = {}
        self._nvml = self._server = self._thread = None
        self._stop = threading.Event()
        if where == "process":
            server = _server(device_index, interval_s)
            if server.error is None:
                self._server, self.limits = server, server.limits
        elif where == "thread":
            try:
                self._nvml = Nvml(device_index)
                self.limits = self._nvml.limits
            except Exception:  # no NVML here (CPU machine, no driver): sample nothing
                self._nvml = None

    def __enter__(self) -> "ClockSampler":
        if self._server is not None:
            self._server.ask("start")
        elif self._nvml is not None:
            self._thread = threading.Thread(target=self._run, name="clock-sampler", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        self.rows = sample_until(self._nvml.read, self.interval_s, self._stop.wait)

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self.rows = [tuple(r) for r in json.loads(self._server.ask("stop"))["rows"]]
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()

    def summary(self) -> dict | None:
        return summarize_clocks(self.rows, self.limits, self.where) if self.rows else None


def summarize_clocks(rows: list[tuple[float, float, int]], limits: dict, sampler: str | None = None) -> dict:
    """Means and extremes of the samples, the share of samples that carried each slowdown reason, and where the
    samples were taken (`WHERE`)."""
    mhz = [r[0] for r in rows]
    watts = [r[1] for r in rows]

    def share(bits):
        return sum(1 for r in rows if r[2] & bits) / len(rows)
    out = {"samples": len(rows), "sm_mhz_mean": sum(mhz) / len(mhz), "sm_mhz_min": min(mhz),
           "power_w_mean": sum(watts) / len(watts), "power_w_max": max(watts),
           "power_cap_share": share(POWER_CAP), "hw_slowdown_share": share(HW_SLOWDOWN | POWER_BRAKE),
           "thermal_share": share(THERMAL), **limits}
    if sampler is not None:
        out["sampler"] = sampler
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    try:
        _nvml = Nvml(int(sys.argv[2]))
    except Exception as e:  # no NVML here: say so and exit
        _nvml = e
    serve(_nvml, float(sys.argv[3]), sys.stdin, sys.stdout)
