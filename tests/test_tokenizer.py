"""model/tokenizer.py and gates/prompts.py: Kimi's pre-tokenizer through tiktoken, the synthetic id mapping.

The real Kimi `tiktoken.model` is not available offline, so the tests write a small BPE file (base64 token,
space, rank per line): the 256 single bytes plus merges chosen so that each one would only apply if the
pre-tokenizer failed to split where Kimi's pattern splits.
"""
import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gates.prompts import MULTIPLIER, PROMPTS, SALT, battery, n_ordinary, synthetic_ids
from model.tokenizer import TOKENIZER_FILE, KimiTokenizer, TokenizerError
from model.config import PRESETS

TINY = PRESETS["tiny"]
HAN = "世".encode()  # e4 b8 96

# Merges after the 256 bytes (rank 256 upward). Each multi-byte token must be reachable by merging two
# lower-ranked tokens, as BPE builds it.
MERGES = [b"th", b"the", b" the",          # ordinary merges inside one pre-token
          b"x" + HAN[:1], b"x" + HAN[:2], b"x" + HAN,   # letter + Han: only if Han were not split off
          b"12", b"123", b"1234",           # four digits: only if numbers were not grouped by three
          b"a1",                            # letter + digit: only if letters and numbers were not split
          HAN[:2], HAN, HAN + HAN[:2], HAN + HAN]   # a Han run is one pre-token
BYTE = {bytes([b]): b for b in range(256)}
RANK = {**BYTE, **{m: 256 + i for i, m in enumerate(MERGES)}}


def write_bpe(path, ranks=RANK):
    path.write_text("".join(f"{base64.b64encode(tok).decode()} {r}\n" for tok, r in ranks.items()))
    return path


@pytest.fixture
def tok(tmp_path):
    return KimiTokenizer(write_bpe(tmp_path / TOKENIZER_FILE), TINY.vocab_size, TINY.bos_token_id)


def test_bos_first_then_bpe(tok):
    assert tok.encode("the") == [TINY.bos_token_id, RANK[b"the"]]
    assert tok.encode("in the") == [TINY.bos_token_id, BYTE[b"i"], BYTE[b"n"], RANK[b" the"]]


def test_han_runs_are_split_from_letters(tok):
    # `&&[^\p{Han}]` keeps Han out of the letter classes: "x" and "世" are separate pre-tokens
    assert tok.encode("x世")[1:] == [BYTE[b"x"], RANK[HAN]]
    assert tok.encode("世世")[1:] == [RANK[HAN + HAN]]


def test_numbers_group_by_three_and_split_from_letters(tok):
    assert tok.encode("1234")[1:] == [RANK[b"123"], BYTE[b"4"]]
    assert tok.encode("a1")[1:] == [BYTE[b"a"], BYTE[b"1"]]


def test_special_token_text_is_ordinary_text(tok):
    assert tok.encode("<|im_end|>")[1:] == [BYTE[bytes([c])] for c in b"<|im_end|>"]


def test_battery_uses_the_checkpoint_tokenizer(tmp_path):
    write_bpe(tmp_path / TOKENIZER_FILE)
    b = battery(TINY, tmp_path)
    assert b.source == f"tiktoken:{tmp_path / TOKENIZER_FILE}"
    assert len(b.ids) == 8 and all(ids[0] == TINY.bos_token_id for ids in b.ids)
    assert all(0 <= i < TINY.vocab_size for ids in b.ids for i in ids)
    assert battery(TINY, tmp_path / "absent").source == "synthetic-bytes"  # no tiktoken.model there


def test_bad_tokenizer_input(tmp_path):
    with pytest.raises(TokenizerError, match="empty prompt"):
        KimiTokenizer(write_bpe(tmp_path / "a.model"), TINY.vocab_size, TINY.bos_token_id).encode("")
    with pytest.raises(TypeError, match="must be a str"):
        KimiTokenizer(tmp_path / "a.model", TINY.vocab_size, TINY.bos_token_id).encode(b"bytes")
    with pytest.raises(TokenizerError, match=r"token rank 200, outside the model's vocabulary 0\.\.199 \(line 201\)"):
        KimiTokenizer(tmp_path / "a.model", 200, 199)
    with pytest.raises(TokenizerError, match="bos_token_id 100 must lie after"):
        KimiTokenizer(tmp_path / "a.model", TINY.vocab_size, 100)
    (tmp_path / "bad.model").write_text("not base64! 0\n")
    with pytest.raises(TokenizerError, match="not a tiktoken BPE file"):
        KimiTokenizer(tmp_path / "bad.model", TINY.vocab_size, TINY.bos_token_id)
    with pytest.raises(TokenizerError, match="no tokenizer file"):
        KimiTokenizer(tmp_path / "missing.model", TINY.vocab_size, TINY.bos_token_id)


# ---- the synthetic mapping ---------------------------------------------------------------------------------

def test_synthetic_ids_formula():
    assert synthetic_ids("A\x00é", TINY) == [500, (65 * 131 + 7) % 500, 7, (0xC3 * 131 + 7) % 500, (0xA9 * 131 + 7) % 500]
    assert (MULTIPLIER, SALT, n_ordinary(TINY)) == (131, 7, 500)


def test_synthetic_ids_are_one_to_one_on_bytes():
    for cfg in PRESETS.values():
        ids = synthetic_ids(bytes(range(128)).decode("ascii"), cfg)[1:]
        assert len(set(ids)) == 128
    all_bytes = {(b * MULTIPLIER + SALT) % n_ordinary(TINY) for b in range(256)}
    assert len(all_bytes) == 256


@given(st.text(min_size=1, max_size=64))
def test_synthetic_ids_stay_ordinary(text):
    for cfg in PRESETS.values():
        ids = synthetic_ids(text, cfg)
        assert ids[0] == cfg.bos_token_id and len(ids) == len(text.encode()) + 1
        assert all(0 <= i < n_ordinary(cfg) for i in ids[1:])


def test_synthetic_ids_bad_input():
    with pytest.raises(ValueError, match="empty prompt"):
        synthetic_ids("", TINY)
    with pytest.raises(TypeError, match="must be a str"):
        synthetic_ids(None, TINY)
    with pytest.raises(ValueError, match="leaves 1 ordinary ids"):
        synthetic_ids("a", TINY.replace(bos_token_id=1, eos_token_id=1, pad_token_id=1))


def test_battery_is_eight_varied_prompts():
    b = battery(TINY)
    assert len(PROMPTS) == len(set(PROMPTS)) == 8 and b.source == "synthetic-bytes"
    assert all(len(ids) > 40 for ids in b.ids)
    assert any(ord(c) > 0x4E00 for c in PROMPTS[6])  # the multilingual prompt holds Han text
