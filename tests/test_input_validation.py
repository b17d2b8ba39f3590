"""Hostile checkpoint-directory inputs: config.json, model.safetensors.index.json, the shards, tiktoken.model.

Every malformed input must end in a ValueError (ConfigError, CheckpointError, TokenizerError; the gates CLI maps
ValueError to exit code 2) whose one-line message names the file: never another exception type (a Rust panic is a
BaseException and escapes `except Exception`), never a hang, never unbounded memory, never a silent fallback.
`assert_contract` is that rule as a check; the property tests hold it over arbitrary inputs, its negative controls
show it reports each kind of violation, and one regression test per class of input pins the refusal.
"""
import base64
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import model.tokenizer as tokenizer_module
import model.config as config_module
from gates.memory import param_counts
from gates.prompts import PROMPTS, battery
from model.tokenizer import MAX_TOKENIZER_BYTES, TOKENIZER_FILE, KimiTokenizer, TokenizerError
from model.checkpoint import (INDEX_FILE, MAX_INDEX_BYTES, CheckpointError, check_checkpoint, original_names,
                              save_checkpoint)
from model.config import (MAX_CONFIG_BYTES, MAX_PARAMS, MAX_TENSORS, PRESETS, ConfigError, KimiConfig,
                          get_config)
from model.weights import synthetic_weights

TINY = PRESETS["tiny"]
ALLOWED = (ConfigError, CheckpointError, TokenizerError)
# Each call also runs under assert_contract's own hard time and memory limits.
FAST = dict(deadline=10_000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                    HealthCheck.function_scoped_fixture])


# ---- the contract ---------------------------------------------------------------------------------------------

class _Budget(BaseException):
    """Raised by `time_limit`'s timer: a BaseException, so that no `except Exception` under test hides it."""


def _vm_data() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    except (OSError, StopIteration):
        return None


@contextlib.contextmanager
def memory_limit(extra_bytes: int):
    """Cap this process's data segment at its current size plus `extra_bytes` (RLIMIT_DATA, which covers malloc
    and anonymous mmap): past it an allocation fails with MemoryError instead of exhausting the machine."""
    now = _vm_data()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if now is None:
        yield
        return
    cap = now + extra_bytes if hard == resource.RLIM_INFINITY else min(now + extra_bytes, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


@contextlib.contextmanager
def time_limit(seconds: float):
    """Interrupt the block after `seconds` (SIGALRM also breaks a blocking open or read). `fired` records it, as
    code under test that catches BaseException (the tokenizer's backstop) could turn the interrupt into an error."""
    fired = []

    def alarm(signum, frame):
        fired.append(True)
        raise _Budget(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def assert_contract(names, fn, *args, seconds: float = 20.0, memory: int = 1 << 30):
    """fn(*args) returns (its result is returned), or raises one of ALLOWED with a one-line message naming one of
    `names` (None is returned). Anything else is an AssertionError: another exception type (KeyError,
    RecursionError, UnicodeDecodeError, OverflowError, a Rust PanicException, a MemoryError past `memory` bytes
    of new data), a message that names no file or spans lines, or a call still running after `seconds`."""
    names = [names] if isinstance(names, (str, Path)) else names
    fired = []
    try:
        with memory_limit(memory), time_limit(seconds) as fired:
            result = fn(*args)
    except (KeyboardInterrupt, SystemExit):
        raise
    except ALLOWED as e:
        assert not fired, f"{fn.__name__} ran past {seconds} s (then raised {type(e).__name__}: {e})"
        msg = str(e)
        assert isinstance(e, ValueError)
        assert "\n" not in msg and len(msg) < 2000, f"{fn.__name__}: the message is not one short line: {msg[:300]!r}"
        assert any(str(n) in msg for n in names), f"{fn.__name__}: the message names none of {names}: {msg}"
        return None
    except BaseException as e:
        raise AssertionError(f"{fn.__name__} raised {type(e).__module__}.{type(e).__name__}, not one of "
                             f"{[c.__name__ for c in ALLOWED]}: {str(e)[:300]}") from e
    assert not fired, f"{fn.__name__} ran past {seconds} s (then returned)"
    return result


def refused(error, pattern: str, names, fn, *args, **limits) -> None:
    """fn(*args) keeps the contract (within its time and memory) and raises `error` matching `pattern`."""
    assert_contract(names, fn, *args, **limits)
    with pytest.raises(error, match=pattern):
        fn(*args)


# ---- negative controls: the contract reports each kind of violation -------------------------------------------

class FakePanic(BaseException):
    """Like pyo3_runtime.PanicException: a BaseException, not an Exception."""


def _raiser(exc):
    def fn(*_, **__):
        raise exc
    return fn


@pytest.mark.parametrize("exc", [KeyError("vocab_size"), RecursionError("maximum recursion depth exceeded"),
                                 UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
                                 OverflowError("int too large to convert to float"),
                                 FakePanic("no entry found for key"),
                                 ValueError("config.json: a plain ValueError, not one of the loaders' errors"),
                                 ConfigError("a message that names no file"),
                                 ConfigError("config.json: a message\nthat spans two lines")])
def test_contract_reports_a_wrong_error(exc):
    with pytest.raises(AssertionError):
        assert_contract("config.json", _raiser(exc))


def test_contract_accepts_a_named_refusal_or_a_result():
    assert assert_contract("config.json", _raiser(ConfigError("/x/config.json: field 'a' must be 1"))) is None
    assert assert_contract("config.json", lambda: 7) == 7


def test_contract_reports_a_hang():
    def hang():
        time.sleep(30)
    t0 = time.perf_counter()
    with pytest.raises(AssertionError, match="still running after 0.5 s"):
        assert_contract("x", hang, seconds=0.5)
    assert time.perf_counter() - t0 < 5


def test_contract_reports_a_hang_hidden_by_a_catch_all():
    def hang_then_refuse():
        try:
            time.sleep(30)
        except BaseException as e:  # what the tokenizer's backstop does with any BaseException
            raise TokenizerError(f"x: {e}") from e
    with pytest.raises(AssertionError, match="ran past 0.5 s"):
        assert_contract("x", hang_then_refuse, seconds=0.5)


def test_contract_reports_unbounded_memory():
    if _vm_data() is None:
        pytest.skip("no /proc/self/status: RLIMIT_DATA is not measured here")
    with pytest.raises(AssertionError, match="MemoryError"):
        assert_contract("x", lambda: bytearray(1 << 30), memory=256 << 20)


# ---- fixtures -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A tiny bf16 checkpoint in several shards, written once: tests copy it (`_copy`) before changing it."""
    return save_checkpoint(synthetic_weights(TINY, seed=1, dtype=torch.bfloat16), TINY,
                           tmp_path_factory.mktemp("input_validation") / "ckpt", max_shard_bytes=100_000)


def _copy(ckpt: Path, dest: Path) -> Path:
    """The checkpoint in a new folder: the shards hard-linked (no test writes into one), the JSON files copied."""
    dest.mkdir(parents=True)
    for f in ckpt.iterdir():
        (os.link if f.suffix == ".safetensors" else shutil.copyfile)(f, dest / f.name)
    return dest


BYTE_RANKS = {bytes([b]): b for b in range(256)}


def _bpe(ranks) -> str:
    return "".join(f"{base64.b64encode(tok).decode()} {r}\n" for tok, r in ranks.items())


# ---- properties -------------------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-10**1200, 10**1200)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=25)
# Values aimed at the config's fields: sizes around and past the limits, bools, zero, negatives, floats, nulls,
# lists of layer numbers (bools among them).
FIELD_VALUES = (st.integers(-3, 2**21) | st.sampled_from([0, 1, True, False, None, 1.0, 2**24, 2**40, 10**400, -1])
                | st.lists(st.integers(-1, 6) | st.booleans(), max_size=6) | JSON)
TINY_DICT = TINY.to_dict()
LAC_KEYS = sorted(TINY_DICT["linear_attn_config"])


def check_config_file(folder: Path, data: bytes, with_checkpoint: bool = False):
    """The contract for one config.json's bytes, through every entry that reads it; the config when valid."""
    file = folder / "config.json"
    file.write_bytes(data)
    cfg = assert_contract(file, KimiConfig.from_json, file)
    assert cfg is None or isinstance(cfg.validate(), KimiConfig)
    assert_contract(file, get_config, str(folder))
    if with_checkpoint:
        assert_contract([file, folder], check_checkpoint, folder)
    return cfg


@settings(max_examples=200, **FAST)
@given(data=st.binary(max_size=400))
def test_property_config_bytes(tmp_path_factory, data):
    check_config_file(tmp_path_factory.mktemp("cfg_bytes"), data)


@settings(max_examples=200, **FAST)
@given(value=JSON)
def test_property_config_json_values(tmp_path_factory, value):
    check_config_file(tmp_path_factory.mktemp("cfg_json"), json.dumps(value).encode())


@st.composite
def tiny_config_variants(draw):
    """The tiny config with some fields (top-level or in linear_attn_config) replaced, removed or added."""
    d = json.loads(json.dumps(TINY_DICT))
    for key in draw(st.lists(st.sampled_from(sorted(TINY_DICT) + ["num_shared_experts", "extra"]), max_size=3)):
        if draw(st.integers(0, 9)) == 0:
            d.pop(key, None)
        else:
            d[key] = draw(FIELD_VALUES)
    lac = d.get("linear_attn_config")
    if isinstance(lac, dict):
        for key in draw(st.lists(st.sampled_from(LAC_KEYS), max_size=2)):
            lac[key] = draw(FIELD_VALUES)
    return d


@settings(max_examples=300, **FAST)
@given(d=tiny_config_variants())
def test_property_tiny_config_with_fields_replaced(tiny_ckpt, tmp_path_factory, d):
    folder = _copy(tiny_ckpt, tmp_path_factory.mktemp("variant") / "ckpt")
    cfg = check_config_file(folder, json.dumps(d).encode(), with_checkpoint=True)
    if cfg is not None:  # a config that passes holds itself to the bounds
        params, tensors = cfg.checkpoint_size()
        assert params <= MAX_PARAMS and tensors <= MAX_TENSORS


@settings(max_examples=100, **FAST)
@given(value=JSON | st.builds(lambda wm: {"weight_map": wm}, st.dictionaries(st.text(max_size=30),
                                                                            JSON | st.text(max_size=30), max_size=5)))
def test_property_index(tiny_ckpt, tmp_path_factory, value):
    folder = _copy(tiny_ckpt, tmp_path_factory.mktemp("index") / "ckpt")
    (folder / INDEX_FILE).write_text(json.dumps(value))
    assert_contract([INDEX_FILE, folder], check_checkpoint, folder)


def check_tokenizer_file(folder: Path, data: bytes, texts=PROMPTS):
    """The contract for one tiktoken.model's bytes: building the tokenizer, then encoding each text; the ids
    when it works."""
    file = folder / TOKENIZER_FILE
    file.write_bytes(data)
    tok = assert_contract(file.name, KimiTokenizer, folder, TINY.vocab_size, TINY.bos_token_id)
    if tok is None:
        return None
    out = []
    for text in texts:
        ids = assert_contract(file.name, tok.encode, text)
        if ids is None:
            return None
        assert ids[0] == TINY.bos_token_id and all(0 <= i < TINY.bos_token_id for i in ids[1:])
        out.append(ids)
    return out


@st.composite
def bpe_files(draw):
    """Line-structured tiktoken files: mostly the 256 single bytes (maybe reordered, maybe some missing), then
    merged tokens with fresh ranks or ranks that may repeat, leave gaps or pass the vocabulary, sometimes an empty
    token or a junk line."""
    lines = []
    if draw(st.integers(0, 4)) > 0:
        order = draw(st.permutations(range(256))) if draw(st.booleans()) else list(range(256))
        drop = draw(st.sets(st.integers(0, 255), max_size=2)) if draw(st.integers(0, 3)) == 0 else set()
        lines += [f"{base64.b64encode(bytes([b])).decode()} {r}" for r, b in enumerate(order) if b not in drop]
    merges = draw(st.lists(st.binary(min_size=2, max_size=5), unique=True, max_size=25))
    for i, tok in enumerate(merges):
        how = draw(st.sampled_from(["fresh rank"] * 12 + ["any rank", "empty token"]))
        rank = draw(st.integers(0, 520)) if how == "any rank" else 256 + i
        lines.append(f"{base64.b64encode(b'' if how == 'empty token' else tok).decode()} {rank}")
    if draw(st.sampled_from([False] * 5 + [True])):
        junk = draw(st.text(alphabet="ABCDQWYZabcxyz0123456789+/= \t-_", max_size=16))
        lines.insert(draw(st.integers(0, len(lines))), junk)
    return ("\n".join(lines) + draw(st.sampled_from(["", "\n", "\r\n", "\n\n"]))).encode()


@settings(max_examples=150, **FAST)
@given(data=st.binary(max_size=300))
def test_property_tokenizer_bytes(tmp_path_factory, data):
    check_tokenizer_file(tmp_path_factory.mktemp("tok_bytes"), data)


@settings(max_examples=300, **FAST)
@given(data=bpe_files(), text=st.text(min_size=1, max_size=40))
def test_property_tokenizer_lines(tmp_path_factory, data, text):
    check_tokenizer_file(tmp_path_factory.mktemp("tok_lines"), data, PROMPTS + (text,))


# ---- negative controls: the property checks would catch a regression ------------------------------------------

def _naive_parse_json(file, data, error):
    """json.loads on the decoded bytes: no handling of bad UTF-8, deep nesting or long integer literals."""
    return json.loads(data.decode())


@pytest.mark.parametrize("data", [b"[" * 100_000, b'{"model_type": "\xff"}', b'{"a": ' + b"9" * 5000 + b"}"])
def test_config_property_catches_a_loader_that_lets_errors_escape(tmp_path, monkeypatch, data):
    check_config_file(tmp_path, data)  # holds as the code is
    monkeypatch.setattr(config_module, "parse_json", _naive_parse_json)
    with pytest.raises(AssertionError, match="RecursionError|UnicodeDecodeError|ValueError"):
        check_config_file(tmp_path, data)


def test_config_property_catches_a_bare_key_error(tmp_path, monkeypatch):
    data = json.dumps(TINY_DICT).encode()
    assert check_config_file(tmp_path, data) == TINY
    monkeypatch.setattr(KimiConfig, "from_dict", classmethod(_raiser(KeyError("vocab_size"))))
    with pytest.raises(AssertionError, match="KeyError"):
        check_config_file(tmp_path, data)


def test_config_property_catches_a_missing_product_bound(tmp_path, monkeypatch):
    """With the bound on the product of sizes gone, a config of 800 million tiny expert tensors passes every
    per-field limit and the checkpoint check exhausts its memory budget building the tensor list."""
    d = TINY_DICT | {"num_hidden_layers": 4096, "num_experts": 1 << 16, "hidden_size": 1, "moe_intermediate_size": 1,
                     "linear_attn_config": TINY_DICT["linear_attn_config"] | {"kda_layers": list(range(1, 4097)),
                                                                             "full_attn_layers": []}}
    folder = tmp_path / "ckpt"
    folder.mkdir()
    check_config_file(folder, json.dumps(d).encode(), with_checkpoint=True)
    monkeypatch.setattr(config_module, "MAX_TENSORS", 10**12)
    monkeypatch.setattr(config_module, "MAX_PARAMS", 10**20)
    with pytest.raises(AssertionError, match="MemoryError|still running|ran past"):
        assert_contract([folder / "config.json", folder], check_checkpoint, folder, seconds=20, memory=256 << 20)


def test_tokenizer_property_catches_an_escaping_panic(tmp_path, monkeypatch):
    """Without the up-front rank checks and the catch, the library's own panic (a BaseException) escapes."""
    dup_rank = _bpe({**BYTE_RANKS, b"ab": 5}).encode()
    no_e = _bpe({t: r for t, r in BYTE_RANKS.items() if t != b"e"}).encode()
    assert check_tokenizer_file(tmp_path, dup_rank) is None and check_tokenizer_file(tmp_path, no_e) is None
    monkeypatch.setattr(tokenizer_module, "read_ranks", _unchecked_ranks)
    monkeypatch.setattr(tokenizer_module, "_PASS_THROUGH", (BaseException,))  # the catch removed
    for data in (dup_rank, no_e):
        with pytest.raises(AssertionError, match="PanicException"):
            check_tokenizer_file(tmp_path, data)


def _unchecked_ranks(path, data, vocab_size):
    """tiktoken's own parse (load_tiktoken_bpe) without its cache: what the library gets with no checks."""
    return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in data.splitlines() if line)}


# ---- the backstop: a panic the up-front checks missed still ends in a TokenizerError --------------------------

@pytest.mark.parametrize("ranks, stage", [({**BYTE_RANKS, b"ab": 5}, "build an encoding"),  # a rank twice
                                          ({t: r for t, r in BYTE_RANKS.items() if t != b"e"}, "encode")])  # no 'e'
def test_tokenizer_backstop_turns_a_real_panic_into_a_named_error(tmp_path, monkeypatch, ranks, stage):
    monkeypatch.setattr(tokenizer_module, "read_ranks", _unchecked_ranks)
    (tmp_path / TOKENIZER_FILE).write_text(_bpe(ranks))
    with pytest.raises(TokenizerError, match=rf"{TOKENIZER_FILE}: the tiktoken library failed to {stage}.*"
                                             rf"PanicException") as e:
        battery(TINY, tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3)])
def test_tokenizer_backstop_lets_an_interrupt_through(tmp_path, exc):
    (tmp_path / TOKENIZER_FILE).write_text(_bpe(BYTE_RANKS))
    tok = KimiTokenizer(tmp_path, TINY.vocab_size, TINY.bos_token_id)

    class Interrupting:
        def encode_ordinary(self, text):
            raise exc
    tok.encoding = Interrupting()
    with pytest.raises(type(exc)):
        tok.encode("hello")


# ---- regression tests, one per class of hostile input ----------------------------------------------------------

def _write_config(folder: Path, d) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d))
    return folder / "config.json"


def _lac(**kw) -> dict:
    return TINY_DICT | {"linear_attn_config": TINY_DICT["linear_attn_config"] | kw}


def test_checkpoint_size_counts_what_layout_lists():
    for cfg in PRESETS.values():
        assert cfg.checkpoint_size() == (param_counts(cfg).total, len(original_names(cfg)))
    assert PRESETS["48b-a3b"].checkpoint_size() == (49_122_681_728, 20_493)
    for kw in (dict(num_shared_experts=0), dict(first_k_dense_replace=0), dict(first_k_dense_replace=4),
               dict(kda_layers=(1, 2, 3, 4), full_attn_layers=()), dict(kda_layers=(), full_attn_layers=(1, 2, 3, 4))):
        cfg = TINY.replace(**kw)
        assert cfg.checkpoint_size() == (param_counts(cfg).total, len(original_names(cfg)))


@pytest.mark.parametrize("fields, message", [
    # every size under its own limit; their product 6.5e17 parameters
    (dict(hidden_size=1 << 20, intermediate_size=1 << 20, vocab_size=1 << 24, num_experts=1 << 16,
          moe_intermediate_size=1 << 20), r"config sizes imply 6\.49e\+17 parameters, past any plausible model "
                                          r"\(limit 2e\+11; .*the largest part is routed experts"),
    (dict(vocab_size=1 << 24, hidden_size=1 << 16),
     r"config sizes imply 2\.2e\+12 parameters.* the largest part is embed_tokens"),
    # few parameters, but 4,096 MoE layers x 65,536 experts x 3 tensors: a name table of 800 million entries
    (dict(num_hidden_layers=4096, num_experts=1 << 16, hidden_size=1, moe_intermediate_size=1, first_k_dense_replace=0,
          linear_attn_config=TINY_DICT["linear_attn_config"] | {"kda_layers": list(range(1, 4097)),
                                                                 "full_attn_layers": []}),
     r"config sizes imply 805,396,483 tensors .*past any plausible model \(limit 262,144"),
])
def test_absurd_product_of_sizes_is_refused_before_anything_is_built(tmp_path, fields, message):
    file = _write_config(tmp_path / "ckpt", TINY_DICT | fields)
    t0 = time.perf_counter()
    refused(ConfigError, rf"{re.escape(str(file))}: {message}", file, check_checkpoint, tmp_path / "ckpt",
            seconds=20, memory=256 << 20)
    refused(ConfigError, message, file, KimiConfig.from_json, file)
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("kind", ["config", "index", "tokenizer"])
def test_oversize_file_is_refused_before_it_is_read(tiny_ckpt, tmp_path, kind):
    folder = _copy(tiny_ckpt, tmp_path / "ckpt")
    if kind == "config":  # a valid config padded past 1 MiB: accepted when read whole
        file = folder / "config.json"
        file.write_text(json.dumps(TINY_DICT) + " " * MAX_CONFIG_BYTES)
        refused(ConfigError, rf"{re.escape(str(file))} is 1,0\d\d,\d\d\d bytes, past the 1,048,576-byte limit for a "
                             r"config\.json", file, check_checkpoint, folder)
        return
    file = folder / (INDEX_FILE if kind == "index" else TOKENIZER_FILE)
    with open(file, "wb") as f:  # sparse: no disk or time spent; read whole, it would be 64 MiB of NULs
        f.truncate((MAX_INDEX_BYTES if kind == "index" else MAX_TOKENIZER_BYTES) + 1)
    refused(CheckpointError if kind == "index" else TokenizerError,
            rf"{re.escape(str(file))} is 67,108,865 bytes, past the 67,108,864-byte limit for a {re.escape(file.name)}",
            file, check_checkpoint if kind == "index" else battery, *([folder] if kind == "index" else [TINY, folder]),
            memory=32 << 20)  # refused by its size, not after reading it


@pytest.mark.parametrize("key, value", [("kda_layers", [True, 2, 4]), ("full_attn_layers", [False]),
                                        ("kda_layers", [1.0, 2, 4]), ("kda_layers", [None, 2, 4])])
def test_layer_ids_must_be_integers_not_bools(tmp_path, key, value):
    file = _write_config(tmp_path, _lac(**{key: value}))
    refused(ConfigError, rf"{re.escape(str(file))}: linear_attn_config\.{key} must be a list of integers \(1-based "
                         r"layer numbers\), got \[", file, KimiConfig.from_json, file)
    with pytest.raises(ConfigError, match=r"linear_attn_config\.kda_layers holds \[true\]"):
        TINY.replace(kda_layers=(True, 2, 4))  # a config built in code is held to the same rule


@pytest.mark.parametrize("data, message", [
    (b'{"model_type": "kimi_linear\xff"}', r"is not UTF-8 text: byte 0xff at offset 27"),
    (json.dumps(TINY_DICT).encode("utf-16"), r"is not UTF-8 text: byte 0xff at offset 0"),
    (b"[" * 100_000, r"nests JSON arrays or objects too deeply to parse"),
    (b'{"a": ' * 100_000, r"nests JSON arrays or objects too deeply to parse"),
    (b'{"vocab_size": ' + b"9" * 5000 + b"}", r"is not valid JSON: an integer literal of 5,000 digits"),
    (json.dumps(TINY_DICT | {"unread": float("nan")}).encode(), r"is not valid JSON: NaN is not a JSON number"),
    (json.dumps(TINY_DICT | {"unread": [float("-inf")]}).encode(), r"is not valid JSON: -Infinity is not a JSON"),
    (json.dumps(TINY_DICT).replace('"vocab_size": 512', '"vocab_size": 512, "vocab_size": 1024').encode(),
     r'is not valid JSON: key "vocab_size" appears twice in one object'),
    (b"[]", r"config\.json must hold a JSON object, got list"),
])
def test_undecodable_config_names_the_file(tmp_path, data, message):
    file = tmp_path / "config.json"
    file.write_bytes(data)
    refused(ConfigError, rf"{re.escape(str(file))}:? {message}", file, KimiConfig.from_json, tmp_path)


@pytest.mark.parametrize("data, message", [
    (b'{"weight_map": {"model.norm.weight": "a\xff"}}', r"is not UTF-8 text: byte 0xff"),
    (b"[" * 100_000, r"nests JSON arrays or objects too deeply"),
    (b'{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}',
     r'is not valid JSON: key "a" appears twice in one object'),
    (b"[1]", r"must hold a JSON object with a weight_map, got list"),
])
def test_undecodable_index_names_the_file(tiny_ckpt, tmp_path, data, message):
    folder = _copy(tiny_ckpt, tmp_path / "ckpt")
    (folder / INDEX_FILE).write_bytes(data)
    refused(CheckpointError, rf"{re.escape(str(folder / INDEX_FILE))}:? {message}", INDEX_FILE,
            check_checkpoint, folder)


@pytest.mark.parametrize("fields, message", [
    (dict(rms_norm_eps=10**400), r"config\.rms_norm_eps must be a finite number, got <an integer of ~401 digits>"),
    (dict(routed_scaling_factor=-10**400), r"config\.routed_scaling_factor must be a finite number"),
    (dict(hidden_size=10**400), r"config\.hidden_size = <an integer of ~401 digits> is past any plausible model"),
    (dict(qk_rope_head_dim=10**12),
     r"config\.qk_rope_head_dim must be an integer in 0\.\.1,048,576, got 1000000000000"),
    (dict(model_max_length=-5), r"config\.model_max_length must be an integer in 1\.\.2\^40, got -5"),
    (dict(num_expert_group=0), r"only num_expert_group = topk_group = 1 .* got 0/1"),  # not read as 1
    (dict(model_type="x" * 10**5), r"model_type is \"x{10,}\.\.\."),  # a long value is cut in the message
    (dict(moe_router_activation_func=[[[[["relu"]]]]]), r"moe_router_activation_func \[\[\[\[\.\.\.\]\]\]\] is not"),
])
def test_out_of_range_fields_name_file_and_field(tmp_path, fields, message):
    file = _write_config(tmp_path, TINY_DICT | fields)
    refused(ConfigError, rf"{re.escape(str(file))}: .*{message}", file, KimiConfig.from_json, file)
    with pytest.raises(ConfigError) as e:
        KimiConfig.from_json(file)
    assert len(str(e.value)) < 400


def test_messages_stay_short_for_huge_values(tmp_path):
    file = _write_config(tmp_path, _lac(kda_layers=list(range(100_000))))
    with pytest.raises(ConfigError, match=rf"{re.escape(str(file))}: linear_attn_config\.kda_layers holds \[0, 5, 6, "
                                          r"7, 8, 9, 10, 11, \.\.\.\]") as e:
        KimiConfig.from_json(file)
    assert len(str(e.value)) < 300


def _link_out(folder: Path, name: str, elsewhere: Path) -> Path:
    """Move folder/name to `elsewhere` and leave a symbolic link to it in its place."""
    shutil.move(folder / name, elsewhere)
    os.symlink(elsewhere, folder / name)
    return folder / name


@pytest.mark.parametrize("name", ["config.json", INDEX_FILE, "model-00001-of-00007.safetensors", TOKENIZER_FILE])
def test_a_link_out_of_the_checkpoint_directory_is_refused(tiny_ckpt, tmp_path, name):
    folder = _copy(tiny_ckpt, tmp_path / "ckpt")
    (folder / TOKENIZER_FILE).write_text(_bpe(BYTE_RANKS))
    assert (folder / "model-00001-of-00007.safetensors").is_file()
    link = _link_out(folder, name, tmp_path / "elsewhere")
    error = TokenizerError if name == TOKENIZER_FILE else ConfigError if name == "config.json" else CheckpointError
    pattern = (rf"{re.escape(str(link))} is a symbolic link to {re.escape(str(tmp_path / 'elsewhere'))}, outside "
               rf"{re.escape(str(folder))}: a file of the checkpoint must lie inside its directory")
    if name == TOKENIZER_FILE:
        refused(error, pattern, name, battery, TINY, folder)
    else:
        refused(error, pattern, name, check_checkpoint, folder)


def test_a_link_inside_the_checkpoint_directory_is_followed(tiny_ckpt, tmp_path):
    folder = _copy(tiny_ckpt, tmp_path / "ckpt")
    (folder / "sub").mkdir()
    for name in ("config.json", INDEX_FILE, "model-00001-of-00007.safetensors"):
        shutil.move(folder / name, folder / "sub" / name)
        os.symlink(Path("sub") / name, folder / name)
    (folder / "sub" / "bpe").write_text(_bpe(BYTE_RANKS))
    os.symlink("sub/bpe", folder / TOKENIZER_FILE)
    assert check_checkpoint(folder) == TINY
    assert battery(TINY, folder).source == f"tiktoken:{folder / TOKENIZER_FILE}"
    os.symlink(folder, tmp_path / "alias")  # the folder given may itself be a link
    assert check_checkpoint(tmp_path / "alias") == TINY and battery(TINY, tmp_path / "alias").ids


@pytest.mark.parametrize("make, message", [
    (lambda p: os.symlink(p.parent / "nothing", p), r"is a dangling symbolic link \(to .*/nothing, which does not "
                                                    r"resolve to a file\): expected a regular file"),
    (lambda p: os.symlink(p.name, p), r"is a dangling symbolic link"),  # a link to itself
    (lambda p: p.mkdir(), r"is a directory: expected a regular file"),
    (lambda p: os.mkfifo(p), r"is a fifo: expected a regular file"),  # never opened: no hang
    (lambda p: (os.mkfifo(p.parent / "pipe"), os.symlink("pipe", p)), r"is a symbolic link to .*/pipe, a fifo"),
])
def test_a_tokenizer_file_that_is_no_regular_file_is_refused_not_passed_over(tmp_path, make, message):
    make(tmp_path / TOKENIZER_FILE)
    refused(TokenizerError, rf"{re.escape(str(tmp_path / TOKENIZER_FILE))} {message}", TOKENIZER_FILE,
            battery, TINY, tmp_path, seconds=5)
    assert battery(TINY, tmp_path / "absent").source == "synthetic-bytes"  # no tiktoken.model at all: synthetic


@pytest.mark.parametrize("name", ["config.json", INDEX_FILE, "model-00003-of-00007.safetensors"])
def test_a_checkpoint_file_that_is_a_fifo_is_refused_without_blocking(tiny_ckpt, tmp_path, name):
    folder = _copy(tiny_ckpt, tmp_path / "ckpt")
    (folder / name).unlink()
    os.mkfifo(folder / name)
    refused(ConfigError if name == "config.json" else CheckpointError,
            rf"{re.escape(str(folder / name))} is a fifo: expected a regular file", name, check_checkpoint, folder,
            seconds=5)


@pytest.mark.parametrize("text, message", [
    (_bpe({**BYTE_RANKS, b"ab": 5}), r"line 257 b'YWI= 5': rank 5 repeats the one of line 6; expected each rank once"),
    (_bpe({t: r for t, r in BYTE_RANKS.items() if t != b"e"}), r"lacks the single-byte token of 1 byte values: 0x65"),
    (_bpe({t: r for t, r in BYTE_RANKS.items() if t[0] >= 128}), r"lacks the single-byte token of 128 byte values: "
                                                                 r"0x00, 0x01, .* \(and 120 more\)"),
    (_bpe(BYTE_RANKS) + "YQ== 300\n", r"line 257 b'YQ== 300': the token repeats the one of line 98"),
])
def test_tokenizer_ranks_the_library_would_panic_on_are_refused_up_front(tmp_path, text, message):
    (tmp_path / TOKENIZER_FILE).write_text(text)
    refused(TokenizerError, rf"{re.escape(str(tmp_path / TOKENIZER_FILE))}.* {message}", TOKENIZER_FILE,
            battery, TINY, tmp_path)


@pytest.mark.parametrize("text, message", [
    ("YQ== -1\n", r"line 1 b'YQ== -1': expected a base64 token, a space and a decimal rank"),
    ("YQ== 1_0\n", r"expected a base64 token, a space and a decimal rank"),
    ("YQ== 99999999999999\n", r"expected a base64 token, a space and a decimal rank"),
    ("Y!Q== 1\n", r"the token is not base64"),
    ("YQ== 512\n", r"has token rank 512, outside the model's vocabulary 0\.\.511 \(line 1\)"),
    ("\n\n", r"holds no tokens"),
])
def test_malformed_tokenizer_lines_name_file_and_line(tmp_path, text, message):
    (tmp_path / TOKENIZER_FILE).write_text(text)
    refused(TokenizerError, rf"{re.escape(str(tmp_path / TOKENIZER_FILE))}.* {message}", TOKENIZER_FILE,
            KimiTokenizer, tmp_path, TINY.vocab_size, TINY.bos_token_id)


def test_a_tokenizer_file_changed_in_place_is_read_again(tmp_path):
    """tiktoken's own loader caches a local file under its path: the second tokenizer would get the first ranks."""
    (tmp_path / TOKENIZER_FILE).write_text(_bpe(BYTE_RANKS))
    assert KimiTokenizer(tmp_path, TINY.vocab_size, TINY.bos_token_id).encode("ab")[1:] == [97, 98]
    (tmp_path / TOKENIZER_FILE).write_text(_bpe({**BYTE_RANKS, b"ab": 256}))
    assert KimiTokenizer(tmp_path, TINY.vocab_size, TINY.bos_token_id).encode("ab")[1:] == [256]


@pytest.mark.parametrize("shard", ["../x.safetensors", "sub/x.safetensors", "..", "a\0b", ""])
def test_shard_names_that_leave_the_directory_are_refused(tiny_ckpt, tmp_path, shard):
    folder = _copy(tiny_ckpt, tmp_path / "ckpt")
    index = json.loads((folder / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = shard
    (folder / INDEX_FILE).write_text(json.dumps(index))
    refused(CheckpointError, rf"{re.escape(str(folder / INDEX_FILE))} names shards outside the checkpoint directory",
            INDEX_FILE, check_checkpoint, folder)


@pytest.mark.parametrize("field,value", [("hidden_act", "relu"), ("mla_use_nope", False), ("hidden_act", None)])
def test_a_config_field_the_model_cannot_honour_is_refused(field, value):
    """A field the model does not read must say what it implements: `hidden_act: relu` passed Gate A (the model
    ran SiLU) and then failed Gate B against HF, which honoured it, blaming the implementation."""
    d = get_config("tiny").to_dict()
    d[field] = value
    with pytest.raises(ConfigError, match=f"config.{field} is .*; this model implements only"):
        KimiConfig.from_dict(d)
