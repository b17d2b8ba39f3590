"""Kimi's tokenizer, rebuilt from a checkpoint's `tiktoken.model` with the tiktoken library.

The published checkpoints tokenise with `tokenization_kimi.py` (remote code). That file is never imported
here: it only wraps `tiktoken.Encoding` around the BPE ranks in `tiktoken.model` with the pre-tokenizer
pattern below, and puts 256 reserved special tokens after the base vocabulary (BOS = `[BOS]` = 163584 for
Kimi-Linear, the config's `bos_token_id`). Prompts are plain text, so they are encoded as ordinary text
(special-token strings inside a prompt are not turned into special ids) and BOS is prepended by id.
"""
from __future__ import annotations

from pathlib import Path

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


class KimiTokenizer:
    def __init__(self, path: str | Path, vocab_size: int, bos_token_id: int):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(f"no tokenizer file at {path}")
        try:
            ranks = load_tiktoken_bpe(str(path))
        except Exception as e:  # tiktoken raises bare ValueError/binascii.Error on a malformed line
            raise TokenizerError(f"{path} is not a tiktoken BPE file (base64 token, space, rank per line): {e}") from e
        if not ranks:
            raise TokenizerError(f"{path} holds no tokens")
        top = max(ranks.values())
        if top >= vocab_size:
            raise TokenizerError(f"{path} has token rank {top}, outside the model's vocabulary 0..{vocab_size - 1}")
        if not 0 <= bos_token_id < vocab_size or bos_token_id <= top:
            raise TokenizerError(f"bos_token_id {bos_token_id} must lie after the {path.name} ranks (max {top}) "
                                 f"and inside the vocabulary 0..{vocab_size - 1}")
        self.path, self.vocab_size, self.bos_token_id = path, vocab_size, bos_token_id
        self.encoding = tiktoken.Encoding(name=path.name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                          special_tokens={})

    def encode(self, text: str) -> list[int]:
        """BOS, then the text's BPE ids."""
        if not isinstance(text, str):
            raise TypeError(f"prompt text must be a str, got {type(text).__name__}")
        if not text:
            raise TokenizerError("empty prompt text: nothing to tokenise")
        return [self.bos_token_id] + self.encoding.encode_ordinary(text)
