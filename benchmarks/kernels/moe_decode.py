"""moe_decode: the batch-N decode MoE of 48B-A3B at its real shapes (random weights): the fused router (GEMV + top-k,
one launch), the gate_up and down expert kernels, and the three in sequence (`moe_layer`, as `model.ops.moe` runs
it), each against PyTorch forms of the same part in the same run (see MoeCase; `moe_layer_plain`: the block against
its own launches without the early starts; `moe_norm_layer`: the add+norm before the block and the block, against
the same with the norm not letting the router start early), with GB/s over the bytes an ideal kernel reads, as a
fraction of 4.25 TB/s and of the read ceiling measured in the run.

These are timed by `graph_ms`, not do_bench: GRAPH_LAYERS layers' calls (each layer its own router, shared expert and
routed experts) captured in one CUDA graph, as the model's decode step runs them. `--moe-sweep` also times every tile
config of `moe_sweep_grid` and logs the best per kernel; pick the defaults in model/triton/moe.py (GATE_UP, DOWN,
ROUTER) from it.

Peers, in the same run, PyTorch forms of each part: the router is the unfused path (x.float(), cuBLAS fp32 GEMM, then
`route`); the expert parts gather the chosen experts' weights and contract them with einsum (no host sync, as a graph
needs), fed the same routing and activations, rounding where the kernels round. Shapes: bf16 experts, fp32 router
weight."""
from __future__ import annotations

import traceback

import torch

from benchmarks.kernels import common
from benchmarks.kernels.common import DTYPE, PEER_TOL, judge_peer, rel_err
from benchmarks.kernels.spec import Bench, Size, Sweep
from benchmarks.timing import log

MOE_N = Size("--moe-N", (1, 8), "tokens per MoE decode step (moe_decode)")
MOE_E, MOE_D, MOE_I, MOE_K, MOE_SCALING = 256, 2304, 1024, 8, 2.446
MOE_PEER = "torch-gather-einsum"
NOMINAL_GBPS = 4250.0  # the H200's HBM figure the task is stated against; the measured read ceiling sits beside it
MOE_PARTS = ("moe_router", "moe_gate_up", "moe_down", "moe_layer", "moe_layer_plain", "moe_norm_layer")
# moe_layer_plain's peer: the model's MoE block (ours: router, gate_up and down started early, PDL) against the same
# three launches issued plainly, so that the early starts are measured alone
MOE_PLAIN_PEER = "the same launches without PDL"
# moe_norm_layer: the add+norm before the block and the block, as a decode step runs them (the norm lets the
# router launch as it starts); its peer the same launches with the norm not signalling (the router then overlaps
# only the norm's tail)
MOE_NORM_PEER = "the same launches, the norm not signalling"


def moe_sweep_grid() -> dict[str, list[dict]]:
    """Tile configs the sweep times, per kernel: those whose one-step tile is at most 256 bytes a thread (beyond
    that the loads spill registers)."""
    kp = MOE_K
    return {
        "moe_gate_up": [dict(BLOCK_I=bi, BLOCK_D=bd, num_warps=nw) for bi in (4, 8, 16, 32)
                        for bd in (128, 256, 512) for nw in (4, 8) if 2 * bi * bd * 2 <= 256 * 32 * nw],
        "moe_down": [dict(BLOCK_D=bd, BLOCK_I=bi, num_warps=nw) for bd in (1, 2, 4, 8)
                     for bi in (256, 512, 1024) for nw in (4, 8) if (kp + 1) * bd * bi * 2 <= 256 * 32 * nw],
        # the router also at 1 and 2 warps: the routing after the GEMV is 8 max-reductions over 256 lanes, which
        # within one warp are shuffles, without the shared-memory round trips of a multi-warp reduction
        "moe_router": [dict(BLOCK_E=be, num_warps=nw) for be in (1, 2, 4, 8) for nw in (1, 2, 4, 8)
                       if be * 4096 * 4 <= 512 * 32 * nw],
    }


def torch_gate_up(x, idx, gate_up, sg, su):
    """act [N*(K+1), I] as `moe.expert_gate_up` computes it: silu(w1 x) * (w3 x) per chosen expert, then the
    shared expert; each projection rounded to x's dtype, as F.linear's."""
    N, K = idx.shape
    I = sg.shape[0]
    w = torch.cat([gate_up[idx], torch.cat([sg, su])[None, None].expand(N, 1, 2 * I, -1)], dim=1)
    g, u = torch.einsum("nkod,nd->nko", w, x).split(I, dim=-1)
    return (torch.nn.functional.silu(g) * u).reshape(N * (K + 1), I)


def torch_down(act, idx, w, down, sd):
    """y [N, D] as `moe.expert_down` computes it: each expert's output rounded, weighted and summed in fp32,
    the shared expert (weight 1) added, one rounding."""
    N, K = idx.shape
    a = act.view(N, K + 1, -1)
    out = torch.einsum("nkdi,nki->nkd", down[idx], a[:, :K])
    y = (out.float() * w[..., None]).sum(1) + torch.nn.functional.linear(a[:, K], sd).float()
    return y.to(act.dtype)


class MoeCase:
    """Random weights at the real shapes for GRAPH_LAYERS layers and N tokens. `fns(part, cfg)` gives (ours, peer)
    on the first layer, for the comparison; `calls(part, cfg)` gives both sides' calls over all the layers, for
    timing (graph_ms)."""

    def __init__(self, N: int, device: str = "cuda"):
        import torch.nn.functional as F
        from model.triton import moe
        from model.triton.norms import add_rmsnorm
        g = torch.Generator(device=device).manual_seed(N)
        self.device = device
        E, D, I, K, R = MOE_E, MOE_D, MOE_I, MOE_K, common.GRAPH_LAYERS

        def rnd(*shape, scale, dtype=DTYPE):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

        self.x = rnd(N, D, scale=1.0)
        # the routed experts are shared by the layers (the routers spread the layers over them); each layer has
        # its own router and shared expert
        self.gate_up, self.down = rnd(E, 2 * I, D, scale=D ** -0.5), rnd(E, D, I, scale=I ** -0.5)
        layers = []
        for _ in range(R):
            wr, bias = rnd(E, D, scale=D ** -0.5, dtype=torch.float32), rnd(E, scale=0.01, dtype=torch.float32)
            sg, su, sd = rnd(I, D, scale=D ** -0.5), rnd(I, D, scale=D ** -0.5), rnd(D, I, scale=I ** -0.5)
            idx, w = moe.fused_router(self.x, wr, bias, K, MOE_SCALING, True)
            act = moe.expert_gate_up(self.x, idx, self.gate_up, (sg, su))
            layers.append(dict(wr=wr, bias=bias, sg=sg, su=su, sd=sd, idx=idx, w=w, act=act))
        self.layers = layers
        # bytes a perfect kernel reads from HBM per layer (mean over the layers): each distinct expert's weights
        # once, the shared expert's, the router weight once
        experts = sum(int(torch.unique(L["idx"]).numel()) + 1 for L in layers) / R
        self.bytes = {"moe_router": E * D * 4, "moe_gate_up": round(experts * 2 * I * D * 2),
                      "moe_down": round(experts * D * I * 2)}
        self.bytes["moe_layer"] = sum(self.bytes.values())
        self.bytes["moe_layer_plain"] = self.bytes["moe_layer"]
        # the norm's residual in, residual and normed rows out, and its weight
        self.bytes["moe_norm_layer"] = self.bytes["moe_layer"] + (4 * N * D + D) * self.x.element_size()
        x, gu, dn = self.x, self.gate_up, self.down
        res, nw = rnd(N, D, scale=1.0), rnd(D, scale=1.0)

        def parts(L, cfg):
            return {"moe_router": (lambda: moe.fused_router(x, L["wr"], L["bias"], K, MOE_SCALING, True, cfg),
                                   lambda: moe.route(F.linear(x.float(), L["wr"]), L["bias"], K, MOE_SCALING, True)),
                    "moe_gate_up": (lambda: moe.expert_gate_up(x, L["idx"], gu, (L["sg"], L["su"]), cfg),
                                    lambda: torch_gate_up(x, L["idx"], gu, L["sg"], L["su"])),
                    "moe_down": (lambda: moe.expert_down(L["act"], L["idx"], L["w"], dn, L["sd"], cfg),
                                 lambda: torch_down(L["act"], L["idx"], L["w"], dn, L["sd"])),
                    "moe_layer": (lambda: ours_layer(L), lambda: peer_layer(L)),
                    "moe_layer_plain": (lambda: ours_layer(L), lambda: plain_layer(L)),
                    "moe_norm_layer": (lambda: norm_layer(L, True), lambda: norm_layer(L, False))}

        def ours_layer(L):  # as the model runs it (model.ops.moe)
            return moe.fused_moe_decode(x, L["wr"], L["bias"], K, MOE_SCALING, True, gu, dn,
                                        (L["sg"], L["su"], L["sd"]))

        def norm_layer(L, signal):  # the add+norm before the block, then the block (model.layers.DecoderLayer.decode)
            h = add_rmsnorm(x, res, nw, 1e-5, signal=signal)[0]
            return moe.fused_moe_decode(h, L["wr"], L["bias"], K, MOE_SCALING, True, gu, dn,
                                        (L["sg"], L["su"], L["sd"]))

        def plain_layer(L):  # the same launches without the early starts
            idx, w = moe.fused_router(x, L["wr"], L["bias"], K, MOE_SCALING, True)
            return moe.expert_down(moe.expert_gate_up(x, idx, gu, (L["sg"], L["su"])), idx, w, dn, L["sd"])

        def peer_layer(L):
            idx, w = moe.route(F.linear(x.float(), L["wr"]), L["bias"], K, MOE_SCALING, True)
            return torch_down(torch_gate_up(x, idx, gu, L["sg"], L["su"]), idx, w, dn, L["sd"])

        self._parts = parts

    def fns(self, part: str, cfg: dict | None = None):
        return self._parts(self.layers[0], cfg)[part]

    def calls(self, part: str, cfg: dict | None = None):
        pairs = [self._parts(L, cfg)[part] for L in self.layers]
        return [o for o, _ in pairs], [p for _, p in pairs]


def moe_compare(part: str, ours, theirs) -> tuple[dict, list[str]]:
    """Outputs of ours vs the peer; the router's must pick the same experts."""
    if part == "moe_router":
        (idx, w), (ridx, rw) = ours, theirs
        o, ro = idx.sort(-1), ridx.sort(-1)
        mismatch = int((o.values != ro.values).any(-1).sum())
        res = {"routing_mismatch_tokens": mismatch,
               "rel_err_vs_peer": rel_err(w.gather(-1, o.indices), rw.gather(-1, ro.indices))}
        return res, [f"router picked other experts than the peer for {mismatch} token(s)"] if mismatch else []
    return {"rel_err_vs_peer": rel_err(ours, theirs)}, []


def moe_measure(case: MoeCase, part: str, cfg: dict | None, rep_ms: int, hbm_gbps: float | None,
                peer_ms: float | None = None) -> tuple[dict, list[str]]:
    """Time ours (and the peer, unless its time is given) on one part; bandwidth against the ideal bytes."""
    ours, theirs = case.fns(part, cfg)
    first, again = ours(), ours()
    res, reasons = moe_compare(part, first, theirs())
    same = all(torch.equal(a, b) for a, b in zip(first, again)) if part == "moe_router" else torch.equal(first, again)
    if not same:
        reasons.append("ours is not deterministic: two runs on the same inputs differ")
    ours_calls, peer_calls = case.calls(part, cfg)
    res["ours_ms"] = common.graph_ms(ours_calls)
    res["peer_ms"] = peer_ms if peer_ms is not None else common.graph_ms(peer_calls)
    res["peer"] = {"moe_layer_plain": MOE_PLAIN_PEER, "moe_norm_layer": MOE_NORM_PEER}.get(part, MOE_PEER)
    res["bytes"], res["timing"] = case.bytes[part], common.graph_timing(common.GRAPH_LAYERS)
    for who in ("ours", "peer"):
        gbps = case.bytes[part] / (res[f"{who}_ms"] / 1e3) / 1e9
        res[f"{who}_gbps"], res[f"{who}_frac_of_nominal"] = gbps, gbps / NOMINAL_GBPS
        if hbm_gbps:
            res[f"{who}_frac_of_measured"] = gbps / hbm_gbps
    res["measured_read_gbps"] = hbm_gbps
    judge_peer(res, reasons, PEER_TOL)
    return res, reasons


def moe_record(part: str, N: int, cfg: dict | None, results: dict, reasons: list[str], sweep: bool,
               device: str) -> dict:
    from model.triton import moe
    default = {"moe_router": moe.ROUTER, "moe_gate_up": moe.GATE_UP, "moe_down": moe.DOWN}.get(part)
    params = {"kernel": part, "op": "moe_decode", "N": N, "E": MOE_E, "D": MOE_D, "I": MOE_I, "K": MOE_K,
              "shared_experts": 1, "dtype": "bfloat16"}
    if default is not None:
        params["cfg"] = {**default, **(cfg or {})}
    if sweep:
        params["sweep"] = True
    return common.kernel_record(params, results, reasons, device)


def moe_line(part: str, N: int, cfg, x: dict, rec: dict) -> str:
    c = "" if cfg is None else " " + ",".join(f"{k}={v}" for k, v in cfg.items())
    line = f"  {part:12s} N={N:<2d}{c:40s} ours={common.fmt_ms(x.get('ours_ms'))}"
    if "ours_gbps" in x:
        line += f" ({x['ours_gbps']:6.0f} GB/s, {x['ours_frac_of_nominal']:.0%} of {NOMINAL_GBPS:.0f}"
        line += f", {x['ours_frac_of_measured']:.0%} of measured)" if "ours_frac_of_measured" in x else ")"
    if "peer_ms" in x:
        line += f"  peer={common.fmt_ms(x['peer_ms'])} ({x['peer_gbps']:.0f} GB/s)  speedup={x['speedup']:.2f}x"
    return line + f"  {rec['verdict']}"


def run_moe(Ns: list[int], sweep: bool, rep_ms: int, device: str = "cuda") -> list[dict]:
    """The MoE decode kernels at N tokens: each part with its default tiles against the peer, then (sweep) every
    config of `moe_sweep_grid`, the peer's time reused. One `kernel` record per (part, N[, config])."""
    from benchmarks.roofline import measure_read_gbps
    hbm_gbps = measure_read_gbps(device, 1 << 30, 20)
    log(f"moe_decode: measured read ceiling {hbm_gbps:.0f} GB/s (1 GiB x.sum()); nominal {NOMINAL_GBPS:.0f}")
    recs = []
    for N in Ns:
        try:
            case = MoeCase(N, device)
        except Exception as e:  # e.g. out of memory: record it, go on with the next N
            traceback.print_exc()
            why = [f"setup failed: {type(e).__name__}: {e}"]
            recs.append(moe_record("moe_layer", N, None, {"peer": MOE_PEER}, why, False, device))
            continue
        peer_ms = {}
        for part in MOE_PARTS:
            try:
                results, reasons = moe_measure(case, part, None, rep_ms, hbm_gbps)
                peer_ms[part] = results["peer_ms"]
            except Exception as e:  # one failing part must not end the run
                traceback.print_exc()
                results, reasons = {"peer": MOE_PEER}, [f"{part} failed: {type(e).__name__}: {e}"]
            rec = moe_record(part, N, None, results, reasons, False, device)
            log(moe_line(part, N, None, results, rec))
            recs.append(rec)
        if not sweep:
            continue
        for part, cfgs in moe_sweep_grid().items():
            best = None
            for cfg in cfgs:
                try:
                    results, reasons = moe_measure(case, part, cfg, rep_ms, hbm_gbps, peer_ms.get(part))
                except Exception as e:  # a config that fails to compile or run is recorded and skipped
                    traceback.print_exc()
                    results, reasons = {"peer": MOE_PEER}, [f"{part} {cfg} failed: {type(e).__name__}: {e}"]
                rec = moe_record(part, N, cfg, results, reasons, True, device)
                log(moe_line(part, N, cfg, results, rec))
                recs.append(rec)
                if rec["verdict"] == "VALID" and (best is None or results["ours_ms"] < best[1]):
                    best = (cfg, results["ours_ms"])
            if best is not None:
                log(f"  best {part} N={N}: {best[0]} {best[1] * 1e3:.1f} us")
        del case
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return recs


BENCH = Bench(
    op="moe_decode", inputs=MoeCase, ours="model.triton.moe:fused_moe_decode", peer=MOE_PEER,
    peer_fn="benchmarks.kernels.moe_decode:torch_down",
    check="each part's output against its PyTorch form by relative RMS error <= PEER_TOL; the router must pick "
          "the same experts; two runs of ours must agree bit for bit",
    tol=PEER_TOL, sizes=MOE_N, study=lambda sizes, rep_ms, swept: run_moe(list(sizes), swept, rep_ms),
    sweep=Sweep(lambda: moe_sweep_grid(), PEER_TOL, "--moe-sweep",
                "moe_decode: also time every tile config of the grid"))
