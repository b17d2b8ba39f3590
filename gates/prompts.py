"""The prompt battery of Gates A and B: eight English prompts, 16 new tokens each = 128 scored positions.

The seed scored 8 prompts x 16 tokens but does not give its prompt texts; these eight are this project's
own, chosen to differ in kind so that a state-carry bug has many ways to show: code, prose, a list, a
question, numbers, a dialogue, multilingual text (Han runs, accents, Cyrillic: other pre-tokenizer paths
and multi-byte UTF-8), and repetition (a long self-similar context stresses the recurrent state).

A checkpoint may carry its own battery, suited to what it was trained on: `prompts.json` in its folder,
`{"prompts": [text, ...]}` (the suite's reference checkpoint carries `model.train.PYTHON_PROMPTS`). It is read as
any other checkpoint file is (size-capped, strict JSON, no link out of the folder) and checked before use.

Text becomes ids one of two ways:
- a checkpoint directory with a `tiktoken.model`: Kimi's tokenizer (`model.tokenizer`), BOS first; a
  `tiktoken.model` in any form (a dangling link, a link out of the directory, a folder, a fifo) counts, so one
  that is no usable file is refused by name rather than passed over;
- otherwise (synthetic presets, or a checkpoint written without a tokenizer): `synthetic_ids`, a fixed
  byte mapping, BOS first. Synthetic weights have no vocabulary to respect, so the mapping only has to be
  deterministic, stay inside the ordinary ids and spread the prompt over the embedding table. The gates say so
  for a checkpoint (`gates.run.prompt_note`), and refuse one whose prompts.json has no tokenizer beside it
  (`check_prompt_files`): its texts as synthetic bytes are not what the model was trained to read.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from model.checkpoint import PROMPTS_FILE
from model.config import KimiConfig, parse_json, read_file
from model.tokenizer import TOKENIZER_FILE, KimiTokenizer
from records.store import shown_path

PROMPTS: tuple[str, ...] = (
    # code
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return",
    # prose
    "The lighthouse keeper climbed the spiral stairs at dusk, as he had every evening for thirty years, and",
    # a list
    "Things to pack for a week of hiking:\n1. tent\n2. sleeping bag\n3. water filter\n4.",
    # a question
    "Why does the sky look blue during the day but red and orange at sunset? The short answer is",
    # numbers
    "Prime numbers below one hundred: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41,",
    # a dialogue
    "Alice: Did you lock the back door?\nBob: I thought you did.\nAlice: Then who has the key?\nBob:",
    # multilingual text
    "English: good morning. Français : bonjour. 中文：早上好。 Русский: доброе утро. Español:",
    # repetition
    "one two three one two three one two three one two three one two three one two three one two",
)

DEFAULT_NEW_TOKENS = 16
MAX_PROMPTS_BYTES = 1 << 16
MAX_BATTERY, MAX_PROMPT_CHARS = 64, 4096


class PromptsError(ValueError):
    """A checkpoint's prompts.json that is no usable battery; the message names the file and the fault."""


def check_prompt_files(model_dir: str | Path) -> None:
    """PromptsError for a checkpoint folder whose prompts.json has no tiktoken.model beside it (either in any form
    counts as present, as the readers take them). The gates' policy (`gates.run.battery_for`); `battery` itself
    maps such texts to synthetic bytes."""
    folder = Path(model_dir)
    if os.path.lexists(folder / PROMPTS_FILE) and not os.path.lexists(folder / TOKENIZER_FILE):
        raise PromptsError(f"{shown_path(folder)}: its {PROMPTS_FILE} holds text prompts, which cannot be tokenised "
                           f"without {TOKENIZER_FILE}; add the checkpoint's {TOKENIZER_FILE} to the folder")


def read_prompts(model_dir: str | Path) -> tuple[str, ...] | None:
    """The battery a checkpoint folder carries in prompts.json, None where it has none. A prompts.json in any form
    (a link, a folder) counts, so one that is no usable file is refused by name rather than passed over."""
    file = Path(model_dir) / PROMPTS_FILE
    if not os.path.lexists(file):
        return None
    data = parse_json(file, read_file(file, MAX_PROMPTS_BYTES, PromptsError, folder=model_dir), PromptsError)
    texts = data.get("prompts") if isinstance(data, dict) else None
    if (not isinstance(texts, list) or not 1 <= len(texts) <= MAX_BATTERY
            or not all(isinstance(t, str) and 0 < len(t) <= MAX_PROMPT_CHARS for t in texts)):
        raise PromptsError(f"{file}: expected {{\"prompts\": [...]}} with 1..{MAX_BATTERY} non-empty texts of at "
                           f"most {MAX_PROMPT_CHARS} characters")
    unknown = sorted(set(data) - {"prompts"})
    if unknown:
        raise PromptsError(f"{file}: unknown keys {unknown}; expected only \"prompts\"")
    return tuple(texts)

# Synthetic mapping: id = (byte * MULTIPLIER + SALT) % n_ordinary. 131 is prime, so the map is one-to-one on
# the 256 byte values whenever n_ordinary >= 256 and is not a multiple of 131 (tiny: 500; 48b-a3b: 163584).
MULTIPLIER, SALT = 131, 7


def n_ordinary(cfg: KimiConfig) -> int:
    """Ids below the first special token (BOS/EOS/pad sit at the top of the vocabulary in both presets)."""
    return min(cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)


def synthetic_ids(text: str, cfg: KimiConfig) -> list[int]:
    """BOS, then one id per UTF-8 byte of `text`: (byte * 131 + 7) % n_ordinary(cfg). Position-independent."""
    if not isinstance(text, str):
        raise TypeError(f"prompt text must be a str, got {type(text).__name__}")
    if not text:
        raise ValueError("empty prompt text: nothing to map to ids")
    n = n_ordinary(cfg)
    if n < 2:
        raise ValueError(f"config leaves {n} ordinary ids below the special tokens; the mapping needs at least 2")
    return [cfg.bos_token_id] + [(b * MULTIPLIER + SALT) % n for b in text.encode("utf-8")]


@dataclass(frozen=True)
class Battery:
    ids: list[list[int]]
    source: str  # 'synthetic-bytes' or 'tiktoken:<path>', with '; prompts:<path>' for a checkpoint's own battery
    texts: tuple[str, ...] = PROMPTS


def battery(cfg: KimiConfig, model_dir: str | Path | None = None, prompts=None) -> Battery:
    """The prompts as ids for this model: `prompts`, else the checkpoint's own battery (prompts.json), else
    PROMPTS; with the checkpoint's tokenizer when it has one."""
    source = ""
    if prompts is None and model_dir is not None:
        prompts = read_prompts(model_dir)
        source = "" if prompts is None else f"; prompts:{Path(model_dir) / PROMPTS_FILE}"
    prompts = tuple(PROMPTS if prompts is None else prompts)
    if model_dir is not None and os.path.lexists(Path(model_dir) / TOKENIZER_FILE):
        tok = KimiTokenizer(Path(model_dir), cfg.vocab_size, cfg.bos_token_id)  # the folder: its file must lie in it
        return Battery([tok.encode(p) for p in prompts], f"tiktoken:{tok.path}{source}", prompts)
    return Battery([synthetic_ids(p, cfg) for p in prompts], f"synthetic-bytes{source}", prompts)
