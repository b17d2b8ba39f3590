"""Kernel modules' launch configs: read-only from outside their modules, changed for one call by a kernel's `cfg`
and for a block of code by `model.triton.overrides` (a call's cfg over the block's change over the default), which
reaches the kernel launch, is undone after the block (also when it raises), stays in its thread and refuses what
it cannot apply. Small shapes through Triton's interpreter on the CPU."""
import importlib
import pkgutil
import threading
from collections.abc import Mapping

import pytest
import torch

import model.triton as mt
from model.triton import conv, kda_chunk, mla_decode as ml

KERNEL_MODULES = sorted(m.name for m in pkgutil.iter_modules(mt.__path__))


def launch_configs() -> dict[str, tuple[object, str, object]]:
    """"module.NAME" -> (module, NAME, value) for every upper-case mapping global of model.triton's kernel modules."""
    out = {}
    for name in KERNEL_MODULES:
        mod = importlib.import_module(f"model.triton.{name}")
        for attr, value in vars(mod).items():
            if attr.isupper() and isinstance(value, (dict, mt.LaunchConfig)):
                out[f"{name}.{attr}"] = (mod, attr, value)
    return out


def test_every_kernel_modules_launch_config_is_read_only_from_outside():
    """Each upper-case config global of a kernel module is a LaunchConfig named by where it lives; writing an item,
    a nested item or an attribute of it, or rebinding or deleting the global, raises and leaves it as it was. The
    module's functions stay patchable (the A/B's call counter and tests wrap them)."""
    found = launch_configs()
    assert {"conv.CONFIG", "kda_chunk.CONFIG", "kda_decode.DECODE", "mla_decode.CONFIG", "mla_decode.SHORT",
            "mla_decode.ABSORB", "moe.GATE_UP", "moe_dispatch.DISPATCH"} <= set(found)
    for key, (mod, attr, cfg) in found.items():
        assert isinstance(cfg, mt.LaunchConfig) and cfg.key == key, key
        before = mt.plain(cfg)
        k = next(iter(cfg))
        with pytest.raises(TypeError):
            cfg[k] = cfg[k]
        with pytest.raises(TypeError):
            del cfg[k]
        with pytest.raises(AttributeError):
            cfg.defaults = {}
        with pytest.raises(AttributeError):
            setattr(mod, attr, dict(before))
        with pytest.raises(AttributeError):
            delattr(mod, attr)
        for v in cfg.values():
            if isinstance(v, Mapping):
                with pytest.raises(TypeError):
                    v[next(iter(v))] = 0
        assert getattr(mod, attr) is cfg and mt.plain(cfg) == before, key
    real = conv.causal_conv1d
    conv.causal_conv1d = real   # not a launch config: rebinding stays allowed
    assert conv.causal_conv1d is real


def test_monkeypatching_a_launch_config_is_refused(monkeypatch):
    """What tests did before there was `overrides`: a monkeypatch of the global or of its items now raises."""
    with pytest.raises(AttributeError, match="model.triton.overrides"):
        monkeypatch.setattr(ml, "SHORT", None)
    with pytest.raises(TypeError):
        monkeypatch.setitem(kda_chunk.CONFIG, "scan_warps", 2)
    assert ml.SHORT["heads"] == 16 and kda_chunk.CONFIG["scan_warps"] == 4


class Spy:
    """Stands in for a kernel: records each launch's grid and keyword arguments, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def conv_spy(monkeypatch):
    spy = Spy(conv._causal_conv1d_kernel)
    real = mt.require_runnable
    monkeypatch.setattr(conv, "_causal_conv1d_kernel", spy)
    monkeypatch.setattr(mt, "require_runnable", lambda kernel, device: real(getattr(kernel, "kernel", kernel), device))
    return spy


def conv_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 40, 8, generator=g), torch.randn(8, 4, generator=g), torch.randn(1, 3, 8, generator=g)


def launched(spy) -> dict:
    grid, kw = spy.launches[-1]
    return dict(rows=grid[0], BT=kw["BT"], BC=kw["BC"], STEP=kw["STEP"], num_warps=kw["num_warps"])


def test_a_scoped_override_reaches_the_launch_and_is_undone_after_the_block(conv_spy):
    """The conv inside `overrides` launches with the block's tiles (its grid too), a call's cfg wins over them key
    by key, and after the block, whether it returned or raised, the default's; every tile gives torch's bits."""
    x, w, taps = conv_inputs()
    y0 = conv.causal_conv1d(x, w, taps)[0]
    assert launched(conv_spy) == dict(rows=2, BT=32, BC=512, STEP=4, num_warps=4)
    with mt.overrides({"conv.CONFIG": dict(BT=16, num_warps=2)}):
        assert conv.CONFIG["BT"] == 16 and conv.CONFIG.defaults["BT"] == 32
        y1 = conv.causal_conv1d(x, w, taps)[0]
        assert launched(conv_spy) == dict(rows=3, BT=16, BC=512, STEP=4, num_warps=2)
        conv.causal_conv1d(x, w, taps, cfg=dict(STEP=2))
        assert launched(conv_spy) == dict(rows=3, BT=16, BC=512, STEP=2, num_warps=2)
        conv.causal_conv1d(x, w, taps, cfg=dict(BT=8))
        assert launched(conv_spy) == dict(rows=5, BT=8, BC=512, STEP=4, num_warps=2)
    conv.causal_conv1d(x, w, taps)
    assert launched(conv_spy) == dict(rows=2, BT=32, BC=512, STEP=4, num_warps=4)
    with pytest.raises(RuntimeError, match="inside the block"):
        with mt.overrides({"conv.CONFIG": dict(BT=8)}):
            conv.causal_conv1d(x, w, taps)
            assert launched(conv_spy)["BT"] == 8
            raise RuntimeError("a failure inside the block")
    conv.causal_conv1d(x, w, taps)
    assert launched(conv_spy)["BT"] == 32 and conv.CONFIG["BT"] == 32
    assert torch.equal(y0, y1)


def test_the_kernel_checks_a_scoped_config_as_it_checks_a_cfg():
    """A value the kernel cannot take fails at the launch inside the block, as the same cfg would."""
    x, w, taps = conv_inputs()
    with mt.overrides({"conv.CONFIG": dict(BT=30)}):
        with pytest.raises(ValueError, match="BT=30 is no multiple of STEP=4"):
            conv.causal_conv1d(x, w, taps)
    with pytest.raises(ValueError, match="BT=30 is no multiple of STEP=4"):
        conv.causal_conv1d(x, w, taps, cfg=dict(BT=30))


@pytest.mark.parametrize("changes, why", [
    ({"conv.CONFIG": dict(BQ=16)}, r"conv.CONFIG: unknown cfg keys \['BQ'\]; its keys: \['BC', 'BT', "),
    ({"kda_chunk.CONFIG": dict(scan_warps=2, exact=dict(chunk=64, BQ=1))},
     r"kda_chunk.CONFIG\['exact'\]: unknown cfg keys \['BQ'\]"),
    # a candidate kernel is no kernel module of model.triton (benchmarks.candidates: installed, not configured)
    ({"moe_grouped.CONFIG": dict(use=("down",))}, "'moe_grouped.CONFIG' names no launch config"),
    ({"kda_chunk.CONFIG": dict(scan_warps="eight")}, "'scan_warps' must be a number as its default 4 is"),
    ({"conv.CONFIG": [("BT", 16)]}, "must be an object of keys to change"),
    ({"conv.NOPE": dict(BT=16)}, "'conv.NOPE' names no launch config"),
    ({"no_such_module.CONFIG": dict(BT=16)}, "'no_such_module.CONFIG' names no launch config"),
    ({"conv": dict(BT=16)}, "'conv' names no launch config"),
    ({"conv.silu_f32": {}}, "'conv.silu_f32' names no launch config"),
])
def test_an_override_it_cannot_apply_is_refused_before_the_block_runs(changes, why):
    """An unknown key (nested too), a value of another kind than the default's, or a name that is no launch
    config: an error before the block's body runs, and nothing changed, also for the block's other names."""
    ran = []
    with pytest.raises(mt.UnknownConfigKeys, match=why):
        with mt.overrides({"kda_chunk.CONFIG": dict(scan_warps=2), **changes}):
            ran.append(1)
    assert ran == [] and kda_chunk.CONFIG["scan_warps"] == 4 and conv.CONFIG["BT"] == 32
    with pytest.raises(ValueError):    # a kernel's caller catches it as a ValueError, a lookup as a KeyError
        with mt.overrides(changes):
            pass
    with pytest.raises(KeyError):
        with mt.overrides(changes):
            pass


def test_overrides_nest_change_nested_configs_key_by_key_and_stay_in_their_thread():
    """An inner block changes the outer block's config (and is undone to it), a nested config keeps the keys the
    change does not name, and another thread sees the defaults (a ContextVar, not a global)."""
    seen = []
    with mt.overrides({"kda_chunk.CONFIG": dict(scan_warps=2, exact=dict(chunk=64))}):
        with mt.overrides({"kda_chunk.CONFIG": dict(exact=dict(prep_warps=4)), "mla_decode.SHORT": dict(heads=None)}):
            assert mt.plain(kda_chunk.CONFIG["exact"]) == {**kda_chunk.CONFIG.defaults["exact"], "chunk": 64,
                                                           "prep_warps": 4}
            assert kda_chunk.CONFIG["scan_warps"] == 2 and ml.SHORT["heads"] is None
            t = threading.Thread(target=lambda: seen.append((kda_chunk.CONFIG["scan_warps"], ml.SHORT["heads"])))
            t.start()
            t.join()
        assert kda_chunk.CONFIG["exact"]["prep_warps"] == 2 and kda_chunk.CONFIG["exact"]["chunk"] == 64
        assert ml.SHORT["heads"] == 16
    assert seen == [(4, 16)]
    assert mt.plain(kda_chunk.CONFIG) == mt.plain(kda_chunk.CONFIG.defaults)


def test_a_launch_config_equals_and_serialises_as_its_dict():
    """Records and tests compare a config with dicts and write it as JSON (`mt.plain`); the launch dict a kernel
    gets is plain, nested configs included."""
    import json
    assert kda_chunk.CONFIG == mt.plain(kda_chunk.CONFIG) and dict(conv.CONFIG) == dict(BT=32, BC=512, STEP=4,
                                                                                          num_warps=4)
    assert kda_chunk.CONFIG != {**mt.plain(kda_chunk.CONFIG), "chunk": 64}
    assert json.loads(json.dumps(mt.plain(kda_chunk.CONFIG)))["exact"] == {"chunk": 32, "prep_warps": 2}
    c = mt.launch_config("kda_chunk", kda_chunk.CONFIG, dict(exact=dict(chunk=64)))
    assert type(c) is dict and type(c["exact"]) is dict and c["exact"] == {"chunk": 64, "prep_warps": 2}


def test_mla_layout_reads_short_from_the_block(monkeypatch):
    """`default_layout` and `plan` (no cfg of their own for SHORT) take the block's SHORT: its heads and loop
    step, and none of its head groups with heads None."""
    monkeypatch.setattr(ml, "_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert ml.default_layout(1056, 1, 32, cuda) == (64, 16)
    with mt.overrides({"mla_decode.SHORT": dict(heads=8, BL=64)}):
        assert ml.default_layout(1056, 1, 32, cuda) == (128, 8)
        assert ml.plan(1056, 1, 32, torch.bfloat16, cuda, split=128, heads=8).step == 64
        with pytest.raises(ValueError, match="multiple of 64"):
            ml.plan(1056, 1, 32, torch.bfloat16, cuda, split=96, heads=8)
    assert ml.plan(1056, 1, 32, torch.bfloat16, cuda, split=96, heads=8).step == 32
    with mt.overrides({"mla_decode.CONFIG": dict(rows="heads")}):
        assert ml.plan(8192, 1, 32, torch.bfloat16, cuda).rows == "heads"
        assert ml.plan(8192, 1, 32, torch.bfloat16, cuda, cfg=dict(rows="positions")).rows == "positions"
    assert ml.plan(8192, 1, 32, torch.bfloat16, cuda).rows == "positions"


def test_the_ab_harness_changes_a_kernel_config_without_writing_it():
    """`bench_ab.applied` (and with it `decompose --variant`) runs its block inside `overrides`: the config reads
    changed there, its defaults are untouched, and after the block it reads as before."""
    from benchmarks import bench_ab
    with bench_ab.applied("kda_chunk", {"scan_warps": 2, "exact": {"chunk": 64}}):
        assert kda_chunk.CONFIG["scan_warps"] == 2 and kda_chunk.CONFIG["exact"]["chunk"] == 64
        assert kda_chunk.CONFIG.defaults["scan_warps"] == 4 and kda_chunk.CONFIG.defaults["exact"]["chunk"] == 32
    assert kda_chunk.CONFIG["scan_warps"] == 4 and kda_chunk.CONFIG["exact"]["chunk"] == 32
    with pytest.raises(RuntimeError):
        with bench_ab.applied("kda_chunk", {"exact": {"prep_warps": 4}}):
            assert kda_chunk.CONFIG["exact"]["prep_warps"] == 4
            raise RuntimeError("an arm that fails")
    assert kda_chunk.CONFIG["exact"]["prep_warps"] == 2 and kda_chunk.CONFIG["scan_warps"] == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_graph_captured_inside_a_block_holds_the_blocks_config(conv_spy):
    """A CUDA graph captured inside `overrides` launches with the block's config, and its replays after the block
    still run what was captured (on new inputs: torch's bits, which every tile gives)."""
    x, w, taps = (t.cuda() for t in conv_inputs())
    with mt.overrides({"conv.CONFIG": dict(BT=16, num_warps=2)}):
        conv.causal_conv1d(x, w, taps)   # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = conv.causal_conv1d(x, w, taps)[0]
    assert launched(conv_spy) == dict(rows=3, BT=16, BC=512, STEP=4, num_warps=2)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    n = len(conv_spy.launches)
    assert torch.equal(y, conv.causal_conv1d(x, w, taps)[0]) and launched(conv_spy)["BT"] == 32
    assert len(conv_spy.launches) == n + 1   # the replay launched nothing from Python
