"""Golden files for Gate B: what a trusted run generated for the battery, with its provenance.

A golden is one JSON file per (model, dtype, device kind, source), named `<model>-<dtype>-<device>-<source>.json`
(`<model>`: the preset, `tiny-seed3` for a non-zero seed, or the checkpoint directory's name). It holds:
- `weights`: the weights id (`model.weights.weights_id`) it was made from, and `prompts[i].ids`, the prompt ids;
- `prompts[i].expected`: the greedy ids, `topk_ids` / `topk_logprobs`: the top-10 at every step;
- `md5`: md5 of the expected id matrix [prompts, new_tokens] as int32 little-endian bytes
  (`np.asarray(ids, '<i4').tobytes()`), the STRICT check;
- `provenance`: implementation ('hf-transformers-<version>' or 'self-recompute'), dtype, device name, torch and
  transformers versions, weights id, time, git commit.

Sources. `hf`: HF transformers' KimiLinearForCausalLM, the independent implementation. On a CPU it loads an
original-format checkpoint through its own conversion mapping (for a preset, the synthetic weights are first
written with `save_checkpoint` to a temporary directory); on CUDA it wraps our tensors (`hf_from_state_dict`,
no second copy of 91 GiB: its math is independent, its loader is not exercised). Its experts run the eager
per-expert loop (readable, and the grouped-mm kernel has no fp64). `self`: our recompute path.

Lookup for a model under test in dtype D on device kind K (`find_golden`): `<model>-D-K-hf.json`, then
`<model>-D-K-self.json`, then the fp64 CPU HF golden `<model>-fp64-cpu-hf.json` (fp64 on the CPU is the most
exact reference; with checkpoint-valued weights it holds for every dtype's run of the same weights).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import math
import re
import shlex
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from model.checkpoint import save_checkpoint
from model.config import parse_json, read_file
from model.generate import Generation, generate_recompute
from model.weights import synthetic_weights, weights_id
from records.store import provenance, shown_path

from .compare import NEAR_TIE_TOP
from .prompts import DEFAULT_NEW_TOKENS
from .run import DEFAULT_TOPK, DEVICES, DTYPES, MAX_NEW_TOKENS, SOURCES, Options, Subject, battery_for

GOLDEN_DIR = Path(__file__).resolve().parent / "goldens"
FORMAT = 1


class GoldenError(ValueError):
    """A golden file that is malformed or does not belong to the model under test; the message says which."""


def ids_md5(ids: list[list[int]]) -> str:
    """md5 of an id matrix [prompts, steps] as int32 little-endian bytes, row-major."""
    a = np.asarray(ids, dtype=np.int64)
    if a.ndim != 2:
        raise ValueError(f"id matrix must be 2-D [prompts, steps], got shape {a.shape}")
    if a.size and (a.min() < -2**31 or a.max() >= 2**31):
        raise ValueError("id matrix holds values outside int32")
    return hashlib.md5(a.astype("<i4").tobytes()).hexdigest()


def golden_name(label: str, dtype: str, device: str, source: str) -> str:
    return f"{label}-{dtype}-{device}-{source}.json"


def _is_greedy(token: int, topk_ids: list[int], topk_logprobs: list[float]) -> bool:
    """`token` is the top-1 of this step's top-k, or exactly tied with it."""
    return token == topk_ids[0] or (token in topk_ids and topk_logprobs[topk_ids.index(token)] == topk_logprobs[0])


def check_golden_file(path: str | Path) -> Path:
    """The golden file `--golden` names, or GoldenError saying why it is none: missing, a directory, not a regular
    file. The command line checks it before a run starts, so a mistyped path is refused without a record."""
    if not str(path):
        raise GoldenError("--golden is empty; name a golden file, or leave it out to look one up in gates/goldens")
    p = Path(path)
    shown = shown_path(p)
    try:
        if p.is_dir():
            raise GoldenError(f"--golden {shown}: is a directory, not a golden file")
        if not p.exists():
            raise GoldenError(f"--golden {shown}: no such file")
        if not p.is_file():
            raise GoldenError(f"--golden {shown}: not a regular file")
    except OSError as e:
        raise GoldenError(f"--golden {shown[:200]}: {e.strerror or e}") from None
    return p


def golden_hint(opts: Options) -> str:
    """The make command that writes the golden the lookup finds for these options, in the committed goldens' naming:
    on a CPU the fp64 HF golden (it judges every dtype's run of the same weights); on CUDA the HF golden in bf16,
    else our recompute path's at the run's precision (HF holds one dtype)."""
    what = ([f"MODEL={shlex.quote(shown_path(opts.model))}"] if opts.model else
            [f"PRESET={opts.preset}"] + ([f"SEED={opts.seed}"] if opts.seed else []))
    if opts.device == "cpu":
        dtype, source, flags = "fp64", "hf", ["DTYPE=fp64"]
    elif opts.dtype == "bf16" and opts.expert_dtype is None:
        dtype, source, flags = "bf16", "hf", ["DTYPE=bf16"]
    else:  # Gate B's CUDA default (fp32, experts bf16) is the golden command's default for SOURCE=self
        dtype, source, flags = opts.dtype, "self", ["SOURCE=self"]
        if (opts.dtype, opts.expert_dtype) != ("fp32", "bf16"):
            flags += [f"DTYPE={opts.dtype}"] + ([f"EXPERT_DTYPE={opts.expert_dtype}"] if opts.expert_dtype else [])
    flags.append(f"DEVICE={opts.device}")
    if opts.new_tokens != DEFAULT_NEW_TOKENS:
        flags.append(f"NEW_TOKENS={opts.new_tokens}")
    out = shown_path(GOLDEN_DIR / golden_name(opts.label, dtype, opts.device, source))
    return f"make golden {' '.join(what + flags)} (writes {out})"


def find_golden(opts: Options, directory: Path = GOLDEN_DIR) -> Path:
    """`opts.golden` if given, else the lookup rule of the module docstring."""
    if opts.golden is not None:
        return check_golden_file(opts.golden)
    tried = [golden_name(opts.label, opts.dtype, opts.device, s) for s in ("hf", "self")]
    tried.append(golden_name(opts.label, "fp64", "cpu", "hf"))
    for name in tried:
        if (directory / name).is_file():
            return directory / name
    raise GoldenError(f"no golden for {opts.label} {opts.dtype} {opts.device} in {shown_path(directory)} (tried "
                      f"{', '.join(tried)}); make one with: {golden_hint(opts)}")


# ---- reading and checking ------------------------------------------------------------------------

# A golden is a few hundred KB (the 48B ones: ~60 KB); anything past this cap is not one.
MAX_GOLDEN_BYTES = 64 << 20
MAX_PROMPTS, MAX_TOPK = 1024, 1024
HEX_MD5 = re.compile(r"[0-9a-f]{32}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _read_json(path: Path) -> object:
    """The file's JSON value, read and parsed as strictly as a checkpoint's config (`model.config.read_file` and
    `parse_json`: a regular file under the size cap, UTF-8, no NaN, no repeated key, no runaway nesting or
    integer), or GoldenError naming the file."""
    return parse_json(shown_path(path), read_file(path, MAX_GOLDEN_BYTES, GoldenError), GoldenError)


def validate_golden(g: object, path: Path | str = "<golden>") -> dict:
    """Check every field a gate reads, by type, shape and range, before any generation; returns `g`.

    The check is strict because a golden is trusted: an id stored as a string or a bool would compare unequal
    token by token yet give the same md5, so a malformed golden could make the gate's table and verdict disagree.
    """
    path = shown_path(path)

    def bad(where: str, want: str, got) -> GoldenError:
        shown = json.dumps(got)[:60] if not isinstance(got, (dict, list)) else type(got).__name__
        return GoldenError(f"golden {path}: {where} must be {want}, got {shown}")

    if not isinstance(g, dict):
        raise bad("the top level", "a JSON object", g)
    need = ("format", "weights", "dtype", "device", "source", "new_tokens", "prompts", "md5", "provenance")
    missing = [k for k in need if k not in g]
    if missing:
        raise GoldenError(f"golden {path} lacks {', '.join(missing)}")
    if g["format"] != FORMAT or not _is_int(g["format"]):
        raise GoldenError(f"golden {path} has format {g['format']!r}; this suite reads format {FORMAT}")
    for k, allowed in (("dtype", DTYPES), ("device", DEVICES), ("source", SOURCES)):
        if not isinstance(g[k], str) or g[k] not in allowed:
            raise bad(k, f"one of {', '.join(allowed)}", g[k])
    if not isinstance(g["weights"], str) or not g["weights"]:
        raise bad("weights", "a weights id string", g["weights"])
    if not isinstance(g["md5"], str) or not HEX_MD5.fullmatch(g["md5"]):
        raise bad("md5", "32 lowercase hex digits", g["md5"])
    n = g["new_tokens"]
    if not _is_int(n) or not 1 <= n <= MAX_NEW_TOKENS:
        raise bad("new_tokens", f"an integer in 1..{MAX_NEW_TOKENS}", n)
    prov = g["provenance"]
    if not isinstance(prov, dict):
        raise bad("provenance", "a JSON object", prov)
    for k in ("implementation", "time", "device_name"):
        if not isinstance(prov.get(k), str) or not prov[k]:
            raise bad(f"provenance.{k}", "a non-empty string", prov.get(k))
    if prov.get("weights", g["weights"]) != g["weights"]:
        raise bad("provenance.weights", f"the golden's weights {g['weights']}", prov.get("weights"))
    prompts = g["prompts"]
    if not isinstance(prompts, list) or not 1 <= len(prompts) <= MAX_PROMPTS:
        raise bad("prompts", f"a list of 1..{MAX_PROMPTS} prompts", prompts)
    for i, p in enumerate(prompts):
        where = f"prompts[{i}]"
        if not isinstance(p, dict):
            raise bad(where, "a JSON object", p)
        for k in ("ids", "expected", "topk_ids", "topk_logprobs"):
            if k not in p:
                raise GoldenError(f"golden {path} prompt {i} lacks {k!r}")
            if not isinstance(p[k], list):
                raise bad(f"{where}.{k}", "a list", p[k])
        for k in ("ids", "expected"):
            for j, t in enumerate(p[k]):
                if not _is_int(t) or not 0 <= t < 2 ** 31:
                    raise bad(f"{where}.{k}[{j}]", "a token id (an integer in 0..2^31-1)", t)
        if not p["ids"]:
            raise bad(f"{where}.ids", "a non-empty list of token ids", p["ids"])
        if not (len(p["expected"]) == len(p["topk_ids"]) == len(p["topk_logprobs"]) == n):
            raise GoldenError(f"golden {path} prompt {i}: expected/topk lengths differ from new_tokens {n}")
        for step, (top, lp) in enumerate(zip(p["topk_ids"], p["topk_logprobs"])):
            at = f"{where} step {step}"
            if not isinstance(top, list) or not NEAR_TIE_TOP <= len(top) <= MAX_TOPK or not all(
                    _is_int(t) and 0 <= t < 2 ** 31 for t in top):
                raise bad(f"{at} topk_ids", f"a list of {NEAR_TIE_TOP}..{MAX_TOPK} token ids (a diagnosis reads the "
                          f"top-{NEAR_TIE_TOP})", top)
            if not isinstance(lp, list) or len(lp) != len(top) or not all(_is_number(x) for x in lp):
                raise bad(f"{at} topk_logprobs", f"{len(top)} finite numbers (one per topk id)", lp)
            if any(a < b for a, b in zip(lp, lp[1:])):
                raise bad(f"{at} topk_logprobs", "in descending order", lp)
            if len(set(top)) != len(top):
                raise bad(f"{at} topk_ids", "distinct ids", top)
        for step, (t, top, lp) in enumerate(zip(p["expected"], p["topk_ids"], p["topk_logprobs"])):
            if not _is_greedy(t, top, lp):
                raise GoldenError(f"golden {path} prompt {i} step {step}: expected id {t} is not the top-1 "
                                  f"of its own top-k {top[:3]}...")
    if ids_md5([p["expected"] for p in prompts]) != g["md5"]:
        raise GoldenError(f"golden {path}: its md5 {g['md5']} does not match its own expected ids (edited by hand?)")
    return g


def load_golden(path: str | Path) -> dict:
    """Read and validate a golden file (`validate_golden`: every field's type, shape and range, its own md5)."""
    path = Path(path)
    return validate_golden(_read_json(path), path)


def golden_label(g: dict) -> str | None:
    """The name of the model a golden was made for (a preset, `tiny-seed3`, a checkpoint directory's name)."""
    label = g.get("label")
    return label if isinstance(label, str) and label else None


def _prompt_source_parts(source: str) -> dict[str, str | None]:
    """A battery's source (`gates.prompts.Battery.source`: 'synthetic-bytes' or 'tiktoken:<path>', with
    '; prompts:<path>') as {kind: path shown relative to the checkout}, so that two spellings of one file agree."""
    parts = {}
    for part in source.split("; "):
        kind, sep, path = part.partition(":")
        parts[kind] = shown_path(path) if sep and path else None
    return parts


def _shown_source(parts: dict[str, str | None]) -> str:
    """A source as `_prompt_source_parts` parsed it, written back: its files shown relative to the checkout."""
    return "; ".join(kind if file is None else f"{kind}:{file}" for kind, file in parts.items())


def _prompt_source_change(golden: dict[str, str | None], run: dict[str, str | None]) -> str:
    """What differs between the golden's prompt source and this run's, in words."""
    lacks, golden_lacks, other = [], [], []
    for kind, file in (("tiktoken", "tiktoken.model"), ("prompts", "prompts.json")):
        if kind in golden and kind not in run:
            lacks.append(file)
        elif kind in run and kind not in golden:
            golden_lacks.append(file)
        elif golden.get(kind) != run.get(kind):
            other.append(file)
    said = ([f"this run has no {' and no '.join(lacks)}"] if lacks else []) + (
        [f"the golden was made without {' or '.join(golden_lacks)}"] if golden_lacks else []) + (
        [f"another {' and '.join(other)}"] if other else [])
    return "; ".join(said) or "another battery"


def check_golden(g: dict, path: Path, weights: str | None, prompt_ids: list[list[int]] | None,
                 new_tokens: int | None, *, label: str | None = None, prompt_source: str | None = None) -> None:
    """Refuse a golden made for other weights, other prompts, or another number of new tokens. `label` and
    `prompt_source` (this run's model name and `Battery.source`) let the refusal name the likely cause: where the
    prompt ids differ, a golden made for another model, then one whose prompts came from other files, and only
    otherwise a stale golden."""
    shown, made_for = shown_path(path), golden_label(g)
    if weights is not None and g["weights"] != weights:
        of = f" ({made_for})" if made_for else ""
        under_test = f" ({label})" if label else ""
        raise GoldenError(f"golden {shown} is for another model: it was made from weights {g['weights']}{of}, the "
                          f"model under test{under_test} has {weights}")
    golden_ids = [p["ids"] for p in g["prompts"]]
    if prompt_ids is not None and golden_ids != prompt_ids:
        bad = next(i for i in range(max(len(golden_ids), len(prompt_ids)))
                   if i >= len(golden_ids) or i >= len(prompt_ids) or golden_ids[i] != prompt_ids[i])
        differ = (f"prompt {bad}'s ids differ from this battery's ({len(golden_ids)} golden prompts, "
                  f"{len(prompt_ids)} in the battery)")
        if made_for and label and made_for != label:
            raise GoldenError(f"golden {shown} is for another model: made for {made_for} (weights {g['weights']}), "
                              f"this run gates {label}, and {differ}")
        source, same = g.get("prompt_ids_source"), ""
        if isinstance(source, str) and prompt_source is not None:
            theirs, ours = _prompt_source_parts(source), _prompt_source_parts(prompt_source)
            if theirs != ours:
                raise GoldenError(f"golden {shown}: {differ}: its prompts came from {_shown_source(theirs)}, this "
                                  f"run's from {_shown_source(ours)} ({_prompt_source_change(theirs, ours)})")
            same = ", from the same prompt files"
        raise GoldenError(f"golden {shown}: {differ}{same}; the golden is stale (the battery or tokenizer changed "
                          f"since it was made)")
    if new_tokens is not None and g["new_tokens"] != new_tokens:
        raise GoldenError(f"golden {shown} holds {g['new_tokens']} new tokens per prompt, --new-tokens is {new_tokens}")


def expected_generations(g: dict) -> list[Generation]:
    return [Generation(prompt=p["ids"], tokens=p["expected"], topk_ids=p["topk_ids"], topk_logprobs=p["topk_logprobs"])
            for p in g["prompts"]]


# ---- making ----------------------------------------------------------------------------------------

def _hf_model(opts: Options, subject: Subject | None):
    """HF's model for the golden (module docstring) and its weights id, checked against ours where we have it."""
    from model.hf import hf_from_checkpoint, hf_from_state_dict

    if opts.expert_dtype is not None:
        raise ValueError(f"--expert-dtype {opts.expert_dtype}: HF transformers holds the whole model in one dtype; "
                         f"make the golden with --dtype alone")
    if opts.device == "cuda":
        hf = hf_from_state_dict(subject.cfg, subject.model.state_dict())
    elif opts.model:
        hf = hf_from_checkpoint(opts.model, dtype=opts.torch_dtype)
    else:
        cfg = opts.config
        with tempfile.TemporaryDirectory(prefix="kimi-golden-") as tmp:
            state = synthetic_weights(cfg, opts.seed, "cpu", torch.bfloat16)
            save_checkpoint(state, cfg, Path(tmp) / "ckpt")
            hf = hf_from_checkpoint(Path(tmp) / "ckpt", dtype=opts.torch_dtype)
    hf.set_experts_implementation("eager")
    return hf, weights_id(hf.state_dict(), opts.config)


def _hf_generate(hf, prompt: list[int], new_tokens: int) -> Generation:
    from model.hf import hf_greedy

    tokens, ids, lps = hf_greedy(hf, prompt, new_tokens, DEFAULT_TOPK)
    for step, (t, top, lp) in enumerate(zip(tokens, ids, lps)):
        # generate()'s logits processors must not have changed the greedy choice (e.g. an EOS suppression)
        if not _is_greedy(t, top, lp):
            raise RuntimeError(f"HF generate chose {t} at step {step} but its logits' argmax is {top[0]}")
    return Generation(prompt=list(prompt), tokens=tokens, topk_ids=ids, topk_logprobs=lps)


def make_golden(opts: Options, subject: Subject | None = None) -> dict:
    """Generate the battery with `opts.source` and return the golden as a dict (see `write_golden`).

    `subject`: our loaded model; needed for `--source self` and for HF on CUDA (which wraps its tensors).
    For HF on a CPU it may be None: HF loads the weights itself and the weights id is taken from its tensors.
    """
    if subject is None and (opts.source == "self" or opts.device == "cuda"):
        raise ValueError(f"a golden from source {opts.source!r} on {opts.device} needs our loaded model (subject)")
    b = battery_for(opts)
    t0 = time.perf_counter()
    if opts.source == "hf":
        from model.hf import hf_version

        hf, wid = _hf_model(opts, subject)
        if subject is not None and wid != subject.weights:
            raise GoldenError(f"HF loaded weights {wid}, ours are {subject.weights}: not the same model")
        gens = [_hf_generate(hf, p, opts.new_tokens) for p in b.ids]
        implementation = f"hf-transformers-{hf_version()}"
    else:
        wid = subject.weights
        gens = [generate_recompute(subject.model, p, opts.new_tokens, topk=DEFAULT_TOPK) for p in b.ids]
        implementation = "self-recompute"
    seconds = time.perf_counter() - t0
    prov = provenance()
    return {
        "format": FORMAT, "label": opts.label, "preset": opts.preset, "checkpoint": opts.model, "seed": opts.seed,
        "weights": wid, "dtype": opts.dtype, "device": opts.device, "source": opts.source,
        "new_tokens": opts.new_tokens, "topk": DEFAULT_TOPK, "prompt_ids_source": b.source,
        "prompts": [{"text": text, "ids": g.prompt, "expected": g.tokens, "topk_ids": g.topk_ids,
                     "topk_logprobs": g.topk_logprobs} for text, g in zip(b.texts, gens)],
        "md5": ids_md5([g.tokens for g in gens]),
        "provenance": {
            "implementation": implementation, "dtype": str(opts.torch_dtype).removeprefix("torch."),
            "expert_dtype": opts.expert_dtype,
            "device_name": _device_name(opts.device, prov), "torch": torch.__version__,
            "transformers": prov["machine"]["transformers"], "weights": wid,
            "time": datetime.now(timezone.utc).isoformat(), "git_commit": prov["git"]["commit"],
            "git_dirty": prov["git"]["dirty"], "seconds": round(seconds, 2),
        },
    }


def _device_name(device: str, prov: dict) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu: {prov['machine']['cpu']}"


def check_golden_writable(path: str | Path) -> Path:
    """Refuse, before any generation, a golden path that exists (a committed golden is replaced on purpose, by
    hand) or whose folder cannot be made or written."""
    path = Path(path)
    try:
        if path.exists() or path.is_symlink():
            raise GoldenError(f"{shown_path(path)} exists; delete it first to replace it, or pass --golden NEWPATH")
        if len(path.name.encode()) > 255:
            raise GoldenError(f"--golden {path.name[:40]}...: a file name of {len(path.name.encode())} bytes, "
                              f"past the 255 a file system takes")
        folder = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path("."))
    except OSError as e:
        raise GoldenError(f"--golden {str(path)[:200]}: {e.strerror or e}") from None
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise GoldenError(f"--golden {path}: cannot write in {folder}")
    return path


def write_golden(g: dict, path: str | Path) -> Path:
    """Write a new golden file; never overwrites one (`check_golden_writable`)."""
    path = check_golden_writable(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GoldenError(f"--golden {path}: cannot make its folder: {e.strerror or e}") from None
    text = json.dumps(g, indent=1, ensure_ascii=False)
    # Each list of numbers on one line (prompt ids, expected ids, one step's top-k): readable, diffable. Only
    # indented lists start with "[\n"; a JSON string never holds a raw newline, so no string is touched.
    text = re.sub(r"\[\n[-+.,\deE\s]*\]", lambda m: "[" + " ".join(m.group(0)[1:-1].split()) + "]", text)
    try:
        with open(path, "x") as f:      # "x": never replaces a file that appeared meanwhile
            f.write(text + "\n")
    except FileExistsError:
        exists = f"{shown_path(path)} exists; delete it first to replace it, or pass --golden NEWPATH"
        raise GoldenError(exists) from None
    except OSError as e:
        with contextlib.suppress(OSError):
            path.unlink()       # a partial file (a full disk) is not a golden
        raise GoldenError(f"--golden {path}: cannot write it: {e.strerror or e}") from None
    return path
