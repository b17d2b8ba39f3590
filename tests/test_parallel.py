"""Expert parallelism (model/parallel.py) on the CPU over gloo, 2 and 4 ranks on tiny, held against one process:
the split of the experts and what each rank loads (synthetic weights and a checkpoint), the partial outputs and
their sum, every step's logits on both generation paths, Gate A and Gate B run through the ranks (rank 0 judging),
and negative controls in which one rank drops its share. The ranks are forked (`parallel.spawn(start_method="fork")`:
no imports per rank); one test starts them fresh, as the CUDA ranks are."""
import copy
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from gates.gate_a import run_gate_a
from gates.gate_b import run_gate_b
from gates.prompts import battery
from gates.run import EXIT_FAIL, EXIT_PASS, resolve
from model import checkpoint, ops, parallel
from model.build import load_model
from model.checkpoint import ROUTED_EXPERTS, save_checkpoint
from model.config import get_config
from model.generate import generate_incremental, generate_recompute
from model.layers import MoE
from model.params import param_counts
from model.parallel import ExpertParallel
from model.weights import SAMPLE, _sample, sample_positions
from records.store import load

CFG = get_config("tiny")
E = CFG.num_experts
PROMPTS = battery(CFG).ids
NEW = 16
# Every step's logits of the ranks against one process, fp32: the ranks add the same terms in another order (a few
# 1e-6 seen on tiny, whose logits have std 3.5); a dropped share moves them by far more (asserted below).
TOL = 5e-5


def fork(fn, world: int, *args, timeout_s: float = 300):
    return parallel.spawn(fn, world, args, start_method="fork", timeout_s=timeout_s)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def single():
    return load_model("tiny")


def generations(model, prompts, new=NEW) -> list[dict]:
    out = []
    for p in prompts:
        inc = generate_incremental(model, p, new, keep_logits=True)
        rec = generate_recompute(model, p, new, keep_logits=True)
        out.append(dict(inc=torch.stack(inc.logits), rec=torch.stack(rec.logits), inc_tokens=inc.tokens,
                        rec_tokens=rec.tokens))
    return out


@dataclasses.dataclass(frozen=True)
class DroppedShare(ExpertParallel):
    """Negative control: rank `drop` zeroes its partial output before the sum (only in decode steps, one token a
    sequence, when `decode_only`)."""
    drop: int = -1
    decode_only: bool = False

    def reduce(self, y):
        if self.rank == self.drop and not (self.decode_only and y.shape[0] > 1):
            y = torch.zeros_like(y)
        return super().reduce(y)


def drop_share(model, rank: int, decode_only: bool = False) -> None:
    for m in model.modules():
        if isinstance(m, MoE):
            m.ep = DroppedShare(**{f.name: getattr(m.ep, f.name) for f in dataclasses.fields(ExpertParallel)},
                                drop=rank, decode_only=decode_only)


# ---- workers: each runs on every rank ----------------------------------------------------------------------------

def _load(ckpt=None, device="cpu"):
    return load_model(None if ckpt else "tiny", ckpt, device=device, ep=ExpertParallel.of(E))


def _state(ckpt=None):
    loaded = _load(ckpt)
    return loaded.weights, {n: t.clone() for n, t in loaded.model.state_dict().items()}


def _generations(n_prompts: int, ckpt=None, drop=None):
    model = _load(ckpt).model
    if drop is not None:
        drop_share(model, drop)
    return generations(model, PROMPTS[:n_prompts])


def _gates(root: str, drop=None, decode_only=False, gates="ab"):
    subject = _load()
    if drop is not None:
        drop_share(subject.model, drop, decode_only)
    rank = dist.get_rank()
    lines = []
    log = lines.append if rank == 0 else (lambda *a: None)
    opts = resolve(preset="tiny", device="cpu", dtype="fp32")
    out = {}
    if "a" in gates:
        out["a"] = run_gate_a(opts, subject=subject, records_root=f"{root}/{rank}", log=log)
    if "b" in gates:
        out["b"] = run_gate_b(opts, subject=subject, records_root=f"{root}/{rank}", log=log)
    return out, lines


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_world_size(), float(t)


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    time.sleep(60)  # outside any collective, so that rank 1's error is the first one seen


def _hang():
    time.sleep(60)


# ---- the split ----------------------------------------------------------------------------------------------------

def test_a_world_that_does_not_divide_the_experts_is_refused():
    with pytest.raises(ValueError, match=r"8 routed experts do not split evenly.*divides 8 \(1, 2, 4, 8\)"):
        ExpertParallel(3, 0, 8)
    with pytest.raises(ValueError, match="rank 2 lies outside 0..1"):
        ExpertParallel(2, 2, 8)
    with pytest.raises(ValueError, match="set up for 16 routed experts; config 'tiny' has 8"):
        ExpertParallel(2, 0, 16).layout(CFG)
    with pytest.raises(TypeError):
        ExpertParallel(2.0, 0, 8)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_the_ranks_hold_every_expert_once_in_contiguous_ranges(world):
    ranges = [ExpertParallel(world, r, E).experts for r in range(world)]
    assert [e for r in ranges for e in r] == list(range(E))
    assert all(len(r) == E // world for r in ranges)


def test_a_rank_layout_lists_its_own_experts_alone():
    full_slots, full_internal = checkpoint.layout(CFG)
    ep = ExpertParallel(4, 2, E)
    slots, internal = ep.layout(CFG)
    experts = [n for n in full_slots if ".experts." in n]
    own = [n for n in experts if int(n.split(".experts.")[1].split(".")[0]) in ep.experts]
    assert len(own) == len(experts) // 4 > 0
    assert set(slots) == (set(full_slots) - set(experts)) | set(own)
    for n in own:
        assert slots[n].index[0] == full_slots[n].index[0] - ep.start
    for n, (shape, dt) in internal.items():
        assert shape == ((E // 4, *full_internal[n][0][1:]) if n.endswith(ROUTED_EXPERTS) else full_internal[n][0])


def test_localize_keeps_own_slots_and_weighs_the_others_zero():
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(64)])
    w = torch.rand(64, 2, generator=g)
    for r in range(4):
        ep = ExpertParallel(4, r, E)
        li, lw = ep.localize(idx, w)
        owned = (idx >= ep.start) & (idx < ep.stop)
        assert 0 < owned.sum() < owned.numel()
        assert ((li >= 0) & (li < ep.num_local)).all()
        assert torch.equal(li[owned], idx[owned] - ep.start)
        assert torch.equal(lw[owned], w[owned]) and (lw[~owned] == 0).all()
        # a foreign slot points at its token's own expert when it has one: no extra rows streamed for it
        some = owned.any(-1)
        first = (idx - ep.start).gather(-1, owned.to(torch.uint8).argmax(-1, keepdim=True))[:, 0]
        assert torch.equal(li[some & ~owned[:, 0], 0], first[some & ~owned[:, 0]])


@pytest.mark.parametrize("world,kernels,tokens", [
    (2, "torch", 40), (4, "torch", 40), (2, "torch", 1), (4, "torch", 1), (2, "triton", 2), (4, "triton", 2)])
def test_partial_outputs_sum_to_the_one_process_moe(single, world, kernels, tokens):
    """In one process, no collective: the ranks' partial outputs of a MoE layer add up to the layer's output; the
    shared expert counted once (adding it on every rank fails); a rank none of whose experts a token chose adds
    exactly zero for it."""
    moe = single.model.model.layers[1].mlp
    x = torch.randn(tokens, CFG.hidden_size, generator=torch.Generator().manual_seed(world + tokens))
    with ops.use(kernels):
        ref = moe(x)
        idx, _ = moe.gate(x)
        partials = []
        for r in range(world):
            m = copy.deepcopy(moe)
            m.shard_(ExpertParallel(world, r, E))
            partials.append(m.partial(x))
            if r:
                none_here = ~((idx >= m.ep.start) & (idx < m.ep.stop)).any(-1)
                assert torch.equal(partials[-1][none_here], torch.zeros_like(partials[-1][none_here]))
        total = sum(p.float() for p in partials)
        torch.testing.assert_close(total, ref, rtol=0, atol=1e-6)
        twice = total + (world - 1) * moe.shared_experts(x)
        assert (twice - ref).abs().max() > 1e-3


def test_sharding_twice_or_for_other_experts_is_refused(single):
    m = copy.deepcopy(single.model.model.layers[1].mlp)
    with pytest.raises(ValueError, match="over 16 experts; this layer holds 8"):
        m.shard_(ExpertParallel(2, 0, 16))
    m.shard_(ExpertParallel(2, 0, E))
    with pytest.raises(RuntimeError, match="sharded already"):
        m.shard_(ExpertParallel(2, 0, E))


def test_one_rank_is_the_one_process_model(single):
    one = load_model("tiny", ep=ExpertParallel(1, 0, E))
    assert all(m.ep is None for m in one.model.modules() if isinstance(m, MoE))
    assert one.weights == single.weights
    a, b = generations(one.model, PROMPTS[:1], 4)[0], generations(single.model, PROMPTS[:1], 4)[0]
    assert torch.equal(a["inc"], b["inc"]) and torch.equal(a["rec"], b["rec"])


# ---- what a rank loads --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 3 * SAMPLE, 3 * SAMPLE + 1, 32768, 1_000_003])
def test_sample_positions_are_those_the_fingerprint_samples(n):
    flat = torch.randperm(n)
    assert torch.equal(flat[sample_positions(n)], _sample(flat))


def check_rank_state(single, world, states):
    full = single.model.state_dict()
    counts = param_counts(CFG)
    for r, (wid, state) in enumerate(states):
        ep = ExpertParallel(world, r, E)
        assert wid == single.weights  # the whole model's weights id, assembled across the ranks
        assert set(state) == set(full)
        for n, t in state.items():
            want = full[n][ep.start:ep.stop] if n.endswith(ROUTED_EXPERTS) else full[n]
            assert t.shape == want.shape and torch.equal(t, want), n
        assert sum(t.numel() for t in state.values()) == counts.total - counts.routed_experts * (world - 1) // world


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_draws_only_its_experts_with_the_one_process_values(single, world):
    check_rank_state(single, world, fork(_state, world))


@pytest.fixture(scope="module")
def tiny_checkpoint(single, tmp_path_factory):
    return save_checkpoint(single.model.state_dict(), CFG, tmp_path_factory.mktemp("ckpt") / "tiny",
                           max_shard_bytes=200_000)


def test_a_rank_reads_only_its_experts_from_a_checkpoint(single, tiny_checkpoint, monkeypatch):
    """No process group: the loader alone. Every other tensor is read; of the experts, only the rank's own."""
    read = []
    opened = []
    real_open = checkpoint._open

    class Recording:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    def recording_open(file, device):
        opened.append(file.name)
        return Recording(real_open(file, device))

    monkeypatch.setattr(checkpoint, "_open", recording_open)
    full = single.model.state_dict()
    names = checkpoint.original_names(CFG)
    for r in range(2):
        read.clear()
        ep = ExpertParallel(2, r, E)
        cfg, state = parallel.load_checkpoint_shard(tiny_checkpoint, ep, dtype=torch.float32)
        own = {n for n in names if ".experts." not in n
               or int(n.split(".experts.")[1].split(".")[0]) in ep.experts}
        assert set(read) == own and len(read) == len(own) < len(names)
        for n, t in state.items():
            assert torch.equal(t, full[n][ep.start:ep.stop] if n.endswith(ROUTED_EXPERTS) else full[n]), n


def test_a_layout_naming_a_tensor_the_checkpoint_lacks_is_refused(tiny_checkpoint):
    """Negative control for the partial loader: a slot that no shard holds is never read, and the load says so
    instead of returning the tensor as allocated."""
    def with_a_ghost(cfg):
        slots, shapes = ExpertParallel(2, 0, E).layout(cfg)
        name, slot = next(iter(slots.items()))
        return {**slots, name + ".ghost": slot}, shapes

    with pytest.raises(checkpoint.CheckpointError, match=r"read \d+ of the \d+ tensors to load"):
        checkpoint.load_checkpoint(tiny_checkpoint, dtype=torch.float32, layout_of=with_a_ghost)


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_loads_only_its_experts_from_a_checkpoint(single, tiny_checkpoint, world):
    check_rank_state(single, world, fork(_state, world, str(tiny_checkpoint)))


# ---- logits, every step, both paths --------------------------------------------------------------------------------

def check_against_one_process(ref, ranks):
    worst = 0.0
    for rank in ranks:
        assert len(rank) == len(ref)
        for got, want, other in zip(rank, ref, ranks[0]):
            assert got["inc_tokens"] == want["inc_tokens"] and got["rec_tokens"] == want["rec_tokens"]
            for path in ("inc", "rec"):
                torch.testing.assert_close(got[path], want[path], rtol=0, atol=TOL)
                assert torch.equal(got[path], other[path])  # every rank the same bits: same tokens, same state
                worst = max(worst, float((got[path] - want[path]).abs().max()))
    return worst


@pytest.mark.parametrize("world", [2, 4])
def test_every_step_matches_one_process_on_both_paths(single, world):
    n = 3 if world == 2 else 1
    ref = generations(single.model, PROMPTS[:n])
    worst = check_against_one_process(ref, fork(_generations, world, n))
    assert worst > 0  # the sums really ran in another order: the comparison is not of one computation with itself


def test_checkpoint_ranks_match_one_process(single, tiny_checkpoint):
    ref = generations(single.model, PROMPTS[:1])
    check_against_one_process(ref, fork(_generations, 2, 1, str(tiny_checkpoint)))


def test_a_rank_that_drops_its_share_moves_the_logits(single):
    ref = generations(single.model, PROMPTS[:1])
    ranks = fork(_generations, 2, 1, None, 1)
    diff = max(float((r[0][p] - ref[0][p]).abs().max()) for r in ranks for p in ("inc", "rec"))
    assert diff > 100 * TOL
    with pytest.raises(AssertionError):
        check_against_one_process(ref, ranks)


@pytest.mark.slow
def test_triton_kernels_through_the_ranks_match_one_process(single):
    """The decode kernels (fused router and expert launches) on a rank's stacks, through Triton's interpreter."""
    with ops.use("torch"):
        ref = generate_incremental(single.model, PROMPTS[0][:12], 3, keep_logits=True)
    ranks = fork(_triton_generation, 2, PROMPTS[0][:12], 3)
    for got in ranks:
        assert got[1] == ref.tokens
        torch.testing.assert_close(got[0], torch.stack(ref.logits), rtol=0, atol=TOL)


def _triton_generation(prompt, new):
    model = _load().model
    with ops.use("triton"):
        g = generate_incremental(model, prompt, new, keep_logits=True)
    return torch.stack(g.logits), g.tokens


# ---- the gates through the ranks ----------------------------------------------------------------------------------

def check_gates_pass(ranks, root):
    for codes, _ in ranks:
        assert codes == {"a": EXIT_PASS, "b": EXIT_PASS}
    lines = ranks[0][1]
    assert any(line.startswith("Gate A PASS 128/128") for line in lines), lines[-3:]
    assert any(line.startswith("Gate B PASS 128/128") for line in lines), lines[-3:]
    assert load("gate_a", root=root / "0").records[0]["results"]["passed"] is True
    assert load("gate_b", root=root / "0").records[0]["results"]["passed"] is True


def test_gates_pass_through_two_ranks(tmp_path):
    check_gates_pass(fork(_gates, 2, str(tmp_path)), tmp_path)


@pytest.mark.slow
def test_gates_pass_through_four_ranks(tmp_path):
    check_gates_pass(fork(_gates, 4, str(tmp_path)), tmp_path)


def test_gate_b_fails_when_a_rank_drops_its_share(tmp_path):
    ranks = fork(_gates, 2, str(tmp_path), 1, False, "b")
    assert [codes["b"] for codes, _ in ranks] == [EXIT_FAIL, EXIT_FAIL]
    assert any("md5 differs" in line for line in ranks[0][1])


def test_gate_a_fails_when_a_rank_drops_its_share_in_decode(tmp_path):
    """Dropped everywhere, both paths lose the same share and agree (Gate B catches that); dropped in the decode step
    alone (a missing collective in the captured step, say), the incremental path parts from the recompute path."""
    ranks = fork(_gates, 2, str(tmp_path), 0, True, "a")
    assert [codes["a"] for codes, _ in ranks] == [EXIT_FAIL, EXIT_FAIL]
    assert any(line.startswith("Gate A FAIL") for line in ranks[0][1]), ranks[0][1][-3:]


# ---- processes ---------------------------------------------------------------------------------------------------

def test_spawned_ranks_start_fresh_and_reduce():
    assert parallel.spawn(_sum_of_ranks, 2, timeout_s=120) == [(2, 3.0), (2, 3.0)]


def test_a_failing_rank_stops_the_run_with_its_error():
    t = time.perf_counter()
    with pytest.raises(ProcessRaisedException, match="rank 1 fails on purpose"):
        fork(_raise_on_rank_1, 2)
    assert time.perf_counter() - t < 30  # rank 0 was stopped, not waited for


def test_ranks_that_hang_are_stopped():
    t = time.perf_counter()
    with pytest.raises(TimeoutError, match="did not finish within 2 s"):
        fork(_hang, 2, timeout_s=2)
    assert time.perf_counter() - t < 30


def test_bad_process_setups_are_refused(monkeypatch):
    for var in parallel.RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="WORLD_SIZE is not set: start the ranks with torchrun"):
        parallel.init()
    with pytest.raises(ValueError, match="positive int"):
        parallel.spawn(_sum_of_ranks, 0)
    with pytest.raises(ValueError, match="CPU ranks only"):
        parallel.spawn(_sum_of_ranks, 2, device="cuda", start_method="fork")
    with pytest.raises(RuntimeError, match="no process group"):
        ExpertParallel.of(E)


# ---- CUDA: NCCL, the collective inside the captured decode step ----------------------------------------------------

def _cuda_generation(prompt, new):
    model = _load(device=torch.device("cuda", torch.cuda.current_device())).model  # cuda:LOCAL_RANK (`init`)
    g = generate_incremental(model, prompt, new, keep_logits=True)  # the CUDA-graph decoder on CUDA
    return torch.stack(g.logits), g.tokens, g.decoder


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_ranks_with_the_graph_decoder_match_one_process():
    ref = generate_incremental(load_model("tiny", device="cuda").model, PROMPTS[0], NEW, keep_logits=True)
    ranks = parallel.spawn(_cuda_generation, 2, (PROMPTS[0], NEW), device="cuda", timeout_s=600)
    for logits, tokens, decoder in ranks:
        assert decoder == "GraphDecoder" and ref.decoder == "GraphDecoder"
        assert tokens == ref.tokens
        torch.testing.assert_close(logits, torch.stack(ref.logits), rtol=0, atol=TOL)
