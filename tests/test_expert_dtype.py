"""Routed experts held apart from the model dtype (`expert_dtype`): bf16 experts under an fp32 model are the same
weights (bf16 widens exactly), so the model computes exactly what the all-fp32 model computes, in every path.
This is how Gate A runs the 48B model in fp32 on one GPU (gates/run.py)."""
import pytest
import torch

from gates.memory import GiB, param_counts, project_peak
from gates.run import resolve
from model import ops
from model.build import load_model
from model.checkpoint import ROUTED_EXPERTS, load_checkpoint, save_checkpoint
from model.config import get_config
from model.triton.moe import fused_moe_small_batch
from model.weights import synthetic_weights, weights_id
from tests.test_gates import EXIT_PASS, cli, only_record

BIG = get_config("48b-a3b")


@pytest.fixture(scope="module")
def pair():
    """The tiny model in fp32, and again with its routed experts in bf16."""
    return (load_model("tiny", dtype=torch.float32).model,
            load_model("tiny", dtype=torch.float32, expert_dtype=torch.bfloat16).model)


def test_only_the_routed_experts_are_held_apart(pair):
    full, mixed = pair
    for (n, a), (m, b) in zip(full.state_dict().items(), mixed.state_dict().items()):
        assert n == m
        assert b.dtype == (torch.bfloat16 if n.endswith(ROUTED_EXPERTS) else a.dtype), n
        assert torch.equal(a, b.to(a.dtype)), n  # the same values
    assert any(n.endswith(ROUTED_EXPERTS) for n in full.state_dict())
    assert weights_id(full.state_dict(), full.cfg) == weights_id(mixed.state_dict(), mixed.cfg)


@torch.no_grad()
def test_bf16_experts_compute_exactly_what_fp32_experts_compute(pair):
    full, mixed = pair
    ids = torch.randint(0, full.cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with ops.use("torch"):
        assert torch.equal(full(ids), mixed(ids))  # recompute path (prefill-sized MoE: the reference loop)
        caches = [m.new_cache(2, 16) for m in pair]
        outs = [m.prefill(ids, c) for m, c in zip(pair, caches)]
        assert torch.equal(*outs)
        nxt = outs[0].argmax(-1).view(-1)
        assert torch.equal(*(m.decode_step(nxt, c) for m, c in zip(pair, caches)))


@pytest.mark.parametrize("N, shared", [(1, True), (3, True), (2, False)])
def test_small_batch_moe_kernel_widens_bf16_experts_exactly(N, shared):
    """The Triton decode MoE (interpreter on a CPU) reads bf16 routed stacks for an fp32 x, beside an fp32 shared
    expert, as the model holds them: the same bits as fp32 stacks holding the same values. (That the kernels
    compile for sm_90 with this mix of pointer types is checked in tests/test_triton_kda.py.)"""
    g = torch.Generator().manual_seed(N)
    E, I, D, K = 8, 32, 64, 2
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(N, D, generator=g).to(dev)
    gate_up = (torch.randn(E, 2 * I, D, generator=g) * D ** -0.5).bfloat16().to(dev)
    down = (torch.randn(E, D, I, generator=g) * I ** -0.5).bfloat16().to(dev)
    sw = tuple((torch.randn(*s, generator=g) * s[1] ** -0.5).bfloat16().float().to(dev)
               for s in ((I, D), (I, D), (D, I))) if shared else None
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(dev)
    w = torch.rand(N, K, generator=g).to(dev)
    narrow = fused_moe_small_batch(x, idx, w, gate_up, down, sw)
    wide = fused_moe_small_batch(x, idx, w, gate_up.float(), down.float(), sw)
    assert narrow.dtype == torch.float32 and torch.isfinite(narrow).all()
    assert torch.equal(narrow, wide)
    with ops.use("torch"):  # and the reference loop agrees to fp32 summation order
        ref = ops.moe_experts(x, idx, w, gate_up, down, None)
    if not shared:
        assert (narrow - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_checkpoint_loads_experts_in_their_own_dtype(tmp_path):
    cfg = get_config("tiny")
    save_checkpoint(synthetic_weights(cfg, 0, "cpu", torch.bfloat16), cfg, tmp_path / "ckpt")
    _, state = load_checkpoint(tmp_path / "ckpt", dtype=torch.float32, expert_dtype=torch.bfloat16)
    held = {n: t.dtype for n, t in state.items() if n.endswith(ROUTED_EXPERTS)}
    assert held and set(held.values()) == {torch.bfloat16}
    assert state["lm_head.weight"].dtype == torch.float32


@pytest.mark.parametrize("bad", [torch.float16, torch.int8])
def test_expert_dtypes_that_cannot_hold_the_values_are_refused(bad, tmp_path):
    with pytest.raises(ValueError, match="cannot hold the experts' bf16 checkpoint values exactly"):
        synthetic_weights(get_config("tiny"), expert_dtype=bad)
    with pytest.raises(ValueError, match="--expert-dtype 'fp16'"):
        resolve(preset="tiny", device="cpu", expert_dtype="fp16")


def test_projection_counts_the_experts_at_their_own_width():
    c = param_counts(BIG)
    assert c.routed_experts == 26 * 256 * 3 * 1024 * 2304  # SPEC §1: 26 MoE layers of 256 experts
    p = project_peak(BIG, torch.float32, 1, 200, expert_dtype=torch.bfloat16)
    assert p.weights_bytes == 4 * (c.total - c.routed_experts) + 2 * c.routed_experts + 2 * c.router  # bf16 router copies
    assert p.weights_bytes == project_peak(BIG, torch.bfloat16, 1, 200).weights_bytes \
        + 2 * (c.total - c.fp32 - c.routed_experts - c.router)
    # fp32 compute fits one H200 (~139.8 GiB) with the default 15 GiB floor; the all-fp32 model does not
    assert p.total + 15 * GiB < 139 * GiB < project_peak(BIG, torch.float32, 1, 200).total


def test_gate_a_defaults_to_fp32_with_bf16_experts_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    a = resolve(preset="48b-a3b", device="cuda", exact=True)
    assert (a.dtype, a.expert_dtype, a.precision) == ("fp32", "bf16", "fp32 (experts bf16)")
    assert (resolve(preset="48b-a3b", device="cuda").dtype, resolve(preset="48b-a3b", device="cuda").expert_dtype) \
        == ("bf16", None)  # the memory gate, HF goldens: the bf16 serving precision
    assert resolve(preset="48b-a3b", device="cuda", dtype="bf16", exact=True).expert_dtype is None  # --dtype wins
    cpu = resolve(preset="tiny", device="cpu", exact=True)
    assert (cpu.dtype, cpu.expert_dtype) == ("fp32", None)
    assert resolve(preset="tiny", device="cpu", dtype="bf16", expert_dtype="bf16").expert_dtype is None  # one dtype


def test_cli_gate_a_passes_on_tiny_with_bf16_experts(tmp_path):
    r = cli("gate-a", "--preset", "tiny", "--device", "cpu", "--expert-dtype", "bf16", records=tmp_path)
    assert r.returncode == EXIT_PASS, r.stdout + r.stderr
    assert "fp32 (experts bf16) cpu" in r.stdout and "Gate A PASS 128/128" in r.stdout
    rec = only_record(tmp_path, "gate_a")
    assert (rec["dtype"], rec["params"]["expert_dtype"]) == ("float32", "bf16")


def test_hf_golden_refuses_held_apart_experts(tmp_path):
    r = cli("golden", "--preset", "tiny", "--device", "cpu", "--expert-dtype", "bf16",
            "--golden", str(tmp_path / "g.json"), records=tmp_path)
    assert r.returncode == 2 and "HF transformers holds the whole model in one dtype" in r.stderr
    assert not (tmp_path / "g.json").exists()


@pytest.mark.parametrize("exact, free_gib, fits", [(True, 120, True), (True, 105, False), (False, 110, True),
                                                   (False, 105, False)])
def test_default_on_one_cuda_gpu_follows_the_projection_at_the_gates_precision(monkeypatch, exact, free_gib, fits):
    """Without --preset a GPU runs 48b-a3b in one process when NVML's free memory holds the projected peak at the
    gate's precision plus the floor: ~97 GiB + 15 for Gate A (fp32, experts bf16), ~93 GiB + 15 for the bf16 gates.
    Where it does not, the run is refused, saying how many such GPUs would hold it (no silent fallback to tiny)."""
    from gates.memory import MemReading, WorldRefused
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    readings = lambda: [MemReading(total=140 * GiB, free=free_gib * GiB, source="simulated")]
    if fits:
        opts = resolve(device="cuda", exact=exact, world=None, readings=readings)
        assert (opts.preset, opts.world) == ("48b-a3b", 1)
    else:
        with pytest.raises(WorldRefused, match=f"this box has 1 x {free_gib}.0 GiB free; 2 such GPUs would hold it"):
            resolve(device="cuda", exact=exact, world=None, readings=readings)
    none = resolve(device="cuda", exact=exact, world=None, readings=lambda: [None])
    assert (none.preset, none.world) == ("48b-a3b", 1)  # no reading: the floor guard refuses for want of one


def test_gate_b_on_cuda_defaults_to_the_committed_self_golden(monkeypatch):
    """Gate B's CUDA default follows Gate A's precision (`gates.__main__.EXACT_COMMANDS`) and finds the fp32 golden
    our recompute path made on the H200 for these prompts, weights and length; `--dtype bf16` finds HF's."""
    from gates.__main__ import EXACT_COMMANDS, exact_precision
    from gates.golden import GOLDEN_DIR, check_golden, find_golden, load_golden
    from gates.run import battery_for
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "gate-b" in EXACT_COMMANDS and "gate-memory" not in EXACT_COMMANDS
    assert exact_precision("golden", "self") and not exact_precision("golden", "hf")  # HF goldens stay bf16
    assert not exact_precision("gate-memory", "hf")
    opts = resolve(preset="48b-a3b", device="cuda", exact=True)
    path = find_golden(opts)
    assert path == GOLDEN_DIR / "48b-a3b-fp32-cuda-self.json"
    g = load_golden(path)
    hf = load_golden(find_golden(resolve(preset="48b-a3b", device="cuda", dtype="bf16", exact=True)))
    assert (hf["source"], hf["dtype"]) == ("hf", "bf16")
    assert (g["dtype"], g["device"], g["source"], g["weights"]) == ("fp32", "cuda", "self", hf["weights"])
    assert g["provenance"]["expert_dtype"] == "bf16" and g["provenance"]["implementation"] == "self-recompute"
    check_golden(g, path, hf["weights"], battery_for(opts).ids, opts.new_tokens)
