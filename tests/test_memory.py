"""gates/memory.py: parameter counts, projection, floor check, sampler, audit."""
import threading

import pytest
import torch

from gates.memory import (
    CUDA_CONTEXT_BYTES, GiB, FloorSampler, MemReading, MemoryFloorError, Projection, _host_meminfo, audit,
    check_floor, param_counts, project_peak, read_device_memory,
)
from model.config import PRESETS
from records.store import append, load, make_record

BIG, TINY = PRESETS["48b-a3b"], PRESETS["tiny"]
FLOOR = 15 * GiB


def test_param_counts_match_spec():
    counts = param_counts(BIG)
    assert counts.total == 49_122_681_728
    assert counts.active_per_token == 3_106_972_544
    assert counts.fp32 == 20 * (32 + 4096) + 26 * 256  # A_log, dt_bias per KDA layer; router bias per MoE layer


def test_param_counts_match_hf_transformers_module():
    transformers = pytest.importorskip("transformers")
    cfg = TINY.to_dict()
    del cfg["architectures"], cfg["model_type"]
    model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**cfg))
    # HF keeps the router bias as a buffer, not a parameter
    hf = sum(p.numel() for p in model.parameters()) + sum(b.numel() for _, b in model.named_buffers()
                                                          if b.dtype.is_floating_point)
    assert param_counts(TINY).total == hf
    assert param_counts(TINY.replace(num_experts=16)).total != hf  # the count follows the config


def test_projection_48b_bf16():
    p = project_peak(BIG, torch.bfloat16, batch=1, context=2048)
    assert abs(p.weights_bytes / (91.5 * GiB) - 1) < 0.005
    assert p.state_bytes == 20 * 32 * 128 * 128 * 4 + 20 * 3 * 3 * 4096 * 2  # 40 MiB of KDA state + conv taps
    assert p.cache_bytes == 2048 * 8064  # SPEC: 8,064 B per token in bf16
    assert p.total == p.weights_bytes + p.state_bytes + p.cache_bytes + p.workspace_bytes
    # 2048 positions of fp32 + bf16 logits dominate the transients; the CUDA context allowance is on top
    assert 2048 * 163840 * 6 + CUDA_CONTEXT_BYTES < p.workspace_bytes < 2.5 * GiB + CUDA_CONTEXT_BYTES
    assert project_peak(BIG, "bf16", 1, 2048, device="cpu").workspace_bytes == p.workspace_bytes - CUDA_CONTEXT_BYTES
    # fp32: every parameter in 4 bytes, plus the routers' bf16 copies (`Router.pack_`)
    assert project_peak(BIG, "float32", 1, 2048).weights_bytes == 4 * 49_122_681_728 + 2 * 26 * 256 * 2304


def test_projection_counts_the_load():
    """The gates' short runs (131 positions) peak while loading: one tensor's fp32 scratch beside the weights,
    lm_head's 1.41 GiB at 48B, more than any stage of their forwards (`project_peak`'s "load")."""
    p = project_peak(BIG, torch.bfloat16, batch=1, context=131, device="cpu")
    assert p.workspace_bytes >= 163840 * 2304 * 4


def _resident_bytes(model) -> int:
    """Bytes of the distinct storages behind a module's parameters and buffers (packed views counted once)."""
    storages = {}
    for t in list(model.parameters()) + list(model.buffers()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("dtype,expert_dtype", [(torch.bfloat16, None), (torch.float32, None),
                                                (torch.float32, torch.bfloat16)])
def test_projected_weights_are_the_built_models_bytes(dtype, expert_dtype):
    """The weight term of the projection is what a built model holds: packed projections, the fp32-held routers
    and their bf16 copies, the experts at their own width."""
    from model.build import load_model
    model = load_model("tiny", dtype=dtype, expert_dtype=expert_dtype).model
    assert all(m.weight_bf16 is not None for m in model.modules() if type(m).__name__ == "Router")
    assert project_peak(TINY, dtype, 1, 16, expert_dtype=expert_dtype).weights_bytes == _resident_bytes(model)


def test_projection_scales_with_batch_context_and_chunk():
    base = project_peak(BIG, torch.bfloat16, batch=1, context=32768)
    wide = project_peak(BIG, torch.bfloat16, batch=4, context=32768)
    assert wide.state_bytes == 4 * base.state_bytes and wide.cache_bytes == 4 * base.cache_bytes
    chunked = project_peak(BIG, torch.bfloat16, batch=1, context=32768, prefill_chunk=2048)
    assert chunked.workspace_bytes < base.workspace_bytes and chunked.cache_bytes == base.cache_bytes
    # a chunk longer than the context is the context
    assert project_peak(BIG, torch.bfloat16, 1, 100, prefill_chunk=4096) == project_peak(BIG, torch.bfloat16, 1, 100)


@pytest.mark.parametrize("args, match", [
    ((torch.int8, 1, 10), "model dtype"), (("bfloat", 1, 10), "model dtype"),
    ((torch.bfloat16, 0, 10), "batch"), ((torch.bfloat16, 1, 1.5), "context"),
])
def test_projection_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        project_peak(BIG, *args)
    with pytest.raises(ValueError, match="prefill_chunk"):
        project_peak(BIG, torch.bfloat16, 1, 10, prefill_chunk=0)


def test_check_floor_refuses_under_the_floor():
    p = project_peak(BIG, torch.bfloat16, batch=1, context=2048)
    tight = MemReading(total=140 * GiB, free=p.total + 10 * GiB, source="simulated")
    d = check_floor(p, FLOOR, tight)
    assert not d.ok and d.free_after_projected == 10 * GiB and d.floor == FLOOR
    assert "REFUSED" in d.message and "floor 15.00 GiB" in d.message and "leaves 10.00 GiB" in d.message
    assert f"free {p.total / GiB + 10:.2f} GiB" in d.message and f"projected peak {p.total / GiB:.2f} GiB" in d.message

    roomy = MemReading(total=140 * GiB, free=p.total + 20 * GiB, source="simulated")
    assert check_floor(p, FLOOR, roomy).ok
    with pytest.raises(ValueError, match="no memory reading"):
        check_floor(p, FLOOR, None)


def _scripted_reader(frees):
    """A reader that replays `frees` (then keeps the last), like NVML during a run that allocates."""
    frees, lock = list(frees), threading.Lock()

    def read():
        with lock:
            free = frees.pop(0) if len(frees) > 1 else frees[0]
        return MemReading(total=140 * GiB, free=free, source="simulated")
    return read


def test_sampler_trips_mid_run_and_check_raises(tmp_path):
    trips = []

    def on_trip(message):  # what a gate does: leave a record behind before the run stops
        trips.append(message)
        append(make_record("memory", preset="48b-a3b", dtype="bfloat16", device="cuda:0", weights="w",
                           params={"floor_gib": FLOOR / GiB}, results={"decision": "tripped", "passed": False},
                           verdict="INVALID", reasons=[message]), root=tmp_path)

    reader = _scripted_reader([40 * GiB] * 5 + [30 * GiB] * 5 + [14 * GiB])
    with pytest.raises(MemoryFloorError, match=r"free 14\.00 GiB \(simulated\) < floor 15\.00 GiB"):
        with FloorSampler(FLOOR, interval_s=0.002, reader=reader, on_trip=on_trip) as s:
            s.check()  # the run starts above the floor
            assert s.tripped.wait(timeout=10)
            s.check()
    assert len(trips) == 1  # once, although every later sample is under the floor too
    assert s.min_free == 14 * GiB and s.peak_used == 126 * GiB and s.samples >= 11
    assert load(kinds="memory", root=tmp_path).records[0]["reasons"] == trips


def test_sampler_catches_a_crossing_when_the_run_ends_between_checks():
    reader = _scripted_reader([40 * GiB, 40 * GiB, 1 * GiB])
    with pytest.raises(MemoryFloorError):
        with FloorSampler(FLOOR, interval_s=0.002, reader=reader) as s:
            assert s.tripped.wait(timeout=10)  # the run's last step finished before the sampler saw the drop


def test_sampler_stays_quiet_above_the_floor():
    with FloorSampler(FLOOR, interval_s=0.002, reader=_scripted_reader([40 * GiB, 16 * GiB])) as s:
        while s.samples < 20:
            s.check()
    assert not s.tripped.is_set() and s.min_free == 16 * GiB


def test_sampler_that_cannot_read_refuses_to_guard():
    with pytest.raises(RuntimeError, match="cannot be watched"):
        with FloorSampler(FLOOR, reader=lambda: None):
            pass


def test_audit_tolerance():
    p = Projection(weights_bytes=90 * GiB, state_bytes=0, cache_bytes=0, workspace_bytes=10 * GiB)
    ok = audit(int(1.05 * p.total), p)
    assert ok.ok and ok.ratio == pytest.approx(1.05, rel=1e-6) and "OK" in ok.message
    bad = audit(int(1.15 * p.total), p)
    assert not bad.ok and "FAILED" in bad.message and "115.00 GiB" in bad.message
    assert audit(int(1.15 * p.total), p, tolerance=0.2).ok


def test_read_device_memory_without_gpu():
    assert read_device_memory() is None


def test_host_meminfo():
    total, available = _host_meminfo()
    assert 0 < available <= total
