"""Kimi-Linear configuration: read the original checkpoint's config.json, validate it, presets; and the checks
every file of a checkpoint directory is read through (`checked_file`, `read_file`, `parse_json`).

The original format numbers layers from 1 in `linear_attn_config.{kda_layers,full_attn_layers}`;
internally every layer index is 0-based.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config.json that cannot describe a Kimi-Linear model; the message says which field and why."""


# Upper bounds on sizes, far past any released model (Kimi-Linear: 256 experts, 27 layers, a 163,840-token
# vocabulary): a size past them is a typo, and a name list of ten million experts' tensors exhausts memory before
# the checkpoint check that would refuse it can run.
MAX_SIZE = 1 << 20
SIZE_LIMITS = {"num_hidden_layers": 4096, "num_experts": 1 << 16, "num_experts_per_token": 1 << 16,
               "num_attention_heads": 4096, "kda_num_heads": 4096, "conv_kernel_size": 64, "vocab_size": 1 << 24}
# Sizes that are each under their limit can still multiply to an absurd model. The checkpoint's parameter and
# tensor counts, computed from the fields alone (`KimiConfig.checkpoint_size`), are bounded too, before anything is
# built from them: about 4x the 48b-a3b preset's 49.1e9 parameters (2e11 is 400 GB in bf16, past every GPU and most
# hosts), and about 13x its 20,493 tensors (a name table of 2^18 tensors takes ~100 MB and ~1 s to build). No
# single tensor can exceed the parameter bound, so no per-tensor bound is needed.
MAX_PARAMS = 2 * 10**11
MAX_TENSORS = 1 << 18
MAX_MODEL_MAX_LENGTH = 1 << 40  # a context length; read and written back, used by nothing here
MAX_CONFIG_BYTES = 1 << 20  # the real config.json is ~3 KB
# The dtype names config.json may give in `torch_dtype` (or `dtype`, HF's newer key), spelled as HF writes them: those
# a safetensors checkpoint of this format can declare. A known name is not held against the shards, whose stored
# dtypes the loader checks tensor by tensor; an unknown one is a broken file.
CHECKPOINT_DTYPES = ("bfloat16", "float16", "float32")

# The JSON types config.json's fields must have (where present): a string where a number belongs, or a null, is
# refused by name here rather than failing later inside float() or a comparison.
_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
         "num_key_value_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
         "first_k_dense_replace", "num_experts", "num_experts_per_token", "num_shared_experts",
         "moe_intermediate_size", "bos_token_id", "pad_token_id", "model_max_length")
_INTS_OR_NULL = ("q_lora_rank", "num_expert_group", "topk_group")
_LAC_INTS = ("head_dim", "num_heads", "short_conv_kernel_size")
_NUMBERS = ("routed_scaling_factor", "rms_norm_eps")
_BOOLS = ("moe_renormalize", "tie_word_embeddings")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite_number(v) -> bool:
    """An int or float (not a bool) that is finite as a float: an int past float range is not."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _show(v, limit: int = 80) -> str:
    """`v` as short one-line JSON for an error message: a hostile file's values may be megabytes long, nested
    thousands deep, or integers of hundreds of digits, and none of that belongs in a message."""
    def render(x, depth: int) -> str:
        if isinstance(x, (list, tuple, dict)):
            if depth == 3:
                return "{...}" if isinstance(x, dict) else "[...]"
            if isinstance(x, dict):
                parts = [f"{render(str(k), depth)}: {render(w, depth + 1)}" for k, w in itertools.islice(x.items(), 8)]
            else:
                parts = [render(w, depth + 1) for w in x[:8]]
            body = ", ".join(parts) + (", ..." if len(x) > 8 else "")
            return "{" + body + "}" if isinstance(x, dict) else "[" + body + "]"
        if _is_int(x) and x.bit_length() > 200:
            return f"<an integer of ~{int(x.bit_length() * math.log10(2)) + 1} digits>"
        if isinstance(x, str) and len(x) > limit:
            x = x[:limit]
        if x is None or isinstance(x, (bool, int, float, str)):
            return json.dumps(x)
        return f"<{type(x).__name__}>"
    out = render(v, 0)
    return out if len(out) <= limit else out[:limit - 3] + "..."


def _quote(v) -> str:
    """A string as Python quotes it (short ones), anything else as `_show` gives it."""
    return repr(v) if isinstance(v, str) and len(v) <= 80 else _show(v)


def _or_one(v):
    return 1 if v is None else v


def _check_types(d: dict, lac: dict) -> None:
    def bad(where: str, v, want: str) -> ConfigError:
        return ConfigError(f"{where} must be {want}, got {_show(v)}")
    for k in _INTS:
        if k in d and not _is_int(d[k]):
            raise bad(f"config.{k}", d[k], "an integer")
    for k in _INTS_OR_NULL:
        if d.get(k) is not None and not _is_int(d[k]):
            raise bad(f"config.{k}", d[k], "an integer or null")
    for k in _LAC_INTS:
        if k in lac and not _is_int(lac[k]):
            raise bad(f"linear_attn_config.{k}", lac[k], "an integer")
    for k in ("kda_layers", "full_attn_layers"):  # a bool is an int to Python: true would pass as layer 1
        if not all(_is_int(i) for i in lac[k]):
            raise bad(f"linear_attn_config.{k}", lac[k], "a list of integers (1-based layer numbers)")
    for k in _NUMBERS:
        if k in d and not _is_finite_number(d[k]):
            raise bad(f"config.{k}", d[k], "a finite number")
    for k in _BOOLS:
        if k in d and not isinstance(d[k], bool):
            raise bad(f"config.{k}", d[k], "true or false")
    eos = d.get("eos_token_id", 0)
    if not (_is_int(eos) or (isinstance(eos, list) and eos and all(_is_int(t) for t in eos))):
        raise bad("config.eos_token_id", eos, "an integer or a non-empty list of integers")


# ---- reading a checkpoint directory's files ---------------------------------------------------------------
# Loading never follows a symbolic link out of the folder it was given, and opens only regular files: a link
# is followed only to a file inside the folder, and a dangling link, a directory, a fifo or a device is refused
# by name. A file is opened only once it is known to be regular (and non-blocking), so a fifo cannot hang a
# load, and its size is checked on the open file before it is read whole.

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def checked_file(file: str | Path, error: type[ValueError], folder: str | Path | None = None) -> Path:
    """`file` as a path to a regular file inside `folder` (default: the folder `file` names as its parent):
    the link's target when `file` is a link that stays inside. Anything else raises `error` naming `file`."""
    file = Path(file)
    folder = file.parent if folder is None else Path(folder)
    if "\0" in str(file):
        raise error(f"{_show(str(file))}: a file name holds a NUL byte")
    target, via = file, ""
    try:
        st = os.lstat(file)
        if stat.S_ISLNK(st.st_mode):
            target, root = Path(os.path.realpath(file)), os.path.realpath(folder)
            if os.path.commonpath([root, target]) != root:
                raise error(f"{file} is a symbolic link to {target}, outside {folder}: a file of the checkpoint "
                            f"must lie inside its directory (loading follows no link out of it)")
            if not os.path.exists(target):
                raise error(f"{file} is a dangling symbolic link (to {target}, which does not resolve to a file): "
                            f"expected a regular file")
            st, via = os.stat(target), f"a symbolic link to {target}, "
    except OSError as e:
        raise error(f"cannot read {file}: {e.strerror or e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{file} is {via}{_kind(st.st_mode)}: expected a regular file")
    return target


def read_file(file: str | Path, cap: int, error: type[ValueError], folder: str | Path | None = None) -> bytes:
    """The bytes of `file` (checked by `checked_file`), refused with `error` naming it when past `cap` bytes."""
    target = checked_file(file, error, folder)
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise error(f"cannot read {file}: {e.strerror or e}") from e
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced since checked_file looked
            raise error(f"{file} is {_kind(st.st_mode)}: expected a regular file")
        if st.st_size > cap:
            raise error(f"{file} is {st.st_size:,} bytes, past the {cap:,}-byte limit for a {Path(file).name}")
        data = f.read(cap + 1)
    if len(data) > cap:  # grew since fstat
        raise error(f"{file} is over {cap:,} bytes, past the limit for a {Path(file).name}")
    return data


MAX_JSON_INT_DIGITS = 1000  # an integer literal past this is no size, id or count (Python parses up to 4,300)


def _json_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_JSON_INT_DIGITS:
        raise ValueError(f"an integer literal of {digits:,} digits (at most {MAX_JSON_INT_DIGITS:,} expected)")
    return int(text)


def _json_constant(name: str):
    raise ValueError(f"{name} is not a JSON number (RFC 8259); expected a finite number")


def _json_object(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {_show(dup)} appears twice in one object; expected unique keys")
    return d


def parse_json(file: str | Path, data: bytes, error: type[ValueError]):
    """`data`, the bytes of `file`, as strict JSON: UTF-8, no NaN or Infinity, no key twice in an object, no
    integer of more than 1,000 digits, nesting only as deep as the parser's recursion allows. Else `error`
    naming the file."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{file} is not UTF-8 text: byte {data[e.start]:#04x} at offset {e.start:,} ({e.reason}); "
                    f"expected UTF-8 JSON") from e
    try:
        return json.loads(text, parse_int=_json_int, parse_constant=_json_constant, object_pairs_hook=_json_object)
    except RecursionError as e:
        raise error(f"{file} nests JSON arrays or objects too deeply to parse; expected a flat JSON object") from e
    except ValueError as e:  # json.JSONDecodeError and the hooks' refusals
        raise error(f"{file} is not valid JSON: {e}") from e


@dataclass(frozen=True)
class KimiConfig:
    vocab_size: int = 163840
    hidden_size: int = 2304
    num_hidden_layers: int = 27
    intermediate_size: int = 9216
    # MLA (full attention, NoPE)
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # KDA (linear attention)
    kda_head_dim: int = 128
    kda_num_heads: int = 32
    conv_kernel_size: int = 4
    kda_layers: tuple[int, ...] = (1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26)  # 1-based
    full_attn_layers: tuple[int, ...] = (4, 8, 12, 16, 20, 24, 27)  # 1-based
    # MoE
    first_k_dense_replace: int = 1
    num_experts: int = 256
    num_experts_per_token: int = 8
    num_shared_experts: int = 1
    moe_intermediate_size: int = 1024
    moe_renormalize: bool = True
    routed_scaling_factor: float = 2.446
    num_expert_group: int = 1
    topk_group: int = 1
    # misc
    rms_norm_eps: float = 1e-5
    kv_norm_eps: float = 1e-6  # kv_a_layernorm keeps the module default in the original code and in HF
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    tie_word_embeddings: bool = False
    model_max_length: int = 1048576
    name: str = field(default="custom", compare=False)

    # ---- derived -------------------------------------------------------------------------
    @property
    def layer_kinds(self) -> list[str]:
        """Per 0-based layer: 'kda' or 'mla'."""
        kinds = ["?"] * self.num_hidden_layers
        for i in self.kda_layers:
            kinds[i - 1] = "kda"
        for i in self.full_attn_layers:
            kinds[i - 1] = "mla"
        return kinds

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "kda"]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "mla"]

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        return self.kda_head_dim * self.kda_num_heads

    def _param_terms(self) -> dict[str, int]:
        """The checkpoint's parameters by part, from the sizes alone (the tensor list of SPEC §1)."""
        D, W, V = self.hidden_size, self.conv_kernel_size, self.vocab_size
        H, d, Hd = self.kda_num_heads, self.kda_head_dim, self.kda_dim
        nh, r, rope = self.num_attention_heads, self.kv_lora_rank, self.qk_rope_head_dim
        E, Im = self.num_experts, self.moe_intermediate_size
        L, n_moe = self.num_hidden_layers, self.num_hidden_layers - self.first_k_dense_replace
        kda = 3 * Hd * D + 3 * Hd * W + 2 * (d * D + Hd * d) + H * D + H + Hd + d + D * Hd
        mla = nh * self.qk_head_dim * D + (r + rope) * D + r + nh * (self.qk_nope_head_dim + self.v_head_dim) * r \
            + D * nh * self.v_head_dim
        return {
            "embed_tokens and lm_head (2 x vocab_size x hidden_size)": 2 * V * D,
            "routed experts (MoE layers x num_experts x 3 x moe_intermediate_size x hidden_size)":
                n_moe * E * 3 * Im * D,
            "routers and shared experts (MoE layers x (num_experts + num_shared_experts x 3 x moe_intermediate_size) "
            "x hidden_size)": n_moe * (E * D + E + self.num_shared_experts * 3 * Im * D),
            "dense MLPs (first_k_dense_replace x 3 x intermediate_size x hidden_size)":
                self.first_k_dense_replace * 3 * self.intermediate_size * D,
            "KDA layers (kda_layers x ~4 x kda_num_heads x kda_head_dim x hidden_size)": len(self.kda_layers) * kda,
            "MLA layers (full_attn_layers x ~num_attention_heads x head dims x hidden_size)":
                len(self.full_attn_layers) * mla,
            "norms (2 per layer and a final one, x hidden_size)": (2 * L + 1) * D,
        }

    def checkpoint_size(self) -> tuple[int, int]:
        """(parameters, tensors) of the original checkpoint: what `model.checkpoint.layout` lists, counted from the
        sizes without building anything, so that `validate` can refuse an absurd product of sizes first."""
        n_moe = self.num_hidden_layers - self.first_k_dense_replace
        tensors = (3 + 17 * len(self.kda_layers) + 7 * len(self.full_attn_layers) + 3 * self.first_k_dense_replace
                   + n_moe * (2 + 3 * self.num_experts + 3 * bool(self.num_shared_experts)))
        return sum(self._param_terms().values()), tensors

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> "KimiConfig":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        def num(v: int) -> str:
            return f"{v:,}" if v.bit_length() <= 200 else _show(v)

        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                  "qk_nope_head_dim", "v_head_dim", "kda_head_dim", "kda_num_heads", "conv_kernel_size",
                  "num_experts", "num_experts_per_token", "moe_intermediate_size", "intermediate_size"):
            v = getattr(self, f)
            need(_is_int(v) and v > 0, f"config.{f} must be a positive integer, got {_show(v)}")
            need(v <= SIZE_LIMITS.get(f, MAX_SIZE), f"config.{f} = {num(v)} is past any plausible model "
                 f"(limit {SIZE_LIMITS.get(f, MAX_SIZE):,}): a typo? (a config this size would exhaust memory "
                 f"before any check of its weights could run)")
        need(_is_int(self.qk_rope_head_dim) and 0 <= self.qk_rope_head_dim <= MAX_SIZE,
             f"config.qk_rope_head_dim must be an integer in 0..{MAX_SIZE:,}, got {_show(self.qk_rope_head_dim)}")
        need(self.q_lora_rank is None,
             f"config.q_lora_rank must be null for Kimi-Linear (plain q_proj), got {_show(self.q_lora_rank)}")
        need(self.num_key_value_heads == self.num_attention_heads and _is_int(self.num_key_value_heads),
             f"config.num_key_value_heads ({_show(self.num_key_value_heads)}) must equal num_attention_heads "
             f"({self.num_attention_heads})")
        L = self.num_hidden_layers
        for name, ids in (("kda_layers", self.kda_layers), ("full_attn_layers", self.full_attn_layers)):
            bad = [i for i in ids if not _is_int(i) or not 1 <= i <= L]
            need(not bad, f"linear_attn_config.{name} holds {_show(bad)}: layers are numbered 1..{L} (1-based)")
            need(len(set(ids)) == len(ids), f"linear_attn_config.{name} repeats a layer: {_show(list(ids))}")
        both = set(self.kda_layers) & set(self.full_attn_layers)
        need(not both, f"layers {_show(sorted(both))} are listed both as kda_layers and full_attn_layers")
        missing = sorted(set(range(1, L + 1)) - set(self.kda_layers) - set(self.full_attn_layers))
        need(not missing, f"layers {_show(missing)} (1-based) are in neither kda_layers nor full_attn_layers")
        need(_is_int(self.first_k_dense_replace) and 0 <= self.first_k_dense_replace <= L,
             f"config.first_k_dense_replace must lie in 0..{L}, got {_show(self.first_k_dense_replace)}")
        need(self.num_experts_per_token <= self.num_experts,
             f"num_experts_per_token ({self.num_experts_per_token}) exceeds num_experts ({self.num_experts})")
        groups = (self.num_expert_group, self.topk_group)
        need(all(_is_int(g) and g == 1 for g in groups),
             f"only num_expert_group = topk_group = 1 (plain top-k) is supported, got "
             f"{_show(groups[0])}/{_show(groups[1])}")
        need(_is_int(self.num_shared_experts) and self.num_shared_experts in (0, 1),
             f"num_shared_experts must be 0 or 1, got {_show(self.num_shared_experts)}")
        params, tensors = self.checkpoint_size()
        if params > MAX_PARAMS:
            part, n = max(self._param_terms().items(), key=lambda kv: kv[1])
            raise ConfigError(f"config sizes imply {params:.3g} parameters, past any plausible model (limit "
                              f"{MAX_PARAMS:.0e}; 48b-a3b has 4.91e+10): the largest part is {part} = {n:.3g}; a typo?")
        need(tensors <= MAX_TENSORS, f"config sizes imply {tensors:,} tensors (3 per routed expert: MoE layers x "
             f"num_experts x 3), past any plausible model (limit {MAX_TENSORS:,}; 48b-a3b has 20,493): a typo?")
        for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, tok)
            need(_is_int(v) and 0 <= v < self.vocab_size,
                 f"config.{tok} = {_show(v)} lies outside the vocabulary (0..{self.vocab_size - 1})")
        need(_is_finite_number(self.rms_norm_eps) and self.rms_norm_eps > 0,
             f"config.rms_norm_eps must be a finite number > 0, got {_show(self.rms_norm_eps)}")
        need(_is_finite_number(self.routed_scaling_factor),
             f"config.routed_scaling_factor must be a finite number, got {_show(self.routed_scaling_factor)}")
        need(_is_int(self.model_max_length) and 0 < self.model_max_length <= MAX_MODEL_MAX_LENGTH,
             f"config.model_max_length must be an integer in 1..2^40, got {_show(self.model_max_length)}")
        need(not self.tie_word_embeddings, "tie_word_embeddings = true is not a Kimi-Linear layout")
        return self

    # ---- original config.json ------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, name: str = "custom") -> "KimiConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
        mt = d.get("model_type")
        if mt != "kimi_linear":
            raise ConfigError(f"config.model_type is {_quote(mt)}, expected 'kimi_linear'")
        lac = d.get("linear_attn_config")
        if not isinstance(lac, dict):
            raise ConfigError(f"config.linear_attn_config must be an object with kda_layers, full_attn_layers, "
                              f"head_dim, num_heads, got {'nothing' if 'linear_attn_config' not in d else _show(lac)}")
        for k in ("kda_layers", "full_attn_layers"):
            if not isinstance(lac.get(k), list):
                raise ConfigError(f"linear_attn_config.{k} must be a list of 1-based layer numbers")
        # fields the model does not read must hold what it implements, or the gates would judge another model
        for k, implemented in (("hidden_act", "silu"), ("mla_use_nope", True)):
            if k in d and (d[k] != implemented or type(d[k]) is not type(implemented)):
                raise ConfigError(f"config.{k} is {_show(d[k])}; this model implements only {_show(implemented)}")
        if d.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"moe_router_activation_func {_quote(d['moe_router_activation_func'])} is not supported "
                              f"(sigmoid only)")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token",
                    "moe_intermediate_size", "intermediate_size")
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"required field{'s' if len(missing) > 1 else ''} missing: {', '.join(missing)}")
        for k in ("torch_dtype", "dtype"):  # null: no dtype declared
            if d.get(k) is not None and not (isinstance(d[k], str) and d[k] in CHECKPOINT_DTYPES):
                raise ConfigError(f"config.{k} is {_quote(d[k])}, not a dtype a safetensors checkpoint of this format "
                                  f"declares; expected one of {', '.join(map(repr, CHECKPOINT_DTYPES))}")
        _check_types(d, lac)
        eos = d.get("eos_token_id", 163586)
        if isinstance(eos, list):
            eos = eos[0]
        kw = dict(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
            intermediate_size=d["intermediate_size"], num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d["kv_lora_rank"],
            qk_nope_head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
            kda_head_dim=lac.get("head_dim", 128), kda_num_heads=lac.get("num_heads", 32),
            conv_kernel_size=lac.get("short_conv_kernel_size", 4),
            kda_layers=tuple(lac["kda_layers"]), full_attn_layers=tuple(lac["full_attn_layers"]),
            first_k_dense_replace=d.get("first_k_dense_replace", 1), num_experts=d["num_experts"],
            num_experts_per_token=d["num_experts_per_token"], num_shared_experts=d.get("num_shared_experts", 1),
            moe_intermediate_size=d["moe_intermediate_size"], moe_renormalize=d.get("moe_renormalize", True),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            # null is HF's default (no grouping): 1 here; a 0 is kept, so validate refuses it by name
            num_expert_group=_or_one(d.get("num_expert_group")), topk_group=_or_one(d.get("topk_group")),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            bos_token_id=d.get("bos_token_id", 163584), eos_token_id=eos, pad_token_id=d.get("pad_token_id", 163839),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            model_max_length=d.get("model_max_length", 1048576), name=name,
        )
        try:
            cfg = cls(**kw)
        except TypeError as e:  # pragma: no cover - defensive
            raise ConfigError(str(e)) from e
        return cfg.validate()

    @classmethod
    def from_json(cls, path: str | Path) -> "KimiConfig":
        """A config.json, or a checkpoint directory holding one: a regular file of at most 1 MiB inside the folder
        (`read_file`), strict JSON (`parse_json`). Every error is a `ConfigError` naming the file."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not os.path.lexists(path):
            raise ConfigError(f"no config.json at {path}")
        d = parse_json(path, read_file(path, MAX_CONFIG_BYTES, ConfigError), ConfigError)
        try:
            return cls.from_dict(d, name=str(path.parent))
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e      # which file, for every caller

    def to_dict(self) -> dict:
        """The original checkpoint's config.json layout (what HF transformers also reads)."""
        return {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "linear_attn_config": {
                "head_dim": self.kda_head_dim,
                "num_heads": self.kda_num_heads,
                "short_conv_kernel_size": self.conv_kernel_size,
                "kda_layers": list(self.kda_layers),
                "full_attn_layers": list(self.full_attn_layers),
            },
            "first_k_dense_replace": self.first_k_dense_replace,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": self.moe_renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "use_grouped_topk": True,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "model_max_length": self.model_max_length,
            "torch_dtype": "bfloat16",
        }

    def replace(self, **kw) -> "KimiConfig":
        return dataclasses.replace(self, **kw).validate()


PRESETS: dict[str, KimiConfig] = {
    "48b-a3b": KimiConfig(name="48b-a3b").validate(),
    # Runs on a CPU in seconds: 4 layers covering KDA, MLA, the dense MLP (layer 0) and MoE (layers 1..3),
    # 8 experts (top-2), a 512-token vocabulary, chunk-unaligned head sizes kept small.
    "tiny": KimiConfig(
        name="tiny", vocab_size=512, hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, kda_head_dim=16, kda_num_heads=4, conv_kernel_size=4,
        kda_layers=(1, 2, 4), full_attn_layers=(3,), first_k_dense_replace=1, num_experts=8,
        num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=2.446,
        bos_token_id=500, eos_token_id=501, pad_token_id=511,
    ).validate(),
}


def get_config(name_or_path: str) -> KimiConfig:
    """A preset name, or a checkpoint directory / config.json path."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    p = Path(name_or_path)
    if p.exists():
        return KimiConfig.from_json(p)
    raise ConfigError(f"unknown preset {name_or_path!r} and no such path; presets: {', '.join(PRESETS)}")
