"""Kimi's tokenizer, rebuilt from a checkpoint's `tiktoken.model` with the tiktoken library.

The published checkpoints tokenise with `tokenization_kimi.py` (remote code). That file is never imported
here: it only wraps `tiktoken.Encoding` around the BPE ranks in `tiktoken.model` with the pre-tokenizer
pattern below, and puts 256 reserved special tokens after the base vocabulary (BOS = `[BOS]` = 163584 for
Kimi-Linear, the config's `bos_token_id`). Prompts are plain text, so they are encoded as ordinary text
(special-token strings inside a prompt are not turned into special ids) and BOS is prepended by id.

The file is read and checked here (`read_ranks`), not by tiktoken's `load_tiktoken_bpe`: that loader caches a
local file's contents in a temporary folder under a key made of its path, so a file changed at the same path would
be served stale, and it hands the library ranks that make it panic.
"""
from __future__ import annotations

import base64
import binascii
import os
import re
from pathlib import Path

from model.config import read_file

TOKENIZER_FILE = "tiktoken.model"

# The pre-tokenizer pattern of Kimi's tokenization_kimi.py (`pat_str`): Han runs split off first; words
# with optional English contractions, where `&&[^\p{Han}]` keeps Han characters out of the letter classes;
# numbers in groups of up to three digits; punctuation runs; newlines; other whitespace.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


class TokenizerError(ValueError):
    """A tokenizer file or a text that cannot give valid prompt ids; the message says which and why."""


# The real Kimi tiktoken.model is ~2.8 MB (163,584 tokens); a file past this is no tokenizer's, and is refused
# before it is read whole.
MAX_TOKENIZER_BYTES = 64 << 20
_RANK = re.compile(rb"[0-9]{1,12}")
# Never turned into a TokenizerError: the user's interrupt, an exit, a closing generator.
_PASS_THROUGH = (KeyboardInterrupt, SystemExit, GeneratorExit)


def _library_error(path: Path, doing: str, e: BaseException) -> TokenizerError:
    first = (str(e).splitlines() or [""])[0][:200]
    return TokenizerError(f"{path}: the tiktoken library failed {doing}: {type(e).__name__}: {first}")


def read_ranks(path: Path, data: bytes, vocab_size: int) -> dict[bytes, int]:
    """The BPE ranks of a tiktoken file's bytes (one `base64-token rank` per line, blank lines skipped, as
    tiktoken's own loader reads it), checked so that the library is never handed ranks it panics on: tiktoken is
    Rust, and a panic raises `pyo3_runtime.PanicException`, a BaseException that escapes `except Exception`.

    Checked, each refused by line with a `TokenizerError` naming the file: two fields per line (an empty token
    leaves one); strict base64; a rank of decimal digits inside the vocabulary 0..vocab_size-1; no token twice;
    no rank twice (the library panics building its decoder); every one of the 256 single bytes a token (the
    library panics encoding a byte without one). Ranks may have gaps."""
    def bad(n: int, line: bytes, why: str) -> TokenizerError:
        shown = repr(line[:60]) + ("..." if len(line) > 60 else "")
        return TokenizerError(f"{path} is not a tiktoken BPE file (base64 token, space, rank per line): line {n:,} "
                              f"{shown}: {why}")

    ranks: dict[bytes, int] = {}
    line_of: dict[int, int] = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not _RANK.fullmatch(parts[1]):
            raise bad(n, line, "expected a base64 token, a space and a decimal rank")
        try:
            token = base64.b64decode(parts[0], validate=True)
        except binascii.Error as e:
            raise bad(n, line, f"the token is not base64 ({e})") from e
        rank = int(parts[1])
        if rank >= vocab_size:
            raise TokenizerError(f"{path} has token rank {rank}, outside the model's vocabulary 0..{vocab_size - 1} "
                                 f"(line {n:,})")
        if token in ranks:
            raise bad(n, line, f"the token repeats the one of line {line_of[ranks[token]]:,}; expected each once")
        if rank in line_of:
            raise bad(n, line, f"rank {rank} repeats the one of line {line_of[rank]:,}; expected each rank once")
        ranks[token], line_of[rank] = rank, n
    if not ranks:
        raise TokenizerError(f"{path} holds no tokens")
    lacking = [b for b in range(256) if bytes([b]) not in ranks]
    if lacking:
        more = f" (and {len(lacking) - 8} more)" if len(lacking) > 8 else ""
        shown = ", ".join(f"{b:#04x}" for b in lacking[:8]) + more
        raise TokenizerError(f"{path} lacks the single-byte token of {len(lacking)} byte values: {shown}; a byte-level "
                             f"BPE file must hold all 256 (tiktoken cannot encode a byte without one)")
    return ranks


class KimiTokenizer:
    def __init__(self, path: str | Path, vocab_size: int, bos_token_id: int):
        """`path`: a tiktoken.model, or a checkpoint directory holding one: a regular file inside the folder (a
        link is followed only to a file inside it; `model.config.read_file`) of at most 64 MiB, its ranks checked
        by `read_ranks`. Every refusal is a `TokenizerError` naming the file, the library's failures included."""
        import tiktoken

        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not os.path.lexists(path):
            raise TokenizerError(f"no tokenizer file at {path}")
        ranks = read_ranks(path, read_file(path, MAX_TOKENIZER_BYTES, TokenizerError), vocab_size)
        top = max(ranks.values())
        if not 0 <= bos_token_id < vocab_size or bos_token_id <= top:
            raise TokenizerError(f"bos_token_id {bos_token_id} must lie after the {path.name} ranks (max {top}) "
                                 f"and inside the vocabulary 0..{vocab_size - 1}")
        self.path, self.vocab_size, self.bos_token_id = path, vocab_size, bos_token_id
        try:  # a backstop: read_ranks refuses every input the library is known to panic on
            self.encoding = tiktoken.Encoding(name=path.name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                              special_tokens={})
        except _PASS_THROUGH:
            raise
        except BaseException as e:
            raise _library_error(path, "to build an encoding from its ranks", e) from e

    def encode(self, text: str) -> list[int]:
        """BOS, then the text's BPE ids."""
        if not isinstance(text, str):
            raise TypeError(f"prompt text must be a str, got {type(text).__name__}")
        if not text:
            raise TokenizerError("empty prompt text: nothing to tokenise")
        try:
            ids = self.encoding.encode_ordinary(text)
        except _PASS_THROUGH:
            raise
        except BaseException as e:  # a Rust panic is a BaseException: it would escape `except Exception`
            raise _library_error(self.path, "to encode a prompt", e) from e
        return [self.bos_token_id] + ids
