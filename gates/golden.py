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

import hashlib
import json
import re
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from model.checkpoint import save_checkpoint
from model.generate import Generation, generate_recompute
from model.weights import synthetic_weights, weights_id
from records.store import provenance

from .prompts import PROMPTS
from .run import DEFAULT_TOPK, Options, Subject, battery_for

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


def find_golden(opts: Options, directory: Path = GOLDEN_DIR) -> Path:
    """`opts.golden` if given, else the lookup rule of the module docstring."""
    if opts.golden:
        p = Path(opts.golden)
        if not p.is_file():
            raise GoldenError(f"--golden {p}: no such file")
        return p
    tried = [golden_name(opts.label, opts.dtype, opts.device, s) for s in ("hf", "self")]
    tried.append(golden_name(opts.label, "fp64", "cpu", "hf"))
    for name in tried:
        if (directory / name).is_file():
            return directory / name
    raise GoldenError(f"no golden for {opts.label} {opts.dtype} {opts.device} in {directory} (tried {', '.join(tried)}); "
                      f"make one with: python -m gates golden --source hf " +
                      (f"--model {opts.model}" if opts.model else f"--preset {opts.preset}") +
                      f" --dtype {opts.dtype} --device {opts.device}")


# ---- reading and checking ------------------------------------------------------------------------

def load_golden(path: str | Path) -> dict:
    """Parse and validate a golden file (fields, shapes, its own md5)."""
    path = Path(path)
    try:
        g = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GoldenError(f"cannot read golden {path}: {e}") from e
    need = ("format", "weights", "dtype", "device", "source", "new_tokens", "prompts", "md5", "provenance")
    missing = [k for k in need if not isinstance(g, dict) or k not in g]
    if missing:
        raise GoldenError(f"golden {path} lacks {', '.join(missing)}")
    if g["format"] != FORMAT:
        raise GoldenError(f"golden {path} has format {g['format']!r}; this suite reads format {FORMAT}")
    n = g["new_tokens"]
    for i, p in enumerate(g["prompts"]):
        for k in ("ids", "expected", "topk_ids", "topk_logprobs"):
            if k not in p:
                raise GoldenError(f"golden {path} prompt {i} lacks {k!r}")
        if not (len(p["expected"]) == len(p["topk_ids"]) == len(p["topk_logprobs"]) == n):
            raise GoldenError(f"golden {path} prompt {i}: expected/topk lengths differ from new_tokens {n}")
        for step, (t, top, lp) in enumerate(zip(p["expected"], p["topk_ids"], p["topk_logprobs"])):
            if not _is_greedy(t, top, lp):
                raise GoldenError(f"golden {path} prompt {i} step {step}: expected id {t} is not the top-1 "
                                  f"of its own top-k {top[:3]}...")
    if ids_md5([p["expected"] for p in g["prompts"]]) != g["md5"]:
        raise GoldenError(f"golden {path}: its md5 {g['md5']} does not match its own expected ids (edited by hand?)")
    return g


def check_golden(g: dict, path: Path, weights: str | None, prompt_ids: list[list[int]] | None,
                 new_tokens: int | None) -> None:
    """Refuse a golden made for other weights, other prompts, or another number of new tokens."""
    if weights is not None and g["weights"] != weights:
        raise GoldenError(f"golden {path} was made from weights {g['weights']}, the model under test has {weights}")
    golden_ids = [p["ids"] for p in g["prompts"]]
    if prompt_ids is not None and golden_ids != prompt_ids:
        bad = next(i for i in range(max(len(golden_ids), len(prompt_ids)))
                   if i >= len(golden_ids) or i >= len(prompt_ids) or golden_ids[i] != prompt_ids[i])
        raise GoldenError(f"golden {path}: prompt {bad}'s ids differ from this battery's "
                          f"({len(golden_ids)} golden prompts, {len(prompt_ids)} in the battery); the golden is stale")
    if new_tokens is not None and g["new_tokens"] != new_tokens:
        raise GoldenError(f"golden {path} holds {g['new_tokens']} new tokens per prompt, --new-tokens is {new_tokens}")


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
                     "topk_logprobs": g.topk_logprobs} for text, g in zip(PROMPTS, gens)],
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


def write_golden(g: dict, path: str | Path) -> Path:
    """Write a new golden file; never overwrites one (a committed golden is replaced on purpose, by hand)."""
    path = Path(path)
    if path.exists():
        raise GoldenError(f"{path} exists; delete it first to replace it, or pass --golden NEWPATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(g, indent=1, ensure_ascii=False)
    # Each list of numbers on one line (prompt ids, expected ids, one step's top-k): readable, diffable. Only
    # indented lists start with "[\n"; a JSON string never holds a raw newline, so no string is touched.
    text = re.sub(r"\[\n[-+.,\deE\s]*\]", lambda m: "[" + " ".join(m.group(0)[1:-1].split()) + "]", text)
    path.write_text(text + "\n")
    return path
