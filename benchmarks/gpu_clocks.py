"""What the GPU's clocks did while a benchmark ran: NVML read by a sampling thread (SM clock, board power, and
the reasons the driver gives for holding the clocks down), so that a timing can say whether it ran at full clock
or under the power cap. A kernel that wins alone can lose that win inside a power-capped workload: faster
kernels draw more power, and the driver lowers the clock of everything around them.

    with ClockSampler(device_index) as s:
        run()
    s.summary()  # {"samples": n, "sm_mhz_mean": ..., "power_cap_share": ..., ...}, or None without NVML

NVML's board power on Hopper is averaged by the driver over a window (tens of ms to ~1 s), so `power_w_*`
lag a short call; the SM clock and the reason flags are read as they stand at each sample. The board's energy
counter (`nvmlDeviceGetTotalEnergyConsumption`) is not read: over single calls of 0.05 to 0.6 s it gave figures
above the power cap (117 J over a 137 ms prefill would be 855 W against a 700 W cap; erratum in records/), so its
updates are too coarse for these windows.
"""
from __future__ import annotations

import threading
import time

# nvmlClocksEventReason* bits (nvml.h): the driver holding the clocks below their maximum
POWER_CAP = 0x4           # SwPowerCap: the board's power limit
HW_SLOWDOWN = 0x8         # HwSlowdown: power brake or thermal, in hardware
THERMAL = 0x20 | 0x40     # SwThermalSlowdown | HwThermalSlowdown
POWER_BRAKE = 0x80        # HwPowerBrakeSlowdown


class ClockSampler:
    """Samples NVML every `interval_s` on a thread between __enter__ and __exit__. Without NVML (no driver, a CPU
    run) it records nothing and `summary()` is None: the caller's timing stands without the clock note."""

    def __init__(self, device_index: int = 0, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.rows: list[tuple[float, float, int]] = []  # (sm MHz, power W, reason bits)
        self.limits: dict = {}
        self._stop = threading.Event()
        self._thread = None
        self._nvml = self._handle = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self.limits = {"sm_mhz_max": float(pynvml.nvmlDeviceGetMaxClockInfo(self._handle, pynvml.NVML_CLOCK_SM)),
                           "power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1000.0}
        except Exception:  # no NVML here (CPU machine, no driver): sample nothing
            self._nvml = None

    def _read(self) -> tuple[float, float, int]:
        n, h = self._nvml, self._handle
        return (float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)), n.nvmlDeviceGetPowerUsage(h) / 1000.0,
                int(n.nvmlDeviceGetCurrentClocksEventReasons(h)))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.rows.append(self._read())
            except Exception:  # a failed read is a missing sample, not a failed benchmark
                pass
            time.sleep(self.interval_s)

    def __enter__(self) -> "ClockSampler":
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, name="clock-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def summary(self) -> dict | None:
        return summarize_clocks(self.rows, self.limits) if self.rows else None


def summarize_clocks(rows: list[tuple[float, float, int]], limits: dict) -> dict:
    """Means and extremes of the samples, and the share of samples that carried each slowdown reason."""
    mhz = [r[0] for r in rows]
    watts = [r[1] for r in rows]

    def share(bits):
        return sum(1 for r in rows if r[2] & bits) / len(rows)
    return {"samples": len(rows), "sm_mhz_mean": sum(mhz) / len(mhz), "sm_mhz_min": min(mhz),
            "power_w_mean": sum(watts) / len(watts), "power_w_max": max(watts),
            "power_cap_share": share(POWER_CAP), "hw_slowdown_share": share(HW_SLOWDOWN | POWER_BRAKE),
            "thermal_share": share(THERMAL), **limits}
