"""Model-level A/B of kernel launch configs and candidate kernels: the whole prefill timed under the defaults and
under each variant, in interleaved rounds of one process, so that a kernel that wins alone (`benchmarks.kernels`) is
also judged where the model runs it.

    python -m benchmarks.bench_ab --variant 'down=benchmarks.candidates.moe_grouped:{"use": ["down"]}' \
        --variant 'both_tma=benchmarks.candidates.moe_grouped:{"gate_up": {"tma": true}, "down": {"tma": true}}' \
        [--prefill 8192,32768] [--rounds 8] [--preset 48b-a3b] [--device cuda]

A variant is NAME=MODULE:JSON: keys of `model.triton.MODULE.CONFIG` to change (a dict value changes only the
keys it names; lists become tuples), or of a dotted module's CONFIG: `'thread=benchmarks.timing:{"clocks":
"thread"}'` samples the clocks on a thread of this process rather than in a child process, and `{"clocks": "off"}`
not at all, which times the sampler's own cost to the host (`benchmarks.gpu_clocks`). A candidate, a kernel
measured against the default that did not become it (`benchmarks.candidates`), is named by its module,
`benchmarks.candidates.MODULE`: the arm runs the model with it installed (its `installed`, through a hook of
`model.ops`) and its CONFIG changed by JSON, which may be `{}` (the candidate as it stands). Each round runs the
defaults and every variant once, in an order rotated from round to round, each call a whole `model.prefill` of
the same random prompt into a fresh cache (`bench_e2e.PrefillCall`), timed by CUDA events from an idle device to
its end (`benchmarks.timing.time_calls`); one untimed call of each first (kernel compilation). One `kernel` record
per variant and length: `results.ours_ms` the variant's median, `results.peer_ms` the defaults' median in the
same rounds (`results.peer` = "defaults"), the host's time inside each call and how many calls it paced
(`results.host_ms`, `host_paced`; `peer_` the defaults'), the per-round ratios variant/defaults
(`results.paired_ratio_median`: rounds pair calls that ran seconds apart, so a drift of the machine cancels),
and the variant's last-position logits against the defaults' (relative RMS error, the same argmax, the same
bits). Each timed call also samples the GPU's clocks through NVML (`benchmarks.timing`,
`benchmarks.gpu_clocks`; `results.clocks_ours` / `clocks_peer`: mean SM clock, board power, the share of samples
under the power cap), since a faster kernel can lose its gain to a lower clock in a
power-capped prefill. A variant whose logits are non-finite or differ past `LOGITS_TOL` is INVALID.

A variant can also be code: NAME=MODULE@REV runs the arm with the `model.triton` kernel module as it was at git
revision REV (`'old_prep=kda_chunk@REV'`: its file from `git show`, loaded beside today's, `code_at`), in place of
today's for the arm's calls (`model.ops` imports each kernel module's entry points when it calls them, so the swap
reaches every call the model makes into it); a candidate is measured as the tree holds it. An arm that no call
reached is an error, not a silent copy of the defaults; its record's `params.changes` is {"@": the full commit}.
Such an arm may change the rounding, which this random-weight model amplifies, so it is held to `CODE_LOGITS_TOL`.
    python -m benchmarks.bench_ab --variant 'old_prep=kda_chunk@REV' [--prefill 8192,32768]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import inspect
import json
import statistics
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

import model.triton as mt
from benchmarks.bench_e2e import PrefillCall
from benchmarks.candidates import Unsupported
from benchmarks.cli import ints
from benchmarks.timing import Samples, log, summarize, time_calls
from records.store import REPO_ROOT, git

# Launch configs change summation orders at most (the grouped MoE candidate keeps torch's bits exactly); a wrong
# tile or expert moves bf16 logits by order 1.
LOGITS_TOL = 2e-2
# Code may change the rounding: a change of KDA's rounding alone moves the random-weight 48B model's 8k logits by
# about 0.1 relative RMS (docs/kernels.md#kda-chunk-launch-config); a wrong kernel still moves them by order 1.
CODE_LOGITS_TOL = 0.5
CODE = "@"  # the key of a code arm's changes: {"@": revision}
CANDIDATES = "benchmarks.candidates"  # the package of candidate kernels (`is_candidate`)


def parse_variant(text: str) -> tuple[str, str, dict]:
    """'NAME=MODULE:JSON' -> (name, module, changes), 'NAME=MODULE@REV' -> (name, module, {"@": REV}); a clear error
    for anything else. JSON is a non-empty object, or for a candidate (`is_candidate`) any object: `{}` runs it as it
    stands."""
    name, sep, rest = text.partition("=")
    code_module, at, rev = rest.partition("@")
    if sep and at and name and code_module and rev and ":" not in code_module:
        if is_candidate(code_module):
            raise argparse.ArgumentTypeError(f"variant {text!r}: a candidate is measured as the tree holds it; a code "
                                             f"arm (@REV) names a kernel module of model.triton")
        return name, code_module, {CODE: rev}
    module, sep2, body = rest.partition(":")
    if not (sep and sep2 and name and module):
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected NAME=MODULE:JSON")
    try:
        changes = json.loads(body)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"variant {text!r}: {e}") from None
    if not isinstance(changes, dict) or not (changes or is_candidate(module)):
        raise argparse.ArgumentTypeError(f"variant {text!r}: JSON must be a non-empty object")
    return name, module, changes


def _tuples(v):
    """JSON's lists as the tuples the CONFIGs hold, inside dicts too."""
    if isinstance(v, dict):
        return {k: _tuples(x) for k, x in v.items()}
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def config_module(module: str) -> str:
    """A variant's module by its full name: a bare name is one of `model.triton`'s kernel modules."""
    return module if "." in module else f"model.triton.{module}"


def is_candidate(module: str) -> bool:
    """Whether a variant's module is a candidate kernel (`benchmarks.candidates.MODULE`), which the arm installs in
    the model instead of changing a config that the model reads."""
    return module.startswith(CANDIDATES + ".")


def changed_config(module: str, changes: dict) -> tuple[Mapping, dict]:
    """(`<module>.CONFIG` (`config_module`), that CONFIG with `changes`, merged as `model.triton.launch_config` merges
    a sweep's overrides, a candidate's by its own `config`); an unknown module (ImportError) or key (KeyError) is an
    error, before anything runs."""
    name = config_module(module)
    mod = importlib.import_module(name)
    cfg = getattr(mod, "CONFIG", None)
    if is_candidate(module):
        return cfg, mod.config(_tuples(changes))
    if not isinstance(cfg, mt.LaunchConfig) and not (isinstance(cfg, Mapping) and hasattr(mod, "configured")):
        raise KeyError(f"{name} has no CONFIG dict to vary")
    return cfg, mt.launch_config(f"{name}.CONFIG", cfg, _tuples(changes))


def is_code(changes: dict) -> bool:
    return set(changes) == {CODE}


# (full module name, commit) -> (that module as it was then, {"calls": calls into its public functions})
_code: dict[tuple[str, str], tuple[object, dict]] = {}


def _public_functions(mod) -> dict:
    """The functions `mod` defines itself and does not mark private: the entry points `model.ops` calls. A candidate
    names them (`ENTRY_POINTS`: those that launch its kernels, not its config and install helpers)."""
    if hasattr(mod, "ENTRY_POINTS"):
        return {k: getattr(mod, k) for k in mod.ENTRY_POINTS}
    return {k: v for k, v in vars(mod).items()
            if inspect.isfunction(v) and v.__module__ == mod.__name__ and not k.startswith("_")}


def _counted(fn, reached: dict):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        reached["calls"] += 1
        return fn(*args, **kwargs)
    return call


def code_at(module: str, rev: str) -> str:
    """Load `module` (`config_module`) as it was at git revision `rev`, once; returns the full commit. The file comes
    from `git show` into a directory of its own (Triton reads a kernel's source from its file) and loads as a module
    beside today's, under another name; its public functions count their calls. A revision git does not know, or
    one without the file, is a ValueError."""
    name = config_module(module)
    if (name, rev) in _code:  # rev is already a loaded module's full commit
        return rev
    sha = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if sha is None:
        raise ValueError(f"{rev!r} is no commit of the checkout at {REPO_ROOT} (a copy of the tree whose git lacks it, "
                         "as on a GPU box, can be given it: `git bundle create main.bundle main` in the full checkout, "
                         "`git fetch main.bundle main:refs/remotes/bundle/main` in the copy)")
    sha = sha.strip()
    if (name, sha) not in _code:
        path = name.replace(".", "/") + ".py"
        src = git("show", f"{sha}:{path}")
        if src is None:
            raise ValueError(f"{path} is not in {sha[:12]}")
        f = Path(tempfile.mkdtemp(prefix="bench_ab_")) / f"{name.rpartition('.')[2]}_{sha[:12]}.py"
        f.write_text(src)
        spec = importlib.util.spec_from_file_location(f"{name}@{sha[:12]}", f)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        reached = {"calls": 0}
        for k, v in _public_functions(mod).items():
            setattr(mod, k, _counted(v, reached))
        _code[(name, sha)] = (mod, reached)
    return sha


def code_calls(module: str, rev: str) -> int:
    """Calls so far into the public functions of `module` as it was at `rev` (`code_at`)."""
    return _code[(config_module(module), code_at(module, rev))][1]["calls"]


@contextlib.contextmanager
def swapped(module: str, rev: str):
    """Inside the block, importing `module` gives it as it was at `rev` (`code_at`); today's after it."""
    name = config_module(module)
    old = _code[(name, code_at(module, rev))][0]
    current = importlib.import_module(name)
    parent, _, leaf = name.rpartition(".")
    pkg = sys.modules[parent]
    sys.modules[name] = old
    setattr(pkg, leaf, old)
    try:
        yield
    finally:
        sys.modules[name] = current
        setattr(pkg, leaf, current)


@contextlib.contextmanager
def counting_calls(module: str):
    """Inside the block, the public functions of today's `module` (`config_module`) count their calls into the
    dict it yields (`model.ops` looks each entry point up when it calls it, so the count sees every call)."""
    mod = importlib.import_module(config_module(module))
    reached = {"calls": 0}
    saved = _public_functions(mod)
    for k, v in saved.items():
        setattr(mod, k, _counted(v, reached))
    try:
        yield reached
    finally:
        for k, v in saved.items():
            setattr(mod, k, v)


def calls_during(module: str, changes: dict, run) -> int | None:
    """How many calls `run()` makes into the arm's kernel module: the module as it was at a code arm's revision,
    today's `model.triton` module of a config arm, or a candidate's `ENTRY_POINTS`; None for a config arm of another
    module (its CONFIG is read by code this count cannot see, e.g. `benchmarks.timing`)."""
    if is_code(changes):
        before = code_calls(module, changes[CODE])
        run()
        return code_calls(module, changes[CODE]) - before
    if "." in module and not is_candidate(module):
        run()
        return None
    with counting_calls(module) as reached:
        run()
    return reached["calls"]


@contextlib.contextmanager
def applied(module: str, changes: dict):
    """`<module>.CONFIG` reading with `changes` inside the block (`changed_config`), as before it after: a kernel
    module's through `model.triton.overrides`, a dotted module's through its own `configured` (`benchmarks.timing`):
    nothing is written. For a code arm ({"@": rev}), the module as it was at rev (`swapped`); for a candidate, the
    candidate installed in the model with its CONFIG so changed (its `installed`)."""
    if is_code(changes):
        with swapped(module, changes[CODE]):
            yield
        return
    if is_candidate(module):
        with importlib.import_module(module).installed(_tuples(changes)):
            yield
        return
    cfg, new = changed_config(module, changes)
    if isinstance(cfg, mt.LaunchConfig):
        with mt.overrides({cfg.key: _tuples(changes)}):
            yield
        return
    with importlib.import_module(config_module(module)).configured(new):
        yield


def compare_logits(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    """The variant's logits against the defaults': relative RMS error, same argmax, same bits, all finite."""
    o, r = ours.double(), ref.double()
    return {"rel_err_vs_peer": float((o - r).norm() / r.norm().clamp_min(1e-300)),
            "same_argmax": bool(torch.equal(ours.argmax(-1), ref.argmax(-1))),
            "same_bits": bool(torch.equal(ours, ref)), "finite": bool(torch.isfinite(ours).all())}


def mean_clocks(per_call: list[dict]) -> dict:
    """The calls' clock summaries (`gpu_clocks.summarize_clocks`) averaged call by call; extremes over all."""
    out = {k: sum(c[k] for c in per_call) / len(per_call) for k in per_call[0]
           if k.endswith(("_mean", "_share"))}
    out.update(samples=sum(c["samples"] for c in per_call), sm_mhz_min=min(c["sm_mhz_min"] for c in per_call),
               power_w_max=max(c["power_w_max"] for c in per_call),
               **{k: per_call[0][k] for k in ("sm_mhz_max", "power_limit_w") if k in per_call[0]})
    return out


def judge(cmp: dict, tol: float = LOGITS_TOL) -> list[str]:
    reasons = []
    if not cmp["finite"]:
        reasons.append("the variant's logits are not all finite")
    if not cmp["rel_err_vs_peer"] <= tol:
        reasons.append(f"the variant's logits differ from the defaults': relative RMS error "
                       f"{cmp['rel_err_vs_peer']:.3g} > {tol}")
    return reasons


@torch.no_grad()
def ab_case(model, T: int, variants: list[tuple[str, str, dict]], rounds: int, device: str, seed: int = 0) -> dict:
    """{name: {"samples": [...], "logits": last-position logits}} for "defaults" and every variant."""
    gen = torch.Generator().manual_seed(seed + T)
    ids = torch.randint(0, model.cfg.vocab_size, (1, T), generator=gen).to(device)
    arms = [("defaults", None, {})] + variants
    prefill, out = PrefillCall(model, ids), {name: {"samples": []} for name, _, _ in arms}

    def call(arm):
        name, module, changes = arm
        with (applied(module, changes) if module else contextlib.nullcontext()):
            s = time_calls(prefill.run, 1, device, setup=prefill.setup)
        out[name]["logits"] = prefill.logits.float().cpu()
        return s.samples_ms[0], s.clocks, (s.host_ms or [None])[0]

    for arm in arms:  # untimed: compilation; and an arm no call reaches would time the defaults twice
        name, module, changes = arm
        if not module:
            call(arm)
            continue
        if calls_during(module, changes, lambda: call(arm)) == 0:
            at = f" as it was at {changes[CODE][:12]}" if is_code(changes) else ""
            where = ("a candidate runs only where the model calls the hook it is installed in: the prefill MoE's "
                     "grouped experts, on CUDA" if is_candidate(module) else
                     "the model calls a kernel module through model.ops only where the kernels are Triton's: on "
                     "CUDA, or KIMI_KERNELS=triton under TRITON_INTERPRET=1; and only where the prefill uses it")
            raise Unreached(f"variant {name}: no call of the prefill reached {config_module(module)}{at}, so the arm "
                            f"would run the defaults' code ({where})")
    for r in range(rounds):
        k = r % len(arms)
        for arm in arms[k:] + arms[:k]:
            ms, clocks, host = call(arm)
            out[arm[0]]["samples"].append(ms)
            if host is not None:
                out[arm[0]].setdefault("host_ms", []).append(host)
            if clocks:
                out[arm[0]].setdefault("clocks", []).append(clocks)
        log(f"  T={T} round {r + 1}/{rounds}: " + ", ".join(f"{n} {v['samples'][-1]:.1f} ms" for n, v in out.items()))
    prefill.drop()
    return out


class Unreached(RuntimeError):
    """An arm whose kernel module no call of the prefill reached."""


def ab_records(model_desc: dict, T: int, variants, out: dict, device_name: str) -> list[dict]:
    from records.store import append, make_record
    base = out["defaults"]
    recs = []
    for name, module, changes in variants:
        v = out[name]
        cmp = compare_logits(v["logits"], base["logits"])
        reasons = judge(cmp, CODE_LOGITS_TOL if is_code(changes) else LOGITS_TOL)
        ratios = [a / b for a, b in zip(v["samples"], base["samples"])]
        results = {"ours_ms": summarize(v["samples"])["median_ms"], "peer": "defaults",
                   "peer_ms": summarize(base["samples"])["median_ms"], "samples_ms": v["samples"],
                   "peer_samples_ms": base["samples"], "paired_ratio_median": statistics.median(ratios),
                   "paired_ratio_min": min(ratios), "paired_ratio_max": max(ratios),
                   "timing": ("CUDA events, a whole prefill from an idle device" if device_name != "cpu" else
                              "host clock, a whole prefill") + ", fresh cache; rounds interleaved",
                   **cmp}
        results["speedup"] = results["peer_ms"] / results["ours_ms"]
        for side, arm in (("ours", v), ("peer", base)):
            if arm.get("clocks"):
                results[f"clocks_{side}"] = mean_clocks(arm["clocks"])
            if arm.get("host_ms"):
                pre = "" if side == "ours" else "peer_"
                results[f"{pre}host_ms"] = arm["host_ms"]
                results[f"{pre}host_paced"] = Samples(arm["samples"], sum(arm["samples"]), None,
                                                      arm["host_ms"]).host_paced()
        params = {"op": "prefill_ab", "variant": name, "T": T, "B": 1, "module": module, "changes": changes,
                  "rounds": len(v["samples"]), **model_desc}
        rec = make_record("kernel", preset=model_desc["preset"], dtype=model_desc["model_dtype"], device=device_name,
                          weights=model_desc["weights"], params=params, results=results,
                          verdict="INVALID" if reasons else "VALID", reasons=reasons)
        append(rec)
        recs.append(rec)
        log(f"  T={T} {name}: {results['ours_ms']:.2f} ms against the defaults' {results['peer_ms']:.2f} ms "
            f"(paired ratio {results['paired_ratio_median']:.4f}, {results['paired_ratio_min']:.4f} to "
            f"{results['paired_ratio_max']:.4f}); logits rel_err {cmp['rel_err_vs_peer']:.2e}, same bits "
            f"{cmp['same_bits']}: {rec['verdict']}" + "".join(
                f"; {side} SM {c['sm_mhz_mean']:.0f} MHz, {c['power_w_mean']:.0f} W, power cap in "
                f"{c['power_cap_share']:.0%} of samples" for side in ("ours", "peer")
                if (c := results.get(f"clocks_{side}"))) + "".join(
                f"; {side} host median {statistics.median(h):.1f} ms, paced {results[pre + 'host_paced']}/{len(h)}"
                for side, pre in (("ours", ""), ("peer", "peer_")) if (h := results.get(pre + "host_ms"))))
    return recs


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", type=parse_variant, action="append", required=True,
                    help="NAME=MODULE:JSON or NAME=MODULE@REV; MODULE a kernel module of model.triton, a dotted "
                         "module with a CONFIG, or a candidate, benchmarks.candidates.MODULE")
    ap.add_argument("--prefill", type=ints, default=[8192], help="prompt lengths")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--preset", default="48b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    names = [v[0] for v in args.variant]
    if len(set(names)) != len(names) or "defaults" in names:
        ap.error(f"variant names must be distinct and not 'defaults': {names}")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here (an A/B of kernel configs times Triton's kernels, "
                 f"which run on CUDA)")
    variants = []
    for name, module, changes in args.variant:  # a typo fails here, before the model is built
        try:
            if is_code(changes):
                changes = {CODE: code_at(module, changes[CODE])}
            else:
                changed_config(module, changes)
        except (KeyError, ImportError, ValueError) as e:
            ap.error(e.args[0] if isinstance(e, KeyError) and e.args else str(e))
        variants.append((name, module, changes))
    from model.build import load_model
    loaded = load_model(args.preset, device=args.device, dtype=getattr(torch, args.dtype), seed=args.seed)
    log(f"weights {loaded.source} {loaded.weights} on {args.device}")
    desc = {"preset": args.preset, "model_dtype": args.dtype, "weights": loaded.weights}
    dev = torch.device(args.device)
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else args.device
    recs = []
    for T in args.prefill:
        try:
            out = ab_case(loaded.model, T, variants, args.rounds, args.device, args.seed)
        except (Unreached, Unsupported) as e:  # an arm the model never ran, or a candidate refusing the inputs
            ap.error(str(e))
        recs += ab_records(desc, T, variants, out, device_name)
    return recs


if __name__ == "__main__":
    main()
