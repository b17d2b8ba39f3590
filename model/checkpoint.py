"""Original-format Kimi-Linear checkpoints: the tensor list, the mapping to our internal names, load, save.

Two naming schemes exist (SPEC.md §1, TEAM_BRIEF.md):
- ORIGINAL, what the published checkpoint holds: `block_sparse_moe.` for MoE layers, one tensor per expert
  (`experts.E.w1/w2/w3.weight`), separate `q_conv1d/k_conv1d/v_conv1d`, `f_a_proj/f_b_proj/A_log/dt_bias`
  directly under `self_attn.`.
- INTERNAL (= HF transformers' names after its conversion): `mlp.`, expert stacks `experts.gate_up_proj`
  [E, 2I, D] (w1 rows, then w3 rows) and `experts.down_proj` [E, D, I], one `conv1d.weight` [3*H*d, 1, W]
  (q|k|v), `forget_gate.*`.

Every original tensor is one `Slot`: a contiguous block of exactly one internal tensor (the whole tensor, a
q/k/v third of the stacked conv, or one expert's w1/w3 half / w2 of a stack). Both directions of the
mapping, the loader and the synthetic weights are driven by that one table, so they cannot disagree.

bf16 throughout, except `A_log`, `dt_bias` and `e_score_correction_bias`, which the original keeps in fp32
(they feed exp/softplus and the routing comparison, where bf16 rounding would move the result).
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import KimiConfig, checked_file, parse_json, read_file


class CheckpointError(ValueError):
    """A checkpoint directory or state dict that does not hold a Kimi-Linear model; the message names what."""


FP32_KEPT = ("A_log", "dt_bias", "e_score_correction_bias")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PROMPTS_FILE = "prompts.json"  # optional: the battery a checkpoint carries for the gates (gates.prompts)
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # HF's default shard size; the original has 20 shards of ~4.6 GiB
# The 48B model's index names 20,493 tensors in ~2 MB; an index past this is no checkpoint's (even the
# config.MAX_TENSORS = 2^18 tensors' names and shard names fit in ~30 MB).
MAX_INDEX_BYTES = 64 << 20

_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


@dataclass(frozen=True)
class Slot:
    """Where one original-format tensor lives in the internal state dict."""
    internal: str              # name of the internal tensor
    index: tuple               # basic index of the block inside it; () = the whole tensor
    shape: tuple[int, ...]     # shape of the original tensor
    dtype: torch.dtype         # dtype in the original checkpoint


def _is_fp32_kept(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in FP32_KEPT


def layout(cfg: KimiConfig) -> tuple[dict[str, Slot], dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """(original name -> Slot, internal name -> (shape, original dtype)), both in checkpoint order."""
    slots: dict[str, Slot] = {}
    internal: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def whole(orig: str, shape: tuple[int, ...], name: str | None = None) -> None:
        dt = torch.float32 if _is_fp32_kept(orig) else torch.bfloat16
        name = name or orig
        slots[orig] = Slot(name, (), shape, dt)
        internal[name] = (shape, dt)

    def block(orig: str, shape: tuple[int, ...], name: str, index: tuple, stack_shape: tuple[int, ...]) -> None:
        slots[orig] = Slot(name, index, shape, torch.bfloat16)
        internal.setdefault(name, (stack_shape, torch.bfloat16))

    D, W = cfg.hidden_size, cfg.conv_kernel_size
    H, d, Hd = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_dim
    nh, r, rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    E, Im = cfg.num_experts, cfg.moe_intermediate_size

    whole("model.embed_tokens.weight", (cfg.vocab_size, D))
    for i, kind in enumerate(cfg.layer_kinds):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        whole(p + "input_layernorm.weight", (D,))
        if kind == "kda":
            for x in "qkv":
                whole(a + f"{x}_proj.weight", (Hd, D))
            for j, x in enumerate("qkv"):
                block(a + f"{x}_conv1d.weight", (Hd, 1, W), a + "conv1d.weight", (slice(j * Hd, (j + 1) * Hd),), (3 * Hd, 1, W))
            whole(a + "f_a_proj.weight", (d, D), a + "forget_gate.f_a_proj.weight")
            whole(a + "f_b_proj.weight", (Hd, d), a + "forget_gate.f_b_proj.weight")
            whole(a + "g_a_proj.weight", (d, D))
            whole(a + "g_b_proj.weight", (Hd, d))
            whole(a + "b_proj.weight", (H, D))
            whole(a + "A_log", (1, 1, H, 1), a + "forget_gate.A_log")
            whole(a + "dt_bias", (Hd,), a + "forget_gate.dt_bias")
            whole(a + "o_norm.weight", (d,))
            whole(a + "o_proj.weight", (D, Hd))
        else:
            whole(a + "q_proj.weight", (nh * cfg.qk_head_dim, D))
            whole(a + "kv_a_proj_with_mqa.weight", (r + rope, D))
            whole(a + "kv_a_layernorm.weight", (r,))
            whole(a + "kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), r))
            whole(a + "o_proj.weight", (D, nh * cfg.v_head_dim))
        whole(p + "post_attention_layernorm.weight", (D,))
        if not cfg.is_moe(i):
            I = cfg.intermediate_size
            whole(p + "mlp.gate_proj.weight", (I, D))
            whole(p + "mlp.up_proj.weight", (I, D))
            whole(p + "mlp.down_proj.weight", (D, I))
            continue
        o, m = p + "block_sparse_moe.", p + "mlp."
        whole(o + "gate.weight", (E, D), m + "gate.weight")
        whole(o + "gate.e_score_correction_bias", (E,), m + "gate.e_score_correction_bias")
        gate_up, down = m + "experts.gate_up_proj", m + "experts.down_proj"
        for e in range(E):
            x = o + f"experts.{e}."
            block(x + "w1.weight", (Im, D), gate_up, (e, slice(0, Im)), (E, 2 * Im, D))
            block(x + "w2.weight", (D, Im), down, (e,), (E, D, Im))
            block(x + "w3.weight", (Im, D), gate_up, (e, slice(Im, 2 * Im)), (E, 2 * Im, D))
        if cfg.num_shared_experts:
            Is = Im * cfg.num_shared_experts
            for w, shape in (("gate_proj", (Is, D)), ("up_proj", (Is, D)), ("down_proj", (D, Is))):
                whole(o + f"shared_experts.{w}.weight", shape, m + f"shared_experts.{w}.weight")
    whole("model.norm.weight", (D,))
    whole("lm_head.weight", (cfg.vocab_size, D))
    return slots, internal


def original_names(cfg: KimiConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of the original checkpoint format: name -> (shape, dtype), in checkpoint order."""
    return {n: (s.shape, s.dtype) for n, s in layout(cfg)[0].items()}


def internal_names(cfg: KimiConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of our internal (= HF) state dict: name -> (shape, dtype as stored in the original)."""
    return layout(cfg)[1]


# Held in fp32 although the checkpoint has them in bf16: the router's GEMV runs in fp32 (SPEC §1), and a
# bf16-held weight would be cast to fp32 again at every decode step (one extra kernel and 3.5 MB per layer).
FP32_HELD = ("mlp.gate.weight",)


# The routed experts' stacks: 96% of the 48B model's weights. `expert_dtype` may hold them apart from the model
# dtype, e.g. in bf16 (their checkpoint dtype, so no value changes) under an fp32 model: the full-size model then
# computes in fp32 on one 141 GB GPU (102 GB of weights instead of 196, by model.params.param_counts), which is
# how Gate A runs it on CUDA.
ROUTED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
EXPERT_DTYPES = (torch.bfloat16, torch.float32, torch.float64)  # the dtypes that hold bf16 checkpoint values exactly


def check_expert_dtype(expert_dtype: torch.dtype | None) -> None:
    if expert_dtype is not None and expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"expert_dtype {expert_dtype} cannot hold the experts' bf16 checkpoint values exactly; "
                         f"use one of {', '.join(str(d).removeprefix('torch.') for d in EXPERT_DTYPES)}")


def storage_dtype(name: str, original_dtype: torch.dtype, dtype: torch.dtype,
                  expert_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype internal tensor `name` is held in when the model runs in `dtype`: fp32-kept tensors and the
    router weight stay fp32 (the values are the same: bf16 widens exactly); the routed experts' stacks in
    `expert_dtype` when given (see ROUTED_EXPERTS)."""
    if original_dtype == torch.float32 or (name.endswith(FP32_HELD) and dtype.itemsize < 4):
        return torch.float32
    if expert_dtype is not None and name.endswith(ROUTED_EXPERTS):
        return expert_dtype
    return dtype


def _name(n: str, limit: int = 120) -> str:
    """A tensor or shard name for a one-line message: as it is, or quoted and cut when long or unprintable."""
    return n if len(n) <= limit and n.isprintable() else repr(n[:limit]) + ("..." if len(n) > limit else "")


def _listing(names, limit: int = 10, bracket: bool = True) -> str:
    """The first `limit` names, then how many more: "a, b (and 3 more)", or without the brackets "a, b and 3 more"
    (for a listing that is itself in brackets)."""
    names = list(names)
    head = ", ".join(_name(n) for n in names[:limit])
    if len(names) <= limit:
        return head
    more = f"and {len(names) - limit:,} more"
    return f"{head} ({more})" if bracket else f"{head} {more}"


def _count(n: int, noun: str) -> str:
    """A count with its noun in the right number: '1 tensor', '2 tensors', '20,493 tensors'."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _them(n: int) -> str:
    return "it" if n == 1 else "them"


def _check_names(got, expected, what: str) -> None:
    got, expected = set(got), list(expected)
    missing = [n for n in expected if n not in got]
    extra = sorted(got - set(expected))
    problems = []
    if missing:
        problems.append(f"{_count(len(missing), 'tensor')} missing: {_listing(missing)}")
    if extra:
        problems.append(f"{_count(len(extra), 'unexpected tensor')}: {_listing(extra)}")
    if problems:
        raise CheckpointError(f"{what}: " + "; ".join(problems))


def _check_shapes(tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple], what: str) -> None:
    bad = [f"{n}: expected shape {list(shapes[n][0])}, got {list(t.shape)}"
           for n, t in tensors.items() if tuple(t.shape) != tuple(shapes[n][0])]
    if bad:
        raise CheckpointError(f"{what}: {_count(len(bad), 'tensor')} with the wrong shape: " + "; ".join(bad[:10]))


def to_internal(original: Mapping[str, torch.Tensor], cfg: KimiConfig) -> dict[str, torch.Tensor]:
    """Original-format tensors -> internal state dict. Renamed tensors are passed through (no copy); the
    stacked conv and expert tensors are new buffers (dtype/device of their first part) filled block by block."""
    slots, internal = layout(cfg)
    _check_names(original, slots, "to_internal")
    _check_shapes(original, {n: (s.shape, s.dtype) for n, s in slots.items()}, "to_internal")
    out: dict[str, torch.Tensor] = {}
    for name, s in slots.items():
        t = original[name]
        if s.index == ():
            out[s.internal] = t
            continue
        if s.internal not in out:
            out[s.internal] = torch.empty(internal[s.internal][0], dtype=t.dtype, device=t.device)
        out[s.internal][s.index].copy_(t)
    return {n: out[n] for n in internal}


def to_original(internal: Mapping[str, torch.Tensor], cfg: KimiConfig) -> dict[str, torch.Tensor]:
    """Internal state dict -> original-format tensors; every one is the internal tensor or a view into it."""
    slots, shapes = layout(cfg)
    _check_names(internal, shapes, "to_original")
    _check_shapes(internal, shapes, "to_original")
    return {n: internal[s.internal] if s.index == () else internal[s.internal][s.index] for n, s in slots.items()}


# ---- loading -----------------------------------------------------------------------------------------------

def _weight_map(path: Path) -> dict[str, str]:
    """tensor name -> shard file name, from the index, or from the single model.safetensors."""
    index, single = path / INDEX_FILE, path / SINGLE_FILE
    has_index, has_single = os.path.lexists(index), os.path.lexists(single)  # any form counts; reading refuses
    if has_index and has_single:
        raise CheckpointError(f"{path} holds both {INDEX_FILE} and {SINGLE_FILE}; which one is the checkpoint is ambiguous")
    if has_single:
        with _open(single, "cpu") as f:
            return {n: SINGLE_FILE for n in f.keys()}
    if not has_index:
        raise CheckpointError(f"{path} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
    d = parse_json(index, read_file(index, MAX_INDEX_BYTES, CheckpointError), CheckpointError)
    if not isinstance(d, dict) or "weight_map" not in d:
        raise CheckpointError(f"{index} must hold a JSON object with a weight_map, got "
                              f"{'an object without one' if isinstance(d, dict) else type(d).__name__}")
    wm = d["weight_map"]
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names (strings)")
    outside = sorted({v for v in wm.values() if Path(v).name != v or v in ("", ".", "..") or "\0" in v})
    if outside:
        raise CheckpointError(f"{index} names shards outside the checkpoint directory: {_listing(outside)}")
    return wm


def _open(file: Path, device: str):
    """`safe_open` on a regular file inside the checkpoint directory (`config.checked_file`: a link out of it, a
    dangling link or a fifo is refused by name rather than followed or blocked on)."""
    target = checked_file(file, CheckpointError)
    try:
        return safe_open(str(target), framework="pt", device=device)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read shard {file.name} in {file.parent}: {e}") from e


def _check_shards(path: Path, by_shard: dict[str, list[str]], slots: dict[str, Slot], indexed: bool) -> None:
    """Every shard exists, holds exactly the tensors the index gives it, each with the expected shape and dtype.
    Reads headers only, so a bad checkpoint fails before any weight is loaded."""
    absent = [s for s in by_shard if not os.path.lexists(path / s)]
    if absent:
        # A few names, not all: a large model's shard holds hundreds of tensors, and the message is one stderr line.
        shown = [f"{_name(s)} (should hold {_count(len(by_shard[s]), 'tensor')}"
                 + (f": {_listing(by_shard[s], 2, bracket=False)})" if k == 0 else ")")
                 for k, s in enumerate(absent[:3])]
        more = f"; and {_count(len(absent) - 3, 'more shard')}" if len(absent) > 3 else ""
        raise CheckpointError(f"missing shard file(s) in {path}: " + "; ".join(shown) + more)
    bad = []
    for shard, names in by_shard.items():
        with _open(path / shard, "cpu") as f:
            held = set(f.keys())
            lacking = [n for n in names if n not in held]
            if lacking:
                raise CheckpointError(f"{INDEX_FILE} maps {_count(len(lacking), 'tensor')} to {_name(shard)}, which "
                                      f"does not hold {_them(len(lacking))}: {_listing(lacking)}")
            unlisted = sorted(held - set(names))
            if indexed and unlisted:
                raise CheckpointError(f"{_name(shard)} holds {_count(len(unlisted), 'tensor')} that {INDEX_FILE} does "
                                      f"not list: {_listing(unlisted)}")
            for n in names:
                sl, want = f.get_slice(n), slots[n]
                shape, dt = tuple(sl.get_shape()), sl.get_dtype()
                wrong = ([f"expected shape {list(want.shape)}, got {list(shape)}"] if shape != want.shape else []) \
                    + ([f"expected dtype {_ST_NAMES[want.dtype]}, got {dt}"] if dt != _ST_NAMES[want.dtype] else [])
                if wrong:   # one entry per tensor, so that the count is of tensors
                    bad.append(f"{n} ({shard}): {', '.join(wrong)}")
    if bad:
        raise CheckpointError(f"{_count(len(bad), 'tensor')} with the wrong shape or dtype in {path}: "
                              f"{'; '.join(bad[:10])}" + (f" (and {len(bad) - 10:,} more)" if len(bad) > 10 else ""))


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                    expert_dtype: torch.dtype | None = None,
                    layout_of=None) -> tuple[KimiConfig, dict[str, torch.Tensor]]:
    """Load an original-format checkpoint directory -> (config, internal state dict on `device`).

    Reads only data: `config.json` (through `KimiConfig.from_json`; an `auto_map` entry is ignored and no .py
    file of the directory is ever imported or executed), `model.safetensors.index.json` or a single
    `model.safetensors`, and the shards through memory-mapped `safe_open`: each a regular file inside the directory
    (a link is followed only to a file inside it, `config.checked_file`). Before any weight is read, every
    name, shape and dtype is held against `original_names(cfg)`; after loading, every tensor must be finite.
    Anything wrong raises `CheckpointError` (a bad config.json: `ConfigError`) naming the file and tensors.

    Floats are cast to `dtype`, except A_log, dt_bias and e_score_correction_bias, which stay fp32, the router
    weight, which stays fp32 under a narrower `dtype`, and the routed experts, which go to `expert_dtype` when
    given (`storage_dtype`). Tensors
    go to `device` one at a time (no host copy of the whole model); expert stacks and the q|k|v conv are
    preallocated on `device` and filled block by block.

    `layout_of(cfg) -> (slots, internal shapes)` reads a part of the model (one rank's, `model.parallel`): the name,
    shape and dtype checks still cover the whole checkpoint, but only the slots it names are read (and checked
    finite), and a shard holding none of them is not opened.
    """
    path = Path(path)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    check_expert_dtype(expert_dtype)
    device = torch.device(device)
    cfg, (slots, internal_shapes), weight_map, by_shard = _headers(path)
    if layout_of is not None:
        slots, internal_shapes = layout_of(cfg)

    stacked = {s.internal for s in slots.values() if s.index != ()}
    out = {n: torch.empty(shape, dtype=storage_dtype(n, dt, dtype, expert_dtype), device=device)
           for n, (shape, dt) in internal_shapes.items() if n in stacked}
    report = sum(torch.Size(s.shape).numel() * s.dtype.itemsize for s in slots.values()) >= 2**30
    loaded, finite, next_report, t0 = [], [], 0.1, time.perf_counter()
    for shard, names in by_shard.items():
        names = [n for n in names if n in slots]
        if not names:
            continue
        with _open(path / shard, str(device)) as f:
            for n in names:
                s = slots[n]
                t = f.get_tensor(n).to(storage_dtype(s.internal, s.dtype, dtype, expert_dtype))
                loaded.append(n)
                finite.append(torch.isfinite(t).all())  # no host sync per tensor: all are read back at the end
                if s.index == ():
                    out[s.internal] = t
                else:
                    out[s.internal][s.index].copy_(t)
                if report and len(loaded) >= next_report * len(slots):
                    print(f"load_checkpoint {path.name}: {len(loaded) / len(slots):.0%} ({len(loaded):,}/{len(slots):,} "
                          f"tensors) {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
                    next_report += 0.1
    if len(loaded) != len(slots):   # every slot is in the checked index, so each must have been read once
        raise CheckpointError(f"{path}: read {len(loaded)} of the {len(slots)} tensors to load")
    _refuse_nonfinite(path, weight_map, loaded, torch.stack(finite).cpu().tolist())
    return cfg, {n: out[n] for n in internal_shapes}


def check_checkpoint(path: str | Path) -> KimiConfig:
    """`load_checkpoint`'s checks, keeping no tensor: config, index, shards, names, shapes, dtypes, then every
    tensor read once (memory-mapped) and held to be finite. For a caller that hands the directory to another
    loader (HF transformers, whose own checks differ: it loads a missing shard's neighbours, a wrong dtype, a NaN)."""
    path = Path(path)
    cfg, _, weight_map, by_shard = _headers(path)
    names, finite = [], []
    for shard, shard_names in by_shard.items():
        with _open(path / shard, "cpu") as f:
            for n in shard_names:
                names.append(n)
                finite.append(bool(torch.isfinite(f.get_tensor(n)).all()))
    _refuse_nonfinite(path, weight_map, names, finite)
    return cfg


def _headers(path: Path) -> tuple[KimiConfig, tuple, dict[str, str], dict[str, list[str]]]:
    """The checks that read no weight: the config, the index, every name, shard, shape and dtype. Returns the
    config, its `layout`, the weight map and the names each shard holds (shards in name order)."""
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory")
    cfg = KimiConfig.from_json(path / "config.json")   # its errors name the file
    shapes = layout(cfg)
    slots = shapes[0]
    weight_map = _weight_map(path)
    _check_listed(path, weight_map, slots)
    by_shard = _by_shard((n, weight_map[n]) for n in slots)
    _check_shards(path, by_shard, slots, indexed=not os.path.lexists(path / SINGLE_FILE))
    return cfg, shapes, weight_map, by_shard


def _held_by(path: Path, shards, names: set[str]) -> dict[str, str]:
    """name -> the first of `shards` (in name order) whose header lists it, for each of `names` some shard holds.
    Reads headers only; a shard that is absent or unreadable is skipped, as the shard checks name it."""
    held: dict[str, str] = {}
    for shard in sorted(shards):
        if len(held) == len(names):
            break
        if not os.path.lexists(path / shard):
            continue
        try:
            with _open(path / shard, "cpu") as f:
                for n in f.keys():
                    if n in names:
                        held.setdefault(n, shard)
        except CheckpointError:
            continue
    return held


def _check_listed(path: Path, weight_map: dict[str, str], slots: dict[str, Slot]) -> None:
    """The weight map (the index, or the single file's names) lists exactly the config's tensors. A tensor it lacks
    that a shard it names holds is reported as the index's omission, with that shard; one no shard holds is missing;
    an unexpected one is named with its shard, and whether the shard holds it."""
    missing = [n for n in slots if n not in weight_map]
    extra = sorted(n for n in weight_map if n not in slots)
    if not missing and not extra:
        return
    held = _held_by(path, set(weight_map.values()), set(missing) | set(extra))
    problems = []
    for shard, names in _by_shard((n, held[n]) for n in missing if n in held).items():
        problems.append(f"{_name(shard)} holds {_count(len(names), 'tensor')} that {INDEX_FILE} does not list: "
                        f"{_listing(names)}")
    nowhere = [n for n in missing if n not in held]
    if nowhere:
        problems.append(f"{_count(len(nowhere), 'tensor')} missing: {_listing(nowhere)}")
    for shard, names in _by_shard((n, weight_map[n]) for n in extra).items():
        inside = [n for n in names if held.get(n) == shard]
        outside = [n for n in names if held.get(n) != shard]
        if inside:
            problems.append(f"{_name(shard)} holds {_count(len(inside), 'unexpected tensor')}: {_listing(inside)}")
        if outside:
            problems.append(f"{INDEX_FILE} maps {_count(len(outside), 'unexpected tensor')} to {_name(shard)}, which "
                            f"does not hold {_them(len(outside))}: {_listing(outside)}")
    raise CheckpointError(f"checkpoint {path}: " + "; ".join(problems))


def _by_shard(pairs) -> dict[str, list[str]]:
    """(name, shard) pairs -> shard -> names, shards in name order, names in the order given."""
    out: dict[str, list[str]] = {}
    for n, shard in pairs:
        out.setdefault(shard, []).append(n)
    return dict(sorted(out.items()))


def _refuse_nonfinite(path: Path, weight_map: dict[str, str], names: list[str], finite: list[bool]) -> None:
    bad = [f"{n} ({weight_map[n]})" for n, good in zip(names, finite) if not good]
    if bad:
        raise CheckpointError(f"{_count(len(bad), 'tensor')} {'holds' if len(bad) == 1 else 'hold'} NaN or inf in "
                              f"{path}: {_listing(bad)}")


# ---- saving ------------------------------------------------------------------------------------------------

def save_checkpoint(internal: Mapping[str, torch.Tensor], cfg: KimiConfig, path: str | Path,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write an original-format checkpoint: config.json, `model-0000k-of-0000n.safetensors`, and
    `model.safetensors.index.json` (metadata.total_size + weight_map) -- the layout HF's
    `KimiLinearForCausalLM.from_pretrained` reads. Tensors are written in the format's dtypes (bf16; fp32 for
    A_log, dt_bias, e_score_correction_bias), so fp32 weights are rounded to bf16. Shards are filled greedily
    in checkpoint order; output is byte-for-byte deterministic. Refuses a directory that already holds a
    checkpoint (stale shards would be mixed in). Returns the directory."""
    path = Path(path)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    original = to_original(internal, cfg)
    shapes = original_names(cfg)
    if path.exists():
        old = sorted(p.name for p in path.iterdir() if p.name in ("config.json", INDEX_FILE) or p.suffix == ".safetensors")
        if old:
            raise CheckpointError(f"refusing to write into {path}: it already holds {_listing(old)}; use an empty directory")
    path.mkdir(parents=True, exist_ok=True)

    shards: list[list[str]] = [[]]
    size = 0
    for n, (shape, dt) in shapes.items():
        nbytes = torch.Size(shape).numel() * dt.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for file, names in zip(files, shards):
        # copy=True: views of one expert stack share storage, which safetensors refuses to write
        tensors = {n: original[n].detach().to("cpu", shapes[n][1], copy=True).contiguous() for n in names}
        save_file(tensors, str(path / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(torch.Size(s).numel() * dt.itemsize for s, dt in shapes.values())},
             "weight_map": {n: file for file, names in zip(files, shards) for n in names}}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return path
