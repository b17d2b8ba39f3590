"""A byte-level BPE tokenizer trained with HF `tokenizers`, written as a Kimi `tiktoken.model`.

Kimi's tokenizer is tiktoken over BPE ranks with the pre-tokenizer pattern `model.tokenizer.KIMI_PAT_STR`. The
trainer here splits text with that same pattern (HF's Oniguruma engine takes its `&&` class intersections as
tiktoken's does), then maps each piece's bytes to HF's byte-level alphabet and learns merges. Each merge adds one
token, in order, after the 256 single bytes; a token's tiktoken rank is its HF id. tiktoken merges the adjacent
pair whose concatenation has the lowest rank, HF the pair whose merge rule came first: with one token per merge,
in merge order, the two are the same procedure, so tiktoken reproduces HF's ids (`train_bpe` checks the order;
tests/test_train.py compares the ids on held-out text).
"""
from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from pathlib import Path

from model.tokenizer import KIMI_PAT_STR

N_SPECIAL = 256  # reserved special tokens after the base vocabulary, as in Kimi's tokenizer
BOS_OFFSET, EOS_OFFSET = 0, 2  # [BOS] and the end-of-turn token's places among them (163584 and 163586 at 48B)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet, which HF's ByteLevel pre-tokenizer uses: printable Latin-1 bytes map to
    themselves, the other 68 bytes to the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return dict(sorted(chars.items()))


def special_ids(n_base: int) -> dict[str, int]:
    """The config's vocabulary fields for a base vocabulary of `n_base` ranks: the specials follow it."""
    return {"vocab_size": n_base + N_SPECIAL, "bos_token_id": n_base + BOS_OFFSET,
            "eos_token_id": n_base + EOS_OFFSET, "pad_token_id": n_base + N_SPECIAL - 1}


def hf_byte_level(tokenizer=None):
    """An HF tokenizer with Kimi's pre-tokenization (pattern split, then byte-level), untrained unless given."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = tokenizer or Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterable[str], n_base: int):
    """Train a byte-level BPE of `n_base` tokens (the 256 bytes and n_base - 256 merges) on `texts`; returns the HF
    tokenizer. Raises ValueError when the texts give fewer merges than asked, or HF's ids are not one token per merge
    in merge order (the ranks would then not reproduce its ids)."""
    from tokenizers import pre_tokenizers, trainers

    if not 256 < n_base <= 1 << 20:
        raise ValueError(f"BPE vocabulary of {n_base} tokens: expected 257..{1 << 20} (the 256 bytes and merges)")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if sorted(alphabet) != sorted(bytes_to_unicode().values()):
        raise RuntimeError("HF's byte-level alphabet is not GPT-2's byte map: the ranks could not be read back")
    tok = hf_byte_level()
    trainer = trainers.BpeTrainer(vocab_size=n_base, initial_alphabet=alphabet, show_progress=False,
                                  special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab, merges = model["vocab"], model["merges"]
    if len(vocab) < n_base:
        raise ValueError(f"the training text gives only {len(vocab)} BPE tokens, fewer than the {n_base} asked: "
                         f"ask for fewer, or train on more text")
    if sorted(vocab.values()) != list(range(len(vocab))) or len(merges) != len(vocab) - 256:
        raise ValueError(f"HF's BPE vocabulary is not 256 bytes then one token per merge ({len(vocab)} tokens, "
                         f"{len(merges)} merges)")
    out_of_order = [i for i, (a, b) in enumerate(merges) if vocab[a + b] != 256 + i]
    if out_of_order:
        raise ValueError(f"{len(out_of_order)} BPE merges do not create the token of their own rank (first: merge "
                         f"{out_of_order[0]}); tiktoken would not reproduce HF's ids")
    return tok


def ranks_of(tokenizer) -> dict[bytes, int]:
    """The tiktoken ranks of a trained byte-level HF tokenizer: each token's bytes -> its HF id."""
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    vocab = json.loads(tokenizer.to_str())["model"]["vocab"]
    return {bytes(to_byte[c] for c in token): i for token, i in vocab.items()}


def write_tiktoken(ranks: dict[bytes, int], path: str | Path) -> Path:
    """`ranks` as a tiktoken BPE file: one `base64(token) rank` line per token, in rank order."""
    path = Path(path)
    lines = [f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    path.write_text("".join(lines))
    return path
