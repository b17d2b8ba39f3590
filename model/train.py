"""Train the suite's small reference Kimi-Linear on the Python standard library's source, and write it as an
original-format checkpoint with its tokenizer and provenance.

    python -m model.train --out DIR [--steps N] [--device cuda] [--time-limit S] [--quick] [--no-record]
    python -m model.train --record-from DIR --commit SHA

Corpus: the `.py` files under `sysconfig.get_paths()["stdlib"]`, in sorted order, without installed packages
(`site-packages`, `dist-packages`), test suites (`test/`, `tests/`, `idlelib/idle_test/`, ...), generated
documentation (`pydoc_data/`), build-specific files (`config-*/`, `_sysconfigdata_*.py`), empty files and files
that are not UTF-8: every machine with Python has it without a download. A file is held out when the sha256 of its
relative path falls in the first `heldout_fraction` of the hash range, so the split of a file never depends on the
other files. The corpus is named by a sha256 over every file's split, relative path and bytes, with the Python
version that supplied it.

Tokenizer: a byte-level BPE trained by HF `tokenizers` on the train files (`model.bpe`), written as
`tiktoken.model` and read back through `model.tokenizer.KimiTokenizer`, which then tokenises the corpus: the
model is trained on exactly the ids the gates give a prompt. Each file is one document, BOS first.

Model (`ModelSize`): every block kind of the 48B model at a small size. KDA layers and MLA layers in the
48B's 3:1 pattern, a dense first layer, sigmoid-routed MoE layers with a shared expert and top-k routing on the
scores plus a correction bias, which is trained as the 48B's aux-loss-free balancing does (DeepSeek-V3): after
each step, each layer's bias rises by `bias_rate` for the experts that took fewer than the mean number of tokens
and falls for those that took more.

Training runs the model's own recompute forward (`KimiLinear._run_layers`; `forward` is a no-grad inference entry)
on the PyTorch kernels (the Triton kernels have no backward). The model packs its KDA and MLA input projections
into one tensor and reads only that (`KimiDeltaAttention.pack_`); `trainable` makes the packed tensors the
parameters, so the gradient reaches them, and the projections' own weights stay views of them. On CUDA the model
is held in bf16 (the checkpoint's dtype; the tensors the checkpoint keeps in fp32 stay fp32) and AdamW updates
fp32 master copies, rather than fp32 weights under autocast: with fp32 operands on CUDA the MoE's grouped GEMM
(`ops.grouped_mm`) is a loop of `torch.mm(out=...)`, which autograd refuses. On a CPU everything is fp32.

The folder written: config.json, safetensors shards with their index (`model.checkpoint.save_checkpoint`),
tiktoken.model, provenance.json (corpus, tokenizer, config, training, the held-out loss and bits per byte and the
expert load of the checkpoint as written, its weights id) and loss_curve.jsonl (one line per step; eval lines
carry the held-out loss).

Record: the run appends one `train` record to `records/train.jsonl` (`train_record`): the corpus, tokenizer, model
and training options, the loss at every step, the held-out evals, the final held-out loss and bits per byte and the
expert load. `--record-from DIR --commit SHA` appends the same record for a checkpoint folder trained before, from
its provenance.json and loss_curve.jsonl: the machine fields are the training machine's as the provenance names them
(GPU or CPU, torch, python), not those of the machine running the command, and the commit is the one given, whose
code trained it (said in `git.note`).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import platform
import re
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from model.tokenizer import TOKENIZER_FILE, KimiTokenizer
from records import store
from records.exits import run_main

from . import bpe, ops
from .build import from_state_dict, load_model
from .checkpoint import PROMPTS_FILE, check_checkpoint, internal_names, original_names, save_checkpoint, storage_dtype
from .config import KimiConfig, parse_json, read_file
from .layers import KimiDeltaAttention, MultiLatentAttention, Router
from .model import KimiLinear
from .weights import LOGIT_STD, synthetic_weights

# Installed packages, test suites, caches, and pydoc_data: one generated file of documentation prose (topics.py,
# ~0.75 MB), which the split happens to hold out, where it would be over half of the held-out text.
EXCLUDED_DIRS = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data")
PROVENANCE_FILE = "provenance.json"
CURVE_FILE = "loss_curve.jsonl"
SHARD_BYTES = 16 << 20  # a few shards, as the original checkpoint has: loaders are exercised on an index
LN2 = math.log(2)
TIMED_STEPS = 20  # steps after the first that time a step for `--time-limit`
CUDA_PRECISION = "bf16 weights, fp32 AdamW masters"   # the precision of a run on CUDA; a CPU run is fp32
RECORD_KIND = "train"
# The battery of a model trained on Python source (the reference checkpoint): eight openings of different kinds,
# each of which a trained model continues with confidence: a signature, a class body, imports, a docstring, a loop,
# exception handling, a dict literal, a decorated method.
PYTHON_PROMPTS: tuple[str, ...] = (
    "def read_lines(path):\n    with open(path, encoding=\"utf-8\") as f:\n        return",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n",
    "import os\nimport sys\nimport re\n\n__all__ = [",
    "def split(s, sep=None, maxsplit=-1):\n    \"\"\"Return a list of the words in the string, using sep as the",
    "    for i in range(len(items)):\n        if items[i] is None:\n",
    "    try:\n        value = int(text)\n    except ValueError:\n        raise",
    "_defaults = {\n    'encoding': 'utf-8',\n    'errors': 'strict',\n",
    "    @property\n    def name(self):\n        \"\"\"The name of the file.\"\"\"\n        return",
)
MAX_CURVE_BYTES = 64 << 20   # a loss curve is ~50 bytes a step: past this it is no curve of this script


# ---- corpus --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Doc:
    name: str    # the path relative to the stdlib root, with forward slashes
    text: str


@dataclass
class Corpus:
    train: list[Doc]
    heldout: list[Doc]
    python: str                   # the version whose standard library supplied the files
    skipped_not_utf8: list[str] = field(default_factory=list)

    @property
    def sha256(self) -> str:
        """sha256 over every document's split, name and bytes, in order (train, then held-out)."""
        h = hashlib.sha256()
        for split, docs in (("train", self.train), ("heldout", self.heldout)):
            for d in docs:
                data = d.text.encode("utf-8")
                h.update(f"{split}\0{d.name}\0{len(data)}\0".encode())
                h.update(data)
        return "sha256:" + h.hexdigest()

    def summary(self) -> dict:
        def size(docs):
            return {"files": len(docs), "bytes": sum(len(d.text.encode("utf-8")) for d in docs)}
        return {"source": "python standard library .py files", "python": self.python, "sha256": self.sha256,
                "train": size(self.train), "heldout": size(self.heldout),
                "skipped_not_utf8": self.skipped_not_utf8}

    def limited(self, max_bytes: int) -> "Corpus":
        """The documents of each split, in order, that fit in `max_bytes` (train) and a tenth of it (held-out), at
        least one each: a toy corpus for tests and `--quick`, named by its own hash."""
        def take(docs, budget):
            out, used = [], 0
            for d in docs:
                n = len(d.text.encode("utf-8"))
                if out and used + n > budget:
                    continue
                out.append(d)
                used += n
            return out
        return Corpus(take(self.train, max_bytes), take(self.heldout, max(1, max_bytes // 10)), self.python,
                      self.skipped_not_utf8)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_excluded(rel: Path) -> bool:
    """A file under one of EXCLUDED_DIRS, or of the build's own configuration (it differs per build)."""
    dirs = rel.parts[:-1]
    return (any(p in EXCLUDED_DIRS or p.startswith("config-") for p in dirs)
            or rel.name.startswith("_sysconfigdata_"))


def is_heldout(name: str, fraction: float) -> bool:
    """Whether the file `name` is held out: the first 8 bytes of sha256(name) as a fraction of 2^64."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") < fraction * 2.0 ** 64


def load_corpus(root: str | Path | None = None, heldout_fraction: float = 0.05) -> Corpus:
    """The `.py` files under `root` (default: this Python's standard library) as documents, split by file."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must lie in (0, 1), got {heldout_fraction}")
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise ValueError(f"corpus root {root} is not a directory")
    corpus = Corpus([], [], platform.python_version())
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if is_excluded(rel) or path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if not data:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            corpus.skipped_not_utf8.append(rel.as_posix())
            continue
        doc = Doc(rel.as_posix(), text)
        (corpus.heldout if is_heldout(doc.name, heldout_fraction) else corpus.train).append(doc)
    if not corpus.train or not corpus.heldout:
        raise ValueError(f"corpus under {root}: {len(corpus.train)} train and {len(corpus.heldout)} held-out files; "
                         f"both splits need at least one")
    return corpus


# ---- tokens --------------------------------------------------------------------------------------------------

@dataclass
class Tokens:
    ids: torch.Tensor   # int64 [N]: each document's BOS, then its ids, documents in order
    bytes: int          # UTF-8 bytes of the documents


def tokenize(docs: list[Doc], tok: KimiTokenizer) -> Tokens:
    ids: list[int] = []
    for d in docs:
        ids += tok.encode(d.text)
    return Tokens(torch.tensor(ids, dtype=torch.int64), sum(len(d.text.encode("utf-8")) for d in docs))


def token_bytes(tok: KimiTokenizer) -> torch.Tensor:
    """Bytes of each id [vocab_size] (0 for the special tokens): what a predicted token adds to bits per byte."""
    out = torch.zeros(tok.vocab_size, dtype=torch.int64)
    for i in range(tok.encoding.n_vocab):
        try:
            out[i] = len(tok.encoding.decode_single_token_bytes(i))
        except KeyError:
            pass
    return out


# ---- model ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSize:
    """The reference model's sizes: MLA at every 4th layer and the last (1-based, as the 48B's 4, 8, ..., 24, 27),
    KDA elsewhere; layer 0 dense; `experts` routed experts, top-`top_k`, plus one shared; the 48B's routing (sigmoid,
    renormalised, x 2.446) and head-dim ratios (MLA nope : rope : v = 2 : 1 : 2); `n_base` BPE tokens, then the 256
    specials. KDA's head dim must be a power of two in [16, 128] for the Triton kernels."""
    n_base: int = 4096
    hidden: int = 256
    layers: int = 8
    heads: int = 4
    head_dim: int = 64
    kv_lora_rank: int = 128
    dense: int = 512
    experts: int = 32
    top_k: int = 4
    expert_dim: int = 64

    def config(self) -> KimiConfig:
        L = self.layers
        mla = tuple(sorted(set(range(4, L + 1, 4)) | {L}))
        return KimiConfig(
            name="reference", hidden_size=self.hidden, num_hidden_layers=L, intermediate_size=self.dense,
            num_attention_heads=self.heads, num_key_value_heads=self.heads, kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.head_dim, qk_rope_head_dim=self.head_dim // 2, v_head_dim=self.head_dim,
            kda_head_dim=self.head_dim, kda_num_heads=self.heads, conv_kernel_size=4,
            kda_layers=tuple(i for i in range(1, L + 1) if i not in mla), full_attn_layers=mla,
            first_k_dense_replace=1, num_experts=self.experts, num_experts_per_token=self.top_k, num_shared_experts=1,
            moe_intermediate_size=self.expert_dim, **bpe.special_ids(self.n_base),
        ).validate()


QUICK_SIZE = ModelSize(n_base=512, hidden=64, layers=4, heads=2, head_dim=32, kv_lora_rank=32, dense=128, experts=8,
                       top_k=2, expert_dim=32)


def checkpoint_bytes(cfg: KimiConfig) -> int:
    """Bytes of the checkpoint's tensors in their format's dtypes (bf16; fp32 where the original keeps it)."""
    return sum(torch.Size(s).numel() * dt.itemsize for s, dt in original_names(cfg).values())


def initial_state(cfg: KimiConfig, seed: int) -> dict[str, torch.Tensor]:
    """The suite's synthetic weights (fp32, bf16-valued) as the starting point, with lm_head scaled to logits of
    std 1 (3.5 would start the loss ~6 nats above uniform) and the routing bias at zero, where balancing starts."""
    state = synthetic_weights(cfg, seed=seed, dtype=torch.float32)
    state["lm_head.weight"] = (state["lm_head.weight"] / LOGIT_STD).to(torch.bfloat16).float()
    for name, t in state.items():
        if name.endswith("e_score_correction_bias"):
            t.zero_()
    return state


def packed_attention(model: KimiLinear):
    return [m for m in model.modules() if isinstance(m, (KimiDeltaAttention, MultiLatentAttention))]


def trainable(model: KimiLinear) -> KimiLinear:
    """Make the model trainable in place: the packed projection buffers become the parameters (the projections'
    own weights stay views of them, so `state_dict` follows every update); every other weight trains, except the
    routing bias (set by `balance_experts`); the routers drop their bf16 copy (`Router.pack_`), which would be
    stale after a step."""
    model.requires_grad_(False)
    views = set()
    for m in packed_attention(model):
        for name in ("in_proj_weight", "gate_b_weight"):
            if name in m._buffers:
                packed = m._buffers[name]
                setattr(m, name, nn.Parameter(packed))   # replaces the buffer; the same storage
                views.add(packed.untyped_storage().data_ptr())
    for m in model.modules():
        if isinstance(m, Router):
            m.weight_bf16 = None
    for name, p in model.named_parameters():
        is_view = p.untyped_storage().data_ptr() in views and not name.endswith(("in_proj_weight", "gate_b_weight"))
        p.requires_grad_(not is_view and not name.endswith("e_score_correction_bias"))
    return model.train()


def build_model(cfg: KimiConfig, seed: int, device: torch.device) -> KimiLinear:
    """The model from `initial_state`, held in bf16 on CUDA (fp32-kept tensors stay fp32) or fp32 on a CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kinds = internal_names(cfg)
    state = {n: t.to(device, storage_dtype(n, kinds[n][1], dtype)) for n, t in initial_state(cfg, seed).items()}
    return trainable(from_state_dict(cfg, state))


def checkpoint_state(model: KimiLinear) -> dict[str, torch.Tensor]:
    """The internal state dict the checkpoint is written from (without the packed tensors)."""
    state = model.state_dict()
    return {n: state[n] for n in internal_names(model.cfg)}


def logits_of(model: KimiLinear, ids: torch.Tensor) -> torch.Tensor:
    """The recompute forward with autograd: `forward` without its no-grad wrapper and id check."""
    return model._run_layers(ids, None, 0, last_only=False)


# ---- optimisation --------------------------------------------------------------------------------------------

class MasterAdamW:
    """AdamW on fp32 master copies of parameters held narrower (bf16 on CUDA); an fp32 parameter is its own master.
    Weight decay on matrices only (not norms, A_log, dt_bias)."""

    def __init__(self, model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95)):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.pairs = [(p, p if p.dtype == torch.float32 else p.detach().float().requires_grad_()) for _, p in named]
        decays = [p.ndim >= 2 and not n.endswith("A_log") for n, p in named]
        groups = [{"params": [m for (_, m), d in zip(self.pairs, decays) if d == want], "weight_decay": wd}
                  for want, wd in ((True, weight_decay), (False, 0.0))]
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8)

    def step(self, lr: float, clip: float) -> float:
        """Clip the gradient norm to `clip`, step at `lr`, copy the masters back; returns the norm before clipping."""
        for p, m in self.pairs:
            if m is not p and p.grad is not None:
                m.grad = p.grad.float()
                p.grad = None
        norm = torch.nn.utils.clip_grad_norm_([m for _, m in self.pairs], clip)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in self.pairs:
                if m is not p:
                    p.copy_(m)
        return float(norm)


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine from `peak` down to `floor * peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


class ExpertLoad:
    """Counts the tokens each routed expert takes, per MoE layer, from the routers' outputs (forward hooks)."""

    def __init__(self, model: KimiLinear):
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        E = model.cfg.num_experts
        self.counts = torch.zeros(len(self.routers), E, device=model.device)
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int):
        def hook(_module, _inputs, out):
            idx = out[0].reshape(-1)
            self.counts[i].scatter_add_(0, idx, torch.ones_like(idx, dtype=self.counts.dtype))
        return hook

    def reset(self) -> None:
        self.counts.zero_()

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def summary(self) -> list[dict]:
        """Per MoE layer: each expert's share of the routed tokens relative to an even share (1.0)."""
        out = []
        for c in self.counts.cpu():
            rel = c / c.mean().clamp_min(1e-9)
            out.append({"max": round(float(rel.max()), 3), "min": round(float(rel.min()), 3),
                        "unused": int((c == 0).sum()), "relative": [round(float(x), 3) for x in rel]})
        return out


@torch.no_grad()
def balance_experts(load: ExpertLoad, rate: float) -> None:
    """Aux-loss-free balancing: each layer's correction bias rises by `rate` for experts under the mean load and
    falls for those over it."""
    for router, c in zip(load.routers, load.counts):
        router.e_score_correction_bias.add_(rate * torch.sign(c.mean() - c))


# ---- evaluation ----------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: KimiLinear, ids: torch.Tensor, nbytes: torch.Tensor, seq_len: int, batch: int, bos: int,
             max_windows: int | None = None) -> dict:
    """Held-out loss over consecutive windows of `seq_len` targets (window s predicts ids[s+1 : s+seq_len+1] and
    starts without context; `max_windows` of them evenly spread when given), BOS targets left out (no bytes):
    nats per token, and bits per byte = nats per token x tokens / bytes / ln 2, the bytes being those of the
    predicted tokens (all of the text when every window is taken)."""
    starts = list(range(0, len(ids) - 1, seq_len))
    if max_windows is not None and len(starts) > max_windows:   # spread over the whole text, files differ
        starts = [starts[i * len(starts) // max_windows] for i in range(max_windows)]
    full = [s for s in starts if s + seq_len < len(ids)]
    groups = [full[i:i + batch] for i in range(0, len(full), batch)] + [[s] for s in starts if s not in full]
    nbytes = nbytes.to(model.device)
    was_training = model.training
    model.eval()
    nats, tokens, total_bytes = 0.0, 0, 0
    for group in groups:
        n = min(seq_len, len(ids) - 1 - group[0])
        window = torch.stack([ids[s:s + n + 1] for s in group]).to(model.device)
        with ops.use("torch"):
            logits = logits_of(model, window[:, :-1])
        target = window[:, 1:].flatten()
        keep = target != bos
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target, reduction="none")
        nats += float(loss[keep].double().sum())
        tokens += int(keep.sum())
        total_bytes += int(nbytes[target[keep]].sum())
    model.train(was_training)
    return {"loss": nats / max(tokens, 1), "tokens": tokens, "bytes": total_bytes,
            "bits_per_byte": nats / max(total_bytes, 1) / LN2}


# ---- training ------------------------------------------------------------------------------------------------

@dataclass
class TrainOptions:
    steps: int = 1000   # about 5 minutes on one H100 at the default sizes (0.26 to 0.30 s a step)
    batch: int = 16
    seq_len: int = 512
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    bias_rate: float = 1e-3
    seed: int = 0
    eval_every: int = 250
    eval_windows: int = 64
    time_limit: float | None = None   # seconds of training; the step count is lowered once, early, to fit it
    log_every: int = 50


def sample_batch(ids: torch.Tensor, batch: int, seq_len: int, g: torch.Generator) -> torch.Tensor:
    """`batch` random windows of seq_len + 1 tokens of `ids` [batch, seq_len + 1]."""
    if len(ids) < seq_len + 2:
        raise ValueError(f"{len(ids)} training tokens cannot fill a window of {seq_len + 1}")
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch,), generator=g)
    return ids[starts[:, None] + torch.arange(seq_len + 1)]


def train_step(model: KimiLinear, opt: MasterAdamW, window: torch.Tensor, lr: float,
               clip: float) -> tuple[float, float]:
    """One optimiser step on a batch of windows [B, T+1]; returns (loss, gradient norm)."""
    with ops.use("torch"):
        logits = logits_of(model, window[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
    loss.backward()
    norm = opt.step(lr, clip)
    return float(loss.detach()), norm


def train(model: KimiLinear, train_ids: torch.Tensor, heldout_ids: torch.Tensor, nbytes: torch.Tensor,
          opts: TrainOptions, curve=None, log=print) -> dict:
    """Train in place; `curve(dict)` takes one record per step (and one per eval). Returns the run's summary."""
    torch.manual_seed(opts.seed)
    g = torch.Generator().manual_seed(opts.seed)
    bos, device = model.cfg.bos_token_id, model.device
    opt = MasterAdamW(model, opts.lr, opts.weight_decay)
    load = ExpertLoad(model)
    total, t0, losses = opts.steps, time.perf_counter(), []

    def do_eval(step: int) -> dict:
        r = evaluate(model, heldout_ids, nbytes, opts.seq_len, opts.batch, bos, opts.eval_windows)
        rec = {"step": step, "heldout_loss": round(r["loss"], 5), "heldout_bpb": round(r["bits_per_byte"], 5)}
        log(f"eval step {step}: held-out {r['loss']:.4f} nats/token, {r['bits_per_byte']:.4f} bits/byte "
            f"({r['tokens']:,} tokens)")
        if curve:
            curve(rec)
        return rec

    evals = [do_eval(0)]
    step, t1 = 0, t0
    while step < total:
        sync(device)
        ts = time.perf_counter()
        window = sample_batch(train_ids, opts.batch, opts.seq_len, g).to(device, non_blocking=True)
        lr = lr_at(step, total, opts.lr, min(opts.warmup, total))
        load.reset()
        loss, norm = train_step(model, opt, window, lr, opts.clip)
        balance_experts(load, opts.bias_rate)
        sync(device)
        dt = time.perf_counter() - ts
        step += 1
        losses.append(loss)
        if curve:
            curve({"step": step, "loss": round(loss, 5), "lr": lr, "grad_norm": round(norm, 4),
                   "step_s": round(dt, 4)})
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss} at step {step}")
        if step <= 3 or step % opts.log_every == 0 or step == total:
            elapsed = time.perf_counter() - t0
            log(f"step {step}/{total} loss {loss:.4f} lr {lr:.2e} |g| {norm:.2f} {dt * 1e3:.0f} ms/step "
                f"{opts.batch * opts.seq_len / dt:,.0f} tok/s elapsed {elapsed:.0f} s")
        if step == 1:
            t1 = time.perf_counter()   # the first step warms up kernels and allocators: not timed
        if step == TIMED_STEPS + 1 and opts.time_limit is not None:
            per_step = (time.perf_counter() - t1) / TIMED_STEPS * 1.05   # slack for the evals
            fit = max(step + 1, step + int((opts.time_limit - (time.perf_counter() - t0)) / per_step))
            if fit < total:
                log(f"time limit {opts.time_limit:.0f} s at {per_step * 1e3:.0f} ms/step: {fit} steps instead of "
                    f"{total}")
                total = fit
        if step % opts.eval_every == 0 or step == total:
            evals.append(do_eval(step))
    load.close()
    tail = losses[-min(len(losses), 50):]
    return {"steps": total, "train_s": round(time.perf_counter() - t0, 1), "final_train_loss": sum(tail) / len(tail),
            "train_loss_over": f"mean of the last {len(tail)} steps", "evals": evals}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---- the reference run ---------------------------------------------------------------------------------------

@dataclass
class RunOptions:
    out: Path
    device: str = "auto"
    size: ModelSize = field(default_factory=ModelSize)
    train: TrainOptions = field(default_factory=TrainOptions)
    heldout_fraction: float = 0.05
    max_corpus_bytes: int | None = None
    corpus_root: Path | None = None
    record: bool = True   # append the run's `train` record


QUICK_TRAIN = dict(steps=30, batch=4, seq_len=64, warmup=5, eval_every=10, eval_windows=4, log_every=10)
QUICK_CORPUS_BYTES = 300_000


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory; the reference is written into a new one")


def run(opts: RunOptions, log=print, command: str | None = None) -> dict:
    """Corpus, tokenizer, model, training, checkpoint, provenance: the whole reference run. Returns the provenance."""
    out = Path(opts.out)
    check_out(out)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if opts.device == "auto" else opts.device)
    if opts.record:
        store.ensure_writable(RECORD_KIND)   # before the training: a run that cannot be recorded is refused first
    t_start = time.perf_counter()
    corpus = load_corpus(opts.corpus_root, opts.heldout_fraction)
    if opts.max_corpus_bytes:
        corpus = corpus.limited(opts.max_corpus_bytes)
    cs = corpus.summary()
    log(f"corpus: Python {cs['python']} stdlib, {cs['train']['files']} train files ({cs['train']['bytes']:,} bytes), "
        f"{cs['heldout']['files']} held out ({cs['heldout']['bytes']:,} bytes), {cs['sha256']}")

    cfg = opts.size.config()
    t = time.perf_counter()
    hf_tok = bpe.train_bpe((d.text for d in corpus.train), opts.size.n_base)
    out.mkdir(parents=True, exist_ok=True)
    bpe.write_tiktoken(bpe.ranks_of(hf_tok), out / TOKENIZER_FILE)
    tok = KimiTokenizer(out, cfg.vocab_size, cfg.bos_token_id)
    train_tokens, heldout_tokens = tokenize(corpus.train, tok), tokenize(corpus.heldout, tok)
    nbytes = token_bytes(tok)
    log(f"tokenizer: {opts.size.n_base} BPE tokens + {bpe.N_SPECIAL} specials, {time.perf_counter() - t:.1f} s; "
        f"{len(train_tokens.ids):,} train tokens ({train_tokens.bytes / len(train_tokens.ids):.2f} bytes/token), "
        f"{len(heldout_tokens.ids):,} held out")

    params, _ = cfg.checkpoint_size()
    log(f"model: {params:,} parameters, {checkpoint_bytes(cfg) / 2**20:.1f} MiB as a checkpoint; layers "
        f"{''.join('K' if k == 'kda' else 'M' for k in cfg.layer_kinds)} (K KDA, M MLA), {cfg.num_experts} "
        f"experts top-{cfg.num_experts_per_token} + 1 shared; {device_name(device)}")
    model = build_model(cfg, opts.train.seed, device)
    curve: list[dict] = []
    summary = train(model, train_tokens.ids, heldout_tokens.ids, nbytes, opts.train, curve=curve.append, log=log)

    save_checkpoint(checkpoint_state(model), cfg, out, max_shard_bytes=SHARD_BYTES)
    del model
    check_checkpoint(out)
    loaded = load_model(checkpoint=str(out), device=device, dtype=torch.float32)
    load = ExpertLoad(loaded.model)
    final = evaluate(loaded.model, heldout_tokens.ids, nbytes, opts.train.seq_len, opts.train.batch, cfg.bos_token_id)
    experts = load.summary()
    load.close()
    log(f"checkpoint {out}: held-out {final['loss']:.4f} nats/token, {final['bits_per_byte']:.4f} bits/byte over "
        f"{final['tokens']:,} tokens; expert load max/mean per MoE layer {[e['max'] for e in experts]}, unused "
        f"{[e['unused'] for e in experts]}; weights {loaded.weights}")

    provenance = {
        "what": "the suite's reference Kimi-Linear, trained on the Python standard library's source (model.train)",
        "command": command,
        "weights": loaded.weights,
        "corpus": cs | {"heldout_rule": f"sha256(relative path)[:8] < {opts.heldout_fraction} x 2^64",
                        "excluded": [f"{d}/" for d in EXCLUDED_DIRS] + ["config-*/", "_sysconfigdata_*.py",
                                                                         "empty files", "non-UTF-8 files"],
                        "max_bytes": opts.max_corpus_bytes},
        "tokenizer": {"library": f"tokenizers {tokenizers_version()}", "kind": "byte-level BPE, Kimi pre-tokenizer",
                      "base_tokens": opts.size.n_base, "specials": bpe.N_SPECIAL,
                      "sha256": "sha256:" + hashlib.sha256((out / TOKENIZER_FILE).read_bytes()).hexdigest(),
                      "train_tokens": len(train_tokens.ids), "heldout_tokens": len(heldout_tokens.ids)},
        "model": {"parameters": params, "checkpoint_bytes": checkpoint_bytes(cfg),
                  "size": dataclasses.asdict(opts.size), "layer_kinds": cfg.layer_kinds},
        "training": dataclasses.asdict(opts.train) | {
            "steps": summary["steps"], "device": device_name(device),
            "precision": CUDA_PRECISION if device.type == "cuda" else "fp32",
            "kernels": "torch", "torch": torch.__version__, "python": platform.python_version(),
            "train_s": summary["train_s"], "total_s": round(time.perf_counter() - t_start, 1)},
        "results": {"final_train_loss": round(summary["final_train_loss"], 5),
                    "train_loss_over": summary["train_loss_over"],
                    "heldout_loss": round(final["loss"], 5), "heldout_bits_per_byte": round(final["bits_per_byte"], 5),
                    "heldout_tokens": final["tokens"], "heldout_bytes": final["bytes"],
                    "heldout_of": "the checkpoint as written, in fp32, over every held-out window (none carries "
                                  "context)",
                    "evals": summary["evals"], "expert_load": experts},
    }
    (out / PROMPTS_FILE).write_text(json.dumps({"prompts": list(PYTHON_PROMPTS)}, indent=1) + "\n")
    (out / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=1) + "\n")
    (out / CURVE_FILE).write_text("".join(json.dumps(rec) + "\n" for rec in curve))
    if opts.record:
        rec = train_record(provenance, curve, out, source="the training run")
        path = store.append(rec)
        log(f"record {rec['id']} appended to {path}")
    return provenance


def tokenizers_version() -> str:
    import tokenizers
    return tokenizers.__version__


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")


# ---- the record ----------------------------------------------------------------------------------------------

class RecordFromError(ValueError):
    """A checkpoint folder whose provenance or loss curve cannot give a train record; the message names the file."""


def _at(d, dotted: str):
    """`d`'s value at a dotted path, or None where a part is missing or not an object."""
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def split_curve(curve: list[dict]) -> tuple[list[dict], list[dict]]:
    """The step lines ({step, loss}) and the eval lines ({step, heldout_loss, heldout_bpb}) of a loss curve."""
    steps = [{"step": c["step"], "loss": c["loss"]} for c in curve if "loss" in c]
    evals = [{k: c[k] for k in ("step", "heldout_loss", "heldout_bpb")} for c in curve if "heldout_loss" in c]
    return steps, evals


def train_record(prov: dict, curve: list[dict], checkpoint: Path, source: str) -> dict:
    """The `train` record of a run from its provenance (what `run` writes as provenance.json) and its loss curve (the
    lines of loss_curve.jsonl); the git and machine of the process making it (`--record-from` replaces them)."""
    tr, res, tok, model, corpus = (prov.get(k) if isinstance(prov.get(k), dict) else {}
                                   for k in ("training", "results", "tokenizer", "model", "corpus"))
    steps, evals = split_curve(curve)
    loads = res.get("expert_load") if isinstance(res.get("expert_load"), list) else []
    skipped = corpus.get("skipped_not_utf8")
    cuda = tr.get("precision") == CUDA_PRECISION
    size = model.get("size") or {}
    vocab = (tok["base_tokens"] + tok["specials"]
             if isinstance(tok.get("base_tokens"), int) and isinstance(tok.get("specials"), int) else None)
    layers = model.get("layer_kinds")
    params = {
        "label": Path(checkpoint).resolve().name, "checkpoint": store.shown_path(checkpoint), "command": prov.get("command"),
        "corpus": {k: corpus.get(k) for k in ("source", "python", "sha256", "train", "heldout", "heldout_rule",
                                               "max_bytes")}
                  | {"skipped_not_utf8": len(skipped) if isinstance(skipped, list) else None},
        "tokenizer": {k: tok.get(k) for k in ("sha256", "library", "kind", "base_tokens", "specials", "train_tokens",
                                              "heldout_tokens")} | {"vocab": vocab},
        "model": {"parameters": model.get("parameters"), "checkpoint_bytes": model.get("checkpoint_bytes"),
                  "layers": "".join("M" if k == "mla" else "K" for k in layers) if isinstance(layers, list) else None,
                  "size": size},
        **{k: tr.get(k) for k in ("steps", "seed", "batch", "seq_len", "lr", "warmup", "weight_decay", "clip",
                                  "bias_rate", "eval_every", "eval_windows", "time_limit", "precision", "kernels",
                                  "torch", "python")},
        "device_name": tr.get("device"), "source": source,
    }
    results = {
        "curve": steps, "evals": evals,
        **{k: res.get(k) for k in ("heldout_loss", "heldout_tokens", "heldout_bytes", "heldout_of", "final_train_loss",
                                   "train_loss_over")},
        "heldout_bpb": res.get("heldout_bits_per_byte"),
        "expert_load_max": [_at(e, "max") for e in loads], "expert_unused": [_at(e, "unused") for e in loads],
        "train_s": tr.get("train_s"), "total_s": tr.get("total_s"),
    }
    return store.make_record(RECORD_KIND, preset=params["label"], dtype="bfloat16" if cuda else "float32",
                             device="cuda" if cuda else "cpu", weights=prov.get("weights"), params=params,
                             results=results)


def read_json_file(path: Path, folder: Path, cap: int):
    if not path.exists() and not path.is_symlink():
        raise RecordFromError(f"{folder}: no {path.name}; --record-from needs a checkpoint folder written by "
                              f"model.train ({PROVENANCE_FILE} and {CURVE_FILE})")
    return read_file(path, cap, RecordFromError, folder)


def read_curve(folder: Path) -> list[dict]:
    """The lines of `folder`/loss_curve.jsonl, each checked: a step line {step, loss, ...} or an eval line {step,
    heldout_loss, heldout_bpb}, steps integers and losses finite numbers."""
    path = folder / CURVE_FILE
    data = read_json_file(path, folder, MAX_CURVE_BYTES)
    out = []
    for n, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        c = parse_json(f"{path}:{n}", line, RecordFromError)
        ok = isinstance(c, dict) and type(c.get("step")) is int and c["step"] >= 0 and (
            ("loss" in c and _finite(c["loss"])) or
            ("heldout_loss" in c and _finite(c["heldout_loss"]) and _finite(c.get("heldout_bpb"))))
        if not ok:
            raise RecordFromError(f"{path}:{n}: expected a step line {{step, loss}} or an eval line {{step, "
                                  f"heldout_loss, heldout_bpb}} with an integer step and finite numbers, got "
                                  f"{line[:80].decode('utf-8', 'replace')}")
        out.append(c)
    if not any("loss" in c for c in out):
        raise RecordFromError(f"{path}: no step line; expected one line per training step")
    return out


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def record_from(folder: Path, commit: str) -> dict:
    """The `train` record of the checkpoint in `folder`, trained at `commit`, from its provenance.json and
    loss_curve.jsonl, after checking that they agree with each other and with the checkpoint's weights."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RecordFromError(f"--record-from {folder}: not a folder; expected a checkpoint folder written by "
                              f"model.train")
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise RecordFromError(f"--commit must be a full 40-digit hex commit id, got {commit!r}")
    if store.git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        raise RecordFromError(f"--commit {commit} is not a commit of this repository; give the commit whose code "
                              f"trained the checkpoint")
    path = folder / PROVENANCE_FILE
    prov = parse_json(path, read_json_file(path, folder, 16 << 20), RecordFromError)
    if not isinstance(prov, dict):
        raise RecordFromError(f"{path}: expected a JSON object")
    curve = read_curve(folder)
    for need in ("weights", "corpus.sha256", "training.steps", "training.device", "training.precision",
                 "results.heldout_loss", "results.heldout_bits_per_byte"):
        if _at(prov, need) is None:
            raise RecordFromError(f"{path} lacks {need}; expected the provenance model.train writes")
    steps, evals = split_curve(curve)
    last = max(c["step"] for c in steps)
    if last != prov["training"]["steps"]:
        raise RecordFromError(f"{folder}: {CURVE_FILE} ends at step {last}, {PROVENANCE_FILE} says "
                              f"{prov['training']['steps']} steps; expected the curve of the same run")
    if _at(prov, "results.evals") is not None and prov["results"]["evals"] != evals:
        raise RecordFromError(f"{folder}: the evals of {CURVE_FILE} differ from those of {PROVENANCE_FILE}; "
                              f"expected the curve of the same run")
    weights = load_model(checkpoint=str(folder)).weights
    if weights != prov["weights"]:
        raise RecordFromError(f"{folder}: the checkpoint's weights are {weights}, {PROVENANCE_FILE} names "
                              f"{prov['weights']}; expected the provenance of these weights")
    rec = train_record(prov, curve, folder, source=f"{PROVENANCE_FILE} and {CURVE_FILE} (--record-from)")
    cuda = rec["device"] == "cuda"
    tr = prov["training"]
    rec["machine"] = {k: v for k, v in (("gpu", tr.get("device") if cuda else None),
                                        ("cpu", None if cuda else tr.get("device")),
                                        ("torch", tr.get("torch")), ("python", tr.get("python"))) if v is not None}
    rec["git"] = {"commit": commit, "commit_source": "--commit",
                  "note": f"recorded after the run by model.train --record-from, from the checkpoint folder's "
                          f"{PROVENANCE_FILE} and {CURVE_FILE}: the commit is the one given with --commit, whose "
                          f"code trained it; the machine is the training machine its provenance names, not the "
                          f"one that made this record"}
    return rec


def record_main(folder: Path, commit: str, log=print) -> int:
    """Append the train record of `folder` (`record_from`), unless the records already hold one of its weights."""
    rec = record_from(folder, commit)
    have = [r for r in store.load(RECORD_KIND).records if r["weights"] == rec["weights"]]
    if have:
        log(f"records already hold train record {have[-1]['id']} of weights {rec['weights']}; nothing appended")
        return 0
    path = store.append(rec)
    log(f"train record {rec['id']} of {rec['preset']} (weights {rec['weights']}, "
        f"{rec['params']['steps']} steps, held-out {rec['results']['heldout_bpb']} bits/byte) appended to {path}")
    return 0


# ---- CLI -----------------------------------------------------------------------------------------------------

def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {s!r}")
    return v


SIZE_FLAGS = ("vocab", "hidden", "layers", "experts", "top_k", "expert_dim")
TRAIN_FLAGS = ("steps", "batch", "seq_len", "lr", "eval_every", "seed", "time_limit")


@dataclass(frozen=True)
class RecordFrom:
    folder: Path
    commit: str


def parse_args(argv=None) -> RunOptions | RecordFrom:
    p = argparse.ArgumentParser(prog="python -m model.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="a new or empty folder for the checkpoint")
    p.add_argument("--record-from", type=Path, metavar="DIR",
                   help="append the train record of a checkpoint folder trained before (its provenance.json and "
                        "loss_curve.jsonl), instead of training")
    p.add_argument("--commit", metavar="SHA", help="with --record-from: the commit whose code trained it")
    p.add_argument("--no-record", action="store_true", help="append no train record (a toy run)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--steps", type=positive_int, help=f"optimiser steps (default {TrainOptions.steps})")
    p.add_argument("--time-limit", type=positive_float, help="seconds of training: fewer steps if they would not fit")
    p.add_argument("--seed", type=int)
    p.add_argument("--batch", type=positive_int, help=f"windows per step (default {TrainOptions.batch})")
    p.add_argument("--seq-len", type=positive_int, help=f"tokens per window (default {TrainOptions.seq_len})")
    p.add_argument("--lr", type=positive_float, help=f"peak learning rate (default {TrainOptions.lr})")
    p.add_argument("--eval-every", type=positive_int)
    p.add_argument("--vocab", type=positive_int,
                   help=f"BPE tokens before the 256 specials (default {ModelSize.n_base})")
    p.add_argument("--hidden", type=positive_int)
    p.add_argument("--layers", type=positive_int)
    p.add_argument("--experts", type=positive_int)
    p.add_argument("--top-k", type=positive_int)
    p.add_argument("--expert-dim", type=positive_int)
    p.add_argument("--heldout-fraction", type=positive_float, default=0.05)
    p.add_argument("--max-corpus-bytes", type=positive_int, help="train on the first files up to this many bytes")
    p.add_argument("--quick", action="store_true", help="a toy run: small corpus, vocabulary, model and step count")
    a = p.parse_args(argv)
    if a.record_from is not None:
        given = [f"--{k.replace('_', '-')}" for k in (*SIZE_FLAGS, *TRAIN_FLAGS, "out", "max_corpus_bytes")
                 if getattr(a, k) is not None] + [f for f, on in (("--quick", a.quick), ("--no-record", a.no_record))
                                                  if on]
        if given:
            p.error(f"--record-from records a folder trained before; it takes no {', '.join(given)}")
        if a.commit is None:
            p.error("--record-from needs --commit SHA: the commit whose code trained the checkpoint")
        return RecordFrom(a.record_from, a.commit)
    if a.commit is not None:
        p.error("--commit goes with --record-from")
    if a.out is None:
        p.error("the following arguments are required: --out (or --record-from DIR --commit SHA)")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    if not a.heldout_fraction < 1:
        p.error(f"--heldout-fraction must lie in (0, 1), got {a.heldout_fraction}")
    size = QUICK_SIZE if a.quick else ModelSize()
    size = dataclasses.replace(size, **{("n_base" if k == "vocab" else k): getattr(a, k)
                                        for k in SIZE_FLAGS if getattr(a, k) is not None})
    train = dict(QUICK_TRAIN) if a.quick else {}
    train |= {k: getattr(a, k) for k in TRAIN_FLAGS if getattr(a, k) is not None}
    opts = RunOptions(out=a.out, device=a.device, size=size, train=TrainOptions(**train),
                      heldout_fraction=a.heldout_fraction,
                      max_corpus_bytes=a.max_corpus_bytes or (QUICK_CORPUS_BYTES if a.quick else None),
                      record=not a.no_record)
    try:
        size.config()
    except ValueError as e:
        p.error(f"model size: {e}")
    try:
        check_out(opts.out)
    except FileExistsError as e:
        p.error(str(e))
    return opts


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = parse_args(argv)
    if isinstance(opts, RecordFrom):
        def record() -> int:
            try:
                return record_main(opts.folder, opts.commit)
            except ValueError as e:   # a folder that gives no record, a record the schema refuses
                print(f"model.train: {e}", file=sys.stderr)
                return 2
        return run_main(record, kinds=(RECORD_KIND,))   # a crash or records that cannot be written: 2
    try:
        run(opts, command=" ".join(["python -m model.train", *argv]))
    except (ValueError, FileExistsError) as e:   # the corpus or the sizes cannot give a model: a bad input
        print(f"model.train: {e}", file=sys.stderr)
        return 2
    except store.RecordsUnwritable as e:
        print(f"model.train: {e}; a checkpoint written before this could be recorded later with --record-from DIR "
              f"--commit SHA", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
