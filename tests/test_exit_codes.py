"""The gates' exit-code contract (docs/EXIT_CODES.md) under hostile input: 0 the gate holds, 1 it fails on valid
inputs, 2 it could not judge. Malformed goldens, out-of-range numbers, unwritable records and crashes of any kind
end in 2 with one line naming what was wrong, before any expensive work where the input allows it."""
import copy
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gates.__main__ as cli
from gates import golden as golden_mod
from gates.compare import GateResult, compare_prompt, near_tie_eps
from gates.gate_b import run_gate_b
from gates.golden import GOLDEN_DIR, GoldenError, expected_generations, ids_md5, load_golden
from gates.run import DTYPES, EXIT_PASS, EXIT_REFUSED, MAX_NEW_TOKENS, resolve
from model.generate import Generation
from records import store

COMMITTED = GOLDEN_DIR / "tiny-fp64-cpu-hf.json"
GOLDEN = json.loads(COMMITTED.read_text())


def write(path: Path, value) -> Path:
    path.write_text(json.dumps(value))
    return path


def no_model(monkeypatch):
    """Make loading the model fail loudly: the checks under test must refuse before it."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded: the input should have been refused first")
    for mod in ("gates.gate_a", "gates.gate_b", "gates.gate_memory", "gates.__main__"):
        monkeypatch.setattr(f"{mod}.load_subject", refuse, raising=False)


# ---- goldens ---------------------------------------------------------------------------------------------------

def mutated(path, value):
    """The committed golden with the field at `path` (a tuple of keys and indices) set to `value`."""
    g = copy.deepcopy(GOLDEN)
    *head, last = path
    node = g
    for k in head:
        node = node[k]
    node[last] = value
    return g


# Each a malformed golden of a kind seen to pass as valid or to crash only after the generation, and the words
# its refusal must hold.
BAD_GOLDENS = [
    (("prompts", 0, "expected", 0), str(GOLDEN["prompts"][0]["expected"][0]), r"prompts\[0\]\.expected\[0\] must be a token id"),
    (("prompts", 2, "expected", 3), True, r"prompts\[2\]\.expected\[3\] must be a token id"),
    (("prompts", 1, "ids", 0), 1.0 * GOLDEN["prompts"][1]["ids"][0], r"prompts\[1\]\.ids\[0\] must be a token id"),
    (("new_tokens",), "16", "new_tokens must be an integer in 1..1024"),
    (("new_tokens",), 10 ** 12, "new_tokens must be an integer in 1..1024"),
    (("dtype",), "fp8", "dtype must be one of fp32, bf16, fp64"),
    (("dtype",), ["fp32"], "dtype must be one of"),
    (("device",), None, "device must be one of cpu, cuda"),
    (("provenance",), [], "provenance must be a JSON object"),
    (("provenance", "implementation"), 5, "provenance.implementation must be a non-empty string"),
    (("provenance", "weights"), "sha256:0000", "provenance.weights must be the golden's weights"),
    (("md5",), 7, "md5 must be 32 lowercase hex digits"),
    (("prompts",), [], "prompts must be a list of 1..1024 prompts"),
    (("prompts",), {"0": {}}, "prompts must be a list"),
    (("prompts", 3, "topk_logprobs", 0, 1), float("nan"), r"NaN is not a JSON number"),
    (("prompts", 3, "topk_logprobs", 0, 2), 1e400, r"Infinity is not a JSON number"),
    (("prompts", 3, "topk_logprobs", 0, 3), "x", r"prompts\[3\] step 0 topk_logprobs must be 10 finite"),
    (("prompts", 3, "topk_logprobs", 0, 1), 0.5, r"prompts\[3\] step 0 topk_logprobs must be in descending order"),
    (("prompts", 4, "topk_ids", 5), [], r"prompts\[4\] step 5 topk_ids must be a list of 5..1024 token ids"),
    (("prompts", 4, "topk_ids", 6), [1], r"prompts\[4\] step 6 topk_ids must be a list of 5..1024 token ids"),
    (("prompts", 5, "topk_ids"), "x", r"prompts\[5\]\.topk_ids must be a list"),
    (("weights",), {"id": 1}, "weights must be a weights id string"),
]


@pytest.mark.parametrize("path,value,match", BAD_GOLDENS, ids=[".".join(map(str, p)) for p, _, _ in BAD_GOLDENS])
def test_a_malformed_golden_is_refused_naming_its_field(tmp_path, path, value, match):
    f = write(tmp_path / "g.json", mutated(path, value))
    with pytest.raises(GoldenError, match=match) as e:
        load_golden(f)
    assert str(f) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("content,match", [
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "too deeply"),
    (b'{"format": 1', "not valid JSON"),
    (b"[1, 2]", "the top level must be a JSON object"),
    (b'{"md5": "x", "md5": "y"}', "appears twice"),
    (b'{"a": NaN}', "not a JSON number"),
    (b'{"a": ' + b"9" * 5000 + b"}", "digits"),
])
def test_a_golden_file_that_is_not_a_golden_is_refused(tmp_path, content, match):
    f = tmp_path / "g.json"
    f.write_bytes(content)
    with pytest.raises(GoldenError, match=match):
        load_golden(f)


def test_an_oversized_golden_is_refused_unread(tmp_path):
    f = tmp_path / "g.json"
    with open(f, "wb") as out:
        out.truncate(golden_mod.MAX_GOLDEN_BYTES + 1)      # sparse: no 64 MiB written
    with pytest.raises(GoldenError, match="past the .*-byte limit"):
        load_golden(f)


def test_string_ids_no_longer_make_gate_b_print_fail_and_exit_0(tmp_path, monkeypatch):
    """Ids stored as strings (expected and top-k alike) gave the same md5 as the ints but compared unequal token by
    token: the gate printed FAIL 0/128, said the md5s were equal, exited 0 and wrote a VALID passing record. The
    golden is refused before loading, naming the field."""
    g = copy.deepcopy(GOLDEN)
    for p in g["prompts"]:
        p["expected"] = [str(t) for t in p["expected"]]
        p["topk_ids"] = [[str(t) for t in step] for step in p["topk_ids"]]
    f = write(tmp_path / "g.json", g)
    no_model(monkeypatch)
    opts = resolve(preset="tiny", device="cpu", dtype="fp32", golden=str(f))
    said = []
    assert run_gate_b(opts, records_root=tmp_path, log=said.append) == EXIT_REFUSED
    (rec,) = store.load("gate_b", root=tmp_path).records
    assert rec["verdict"] == "INVALID" and rec["results"]["passed"] is False
    assert "must be a token id" in rec["results"]["refused"] and "REFUSED" in said[-1]


def gate_b_reading(g: dict) -> None:
    """What Gate B does with an accepted golden once the generation is over, with a model that generated exactly
    the golden's ids: the md5 and the token comparison must both say the run matches."""
    eps = near_tie_eps(DTYPES[g["dtype"]])
    name = f"golden[{g['provenance']['implementation']} {g['dtype']} {g['device']}]"
    ref = expected_generations(g)
    ours = [Generation(r.prompt, [int(t) for t in r.tokens], [[int(t) for t in top] for top in r.topk_ids],
                       r.topk_logprobs) for r in ref]
    result = GateResult("Gate B", name, "incremental", [compare_prompt(i, a, b, eps, name, "incremental")
                                                        for i, (a, b) in enumerate(zip(ref, ours))])
    md5_equal = ids_md5([x.tokens for x in ours]) == g["md5"]
    assert md5_equal and result.passed, f"accepted golden: md5 equal {md5_equal}, tokens {result.score}/{result.total}"


def golden_contract(value, path="g.json") -> str:
    """The contract of golden loading: a GoldenError naming the file, or a golden Gate B reads consistently.
    Any other exception, or an accepted golden that misleads the gate, is an AssertionError."""
    try:
        g = golden_mod.validate_golden(copy.deepcopy(value), path)
    except GoldenError as e:
        assert str(path) in str(e), f"the error does not name the file: {e}"
        return "refused"
    except Exception as e:      # noqa: BLE001 -- any other exception breaks the contract
        raise AssertionError(f"validate_golden raised {type(e).__name__}: {e}") from e
    try:
        gate_b_reading(g)
    except AssertionError:
        raise
    except Exception as e:      # noqa: BLE001
        raise AssertionError(f"an accepted golden crashed the gate's reading: {type(e).__name__}: {e}") from e
    return "accepted"


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node[:3]):    # a few elements of each list reach every kind of field
            yield from _paths(v, prefix + (i,))


GOLDEN_PATHS = [p for p in _paths(GOLDEN) if p]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2 ** 70, max_value=2 ** 70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(GOLDEN_PATHS), value=json_values | st.integers(0, 200_000))
def test_property_any_json_value_in_any_golden_field_keeps_the_contract(path, value):
    golden_contract(mutated(path, value))


@settings(max_examples=150, deadline=None)
@given(value=json_values)
def test_property_any_json_value_as_a_golden_keeps_the_contract(value):
    assert golden_contract(value) == "refused"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200))
def test_property_any_bytes_as_a_golden_file_give_a_golden_error(tmp_path, data):
    f = tmp_path / "g.json"
    f.write_bytes(data)
    with pytest.raises(GoldenError, match=r"g\.json"):
        load_golden(f)


def test_the_golden_property_catches_a_validator_that_lets_strings_through(monkeypatch):
    """Negative control: with no type checks (the validator accepting whatever parses), the contract check fails
    on the string-id golden (the md5 says equal, the tokens say otherwise), as the gate did before."""
    string_ids = mutated(("prompts", 0, "expected", 0), str(GOLDEN["prompts"][0]["expected"][0]))
    string_ids["prompts"][0]["topk_ids"][0][0] = str(GOLDEN["prompts"][0]["topk_ids"][0][0])
    assert golden_contract(string_ids) == "refused"
    monkeypatch.setattr(golden_mod, "validate_golden", lambda g, path: g)
    with pytest.raises(AssertionError, match="md5 equal True, tokens 127/128"):
        golden_contract(string_ids)


def test_the_golden_property_catches_an_exception_that_is_not_a_golden_error(monkeypatch):
    """Negative control: a validator that lets a TypeError out breaks the contract."""
    def crash(g, path):
        raise TypeError("unhashable type: 'list'")
    monkeypatch.setattr(golden_mod, "validate_golden", crash)
    with pytest.raises(AssertionError, match="raised TypeError"):
        golden_contract(GOLDEN)


# ---- the command line ------------------------------------------------------------------------------------------

def run_cli(argv, monkeypatch, capsys, records):
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(records))
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv,match", [
    (["gate-a", "--floor-gib", "inf"], r"--floor-gib must be a number of GiB in 0\.\.1024"),
    (["gate-memory", "--floor-gib", "1e300"], r"--floor-gib must be a number of GiB in 0\.\.1024"),
    (["gate-b", "--floor-gib", "nan"], r"--floor-gib must be"),
    (["gate-a", "--new-tokens", str(MAX_NEW_TOKENS + 1)], r"--new-tokens must be an integer in 1\.\.1024"),
    (["golden", "--new-tokens", "0"], r"--new-tokens must be an integer in 1\.\.1024"),
    (["gate-a", "--seed", "-1"], r"--seed must be an integer in 0\.\.2\^63-1"),
    (["gate-b", "--seed", str(2 ** 64)], r"--seed must be an integer"),
])
def test_out_of_range_numbers_are_refused_with_their_bound(tmp_path, monkeypatch, capsys, argv, match):
    no_model(monkeypatch)
    code, out, err = run_cli([*argv, "--device", "cpu"], monkeypatch, capsys, tmp_path)
    assert code == EXIT_REFUSED
    assert len(err.strip().splitlines()) == 1 and re.search(match, err), err
    assert "Traceback" not in err and not list(tmp_path.iterdir())


def test_a_gate_b_golden_of_the_wrong_types_exits_2_before_loading(tmp_path, monkeypatch, capsys):
    f = write(tmp_path / "g.json", mutated(("prompts", 0, "topk_ids", 0, 0), "7"))
    no_model(monkeypatch)
    code, out, err = run_cli(["gate-b", "--device", "cpu", "--golden", str(f)], monkeypatch, capsys, tmp_path)
    assert code == EXIT_REFUSED and "REFUSED" in err and "topk_ids must be a list of 5..1024 token ids" in err
    assert len(err.strip().splitlines()) == 1 and "PASS" not in out + err and "FAIL" not in out + err


def unwritable_records(tmp_path) -> Path:
    """A records folder that cannot be made, even by root: its parent is a regular file."""
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "records"


@pytest.mark.parametrize("command", ["gate-a", "gate-b", "gate-memory"])
def test_an_unwritable_records_folder_is_refused_before_the_run(tmp_path, monkeypatch, capsys, command):
    no_model(monkeypatch)
    code, out, err = run_cli([command, "--device", "cpu"], monkeypatch, capsys, unwritable_records(tmp_path))
    assert code == EXIT_REFUSED, (out, err)
    assert "records" in err and "Traceback" not in err and out == ""


def test_a_passing_gate_whose_record_cannot_be_written_exits_2_with_no_verdict(tmp_path, monkeypatch, capsys):
    """The records file fails at the last write (a full disk): the gate held, but a run that is not recorded does
    not count, so it exits 2, prints no PASS and no traceback. It used to exit 1 (the code of a failed gate)."""
    def full(rec, root=None):
        raise store.RecordsUnwritable(f"{store.records_dir(root)}/{rec['kind']}.jsonl: No space left on device")
    monkeypatch.setattr(store, "append", full)
    code, out, err = run_cli(["gate-a", "--device", "cpu", "--new-tokens", "2"], monkeypatch, capsys, tmp_path)
    assert code == EXIT_REFUSED, (out, err)
    assert "No space left on device" in err and len(err.strip().splitlines()) == 1
    assert "PASS" not in out and "Traceback" not in err


class Panic(BaseException):
    """What a Rust library's panic raises through pyo3: not an Exception."""


def test_a_panic_that_is_not_an_exception_exits_2_and_is_recorded(tmp_path, monkeypatch, capsys):
    def panic(command, opts):
        raise Panic("called `Option::unwrap()` on a `None` value")
    monkeypatch.setattr(cli, "run_command", panic)
    code, out, err = run_cli(["gate-a", "--device", "cpu"], monkeypatch, capsys, tmp_path)
    assert code == EXIT_REFUSED and "Panic" in err
    (rec,) = store.load("gate_a", root=tmp_path).records
    assert rec["verdict"] == "INVALID" and "crashed: Panic" in rec["results"]["refused"]


def test_keyboard_interrupt_is_not_swallowed(tmp_path, monkeypatch, capsys):
    def interrupted(command, opts):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "run_command", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_cli(["gate-a", "--device", "cpu"], monkeypatch, capsys, tmp_path)


def test_the_golden_command_refuses_an_existing_or_unwritable_path_before_generating(tmp_path, monkeypatch, capsys):
    no_model(monkeypatch)
    monkeypatch.setattr(cli, "make_golden", lambda *a, **k: pytest.fail("generated before checking the path"))
    existing = write(tmp_path / "g.json", {})
    code, _, err = run_cli(["golden", "--device", "cpu", "--source", "self", "--golden", str(existing)], monkeypatch,
                           capsys, tmp_path)
    assert code == EXIT_REFUSED and "exists; delete it first" in err
    code, _, err = run_cli(["golden", "--device", "cpu", "--source", "self", "--golden",
                            str(unwritable_records(tmp_path) / "g.json")], monkeypatch, capsys, tmp_path)
    assert code == EXIT_REFUSED and "cannot write in" in err and "Traceback" not in err


@pytest.mark.parametrize("argv,match", [
    (["gate-a", "--model", ""], "--model must name a checkpoint directory"),
    (["gate-a", "--kernels", "triton"], "set TRITON_INTERPRET=1"),
    (["golden", "--source", "hf", "--dtype", "fp32", "--expert-dtype", "bf16", "--golden", "NEW"],
     "HF transformers holds the whole model in one dtype"),
    (["golden", "--source", "self", "--golden", "x" * 300 + ".json"], "File name too long"),
])
def test_bad_option_combinations_are_refused_before_loading(tmp_path, monkeypatch, capsys, argv, match):
    no_model(monkeypatch)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = [str(tmp_path / "new.json") if a == "NEW" else a for a in argv]
    code, out, err = run_cli([*argv, "--device", "cpu"], monkeypatch, capsys, tmp_path)
    assert code == EXIT_REFUSED and match in err and "Traceback" not in err, (out, err)


def test_an_hf_golden_refuses_a_checkpoint_link_out_of_the_folder(tmp_path, monkeypatch, capsys):
    """HF reads files our loader never opens (generation_config.json): a link out of the folder there could change
    what HF generates, so the golden command refuses it before HF loads anything."""
    import torch
    from model.checkpoint import save_checkpoint
    from model.config import get_config
    from model.weights import synthetic_weights
    cfg = get_config("tiny")
    ckpt = save_checkpoint(synthetic_weights(cfg, 0, "cpu", torch.bfloat16), cfg, tmp_path / "ckpt")
    (tmp_path / "outside.json").write_text('{"suppress_tokens": [1]}')
    (Path(ckpt) / "generation_config.json").symlink_to(tmp_path / "outside.json")
    monkeypatch.setattr(cli, "make_golden", lambda *a, **k: pytest.fail("HF ran on a folder with an outside link"))
    code, out, err = run_cli(["golden", "--device", "cpu", "--model", str(ckpt), "--golden", str(tmp_path / "g.json")],
                             monkeypatch, capsys, tmp_path)
    assert code == EXIT_REFUSED and "generation_config.json: a link out of the checkpoint folder" in err


def test_a_new_golden_that_gate_b_would_read_first_says_which_one_it_displaces(tmp_path, monkeypatch, capsys):
    goldens = tmp_path / "goldens"
    goldens.mkdir()
    monkeypatch.setattr(cli, "GOLDEN_DIR", goldens)
    argv = ["golden", "--preset", "tiny", "--device", "cpu", "--source", "self", "--new-tokens", "2"]
    code, out, _ = run_cli(argv, monkeypatch, capsys, tmp_path)   # nothing to displace: no note
    assert code == EXIT_PASS and (goldens / "tiny-fp32-cpu-self.json").is_file() and "note:" not in out
    (goldens / "tiny-fp32-cpu-self.json").rename(goldens / "tiny-fp64-cpu-hf.json")
    code, out, _ = run_cli(argv, monkeypatch, capsys, tmp_path)
    assert code == EXIT_PASS and "note: Gate B on tiny fp32 cpu now reads this golden in place of" in out
    assert "tiny-fp64-cpu-hf.json" in out
