"""moe_prefill (not in the default --ops): the candidate Triton grouped GEMMs of benchmarks/candidates/moe_grouped.py,
both together against the torch form at the model router's spread of rows, and in `results.sweep` each kernel's tile
configs timed alone against the part of the torch form it replaces. All by do_bench."""
from __future__ import annotations

import torch

from benchmarks.kernels import common
from benchmarks.kernels.common import DTYPE, PEER, PEER_TOL, PREFILL_T, rel_err
from benchmarks.kernels.spec import Bench, Sweep
from benchmarks.timing import log

K, E, DM, I = 8, 256, 2304, 1024  # the 48B's MoE: top-8 of 256 experts, hidden 2304, expert intermediate 1024
MOE_PREFILL_TOL = 1e-2  # the fused output and each sweep config's against the torch form's


def first_router(preset: str, device: str):
    """(router, description): the first MoE layer's router of `preset` with the synthetic weights (seed 0) the
    benchmarks' model has, which gives the spread of rows over the experts that the model's prefill MoE sees."""
    from model.config import get_config
    from model.layers import Router
    from model.weights import synthetic_tensor
    cfg = get_config(preset)
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i))
    router = Router(cfg).to(device)
    name = f"model.layers.{layer}.block_sparse_moe.gate."
    with torch.no_grad():
        router.weight.copy_(synthetic_tensor(cfg, name + "weight", device=device))
        router.e_score_correction_bias.copy_(synthetic_tensor(cfg, name + "e_score_correction_bias", device=device))
    router.pack_()
    return router, f"model.layers.{layer} of {preset}, synthetic seed 0, inputs N(0, 1)"


# each fused kernel's tile configs, timed alone against the part of the torch form it replaces (results.sweep): the
# per-thread loads at the default tiles and one other, then the tiles through TMA descriptors at tiles that fit their
# stages in shared memory, and persistent programs (docs/kernels.md has the sweeps that picked the defaults)
_TILES = ("BM", "BN", "BK", "num_warps", "num_stages")
MOE_GATE_UP_SWEEP = ([dict(zip(_TILES, t)) for t in ((64, 256, 64, 8, 3), (128, 128, 64, 8, 4))]
                     + [dict(zip(_TILES, t), tma=True) for t in (
                         (64, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4))]
                     + [dict(zip(_TILES, t), tma=tma, persistent=True) for t, tma in (
                         ((64, 256, 64, 8, 3), False), ((64, 256, 64, 8, 3), True), ((128, 128, 64, 8, 4), True))])
MOE_DOWN_SWEEP = ([dict(zip(_TILES, t)) for t in ((128, 256, 64, 8, 4), (128, 128, 64, 8, 4))]
                  + [dict(zip(_TILES, t), tma=True) for t in (
                      (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 8, 5),
                      (256, 128, 64, 8, 3), (64, 256, 64, 4, 4))]
                  + [dict(zip(_TILES, t), tma=tma, persistent=True) for t, tma in (
                      ((128, 256, 64, 8, 4), False), ((128, 256, 64, 8, 4), True), ((128, 128, 64, 8, 4), True))])


def sweep_configs() -> list[tuple[str, dict]]:
    """(kernel, cfg) for each config the case times alone."""
    return ([("gate_up", {"gate_up": k}) for k in MOE_GATE_UP_SWEEP]
            + [("down", {"down": k}) for k in MOE_DOWN_SWEEP])


def moe_prefill_inputs(T: int) -> tuple:
    """Seeded inputs of the prefill MoE's experts for T tokens on the GPU: (x [T, DM], gate_up [E, 2I, DM], down
    [E, DM, I], router: the first MoE layer's (`first_router`), its description)."""
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, DM, generator=gen, device="cuda").to(DTYPE)
    gate_up = (torch.randn(E, 2 * I, DM, generator=gen, device="cuda") / DM ** 0.5).to(DTYPE)
    down = (torch.randn(E, DM, I, generator=gen, device="cuda") / I ** 0.5).to(DTYPE)
    router, desc = first_router("48b-a3b", "cuda")
    return x, gate_up, down, router, desc


def moe_prefill_case(T: int, rep_ms: int) -> tuple[dict, list[str]]:
    """The prefill MoE's expert GEMMs for T tokens at the 48B's shapes (256 experts, top-8, D 2304, I 1024, bf16)
    at the rows per expert the model's first router gives (`first_router`), from the same sorted pairs: the fused
    Triton form (the candidate `moe_grouped`: dispatch and SwiGLU fused in) against the torch form the model runs
    (dispatch copy, torch's grouped GEMM, silu_mul, grouped GEMM). The sort and the combine, common to both, are left
    out. The sweep times each kernel alone: gate_up (+ dispatch + silu_mul in the torch form) and down."""
    from model import ops
    import model.triton as mt
    from benchmarks.candidates import moe_grouped as mg
    x, gate_up, down, router, desc = moe_prefill_inputs(T)
    order, offs = ops.sort_by_expert(router(x)[0], E)

    def torch_gate_up():
        gu = ops.grouped_mm(ops.moe_dispatch(x, order, K), gate_up.transpose(1, 2), offs)
        return ops.silu_mul(gu[:, :I], gu[:, I:])

    h = torch_gate_up()

    def torch_down(h=h):
        return ops.grouped_mm(h, down.transpose(1, 2), offs)

    def fused(cfg=None):
        return mg.experts(x, order, offs, gate_up, down, K, cfg)

    flops = 2 * T * K * 3 * DM * I
    ref = torch_down()  # the torch form's output: its down over its own h
    res = {"ours_ms": common.gpu_ms(fused, rep_ms),
           "peer_ms": common.gpu_ms(lambda: torch_down(torch_gate_up()), rep_ms),
           "peer_gate_up_ms": common.gpu_ms(torch_gate_up, rep_ms), "peer_down_ms": common.gpu_ms(torch_down, rep_ms),
           "rel_err_vs_peer": rel_err(fused(), ref), "peer": f"torch-{torch.__version__} grouped_mm",
           "router": desc, "cfg": {k: v for k, v in mt.plain(mg.CONFIG).items() if k != "use"},
           "sweep": []}
    for kernel, cfg in sweep_configs():
        if kernel == "gate_up":
            run, want = (lambda cfg=cfg: mg.gate_up_silu(x, order, offs, gate_up, K, cfg)), h
        else:
            run, want = (lambda cfg=cfg: mg.down(h, offs, down, cfg)), ref
        try:
            err = rel_err(run(), want)
            res["sweep"].append({"kernel": kernel, "cfg": cfg, "ms": common.gpu_ms(run, rep_ms),
                                 "rel_err_vs_peer": err})
        except Exception as e:  # a config that does not compile or launch is reported, not fatal
            res["sweep"].append({"kernel": kernel, "cfg": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    res["tflops_ours"], res["tflops_peer"] = (flops / (res[k] * 1e9) for k in ("ours_ms", "peer_ms"))
    log(f"  moe_prefill T={T}: fused {res['ours_ms']:.3f} ms ({res['tflops_ours']:.0f} TFLOP/s), torch form "
        f"{res['peer_ms']:.3f} ms ({res['tflops_peer']:.0f}): gate_up part {res['peer_gate_up_ms']:.3f}, down "
        f"{res['peer_down_ms']:.3f}; sweep:")
    for c in res["sweep"]:
        log(f"    {c['kernel']:8s} {c['cfg']} {c.get('ms', float('nan')):.3f} ms {c.get('error', '')}")
    reasons = [] if res["rel_err_vs_peer"] < MOE_PREFILL_TOL else [
        f"fused output differs from the torch form's: rel_err {res['rel_err_vs_peer']:.2e}"]
    reasons += [f"sweep config {c['cfg']} differs from the torch form's: rel_err {c['rel_err_vs_peer']:.2e}"
                for c in res["sweep"] if c.get("rel_err_vs_peer", 0) >= MOE_PREFILL_TOL]
    return res, reasons


BENCH = Bench(
    op="moe_prefill", inputs=moe_prefill_inputs, ours="benchmarks.candidates.moe_grouped:experts",
    peer=f"torch-{torch.__version__} grouped_mm", peer_fn=None,
    check="relative RMS error < MOE_PREFILL_TOL against the torch form's output, each sweep config's too; "
          "<= PEER_TOL when judged against the peer",
    tol=PEER_TOL, sizes=PREFILL_T, case=moe_prefill_case,
    params=lambda: dict(peer_scope="the torch form the model runs; ours under evaluation"),
    # a case that raises before naming its peer is recorded with the fla label, as every failed non-MLA case is
    peer_if_failed=PEER,
    sweep=Sweep(sweep_configs, MOE_PREFILL_TOL))
