"""Kimi Delta Attention (KDA) in plain PyTorch: the references every fast kernel is held against.

Layouts (fla's): q, k, v, g are [B, T, H, D]; beta is [B, T, H]; the recurrent state is [B, H, K, V]
in fp32. `g` is the log decay per head and key channel (<= 0), beta the per-head write strength.

The recurrence, per head (SPEC.md §1, KDA step 5):
    S <- S * exp(g_t)[:, None]
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T (q_t * scale)

Three forms live here:
- `naive_recurrent_kda`: the recurrence token by token, in any float dtype (fp64 for ground truth).
- `chunk_kda`: the chunked (WY / UT-transform) form used for prefill, fp32.
- `recurrent_kda_step`: one token from a carried state, fp32, used by decode.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in x's dtype (callers pass fp32 or fp64)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _prep(q, k, v, g, beta, scale, l2norm_qk, dtype):
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if l2norm_qk:
        q, k = l2norm(q), l2norm(k)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return q * scale, k, v, g, beta


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, l2norm_qk=True,
                        dtype=torch.float64):
    """Token-by-token recurrence in `dtype`. Returns (o [B,T,H,V] in dtype, final state [B,H,K,V] in dtype)."""
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale, l2norm_qk, dtype)
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = k.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype).clone()
    o = v.new_zeros(B, T, H, V)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        kv = (S * k[:, t, :, :, None]).sum(-2)                       # S^T k  [B,H,V]
        u = beta[:, t, :, None] * (v[:, t] - kv)
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        o[:, t] = (S * q[:, t, :, :, None]).sum(-2)
    return o, S


def recurrent_kda_step(q, k, v, g, beta, state, scale=None, l2norm_qk=True):
    """One token per sequence: q, k, v, g [B,H,D]; beta [B,H]; state [B,H,K,V] fp32, updated in place.

    Returns o [B,H,V] in fp32.
    """
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale, l2norm_qk, torch.float32)
    state.mul_(g.exp()[..., None])
    kv = torch.einsum("bhkv,bhk->bhv", state, k)
    u = beta[..., None] * (v - kv)
    state.add_(k[..., :, None] * u[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, chunk_size: int = 64, l2norm_qk=True):
    """Chunked form of the same recurrence (fp32). Any T >= 0; T need not be a multiple of the chunk.

    Within a chunk with cumulative log decay G_t = sum_{s<=t} g_s and chunk-start state S0:
        A[t,s]   = beta_t sum_c k_t[c] k_s[c] exp(G_t[c]-G_s[c])        (s < t)
        u        = (I + A)^-1 diag(beta) (V - (K*exp(G)) S0)             (the WY / UT transform)
        o_t      = S0^T (q_t*exp(G_t)) + sum_{s<=t} (sum_c q_t[c] k_s[c] exp(G_t[c]-G_s[c])) u_s
        S_end    = exp(G_C) * S0 + sum_s (k_s * exp(G_C - G_s)) u_s^T
    Pairwise decays are formed as exp(G_t - G_s) directly (never exp(G_t) * exp(-G_s)), so very
    negative gates underflow to 0 instead of overflowing. Returns (o [B,T,H,V] fp32, state [B,H,K,V] fp32).
    """
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale, l2norm_qk, torch.float32)
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = k.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(torch.float32).clone()
    o = v.new_zeros(B, T, H, V)
    C = chunk_size
    # [B,H,T,D] so each chunk is a contiguous slab along T
    q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))
    beta = beta.transpose(1, 2)
    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
    eye = torch.eye(C, dtype=torch.float32, device=k.device)
    for start in range(0, T, C):
        n = min(C, T - start)
        sl = slice(start, start + n)
        qc, kc, vc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl]
        G = g[:, :, sl].cumsum(-2)                                          # [B,H,n,K]
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]                    # [B,H,n(t),n(s),K]
        decay = diff.masked_fill(~causal[:n, :n, None], float("-inf")).exp()
        Akk = torch.einsum("bhtc,bhsc,bhtsc->bhts", kc, kc, decay) * bc[..., None]
        Akk = Akk.masked_fill(~strict[:n, :n], 0.0)
        Tm = torch.linalg.solve_triangular(Akk + eye[:n, :n], eye[:n, :n].expand_as(Akk), upper=False,
                                           unitriangular=True)
        eG = G.exp()
        w = Tm @ (bc[..., None] * kc * eG)                                   # [B,H,n,K]
        u = Tm @ (bc[..., None] * vc) - w @ S                                # [B,H,n,V]
        Aqk = torch.einsum("bhtc,bhsc,bhtsc->bhts", qc, kc, decay)
        oc = (qc * eG) @ S + Aqk @ u
        o[:, sl] = oc.transpose(1, 2)
        GC = G[:, :, -1:, :]                                                 # [B,H,1,K]
        S = S * GC.transpose(-1, -2).exp() + (kc * (GC - G).exp()).transpose(-1, -2) @ u
    return o, S


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Log decay g = -exp(A_log[h]) * softplus(f + dt_bias), fp32, [..., H, head_dim].

    f is f_b(f_a(x)) of shape [..., H*head_dim]; A_log holds one value per head.
    """
    x = (f + dt_bias.float()).unflatten(-1, (-1, head_dim))   # promotes to fp32 exactly, without a cast copy of f
    return -A_log.float().reshape(-1, 1).exp() * F.softplus(x)


def gate_b_proj(fg_a: torch.Tensor, gate_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(f_b(f_a(x)), g_b(g_a(x))), each [..., H*d], from fg_a = f_a(x)|g_a(x) [..., 2*d] (a view of the packed
    input projection) and gate_b_weight [2, H*d, d] (f_b's and g_b's weights stacked): one batched GEMM."""
    d = gate_b_weight.shape[-1]
    f, gate = torch.bmm(fg_a.reshape(-1, 2, d).transpose(0, 1), gate_b_weight.transpose(1, 2))
    shape = (*fg_a.shape[:-1], gate_b_weight.shape[1])
    return f.view(shape), gate.view(shape)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor | None = None):
    """Depthwise causal conv over time, then SiLU.

    x [B, T, C]; weight [C, W] (weight[:, W-1] multiplies the current token); taps [B, W-1, C] holds the
    previous W-1 inputs (zeros at the start of a sequence). Returns (y [B,T,C] in x.dtype,
    new taps [B, W-1, C]: the last W-1 inputs, carried to the next call).
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    if taps is None:
        taps = x.new_zeros(B, W - 1, C)
    xx = torch.cat([taps.to(x.dtype), x], dim=1)                             # [B, W-1+T, C]
    y = F.conv1d(xx.transpose(1, 2).to(weight.dtype), weight[:, None, :], groups=C)  # [B, C, T]
    y = F.silu(y).transpose(1, 2).to(x.dtype)
    return y, carried_taps(x, taps, W)


def carried_taps(x: torch.Tensor, taps: torch.Tensor | None, W: int) -> torch.Tensor:
    """The last W-1 inputs of taps followed by x [B, T, C] (a new contiguous tensor, in x's dtype): what a
    causal conv of W taps carries to the next call."""
    B, T, C = x.shape
    old = x.new_zeros(B, W - 1, C) if taps is None else taps.to(x.dtype)
    if W == 1:
        return x[:, :0]
    return torch.cat([old, x[:, max(0, T - (W - 1)):]], dim=1)[:, -(W - 1):].contiguous()  # updated in place later
