"""Synthetic Kimi-Linear weights and a content fingerprint for provenance.

`synthetic_weights(cfg, seed)` gives every ORIGINAL-format tensor its own generator, seeded from
sha256(f"{seed}:{name}")[:8], and writes the values straight into the internal (= HF) buffers on the target
device: an expert's w1/w3/w2 land in its slice of the preallocated stack, so there is no host copy and no host
sync (the GPU test holds the 48B model in bf16 to < 60 s, its fingerprint to < 10 s). Values are drawn in fp32
and rounded to the checkpoint format's dtype (bf16; fp32 for A_log, dt_bias, e_score_correction_bias), then
held in `dtype`: the fp64, fp32 and bf16 models carry the same values, and so does a checkpoint written from
any of them (precision comparisons and the HF oracle hold the same weights). They depend
on (seed, name, config, device type): torch's CPU and CUDA generators differ, so a golden made on a GPU records
the weights fingerprint, never "seed 0". On a CPU they are the same on every machine: the transforms of the
draws run in fp64 and round once (`_normal`, `_fp32_op`), since ATen's fp32 forms go through vector math whose
last bit follows the CPU's vendor and instruction set (MKL's and ATen's own dispatch).

Scales (D hidden, d KDA head dim, W conv taps, r kv_lora_rank, L layers, fan_in = the input dim of a [out, in]
weight; f = 1/sqrt(2L)):

| tensor                                                       | init                                          |
|--------------------------------------------------------------|-----------------------------------------------|
| embed_tokens                                                 | N(0, 1)                                       |
| input/post_attention_layernorm, norm, o_norm, kv_a_layernorm | 1 + N(0, 0.02^2)                              |
| q/k/v_proj, f_a_proj, g_a_proj, b_proj (KDA)                 | N(0, 1/D)                                     |
| f_b_proj, g_b_proj                                           | N(0, 1/d)                                     |
| q/k/v_conv1d                                                 | N(0, 1/W)                                     |
| A_log (fp32)                                                 | log U(1, 16)  (fla's init)                    |
| dt_bias (fp32)                                               | softplus^-1(dt), dt = exp U(ln 1e-3, ln 1e-1) |
| q_proj, kv_a_proj_with_mqa (MLA)                             | N(0, 1/D)                                     |
| kv_b_proj                                                    | N(0, 1/r)                                     |
| mlp/shared_experts gate_proj, up_proj; experts w1, w3        | N(0, 1/D)                                     |
| gate.weight (router)                                         | N(0, 1/D)                                     |
| gate.e_score_correction_bias (fp32)                          | N(0, 0.01^2)                                  |
| o_proj, down_proj, experts w2 (into the residual)            | N(0, f^2/fan_in)                              |
| lm_head                                                      | N(0, 3.5^2/D)                                 |

Why: with 1/fan_in every projection keeps unit variance, so gates and attention logits sit in their working
range (router and beta logits ~N(0,1); KDA decay exp(g) spans ~0.1..0.999 per step, short and long memory; MLA
scores ~N(0,1)). Each of the 2L residual branches adds variance ~f^2 (times O(1)), so the residual stream
stays RMS ~1 at any depth instead of growing ~sqrt(L), while the blocks still carry a good part of it: the
context moves the logits, so a broken state carry changes tokens. The final RMSNorm makes the hidden RMS 1, so
the logit std over the vocabulary is std(lm_head) * sqrt(D) = 3.5 for every config: neither flat nor
saturated. The bias std 0.01 is comparable to the gaps between the top router scores of the 48B config
(~0.007 around the 8th of 256), so the bias really changes the expert choice. Norm weights get noise so a
weight read from the wrong place shows.
Measured with model/model.py (fp32, CPU, 4 x 48 random tokens): logit std 3.49; residual RMS after each layer
1.04 -> 1.32 (tiny), 1.01 -> 1.19 (the 48B config's 27 layers and top-8 routing, cut to width 512 and 64
experts); replacing the 47-token prefix of the same last token moves the last logits by 63% / 43% (relative
L2) and changes the argmax 3 times in 4.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch

from .checkpoint import Slot, check_expert_dtype, internal_names, layout, storage_dtype
from .config import KimiConfig

LOGIT_STD = 3.5
NORM_NOISE = 0.02
ROUTER_BIAS_STD = 0.01
SAMPLE = 4096  # elements taken from the head, the tail and strided across each tensor by `fingerprint`


def tensor_seed(seed: int, name: str) -> int:
    """Seed of one original tensor's generator: the first 8 bytes of sha256(f"{seed}:{name}")."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def _init(cfg: KimiConfig, name: str, shape: tuple[int, ...]) -> tuple[str, float]:
    """(kind, std) for one original tensor; see the module docstring's table."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if leaf == "embed_tokens":
        return "normal", 1.0
    if leaf == "lm_head":
        return "normal", LOGIT_STD / math.sqrt(cfg.hidden_size)
    if leaf.endswith("norm"):
        return "one_plus", NORM_NOISE
    if leaf in ("A_log", "dt_bias"):
        return leaf, 0.0
    if leaf == "e_score_correction_bias":
        return "normal", ROUTER_BIAS_STD
    if leaf.endswith("conv1d"):
        return "normal", 1 / math.sqrt(cfg.conv_kernel_size)
    if leaf in ("o_proj", "down_proj", "w2"):
        return "normal", 1 / math.sqrt(2 * cfg.num_hidden_layers * shape[-1])
    if len(shape) == 2:  # every other [out, in] projection, the router included
        return "normal", 1 / math.sqrt(shape[-1])
    raise AssertionError(f"no init rule for {name} {shape}")  # a tensor added to layout() without a rule


def _fp32_op(fn, t: torch.Tensor) -> torch.Tensor:
    """fn(t) for fp32 t, the same bits on every CPU. ATen's fp32 log/exp/expm1 on a CPU call MKL's vector math,
    whose code path, and with it the last bit, follows the CPU's vendor and instruction set: the same tiny
    weights fingerprinted alike on an AMD EPYC and under MKL_CBWR=AVX on an Intel Xeon, but otherwise under that
    Xeon's own AVX-512 path (docs/RESULTS.md, "Notes behind the code"). In fp64 and rounded once to fp32 the result is
    the correctly rounded one on any CPU (it could differ only where an fp64 result within an ulp of it sits on
    an fp32 rounding boundary). CUDA keeps its own fp32 ops: the 48B goldens were made from weights drawn that
    way."""
    return fn(t.double()).float() if t.device.type == "cpu" else fn(t)


def _uniform(x: torch.Tensor, lo: float, hi: float, g: torch.Generator) -> torch.Tensor:
    """x (fp32) <- U(lo, hi) from g; returns x. On a CPU from g's fp64 uniforms on [0, 1), scaled in fp64 and
    rounded once: ATen's fp32 uniform_(lo, hi) scales in a kernel that the CPU's instruction set picks, and its
    values differed in the last bit between ATEN_CPU_CAPABILITY=default and avx2. On CUDA, torch's as before."""
    if x.device.type != "cpu":
        return x.uniform_(lo, hi, generator=g)
    u = torch.empty(x.shape, dtype=torch.float64).uniform_(generator=g)
    return x.copy_((lo + (hi - lo) * u).float())


_NORMAL_CHUNK = 1 << 22  # values per fp64 Box-Muller step on a CPU (64 MiB of uniforms)
_SLICE = 1 << 22  # values rounded to a checkpoint dtype, or widened back from one, at a time (16 MiB in fp32)


def _normal(x: torch.Tensor, mean: float, std: float, g: torch.Generator) -> None:
    """x (contiguous fp32) <- N(mean, std^2) from g. On a CPU by Box-Muller in fp64 from g's fp64 uniforms, rounded
    once: ATen's own CPU normal_ transforms in fp32 through vector math chosen by the CPU's instruction set (the
    tiny weights differed between ATEN_CPU_CAPABILITY=default and avx2), this is the same on every CPU
    (`_fp32_op`). On CUDA, torch's normal_ as before."""
    if x.device.type != "cpu":
        x.normal_(mean, std, generator=g)
        return
    flat = x.view(-1)
    for i in range(0, flat.numel(), _NORMAL_CHUNK):
        part = flat[i:i + _NORMAL_CHUNK]
        u = torch.empty(part.numel(), 2, dtype=torch.float64).uniform_(generator=g)
        z = torch.sqrt(-2.0 * torch.log1p(-u[:, 0])) * torch.cos((2 * math.pi) * u[:, 1])
        part.copy_((mean + std * z).float())


def _fill(dst: torch.Tensor, kind: str, std: float, g: torch.Generator, fmt: torch.dtype) -> None:
    """Draw in fp32, round to the checkpoint format's dtype `fmt` (bf16 for all but the fp32-kept tensors),
    then store in dst's dtype: synthetic weights hold the values a real checkpoint could hold, so an fp32 or
    fp64 model and the checkpoint our writer makes from it carry exactly the same weights.

    An fp32 dst is drawn in place; any other dst takes an fp32 scratch of its size. Rounding goes a slice at a
    time. Where a value is drawn does not change it, so the bits are those of the whole-tensor scratch and rounded
    copy used before. What changed is memory. For lm_head at 48B (1.41 GiB in fp32), the scratch and its 0.70 GiB
    rounded copy were alive at once, with every other weight already allocated. That put the load's peak over
    the memory projection, which counts only what the model holds (docs/RESULTS.md, memory gate). In fp32 with bf16
    experts the weights id added more (see `_AsStored`)."""
    in_place = dst.dtype == torch.float32
    x = dst if in_place else torch.empty(dst.shape, dtype=torch.float32, device=dst.device)
    if kind == "normal":
        _normal(x, 0.0, std, g)
    elif kind == "one_plus":
        _normal(x, 1.0, std, g)
    elif kind == "A_log":
        x.copy_(_fp32_op(torch.log, _uniform(x, 1.0, 16.0, g)))
    elif kind == "dt_bias":
        dt = _fp32_op(torch.exp, _uniform(x, math.log(1e-3), math.log(1e-1), g)).clamp_min_(1e-4)
        x.copy_(dt + _fp32_op(torch.log, -_fp32_op(torch.expm1, -dt)))  # inverse softplus, the stable form
    else:
        raise AssertionError(kind)
    if in_place and fmt == torch.float32:
        return
    for d, part in zip(dst.view(-1).split(_SLICE), x.view(-1).split(_SLICE)):  # dst: a tensor or a stack's rows
        d.copy_(part.to(fmt))  # to the checkpoint format, then dst's dtype


def _draw(cfg: KimiConfig, name: str, slot: Slot, dst: torch.Tensor, seed: int) -> None:
    g = torch.Generator(device=dst.device)
    g.manual_seed(tensor_seed(seed, name))
    _fill(dst, *_init(cfg, name, slot.shape), g, slot.dtype)


def synthetic_weights(cfg: KimiConfig, seed: int = 0, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32,
                      expert_dtype: torch.dtype | None = None, shard=None) -> dict[str, torch.Tensor]:
    """Deterministic random weights as an internal state dict; A_log, dt_bias, e_score_correction_bias in
    fp32, the router weight in fp32 under a narrower `dtype`, the routed experts in `expert_dtype` when given,
    everything else in `dtype` (`checkpoint.storage_dtype`). See the module docstring for scales and
    determinism.

    `shard` (a `model.parallel.ExpertParallel`): only that rank's routed experts, in stacks of its experts alone.
    Each expert's tensors have their own generators, so they get the values the whole model's stacks hold."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    check_expert_dtype(expert_dtype)
    device = torch.device(device)
    slots, internal = layout(cfg) if shard is None else shard.layout(cfg)
    out = {n: torch.empty(shape, dtype=storage_dtype(n, dt, dtype, expert_dtype), device=device)
           for n, (shape, dt) in internal.items()}
    for name, s in slots.items():
        _draw(cfg, name, s, out[s.internal][s.index] if s.index else out[s.internal], seed)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the fp32 scratch back: NVML (the memory floor) sees cached blocks as used
    return out


def synthetic_tensor(cfg: KimiConfig, name: str, seed: int = 0, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One ORIGINAL-format tensor of `synthetic_weights(cfg, seed, device, dtype)`, generated on its own."""
    slots = layout(cfg)[0]
    if name not in slots:
        raise KeyError(f"{name!r} is not a tensor of the original checkpoint format for config {cfg.name!r}")
    s = slots[name]
    t = torch.empty(s.shape, dtype=storage_dtype(s.internal, s.dtype, dtype), device=torch.device(device))
    _draw(cfg, name, s, t, seed)
    return t


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _sample(flat: torch.Tensor) -> torch.Tensor:
    n = flat.numel()
    if n <= 3 * SAMPLE:
        return flat
    step = (n - 2 * SAMPLE) // SAMPLE
    return torch.cat([flat[:SAMPLE], flat[SAMPLE:n - SAMPLE:step][:SAMPLE], flat[-SAMPLE:]])


def sample_positions(n: int) -> torch.Tensor:
    """The flat positions of the elements `_sample` takes from a tensor of n elements (int64, on the CPU): for a
    tensor held in parts (`model.parallel`), whose sample is assembled from the parts."""
    if n <= 3 * SAMPLE:
        return torch.arange(n)
    step = (n - 2 * SAMPLE) // SAMPLE
    strided = torch.arange(SAMPLE, n - SAMPLE, step)[:SAMPLE]
    return torch.cat([torch.arange(SAMPLE), strided, torch.arange(n - SAMPLE, n)])


def bit_patterns(t: torch.Tensor) -> torch.Tensor:
    """t's elements as integers of the same width (their bit patterns), flat."""
    return t.view(_INT_OF_SIZE[t.element_size()]).reshape(-1)


def bit_sum(bits: torch.Tensor) -> torch.Tensor:
    """The int64 sum of bit patterns, [1]; summed in slices: an int64 copy of a whole 2.4 GB expert stack would cost
    9.7 GB of device memory."""
    return sum(c.sum(dtype=torch.int64) for c in bits.split(1 << 24)).reshape(1)


def tensor_digest(name: str, t: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """One tensor's part of `fingerprint`: (its shape, the int64 sum of its elements' bit patterns and then the raw
    bytes of its sample, as uint8)."""
    bits = bit_patterns(t)
    return list(t.shape), torch.cat([bit_sum(bits).view(torch.uint8), _sample(bits).view(torch.uint8)])


def fingerprint(state_dict: Mapping[str, torch.Tensor], digest=tensor_digest) -> str:
    """'sha256:<16 hex>' over every tensor's name, shape, dtype, the int64 sum of all its elements' bit
    patterns (any single changed element changes it) and the raw bytes of a sample (first/last 4096 elements and
    4096 strided). Computed on the tensors' device; one transfer to the host. Equal for equal state dicts,
    whether loaded or synthesised, on any device. `digest` (`tensor_digest`'s signature) gives the whole tensor's
    shape and part for a tensor of which `state_dict` holds one rank's slice (`model.parallel`)."""
    h = hashlib.sha256()
    parts = []
    for name in sorted(state_dict):
        t = state_dict[name].detach()
        shape, part = digest(name, t)
        h.update(f"{name}|{shape}|{t.dtype}\n".encode())
        parts.append(part)
        del t  # before the next is read: `weights_id` hands over a cast made on reading
    if parts:
        h.update(torch.cat([p.to(parts[0].device) for p in parts]).cpu().numpy().tobytes())
    return "sha256:" + h.hexdigest()[:16]


def weights_id(state, cfg: KimiConfig, digest=tensor_digest) -> str:
    """Fingerprint of `state` in the checkpoint's dtypes; the same for any upcast of the same weights.

    `state` may be ours or HF's (same names; HF's extra buffers are ignored). Weights bf16 cannot hold
    exactly (e.g. fp32 draws) would collide with their rounding, so they are refused. `digest`: see `fingerprint`.
    """
    kinds = internal_names(cfg)
    missing = sorted(set(kinds) - set(state))
    if missing:
        raise ValueError(f"state dict lacks {len(missing)} tensors of the config, e.g. {missing[:5]}")
    return fingerprint(_AsStored(state, {n: dt for n, (_, dt) in kinds.items()}), digest)


class _AsStored(Mapping):
    """The tensors of `state` named in `dtypes`, each cast to its checkpoint dtype when it is read, and refused when
    the cast is not exact. `fingerprint` reads one tensor at a time, so one cast is alive at a time, and the
    check widens it back slice by slice. Casting them all first held a bf16 copy of every fp32 tensor: for the 48B
    model in fp32 with bf16 experts, 3.7 GiB (derived from `model.params.param_counts`) of GPU memory inside the
    memory gate's measured load, about the gap in its audit of Gate A's precision (docs/RESULTS.md, memory gate; a
    reading, not measured apart)."""

    def __init__(self, state: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype]):
        self.state, self.dtypes = state, dtypes

    def __getitem__(self, name: str) -> torch.Tensor:
        t, dt = self.state[name].detach(), self.dtypes[name]
        c = t.to(dt)
        if c.dtype != t.dtype and not all(torch.equal(a.to(t.dtype), b) for a, b in
                                          zip(c.reshape(-1).split(_SLICE), t.reshape(-1).split(_SLICE))):
            raise ValueError(f"{name} ({t.dtype}) holds values that {dt} cannot represent exactly: not "
                             f"checkpoint-valued weights, so they have no dtype-independent identity")
        return c

    def __iter__(self):
        return iter(self.dtypes)

    def __len__(self) -> int:
        return len(self.dtypes)
