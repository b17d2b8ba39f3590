"""Gate B, STRICT against a golden: the incremental path's ids over the golden's prompts, as int32
little-endian bytes, must have the golden's md5. The per-position score and the near-tie diagnosis (against
the golden's top-k log-probabilities) explain a failure; they never soften it.

The golden must belong to the model under test: same weights id, same prompt ids as this battery, same
number of new tokens (`gates.golden.check_golden`); otherwise the gate refuses before generating.
"""
from __future__ import annotations

import time

from model import ops
from model.generate import generate_incremental
from records import store

from .compare import GateResult, compare_prompt, eps_note, near_tie_eps_at
from .golden import GoldenError, check_golden, expected_generations, find_golden, ids_md5, load_golden
from .memory import MemoryFloorError
from .run import (DEFAULT_TOPK, DTYPES, EXIT_FAIL, EXIT_PASS, GateRefused, Options, Subject, battery_for,
                  context_len, floor_guard, load_subject, record, refused, shown_record)


def run_gate_b(opts: Options, *, subject: Subject | None = None, reader=None, records_root=None, log=print) -> int:
    """Run Gate B, print the verdict table and summary, append a `gate_b` record; returns the exit code."""
    t0 = time.perf_counter()
    b = battery_for(opts)
    try:
        path = find_golden(opts)
        g = load_golden(path)
        check_golden(g, path, None, b.ids, opts.new_tokens, label=opts.label, prompt_source=b.source)
        with floor_guard(opts, context_len(b, opts.new_tokens), reader, log) as guard, ops.use(opts.kernels):
            subject = subject or load_subject(opts)
            check_golden(g, path, subject.weights, None, None, label=opts.label)
            t = time.perf_counter()
            gens = [generate_incremental(subject.model, p["ids"], g["new_tokens"], DEFAULT_TOPK,
                                         step_hook=guard.step_hook()) for p in g["prompts"]]
            t_gen = time.perf_counter() - t
    except (GoldenError, GateRefused, MemoryFloorError) as e:
        return refused("gate_b", opts, str(e), None if subject is None else subject.weights,
                       records_root=records_root, log=log)

    # the less precise side sets how close two logits must be to count as a tie
    eps_at = near_tie_eps_at(opts.torch_dtype, DTYPES[g["dtype"]])
    eps = eps_at(None)
    ref_name = f"golden[{g['provenance']['implementation']} {g['dtype']} {g['device']}]"
    prompts = [compare_prompt(i, ref, ours, eps_at, ref_name, "incremental")
               for i, (ref, ours) in enumerate(zip(expected_generations(g), gens))]
    result = GateResult("Gate B", ref_name, "incremental", prompts)
    md5 = ids_md5([x.tokens for x in gens])
    passed = md5 == g["md5"]
    if passed != result.passed:     # validate_golden makes this impossible; a verdict must never contradict itself
        return refused("gate_b", opts, f"the md5 ({'equal' if passed else 'different'}) and the token comparison "
                       f"({result.score}/{result.total}) disagree", subject.weights, records_root=records_root, log=log)
    note = eps_note(opts.torch_dtype, DTYPES[g["dtype"]])
    log(f"Gate B on {opts.label} ({subject.source}, weights {subject.weights}) {opts.precision} {opts.device}, "
        f"kernels {opts.kernels}, golden {store.shown_path(path)}, near-tie eps {eps:g} nats{note}")
    log(result.table())
    results = {
        **result.results(), "passed": passed, "md5": md5, "golden_md5": g["md5"], "near_tie_eps": eps,
        "timings": {"load_s": subject.load_s, "generate_s": t_gen, "total_s": time.perf_counter() - t0},
        **guard.results(),
    }
    params = {"golden_path": store.shown_path(path), "golden_source": g["source"], "golden_dtype": g["dtype"],
              "golden_device": g["device"], "golden_implementation": g["provenance"]["implementation"],
              "prompt_ids_source": b.source, "weights_source": subject.source}
    rec_path = record("gate_b", opts, subject.weights, params, results, records_root=records_root)
    # the verdict is printed only once its record is kept: an unwritable records file exits 2 with no verdict shown
    log(f"md5 ours {md5} golden {g['md5']}: {'equal' if passed else 'DIFFERENT'}")
    log(f"{result.summary()}, md5 {'equal' if passed else 'differs'} [{results['timings']['total_s']:.1f} s; "
        f"record {shown_record(rec_path)}]")
    return EXIT_PASS if passed else EXIT_FAIL
