"""Energy per token of a long prefill, ours against HF + fla, from the board's energy counter over sustained runs.

A prefill of 8k tokens on the H200 runs ours at the board's 700 W power cap for most of the call, while HF + fla
never reaches it (docs/RESULTS.md, "Targets"): under the cap time is energy over 700 W, so what a faster prefill has to
save is joules per token, and the time ratio against a peer that is not capped says less than it seems. This
measures that currency directly.

    python -m benchmarks.bench_energy [--prefill 8192] [--seconds 4] [--rounds 2] [--preset 48b-a3b]

Each side runs whole prefills of the same random prompt back to back, each as `bench_e2e` times it (ours
`PrefillCall`, here with the fresh cache's allocation inside the window; HF `hf_prefill_logits`),
after one untimed call (compilation, fla's autotuning), until `--seconds` have passed; the board's energy counter
(`nvmlDeviceGetTotalEnergyConsumption`, mJ) is read before the first and after the last call, with a device
sync. Over seconds the counter is sound (over single calls of 0.05 to 0.6 s it is not: `benchmarks.gpu_clocks`);
a board idle for a second before each side gives the idle power, kept for context. The sides alternate for
`--rounds` rounds. One `kernel` record per round (`op` = `prefill_energy`): `results.ours_ms` / `peer_ms` the
sustained time per call, `ours_j_per_token` / `peer_j_per_token`, the mean board power of each, and
`energy_ratio` = the peer's joules per token over ours (the multiple of the peer that ours would reach at equal
power). A round whose last logits on either side are not all finite is INVALID. Needs NVML and CUDA; anywhere
else it stops with an error before it loads anything.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.bench_e2e import PrefillCall, hf_kernels, hf_prefill_logits, peer_unavailable
from benchmarks.cli import ints
from benchmarks.gpu_clocks import Nvml
from benchmarks.timing import log, sync

PEER = "hf-fla"
IDLE_S = 1.0


def sustained(fn, seconds: float, device, energy_j, setup=None) -> dict:
    """Calls of fn back to back for at least `seconds` (setup() before each, inside the window): the calls, the
    wall time and the board's energy over the window, both read after a sync."""
    sync(device)
    e0, t0, n = energy_j(), time.perf_counter(), 0
    while True:
        if setup is not None:
            setup()
        fn()
        n += 1
        if n >= 2 and time.perf_counter() - t0 >= seconds:
            break
    sync(device)
    t, e = time.perf_counter() - t0, energy_j() - e0
    return {"calls": n, "seconds": t, "joules": e}


def summarize_side(run: dict, tokens: int) -> dict:
    """Per call and per token: ms a call, J a token, mean W (energy over wall time)."""
    return {"ms": 1000.0 * run["seconds"] / run["calls"], "j_per_token": run["joules"] / (run["calls"] * tokens),
            "watts": run["joules"] / run["seconds"], **run}


def idle_watts(seconds: float, device, energy_j) -> float:
    sync(device)
    e0, t0 = energy_j(), time.perf_counter()
    time.sleep(seconds)
    return (energy_j() - e0) / (time.perf_counter() - t0)


def energy_record(desc: dict, T: int, rnd: int, ours: dict, peer: dict, idle: dict, device_name: str,
                  reasons: list[str] = ()) -> dict:
    from records.store import append, make_record
    results = {"ours_ms": ours["ms"], "peer_ms": peer["ms"], "peer": PEER, "speedup": peer["ms"] / ours["ms"],
               "ours_j_per_token": ours["j_per_token"], "peer_j_per_token": peer["j_per_token"],
               "energy_ratio": peer["j_per_token"] / ours["j_per_token"], "ours_watts": ours["watts"],
               "peer_watts": peer["watts"], "idle_watts_before_ours": idle["ours"],
               "idle_watts_before_peer": idle["peer"], "ours_run": ours, "peer_run": peer,
               "timing": "whole prefills back to back for seconds; the board's energy counter and the host clock "
                         "read around the whole run, after a device sync"}
    params = {"op": "prefill_energy", "T": T, "B": 1, "round": rnd, **desc}
    rec = make_record("kernel", preset=desc["preset"], dtype=desc["model_dtype"], device=device_name,
                      weights=desc["weights"], params=params, results=results,
                      verdict="INVALID" if reasons else "VALID", reasons=list(reasons))
    append(rec)
    return rec


@torch.no_grad()
def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_energy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=ints, default=[8192], help="prompt lengths")
    ap.add_argument("--seconds", type=float, default=4.0, help="sustained run per side and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--preset", default="48b-a3b")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0:
        ap.error("--rounds must be >= 1 and --seconds > 0")
    if not torch.cuda.is_available():
        ap.error("needs CUDA and NVML: the board's energy counter is the measurement")
    try:
        nvml = Nvml(torch.cuda.current_device())
    except Exception as e:
        ap.error(f"needs NVML for the board's energy counter: {type(e).__name__}: {e}")
    why = peer_unavailable(PEER)
    if why:
        ap.error(why)
    os.environ.setdefault("FLA_FLASH_KDA", "0")  # fla reads it when HF imports it: its Triton KDA path
    from model.build import load_model
    from model.hf import hf_from_state_dict
    loaded = load_model(args.preset, device="cuda", dtype=torch.bfloat16, seed=args.seed)
    model = loaded.model
    hf = hf_from_state_dict(loaded.cfg, model.state_dict(), attn="sdpa")
    desc = {"preset": args.preset, "model_dtype": "bfloat16", "weights": loaded.weights}
    name = torch.cuda.get_device_name()
    log(f"weights {loaded.source} {loaded.weights}; HF + fla beside ours")
    recs = []
    for T in args.prefill:
        ids = torch.randint(0, loaded.cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(T)).cuda()
        call, held = PrefillCall(model, ids), {}

        def peer():
            held["logits"] = hf_prefill_logits(hf, ids)

        call.setup()
        call.run()
        with hf_kernels(PEER):
            peer()  # untimed: compilation, fla's autotuning at this shape
        for rnd in range(args.rounds):
            idle = {"ours": idle_watts(IDLE_S, "cuda", nvml.energy_j)}
            o = summarize_side(sustained(call.run, args.seconds, "cuda", nvml.energy_j, call.setup), T)
            reasons = [] if bool(torch.isfinite(call.logits).all()) else ["ours: last logits not all finite"]
            call.drop()
            idle["peer"] = idle_watts(IDLE_S, "cuda", nvml.energy_j)
            with hf_kernels(PEER):
                p = summarize_side(sustained(peer, args.seconds, "cuda", nvml.energy_j), T)
            if not bool(torch.isfinite(held.pop("logits")).all()):
                reasons.append(f"{PEER}: last logits not all finite")
            rec = energy_record(desc, T, rnd, o, p, idle, name, reasons)
            recs.append(rec)
            r = rec["results"]
            log(f"T={T} round {rnd + 1}/{args.rounds}: ours {o['ms']:.1f} ms a call, {o['j_per_token'] * 1e3:.3f} mJ "
                f"a token at {o['watts']:.0f} W; {PEER} {p['ms']:.1f} ms, {p['j_per_token'] * 1e3:.3f} mJ at "
                f"{p['watts']:.0f} W; time ratio {r['speedup']:.2f}x, energy ratio {r['energy_ratio']:.2f}x "
                f"(idle {idle['ours']:.0f} / {idle['peer']:.0f} W)")
    return recs


if __name__ == "__main__":
    main()
