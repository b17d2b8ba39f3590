"""The gates over several ranks from the command line (`--world`, gates/ranks.py), on tiny over gloo: Gate A and
Gate B pass through 2 ranks with one record saying so; a rank that drops its share fails them; a rank that crashes
or hangs exits 2 naming it; bad world sizes are refused; the per-rank memory projection and the floor on every
rank's device; the default world chosen from the GPUs' free memory, or a refusal that says what would hold it."""
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from gates import ranks as ranks_mod
from gates.__main__ import main
from gates.gate_a import run_gate_a
from gates.gate_memory import run_memory_gate
from gates.memory import (NCCL_BYTES, GiB, MemReading, WorldRefused, choose_world, describe_links, gpu_links,
                          project_peak, world_sizes)
from gates.prompts import battery
from gates.ranks import first_line
from gates.run import EXIT_FAIL, EXIT_PASS, EXIT_REFUSED, context_len, record, resolve
from model import parallel
from model.build import load_model
from model.config import PRESETS
from model.params import param_counts
from model.parallel import ExpertParallel, shard_
from tests.test_gates import cli, only_record
from tests.test_memory import _resident_bytes
from tests.test_parallel import drop_share

TINY, BIG = PRESETS["tiny"], PRESETS["48b-a3b"]
E = TINY.num_experts


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def records(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_RECORDS_DIR", str(tmp_path))
    return tmp_path


# ---- the gates through the command line -----------------------------------------------------------------------

def test_cli_gate_a_over_two_ranks_passes_with_one_record(tmp_path):
    r = cli("gate-a", "--world", "2", "--device", "cpu", "--preset", "tiny", records=tmp_path)
    assert r.returncode == EXIT_PASS, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "Gate A over 2 ranks, 4 experts each: tiny fp32 (cpu, gloo)"
    assert r.stdout.count("Gate A PASS 128/128") == 1 and r.stdout.count("prompt      k/n") == 1  # rank 0 alone
    rec = only_record(tmp_path, "gate_a")
    assert (rec["params"]["world"], rec["params"]["experts_per_rank"]) == (2, 4)
    assert rec["verdict"] == "VALID" and rec["results"]["passed"] is True and rec["results"]["score"] == 128
    assert "gpus" not in rec["params"]  # no GPUs to name on a CPU
    # the whole model's weights id, as one process reports it
    assert rec["weights"] == load_model("tiny").weights


def test_gate_b_over_two_ranks_passes(records, capfd):
    assert main(["gate-b", "--world", "2", "--device", "cpu", "--preset", "tiny"]) == EXIT_PASS
    out = capfd.readouterr().out
    assert out.splitlines()[0].startswith("Gate B over 2 ranks, 4 experts each: tiny")
    assert out.count("Gate B PASS 128/128") == 1 and "md5 equal" in out
    rec = only_record(records, "gate_b")
    assert rec["params"]["world"] == 2 and rec["results"]["passed"] is True


@pytest.mark.parametrize("command, module, rank, decode_only, says", [
    ("gate-b", "gates.gate_b", 1, False, "md5 differs"),
    ("gate-a", "gates.gate_a", 0, True, "Gate A FAIL"),
])
def test_a_rank_that_drops_its_share_fails_the_gate(records, capfd, monkeypatch, command, module, rank,
                                                    decode_only, says):
    """Negative control: one rank zeroes its partial output before the sum (everywhere for Gate B; in the decode
    step alone for Gate A, whose two paths would otherwise lose the same share)."""
    import importlib
    real = importlib.import_module(module).load_subject

    def dropping(opts):
        subject = real(opts)
        drop_share(subject.model, rank, decode_only)
        return subject
    monkeypatch.setattr(f"{module}.load_subject", dropping)  # the forked ranks inherit it
    assert main([command, "--world", "2", "--device", "cpu"]) == EXIT_FAIL
    assert says in capfd.readouterr().out
    rec = only_record(records, command.replace("-", "_"))
    assert rec["params"]["world"] == 2 and rec["results"]["passed"] is False and rec["verdict"] == "VALID"


def _crash_on_rank_1(command, opts):
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    time.sleep(60)  # outside any collective: rank 1's error is the one seen


def _hang_on_rank_1(command, opts):
    if dist.get_rank() == 1:
        time.sleep(60)
    return EXIT_PASS


def test_a_rank_that_crashes_exits_2_naming_it(records, capfd, monkeypatch):
    monkeypatch.setattr(ranks_mod, "_rank_main", _crash_on_rank_1)
    t = time.perf_counter()
    assert main(["gate-a", "--world", "2", "--device", "cpu"]) == EXIT_REFUSED
    assert time.perf_counter() - t < 30  # rank 0 was stopped, not waited for
    err = capfd.readouterr().err
    assert "Traceback" in err and "Gate A REFUSED: rank 1 crashed: ValueError: rank 1 fails on purpose" in err
    rec = only_record(records, "gate_a")
    assert rec["verdict"] == "INVALID" and rec["params"]["world"] == 2
    assert rec["reasons"] == ["refused: rank 1 crashed: ValueError: rank 1 fails on purpose"]


def test_a_rank_that_hangs_is_stopped_at_the_timeout_naming_it(records, capfd, monkeypatch):
    monkeypatch.setattr(ranks_mod, "_rank_main", _hang_on_rank_1)
    t = time.perf_counter()
    assert main(["gate-b", "--world", "2", "--device", "cpu", "--rank-timeout-s", "2"]) == EXIT_REFUSED
    assert time.perf_counter() - t < 30
    assert "did not finish within 2 s; still running: rank 1 [record" in capfd.readouterr().err
    assert only_record(records, "gate_b")["verdict"] == "INVALID"


# ---- refusals ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, says", [
    (["gate-a", "--world", "3"],
     "--world 3: the 8 routed experts do not split evenly over 3 ranks; use one of 1, 2, 4, 8"),
    (["gate-b", "--world", "16"], "use one of 1, 2, 4, 8"),
    (["gate-a", "--world", "0"], "--world must be a positive integer, got 0"),
    (["gate-memory", "--world", "-2"], "--world must be a positive integer, got -2"),
    (["gate-a", "--world", "2", "--rank-timeout-s", "0"], "--rank-timeout-s must be a number of seconds"),
    (["gate-a", "--world", "2", "--rank-timeout-s", "nan"], "--rank-timeout-s must be a number of seconds"),
])
def test_a_bad_world_is_refused_with_exit_2(records, capsys, argv, says):
    assert main([*argv, "--device", "cpu", "--preset", "tiny"]) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1
    assert not list(records.glob("*.jsonl"))  # refused before anything ran


def test_more_ranks_than_gpus_is_refused(records, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["gate-a", "--world", "2", "--device", "cuda", "--preset", "tiny"]) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert "--world 2: each rank computes on a GPU of its own, and torch sees 1 CUDA device\n" in err
    with pytest.raises(SystemExit) as e:  # a golden is made in one process
        main(["golden", "--world", "2"])
    assert e.value.code == 2 and "unrecognized arguments: --world 2" in capsys.readouterr().err


# ---- the floor on every rank's device ---------------------------------------------------------------------------

def _reader(frees, calls=None):
    """Rank r reads frees[r]; rank 1 only for its first `calls` readings, then 1 GiB."""
    rank, n = dist.get_rank(), [0]
    calls = calls if rank == 1 else None

    def read():
        n[0] += 1
        free = frees[rank] if calls is None or n[0] <= calls else GiB
        return MemReading(total=140 * GiB, free=free, source="simulated")
    return read


def _memory_gate(root, frees, calls=None):
    return run_memory_gate(resolve(preset="tiny", device="cpu", world=2), reader=_reader(frees, calls),
                           records_root=root, log=lambda *a: None)


def _gate_a(root, frees):
    return run_gate_a(resolve(preset="tiny", device="cpu", world=2), reader=_reader(frees), records_root=root,
                      log=lambda *a: None)


def fork(fn, *args):
    return parallel.spawn(fn, 2, args, start_method="fork", timeout_s=120)


def tiny_projection(world):
    return project_peak(TINY, torch.float32, 1, context_len(battery(TINY), 16), device="cpu", world=world)


def test_every_rank_is_held_to_the_floor_and_they_refuse_together(tmp_path):
    """Rank 1's GPU lacks room: both ranks refuse before loading (neither waits for the other in a collective),
    and rank 0's record names rank 1."""
    room = tiny_projection(2).total + 15 * GiB
    assert fork(_gate_a, str(tmp_path), [room + GiB, room - GiB]) == [EXIT_REFUSED, EXIT_REFUSED]
    rec = only_record(tmp_path, "gate_a")  # one record, rank 0's
    assert rec["weights"] is None and rec["reasons"][0].startswith("refused: rank 1: memory floor REFUSED")
    assert "rank 0" not in rec["reasons"][0]
    assert fork(_memory_gate, str(tmp_path), [room - GiB, room + GiB]) == [EXIT_REFUSED, EXIT_REFUSED]
    res = only_record(tmp_path, "memory")["results"]
    assert res["decision"] == "refused" and res["projected_bytes"] == tiny_projection(2).total
    assert res["free_before_bytes"] == room - GiB


def test_the_memory_gate_over_two_ranks_audits_each_and_stops_all_when_one_trips(tmp_path):
    room = 100 * GiB
    assert fork(_memory_gate, str(tmp_path / "ran"), [room, room]) == [EXIT_PASS, EXIT_PASS]
    rec = only_record(tmp_path / "ran", "memory")
    assert rec["results"]["decision"] == "ran" and rec["params"]["world"] == 2
    assert [x["rank"] for x in rec["results"]["ranks"]] == [0, 1]
    assert "a rank of 2" in rec["results"]["projection"]
    # rank 1's GPU drops under the floor after its first readings: every rank stops at the same step
    assert fork(_memory_gate, str(tmp_path / "trip"), [room, room], 2) == [EXIT_FAIL, EXIT_FAIL]
    rec = only_record(tmp_path / "trip", "memory")
    assert rec["results"]["decision"] == "tripped"
    why = rec["reasons"][0]
    assert why.startswith("rank 1: memory floor crossed: free 1.00 GiB") and "rank 0" not in why


# ---- the projection per rank ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [TINY, BIG], ids=["tiny", "48b-a3b"])
@pytest.mark.parametrize("dtype, expert_dtype", [(torch.bfloat16, None), (torch.float32, torch.bfloat16)])
def test_the_projection_over_ranks_counts_the_routed_experts_once_in_all(cfg, dtype, expert_dtype):
    counts = param_counts(cfg)
    e = (expert_dtype or dtype).itemsize
    one = project_peak(cfg, dtype, 1, 131, expert_dtype=expert_dtype)
    for world in (2, 4):
        rank = project_peak(cfg, dtype, 1, 131, expert_dtype=expert_dtype, world=world)
        # the ranks together hold every routed expert once and everything else world times
        assert world * rank.weights_bytes == one.weights_bytes + (world - 1) * (one.weights_bytes
                                                                                 - counts.routed_experts * e)
        assert one.weights_bytes - rank.weights_bytes == counts.routed_experts * e * (world - 1) // world
        assert (rank.state_bytes, rank.cache_bytes) == (one.state_bytes, one.cache_bytes)  # replicated
        assert rank.workspace_bytes >= one.workspace_bytes + NCCL_BYTES
    with pytest.raises(ValueError, match="do not split evenly over 3 ranks"):
        project_peak(cfg, dtype, 1, 131, world=3)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_projected_weights_are_what_a_rank_holds(rank):
    model = shard_(load_model("tiny").model, ExpertParallel(2, rank, E))
    assert project_peak(TINY, torch.float32, 1, 16, world=2).weights_bytes == _resident_bytes(model)


def test_the_48b_model_fits_two_80gb_gpus_at_the_gates_precision():
    context = context_len(battery(BIG), 16)
    need = {w: project_peak(BIG, torch.float32, 1, context, expert_dtype=torch.bfloat16, world=w).total + 15 * GiB
            for w in (1, 2)}
    assert need[2] < 79 * GiB < need[1]


# ---- the default world ------------------------------------------------------------------------------------------

def needs(table):
    return lambda world: int(table[world] * GiB)


def test_choose_world_takes_one_gpu_when_it_holds_the_model():
    world, why = choose_world("m", needs({1: 90, 2: 50, 4: 30, 8: 20}), 8, [100 * GiB, 100 * GiB])
    assert world == 1 and why == "m needs 90.00 GiB with the floor; GPU 0 has 100.00 GiB free"


def test_choose_world_spreads_over_as_few_gpus_as_hold_it():
    table = {1: 200, 2: 110, 4: 70, 8: 40}
    world, why = choose_world("m", needs(table), 8, [79 * GiB] * 8)
    assert world == 4 and why == "m needs 200.00 GiB with the floor in one process, 70.00 GiB a rank over 4; " \
                                 "this box has 8 x 79.0 GiB free"
    # sizes that do not split the experts are skipped: with 6 experts and 3 GPUs, 3 ranks where 2 do not fit
    assert choose_world("m", needs({1: 200, 2: 90, 3: 70, 6: 40}), 6, [79 * GiB] * 3)[0] == 3


@pytest.mark.parametrize("table, free, says", [
    ({1: 105, 2: 60, 4: 40, 8: 30}, [79], "m needs 105.00 GiB with the floor; this box has 1 x 79.0 GiB free; 2 such "
                                          "GPUs would hold it (60.00 GiB each with the floor)"),
    ({1: 200, 2: 110, 4: 70, 8: 40}, [79, 79], "this box has 2 x 79.0 GiB free; 4 such GPUs would hold it"),
    ({1: 105, 2: 60, 4: 40, 8: 30}, [79, 10], "this box has 2 GPUs with 79.0, 10.0 GiB free; over 2 ranks each needs "
                                              "60.00 GiB with the floor, more than GPUs 0..1 have free"),
    ({1: 300, 2: 200, 4: 150, 8: 100}, [79], "no number of such GPUs would hold it: even over 8 ranks each needs "
                                             "100.00 GiB with the floor"),
])
def test_choose_world_refuses_saying_what_would_hold_it(table, free, says):
    with pytest.raises(WorldRefused) as e:
        choose_world("m", needs(table), 8, [f * GiB for f in free])
    assert says in str(e.value)
    assert world_sizes(8) == [1, 2, 4, 8]


def gpus(monkeypatch, *free_gib):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(free_gib))
    return lambda: [MemReading(total=80 * GiB, free=int(f * GiB), source="simulated") for f in free_gib]


def test_the_default_on_cuda_follows_the_box(monkeypatch):
    """No more silent tiny: 48b-a3b on one GPU that holds it, spread over as few as hold it, or refused."""
    one = resolve(device="cuda", exact=True, world=None, readings=gpus(monkeypatch, 139))
    assert (one.preset, one.world, one.experts_per_rank) == ("48b-a3b", 1, None)
    assert one.world_choice.startswith("48b-a3b needs ") and "GPU 0 has 139.00 GiB free" in one.world_choice
    said = []
    two = resolve(device="cuda", exact=True, world=None, readings=gpus(monkeypatch, 79, 79, 79, 79), log=said.append)
    assert (two.preset, two.world, two.experts_per_rank) == ("48b-a3b", 2, 128)
    assert "a rank over 2; this box has 4 x 79.0 GiB free" in two.world_choice
    assert said == [f"default world 2: {two.world_choice}"]
    with pytest.raises(WorldRefused, match=r"^48b-a3b needs 1\d\d\.\d\d GiB with the floor; this box has 1 x 79\.0 GiB "
                                           r"free; 2 such GPUs would hold it"):
        resolve(device="cuda", exact=True, world=None, readings=gpus(monkeypatch, 79))
    # --world, --preset tiny, and a box without NVML readings keep what they ask for
    assert resolve(device="cuda", exact=True, world=1, readings=gpus(monkeypatch, 79)).world == 1
    assert resolve(preset="tiny", device="cuda", world=None, readings=gpus(monkeypatch, 79)).world == 1
    assert resolve(device="cuda", world=None, readings=lambda: [None]).world == 1
    assert resolve(device="cpu", world=None).label == "kimi-linear-ref"


def test_the_default_refusal_exits_2_from_the_command_line(records, capsys, monkeypatch):
    monkeypatch.setattr("gates.run.visible_gpu_memory", gpus(monkeypatch, 79))
    assert main(["gate-a"]) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert err.startswith("error: 48b-a3b needs ") and "2 such GPUs would hold it" in err
    assert not list(records.glob("*.jsonl"))


# ---- what a run over GPUs says and records ----------------------------------------------------------------------

LINKS = {"gpus": [{"rank": r, "cuda": r, "nvml_index": r, "name": "NVIDIA H100 80GB HBM3", "nvlinks": 18}
                  for r in range(2)],
         "links": [{"ranks": [0, 1], "link": "NVLink"}]}


def test_the_first_line_and_the_record_name_the_gpus_and_their_link(tmp_path, monkeypatch):
    opts = dataclasses.replace(resolve(preset="tiny", device="cpu", world=2), device="cuda",
                               world_choice="tiny needs 1.50 GiB with the floor")
    assert first_line("gate-a", opts, LINKS) == (
        "Gate A over 2 ranks, 4 experts each: tiny fp32 (cuda, NCCL; rank 0 cuda:0 NVIDIA H100 80GB HBM3, "
        "rank 1 cuda:1 NVIDIA H100 80GB HBM3; all pairs NVLink (18 active NVLinks a GPU)); default world: tiny "
        "needs 1.50 GiB with the floor")
    monkeypatch.setattr("gates.run.gpu_links", lambda indices: LINKS if list(indices) == [0, 1] else None)
    record("gate_a", opts, None, {}, {"passed": False, "refused": "x"}, reasons=["refused: x"], valid=False,
           records_root=tmp_path)  # the store validates it against records/schema.py
    params = only_record(tmp_path, "gate_a")["params"]
    assert (params["gpus"], params["links"], params["world"]) == (LINKS["gpus"], LINKS["links"], 2)


def test_gpu_links_reads_names_and_links_from_nvml(monkeypatch):
    """Through pynvml's own names (monkeypatch refuses one the library lacks): 3 GPUs, 0-1 over NVLink, 2 on PCIe
    behind a host bridge; CUDA_VISIBLE_DEVICES maps torch's indices to NVML's."""
    pynvml = pytest.importorskip("pynvml")
    nvlinked = {(3, 5), (5, 3)}
    monkeypatch.setattr("gates.memory.nvml_index", lambda i: [3, 5, 6][i])
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: i)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: b"NVIDIA H100 80GB HBM3" if h < 6 else "NVIDIA L4")

    def state(h, link):
        if h == 6 or link >= 18:
            raise pynvml.NVMLError_NotSupported()
        return pynvml.NVML_FEATURE_ENABLED
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNvLinkState", state)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetP2PStatus", lambda a, b, i: pynvml.NVML_P2P_STATUS_OK
                        if i == pynvml.NVML_P2P_CAPS_INDEX_NVLINK and (a, b) in nvlinked else 1)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTopologyCommonAncestor", lambda a, b: pynvml.NVML_TOPOLOGY_HOSTBRIDGE)
    got = gpu_links([0, 1, 2])
    assert [(g["rank"], g["cuda"], g["nvml_index"], g["name"], g["nvlinks"]) for g in got["gpus"]] == [
        (0, 0, 3, "NVIDIA H100 80GB HBM3", 18), (1, 1, 5, "NVIDIA H100 80GB HBM3", 18), (2, 2, 6, "NVIDIA L4", 0)]
    phb = "PCIe PHB (a PCIe host bridge)"
    assert got["links"] == [{"ranks": [0, 1], "link": "NVLink"}, {"ranks": [0, 2], "link": phb},
                            {"ranks": [1, 2], "link": phb}]
    assert describe_links(got).endswith("; 0-1 NVLink; 0-2 PCIe PHB (a PCIe host bridge); 1-2 PCIe PHB (a PCIe host "
                                        "bridge) (0/18 active NVLinks a GPU)")


def test_gpu_links_is_none_without_nvml():
    try:
        import pynvml
        pynvml.nvmlInit()
        pytest.skip("NVML answers on this machine")
    except Exception:
        pass
    assert gpu_links([0, 1]) is None


def _exit_without_result():
    import os
    dist.barrier()   # every rank has joined the group: none leaves while another still connects
    os._exit(0)


def test_ranks_that_exit_without_a_result_are_a_rank_failure():
    """A rank that exits cleanly but returns nothing is reported as RankFailed (exit 2 in the commands), not as a
    bare RuntimeError."""
    with pytest.raises(ranks_mod.RankFailed, match=r"ranks \[0, 1\] exited without a result"):
        ranks_mod.spawn_ranks(_exit_without_result, 2, (), "cpu", 60.0)
