"""Candidate: grouped expert GEMMs of the prefill MoE in Triton, with the dispatch and the SwiGLU fused in, in place
of `model.ops.grouped_experts` (dispatch copy, torch's grouped GEMM, `silu_mul`, grouped GEMM), its twin up to fp32
summation order. Not the model's default: no variant made the whole prefill faster (docs/kernels.md#moe-grouped).
`installed` runs it inside the model through `model.ops.experts_kernel`; `CONFIG["use"]` names which of its two
kernels replace the torch form's steps. Row tiles hold BM rows of one expert (`expert_tiles`); programs past the last
tile return at once. Rounding follows the torch form: gate, up, silu, their product and the down output each rounded
to the model dtype. bf16 only.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import model.triton as mt
from benchmarks.candidates import Unsupported
from model import ops
from model.triton.common import rounded, silu_f32

# Launch config, read-only: the kernels that replace the torch form's steps ("gate_up": dispatch, gate_up GEMM and
# silu_mul; "down": the down GEMM), the program order (`_program_tile`), and per kernel its tiles (BM may differ),
# warps, `tma` (tiles through the tensor-copy engine) and `persistent` (one program an SM, looping over tiles). An
# arm's changes travel with the function it installs (`installed`), so nothing reads this from a scope.
CONFIG = mt.frozen(dict(use=("gate_up", "down"), n_fastest=True,
                        gate_up=dict(BM=64, BN=256, BK=64, num_warps=8, num_stages=3, tma=False, persistent=False),
                        down=dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=4, tma=False, persistent=False)))
KERNELS = ("gate_up", "down")  # what `use` may name
# The functions that launch its kernels: `benchmarks.bench_ab` counts their calls, so an arm that none reached is
# an error rather than a second timing of the defaults.
ENTRY_POINTS = ("gate_up_silu", "down")


@triton.jit
def _dot(a, b, acc, COMPILED: tl.constexpr):
    """acc + a @ b on tensor cores; under the interpreter (whose bf16 tl.dot is wrong in Triton 3.6) the same bf16
    values as fp32 in an IEEE dot: the same exact products, summed in another order."""
    if COMPILED:
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _program_tile(p, n_tiles, NB: tl.constexpr, N_FASTEST: tl.constexpr):
    """(row tile, column block) of tile p in the grid of n_tiles x NB. N_FASTEST: a row tile's column blocks are
    consecutive programs, reading its rows once from DRAM, and an expert's row tiles share its weights through L2.
    Else row tiles vary fastest."""
    if N_FASTEST:
        return p // NB, p % NB
    return p % n_tiles, p // n_tiles


@triton.jit
def _row_tile(tile_e, tile_r0, offs, t, BM: tl.constexpr):
    """(expert, rows, live rows) of row tile t (`expert_tiles`); expert -1 past the last tile."""
    e = tl.load(tile_e + t)
    r = tl.load(tile_r0 + t) + tl.arange(0, BM)
    return e, r, r < tl.load(offs + tl.maximum(e, 0))


@triton.jit
def _gate_up_silu_tile(p, x, order, w, w_desc, h, tile_e, tile_r0, offs, n_tiles, K: tl.constexpr, D: tl.constexpr,
                       I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, N_FASTEST: tl.constexpr,
                       TMA: tl.constexpr, COMPILED: tl.constexpr):
    """Tile p of the grid of n_tiles x cdiv(I, BN); nothing past the last tile. TMA: the weight tiles through `w_desc`
    (w as [E * 2I, D] rows); rows past I land in columns the store masks off."""
    t, nb = _program_tile(p, n_tiles, tl.cdiv(I, BN), N_FASTEST)
    e, r, live = _row_tile(tile_e, tile_r0, offs, t, BM)
    if e >= 0:
        tok = (tl.load(order + r, mask=live, other=0) // K).to(tl.int64)
        n = nb * BN + tl.arange(0, BN)
        m_n = n < I
        kk = tl.arange(0, BK)
        a_p = x + tok[:, None] * D + kk[None, :]
        g_p = w + e.to(tl.int64) * (2 * I * D) + n[None, :] * D + kk[:, None]   # [BK, BN]: gate rows, transposed
        g_row = e * (2 * I) + nb * BN
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, D, BK):
            m_k = k0 + kk < D
            a = tl.load(a_p + k0, mask=live[:, None] & m_k[None, :], other=0.)
            if TMA:
                b_g = w_desc.load([g_row, k0]).T
                b_u = w_desc.load([g_row + I, k0]).T
            else:
                b_g = tl.load(g_p + k0, mask=m_k[:, None] & m_n[None, :], other=0.)
                b_u = tl.load(g_p + I * D + k0, mask=m_k[:, None] & m_n[None, :], other=0.)
            acc_g = _dot(a, b_g, acc_g, COMPILED)
            acc_u = _dot(a, b_u, acc_u, COMPILED)
        dt = h.dtype.element_ty
        g = rounded(acc_g, dt, COMPILED).to(tl.float32)
        s = rounded(silu_f32(g, COMPILED), dt, COMPILED).to(tl.float32)
        out = rounded(s * rounded(acc_u, dt, COMPILED).to(tl.float32), dt, COMPILED)
        tl.store(h + r.to(tl.int64)[:, None] * I + n[None, :], out, mask=live[:, None] & m_n[None, :])


@triton.jit
def _moe_grouped_gate_up_kernel(x, order, w, w_desc, h, tile_e, tile_r0, offs, n_tiles, K: tl.constexpr,
                                D: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                BK: tl.constexpr, N_FASTEST: tl.constexpr, TMA: tl.constexpr,
                                PERSISTENT: tl.constexpr, COMPILED: tl.constexpr):
    """x [N, D]; order [M] sorted pairs (flat n*K + k); w [E, 2I, D] (gate rows, then up rows); h [M, I]; tile_e /
    tile_r0 (`expert_tiles`); offs [E] int32 row ends. One program a tile, or PERSISTENT: every num_programs-th."""
    n_all = n_tiles * tl.cdiv(I, BN)
    if PERSISTENT:
        if COMPILED:
            for p in range(tl.program_id(0), n_all, tl.num_programs(0)):
                _gate_up_silu_tile(p, x, order, w, w_desc, h, tile_e, tile_r0, offs, n_tiles, K, D, I, BM, BN, BK,
                                   N_FASTEST, TMA, COMPILED)
        else:  # the interpreter takes no run-time loop bounds (a 1-element array is no index under NumPy 2)
            p = tl.program_id(0)
            while p < n_all:
                _gate_up_silu_tile(p, x, order, w, w_desc, h, tile_e, tile_r0, offs, n_tiles, K, D, I, BM, BN, BK,
                                   N_FASTEST, TMA, COMPILED)
                p += tl.num_programs(0)
    else:
        _gate_up_silu_tile(tl.program_id(0), x, order, w, w_desc, h, tile_e, tile_r0, offs, n_tiles, K, D, I, BM,
                           BN, BK, N_FASTEST, TMA, COMPILED)


@triton.jit
def _down_tile(p, h, h_desc, w, w_desc, out, tile_e, tile_r0, offs, n_tiles, D: tl.constexpr, I: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, N_FASTEST: tl.constexpr, TMA: tl.constexpr,
               COMPILED: tl.constexpr):
    """Tile p of the grid of n_tiles x cdiv(D, BN); nothing past the last tile. TMA: h's row tiles (`h_desc`) and
    the weight tiles (`w_desc`, w as [E * D, I]); rows past the expert's land in rows the store masks off."""
    t, nb = _program_tile(p, n_tiles, tl.cdiv(D, BN), N_FASTEST)
    e, r, live = _row_tile(tile_e, tile_r0, offs, t, BM)
    if e >= 0:
        r64 = r.to(tl.int64)
        n = nb * BN + tl.arange(0, BN)
        m_n = n < D
        kk = tl.arange(0, BK)
        a_p = h + r64[:, None] * I + kk[None, :]
        b_p = w + e.to(tl.int64) * (D * I) + n[None, :] * I + kk[:, None]       # [BK, BN]: rows of w[e], transposed
        r0 = tl.load(tile_r0 + t)
        w_row = e * D + nb * BN
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            m_k = k0 + kk < I
            if TMA:
                a = h_desc.load([r0, k0])
                b = w_desc.load([w_row, k0]).T
            else:
                a = tl.load(a_p + k0, mask=live[:, None] & m_k[None, :], other=0.)
                b = tl.load(b_p + k0, mask=m_k[:, None] & m_n[None, :], other=0.)
            acc = _dot(a, b, acc, COMPILED)
        tl.store(out + r64[:, None] * D + n[None, :], rounded(acc, out.dtype.element_ty, COMPILED),
                 mask=live[:, None] & m_n[None, :])


@triton.jit
def _moe_grouped_down_kernel(h, h_desc, w, w_desc, out, tile_e, tile_r0, offs, n_tiles, D: tl.constexpr,
                             I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             N_FASTEST: tl.constexpr, TMA: tl.constexpr, PERSISTENT: tl.constexpr,
                             COMPILED: tl.constexpr):
    """h [M, I] (sorted rows); w [E, D, I]; out [M, D] (sorted rows). Grid as `_moe_grouped_gate_up_kernel`'s."""
    n_all = n_tiles * tl.cdiv(D, BN)
    if PERSISTENT:
        if COMPILED:
            for p in range(tl.program_id(0), n_all, tl.num_programs(0)):
                _down_tile(p, h, h_desc, w, w_desc, out, tile_e, tile_r0, offs, n_tiles, D, I, BM, BN, BK, N_FASTEST,
                           TMA, COMPILED)
        else:  # the interpreter takes no run-time loop bounds (a 1-element array is no index under NumPy 2)
            p = tl.program_id(0)
            while p < n_all:
                _down_tile(p, h, h_desc, w, w_desc, out, tile_e, tile_r0, offs, n_tiles, D, I, BM, BN, BK, N_FASTEST,
                           TMA, COMPILED)
                p += tl.num_programs(0)
    else:
        _down_tile(tl.program_id(0), h, h_desc, w, w_desc, out, tile_e, tile_r0, offs, n_tiles, D, I, BM, BN, BK,
                   N_FASTEST, TMA, COMPILED)


def expert_tiles(offs: torch.Tensor, M: int, BM: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_e, tile_r0), each [cdiv(M, BM) + E] int32 (the most tiles any routing can need): the expert and first
    row of every row tile, each expert's rows cut into tiles of BM; -1 / 0 past the last. No host sync."""
    E = offs.numel()
    offs = offs.long()
    starts = torch.cat([offs.new_zeros(1), offs[:-1]])
    tiles = (offs - starts + BM - 1) // BM
    tile_end = torch.cumsum(tiles, 0)
    t = torch.arange(triton.cdiv(M, BM) + E, device=offs.device)
    e = torch.searchsorted(tile_end, t, right=True)           # E for t past the last tile
    live = e < E
    e_c = e.clamp(max=E - 1)
    r0 = starts[e_c] + (t - (tile_end[e_c] - tiles[e_c])) * BM
    return torch.where(live, e, -1).to(torch.int32), torch.where(live, r0, 0).to(torch.int32)


def _launch(kernel, n_all: int, k: dict, device: torch.device, *args, **meta) -> None:
    """kernel over n_all tiles with k's launch config: a program a tile, or (k["persistent"]) one an SM."""
    mt.require_runnable(kernel, device)
    compiled = mt.compiled(kernel)
    programs = n_all
    if k["persistent"]:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if compiled else 4
        programs = min(n_all, sms)
    kernel[(programs,)](*args, **meta, TMA=bool(k["tma"]), PERSISTENT=bool(k["persistent"]), COMPILED=compiled,
                        num_warps=k["num_warps"], num_stages=k["num_stages"])


def config(changes: Mapping | None = None) -> dict:
    """CONFIG with `changes` (a nested config's keys one by one), checked as `model.triton.launch_config` checks a
    kernel's cfg; `use` must name one or both of KERNELS, as an arm of neither would be the torch form."""
    c = mt.launch_config("moe_grouped.CONFIG", CONFIG, changes)
    if not c["use"] or set(c["use"]) - set(KERNELS):
        raise mt.UnknownConfigKeys(f"moe_grouped.CONFIG: 'use' must name one or both of {list(KERNELS)}, "
                                   f"got {list(c['use'])}")
    return c


def gate_up_silu(x: torch.Tensor, order: torch.Tensor, offs: torch.Tensor, gate_up: torch.Tensor, K: int,
                 cfg: dict | None = None) -> torch.Tensor:
    """h [M, I] = silu(W1[e] x_r) * W3[e] x_r for each sorted pair row r (token order[r] // K, expert e by offs)."""
    c = mt.launch_config("moe_grouped.gate_up_silu", CONFIG, cfg)
    k = c["gate_up"]
    N, D = x.shape
    M, I = order.numel(), gate_up.shape[1] // 2
    E = gate_up.shape[0]
    tiles = expert_tiles(offs, M, k["BM"])
    h = mt.empty(M, I, dtype=x.dtype, device=x.device)
    gate_up = gate_up.contiguous()
    w_desc = TensorDescriptor.from_tensor(gate_up.view(E * 2 * I, D), [k["BN"], k["BK"]]) if k["tma"] else None
    _launch(_moe_grouped_gate_up_kernel, tiles[0].numel() * triton.cdiv(I, k["BN"]), k, x.device,
            x.contiguous(), order, gate_up, w_desc, h, *tiles, offs, tiles[0].numel(), K=K, D=D, I=I,
            BM=k["BM"], BN=k["BN"], BK=k["BK"], N_FASTEST=bool(c["n_fastest"]))
    return h


def down(h: torch.Tensor, offs: torch.Tensor, down_w: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """out [M, D] = W2[e] h_r for each sorted row r (expert e by offs), in h's dtype."""
    c = mt.launch_config("moe_grouped.down", CONFIG, cfg)
    k = c["down"]
    M, I = h.shape
    E, D = down_w.shape[:2]
    tiles = expert_tiles(offs, M, k["BM"])
    out = mt.empty(M, D, dtype=h.dtype, device=h.device)
    h, down_w = h.contiguous(), down_w.contiguous()
    h_desc = w_desc = None
    if k["tma"]:
        h_desc = TensorDescriptor.from_tensor(h, [k["BM"], k["BK"]])
        w_desc = TensorDescriptor.from_tensor(down_w.view(E * D, I), [k["BN"], k["BK"]])
    _launch(_moe_grouped_down_kernel, tiles[0].numel() * triton.cdiv(D, k["BN"]), k, h.device,
            h, h_desc, down_w, w_desc, out, *tiles, offs, tiles[0].numel(), D=D, I=I, BM=k["BM"], BN=k["BN"],
            BK=k["BK"], N_FASTEST=bool(c["n_fastest"]))
    return out


def experts(x: torch.Tensor, order: torch.Tensor, offs: torch.Tensor, gate_up: torch.Tensor, down_w: torch.Tensor,
            K: int, cfg: Mapping | None = None) -> torch.Tensor:
    """out [M, D] = W2[e] (silu(W1[e] x_r) * W3[e] x_r) for each sorted pair row r, in the sorted order: what
    `model.ops.grouped_experts` computes, with CONFIG changed by `cfg` (`config`). A step that `use` leaves out runs
    as in that torch form. bf16 only (`Unsupported` otherwise)."""
    c = config(cfg)
    N, D = x.shape
    E, I2, D2 = gate_up.shape
    M, I = order.numel(), I2 // 2
    if D2 != D or M != N * K or offs.shape != (E,) or down_w.shape != (E, D, I):
        raise ValueError(f"moe_grouped.experts: x {tuple(x.shape)}, order {tuple(order.shape)}, offs "
                         f"{tuple(offs.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down_w.shape)} do not "
                         f"fit K={K}")
    if not x.dtype == gate_up.dtype == down_w.dtype == torch.bfloat16:
        raise Unsupported(f"moe_grouped.experts: bf16 tokens and expert stacks only, got x {x.dtype}, gate_up "
                          f"{gate_up.dtype}, down {down_w.dtype} (the model's dtype bfloat16, experts held in bf16)")
    if "gate_up" in c["use"]:
        h = gate_up_silu(x, order, offs, gate_up, K, c)
    else:
        gu = ops.grouped_mm(ops.moe_dispatch(x, order, K), gate_up.transpose(1, 2), offs)
        h = ops.silu_mul(gu[:, :I], gu[:, I:])
    return down(h, offs, down_w, c) if "down" in c["use"] else ops.grouped_mm(h, down_w.transpose(1, 2), offs)


@contextlib.contextmanager
def installed(changes: Mapping | None = None):
    """Inside the block, in this thread or task, the model's grouped experts (`model.ops.moe_experts_grouped`) run
    `experts` with CONFIG changed by `changes`, checked before the block runs; after it, also when it raises, the
    torch form."""
    c = config(changes)

    def run(x, order, offs, gate_up, down_w, K):
        return experts(x, order, offs, gate_up, down_w, K, c)
    with ops.experts_kernel(run):
        yield
