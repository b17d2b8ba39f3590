"""What the gates' command line says, and when it writes a record: a checkpoint folder without its tokenizer, a
`--golden` that names no golden file or another model's, the paths the gates print, and the hint for a model without
a golden. Each runs `gates.__main__.main` in this process with the records in a temporary folder."""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import gates.__main__ as cli
from gates import golden as golden_mod
from gates.golden import GOLDEN_DIR, golden_name
from gates.run import EXIT_PASS, EXIT_REFUSED, Options, resolve
from records import store

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "checkpoints" / "kimi-linear-ref"
TINY_GOLDEN = GOLDEN_DIR / "tiny-fp64-cpu-hf.json"


def run_cli(argv, monkeypatch, capsys, records):
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(records))
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def no_model(monkeypatch):
    """Make loading the model fail loudly: the checks under test must refuse before it."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded: the input should have been refused first")
    for mod in ("gates.gate_a", "gates.gate_b", "gates.__main__"):
        monkeypatch.setattr(f"{mod}.load_subject", refuse, raising=False)


def refusal(records: Path, kind: str = "gate_b") -> str:
    """The reason of the one INVALID record in `records`."""
    (rec,) = store.load(kind, root=records).records
    assert rec["verdict"] == "INVALID"
    return rec["results"]["refused"]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """Copies of the reference checkpoint, each named like it (so the golden lookup finds its golden): `bare` without
    tiktoken.model or prompts.json, `prompts` without tiktoken.model only, `renamed` whole under another name."""
    base = tmp_path_factory.mktemp("ckpts")
    out = {}
    for name, folder, leave_out in (("bare", "bare/kimi-linear-ref", {"tiktoken.model", "prompts.json"}),
                                    ("prompts", "prompts/kimi-linear-ref", {"tiktoken.model"}),
                                    ("renamed", "renamed/my-ref", set())):
        dest = base / folder
        dest.mkdir(parents=True)
        for f in REF.iterdir():
            if f.name not in leave_out:
                shutil.copy(f, dest / f.name)
        out[name] = dest
    return out


# ---- the default run -------------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="the default on CUDA is the 48B model")
def test_the_default_run_still_passes(tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(["gate-a"], monkeypatch, capsys, tmp_path)
    assert code == EXIT_PASS, out + err
    assert "Gate A PASS 128/128" in out and "note:" not in out + err
    code, out, err = run_cli(["gate-b"], monkeypatch, capsys, tmp_path)
    assert code == EXIT_PASS, out + err
    assert "Gate B PASS 128/128" in out and "golden gates/goldens/kimi-linear-ref-fp64-cpu-hf.json" in out
    for kind in ("gate_a", "gate_b"):
        (rec,) = store.load(kind, root=tmp_path).records
        assert rec["verdict"] == "VALID" and rec["results"]["passed"] is True


# ---- 1. a checkpoint folder without tiktoken.model ------------------------------------------------------------

@pytest.mark.parametrize("command", ["gate-a", "gate-b", "golden"])
def test_a_folder_without_a_tokenizer_is_said_to_use_the_synthetic_battery(tmp_path, monkeypatch, capsys, copies,
                                                                          command):
    monkeypatch.setattr(cli, "run_command", lambda command, opts: EXIT_PASS)   # what is said before the run
    code, out, err = run_cli([command, "--model", str(copies["bare"])], monkeypatch, capsys, tmp_path)
    assert code == EXIT_PASS, err
    (line,) = [x for x in out.splitlines() if x.startswith("note:")]
    assert "no tiktoken.model" in line and "synthetic-byte battery" in line and str(copies["bare"]) in line


def test_text_prompts_without_a_tokenizer_are_refused_before_any_record(tmp_path, monkeypatch, capsys, copies):
    no_model(monkeypatch)
    for command in ("gate-a", "gate-b"):
        code, out, err = run_cli([command, "--model", str(copies["prompts"])], monkeypatch, capsys, tmp_path)
        assert code == EXIT_REFUSED, out + err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert "prompts.json" in err and "cannot be tokenised without tiktoken.model" in err
        assert "REFUSED" not in err and not list(tmp_path.iterdir())


def test_a_golden_of_other_prompt_files_names_both_sources_not_staleness(tmp_path, monkeypatch, capsys, copies):
    """The folder is named like the reference checkpoint, so the lookup finds its golden, whose prompt ids came from
    the tokenizer and prompts.json this folder lacks."""
    no_model(monkeypatch)
    code, out, err = run_cli(["gate-b", "--model", str(copies["bare"])], monkeypatch, capsys, tmp_path)
    assert code == EXIT_REFUSED, out + err
    assert "note:" in out and "REFUSED" in err and len(err.strip().splitlines()) == 1
    why = refusal(tmp_path)
    assert "its prompts came from tiktoken:checkpoints/kimi-linear-ref/tiktoken.model" in why
    assert "this run's from synthetic-bytes" in why and "this run has no tiktoken.model and no prompts.json" in why
    assert "stale" not in why


def test_a_golden_of_the_same_prompt_files_with_other_ids_is_stale(tmp_path, monkeypatch, capsys):
    g = json.loads(TINY_GOLDEN.read_text())
    g["prompts"][0]["ids"][3] += 1
    golden = tmp_path / "g.json"
    golden.write_text(json.dumps(g))
    no_model(monkeypatch)
    code, _, err = run_cli(["gate-b", "--preset", "tiny", "--golden", str(golden)], monkeypatch, capsys,
                           tmp_path / "rec")
    assert code == EXIT_REFUSED
    assert "prompt 0's ids differ" in err and "from the same prompt files" in err and "the golden is stale" in err


# ---- 2. a --golden that names no golden file -------------------------------------------------------------------

@pytest.mark.parametrize("what, words", [("missing", "no such file"), ("folder", "is a directory, not a golden file")])
def test_a_bad_golden_path_is_refused_before_the_run_without_a_record(tmp_path, monkeypatch, capsys, what, words):
    (tmp_path / "folder").mkdir()
    no_model(monkeypatch)
    records = tmp_path / "records"
    code, out, err = run_cli(["gate-b", "--preset", "tiny", "--golden", str(tmp_path / what)], monkeypatch, capsys,
                             records)
    assert code == EXIT_REFUSED, out + err
    assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "REFUSED" not in err and "record" not in err and out == ""
    assert what != "folder" or "no such file" not in err
    assert not records.exists()


def test_a_run_that_started_and_was_refused_keeps_its_record(tmp_path, monkeypatch, capsys):
    no_model(monkeypatch)
    code, _, err = run_cli(["gate-b", "--preset", "tiny", "--new-tokens", "8", "--golden", str(TINY_GOLDEN)],
                           monkeypatch, capsys, tmp_path)
    assert code == EXIT_REFUSED and "REFUSED" in err
    assert "holds 16 new tokens per prompt, --new-tokens is 8" in refusal(tmp_path)


# ---- 3. a golden made for another model ------------------------------------------------------------------------

def test_another_models_golden_is_named_as_such_before_its_prompt_ids(tmp_path, monkeypatch, capsys):
    no_model(monkeypatch)
    code, out, err = run_cli(["gate-b", "--device", "cpu", "--golden", str(TINY_GOLDEN)], monkeypatch, capsys, tmp_path)
    assert code == EXIT_REFUSED, out + err
    why = refusal(tmp_path)
    assert "is for another model" in why and "made for tiny (weights sha256:09757485242725ec)" in why
    assert "this run gates kimi-linear-ref" in why and "stale" not in why


def test_another_seeds_golden_is_named_as_such_by_its_weights(tmp_path, monkeypatch, capsys):
    """Same prompt ids (the synthetic battery of one config), other weights: found once the model is loaded."""
    code, out, err = run_cli(["gate-b", "--preset", "tiny", "--seed", "1", "--golden", str(TINY_GOLDEN)],
                             monkeypatch, capsys, tmp_path)
    assert code == EXIT_REFUSED, out + err
    why = refusal(tmp_path)
    assert "is for another model" in why and "sha256:09757485242725ec (tiny)" in why
    assert "the model under test (tiny-seed1) has sha256:" in why


# ---- 4. the paths the gates print ------------------------------------------------------------------------------

def test_a_golden_path_is_printed_relative_to_the_checkout_in_a_refusal(tmp_path, monkeypatch, capsys):
    no_model(monkeypatch)
    code, _, err = run_cli(["gate-b", "--preset", "tiny", "--new-tokens", "8", "--golden", str(TINY_GOLDEN)],
                           monkeypatch, capsys, tmp_path)
    assert code == EXIT_REFUSED
    assert "golden gates/goldens/tiny-fp64-cpu-hf.json holds 16 new tokens" in err
    assert str(ROOT) not in err.replace(str(tmp_path), "")


def test_a_records_file_in_the_checkout_is_printed_relative_to_it(tmp_path, monkeypatch, capsys):
    """A checkout at tmp_path whose records folder is records/: the gates print `record records/<kind>.jsonl`, as the
    README shows, for a verdict and for a refusal alike."""
    monkeypatch.setattr(store, "REPO_ROOT", tmp_path)
    code, out, err = run_cli(["gate-a", "--preset", "tiny", "--new-tokens", "2"], monkeypatch, capsys,
                             tmp_path / "records")
    assert code == EXIT_PASS, out + err
    assert re.search(r"Gate A PASS .*; record records/gate_a\.jsonl\]$", out.strip())
    no_model(monkeypatch)
    code, _, err = run_cli(["gate-b", "--preset", "tiny", "--new-tokens", "8"], monkeypatch, capsys,
                           tmp_path / "records")
    assert code == EXIT_REFUSED and err.strip().endswith("[record records/gate_b.jsonl]"), err


# ---- 5. the hint for a model without a golden -----------------------------------------------------------------

def make_variables() -> set[str]:
    """The variables the Makefile maps to the golden command's flags."""
    return set(re.findall(r"\$\((\w+)\),--", (ROOT / "Makefile").read_text())) | {"SOURCE"}


def hinted(text: str) -> tuple[dict, str]:
    """The make variables and the golden path of a `make golden ... (writes PATH)` hint."""
    m = re.search(r"make golden ((?:\w+=\S+ )*\w+=\S+) \(writes (\S+)\)", text)
    assert m, text
    return dict(v.split("=", 1) for v in m.group(1).split()), m.group(2)


def test_the_missing_golden_hint_is_the_make_command_in_the_goldens_naming(tmp_path, monkeypatch, capsys, copies):
    no_model(monkeypatch)
    code, _, err = run_cli(["gate-b", "--preset", "tiny", "--seed", "1", "--dtype", "bf16"], monkeypatch, capsys,
                           tmp_path)
    assert code == EXIT_REFUSED and "python -m gates golden" not in err and "--dtype" not in err
    variables, path = hinted(err)
    assert variables == {"PRESET": "tiny", "SEED": "1", "DTYPE": "fp64", "DEVICE": "cpu"}
    assert set(variables) <= make_variables()
    # what the golden command writes for those options, and what Gate B's lookup then finds
    made = resolve(preset="tiny", seed=1, dtype="fp64", device="cpu", source="hf")
    assert path == "gates/goldens/" + golden_name(made.label, made.dtype, made.device, made.source)
    assert path == "gates/goldens/tiny-seed1-fp64-cpu-hf.json"

    code, _, err = run_cli(["gate-b", "--model", str(copies["renamed"])], monkeypatch, capsys, tmp_path)
    assert code == EXIT_REFUSED
    variables, path = hinted(err)
    assert variables == {"MODEL": str(copies["renamed"]), "DTYPE": "fp64", "DEVICE": "cpu"}
    assert path == "gates/goldens/my-ref-fp64-cpu-hf.json"


@pytest.mark.parametrize("dtype, expert_dtype, variables, name", [
    ("fp32", "bf16", {"SOURCE": "self", "DEVICE": "cuda"}, "48b-a3b-fp32-cuda-self.json"),
    ("bf16", None, {"DTYPE": "bf16", "DEVICE": "cuda"}, "48b-a3b-bf16-cuda-hf.json"),
])
def test_the_cuda_hints_name_the_committed_goldens(dtype, expert_dtype, variables, name):
    opts = Options("48b-a3b", None, dtype, "cuda", 16, 15.0, "hf", None, 0, "auto", expert_dtype)
    got, path = hinted(golden_mod.golden_hint(opts))
    assert got == {"PRESET": "48b-a3b", **variables} and path == f"gates/goldens/{name}"
    assert (GOLDEN_DIR / name).is_file() and set(got) <= make_variables()
