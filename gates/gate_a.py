"""Gate A, token identity: the incremental path (prefill once, then one token a step from the carried state)
must choose exactly the tokens of the recompute path (the whole sequence re-run every step), for every
prompt and step of the battery. Reference: recompute; under test: incremental.

Besides the score and the diagnosis of each divergence (`gates.compare`), the record keeps, per prompt and
step, max |logit_recompute - logit_incremental| while both paths still saw the same context: the margin a
correct carry leaves (~1e-5 in fp32 on tiny), which tells how close any near-tie came.

Two criteria, both reported per prompt (`gates.compare.GateResult`): tokens (every step's choice identical) and
logits. For the logit criterion every prompt's reference tokens are run once more as one teacher-forced forward
pass of the whole sequence on the PyTorch kernels (`logit_control`): a second correct computation of the same
logits, whose largest difference from the recompute path over the battery is the run's noise floor. In the exact
modes (fp32, fp64, fp32 with bf16 experts) the incremental path fails where its logits stray more than
`LOGIT_FACTOR` times that floor; in bf16 the excess is reported only. See docs/GATE_A.md.

When the gate ran on the Triton kernels and a prompt diverges, the recompute path is run once more on the
PyTorch kernels (the control) and the divergence is held against that noise floor (`gates.compare.noise_check`):
in bf16 on a deep random-weight model two correct implementations can part ways too, and the gate says so
instead of leaving the reader to find out. That diagnosis never softens either criterion.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from model import ops
from model.generate import generate_incremental, generate_recompute

from .compare import GateResult, compare_prompt, eps_note, logit_bound, near_tie_eps_at, noise_check
from .memory import MemoryFloorError
from .run import (DEFAULT_TOPK, EXIT_FAIL, EXIT_PASS, GateRefused, Options, Subject, battery_for, context_len,
                  floor_guard, load_subject, record, refused, shown_record)


def control_kernels(opts: Options, device: torch.device) -> str | None:
    """The kernels of the control run: PyTorch when the gate ran on the Triton kernels, else none (there
    is no cheap second implementation then, and on the CPU in fp32 the paths agree to ~1e-5 anyway)."""
    triton = opts.kernels == "triton" or (opts.kernels == "auto" and device.type == "cuda")
    return "torch" if triton else None


# The precisions in which Gate A enforces its logit criterion: those where two correct paths agree to rounding.
EXACT_DTYPES = (torch.float32, torch.float64)
LOGIT_CONTROL_KERNELS = "torch"


@torch.no_grad()
def logit_control(model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The logits of every step of a generation, recomputed in one forward pass over prompt + tokens[:-1] on the
    PyTorch kernels: the same contexts as the recompute path's steps, computed in another order."""
    ids = torch.tensor([list(prompt) + list(tokens[:-1])], dtype=torch.long, device=model.device)
    with ops.use(LOGIT_CONTROL_KERNELS):
        logits = model(ids)[0, len(prompt) - 1:]
    return [row.float().cpu() for row in logits]


def run_gate_a(opts: Options, *, subject: Subject | None = None, decode: Callable | None = None, reader=None,
               records_root=None, log=print) -> int:
    """Run Gate A, print the verdict table and summary, append a `gate_a` record; returns the exit code.

    `subject`: an already loaded model (else loaded here, after the floor check). `decode`: replaces
    `model.decode_step` on the incremental path (e.g. a negative control that drops the state carry).
    """
    b = battery_for(opts)
    eps_at = near_tie_eps_at(opts.torch_dtype)
    eps = eps_at(None)
    t0 = time.perf_counter()
    try:
        with floor_guard(opts, context_len(b, opts.new_tokens), reader, log) as guard, ops.use(opts.kernels):
            subject = subject or load_subject(opts)
            hook = guard.step_hook()
            prompts, t_rec, t_inc, t_ctrl, t_floor = [], 0.0, 0.0, 0.0, 0.0
            ref_logits, ctrl_logits = [], []
            ctrl = control_kernels(opts, subject.model.device)
            for i, ids in enumerate(b.ids):
                t = time.perf_counter()
                rec = generate_recompute(subject.model, ids, opts.new_tokens, DEFAULT_TOPK, keep_logits=True,
                                         step_hook=hook)
                t_rec += time.perf_counter() - t
                t = time.perf_counter()
                inc = generate_incremental(subject.model, ids, opts.new_tokens, DEFAULT_TOPK, keep_logits=True,
                                           step_hook=hook, decode=decode)
                t_inc += time.perf_counter() - t
                t = time.perf_counter()
                ref_logits.append(rec.logits)
                ctrl_logits.append(logit_control(subject.model, ids, rec.tokens))
                t_floor += time.perf_counter() - t
                p = compare_prompt(i, rec, inc, eps_at, "recompute", "incremental")
                if p.divergence is not None and ctrl is not None:
                    t = time.perf_counter()
                    with ops.use(ctrl):
                        alt = generate_recompute(subject.model, ids, opts.new_tokens, DEFAULT_TOPK,
                                                 keep_logits=True, step_hook=hook)
                    name = f"recompute[{ctrl} kernels]"
                    p.noise = noise_check(p, compare_prompt(i, rec, alt, eps_at, "recompute", name), name)
                    t_ctrl += time.perf_counter() - t
                prompts.append(p)
    except (GateRefused, MemoryFloorError) as e:
        return refused("gate_a", opts, str(e), None if subject is None else subject.weights,
                       records_root=records_root, log=log)

    bound = logit_bound(ref_logits, ctrl_logits, f"one forward pass [{LOGIT_CONTROL_KERNELS} kernels]",
                        enforced=opts.torch_dtype in EXACT_DTYPES)
    result = GateResult("Gate A", "recompute", "incremental", prompts, bound)
    log(f"Gate A on {opts.label} ({subject.source}, weights {subject.weights}) {opts.precision} {opts.device}, "
        f"kernels {opts.kernels}, prompts {b.source}, near-tie eps {eps:g} nats{eps_note(opts.torch_dtype)}")
    log(result.table())
    diffs = [d for p in prompts for d in p.max_abs_logit_diff]
    results = {
        **result.results(),
        "max_abs_logit_diff": [p.max_abs_logit_diff for p in prompts],
        "max_abs_logit_diff_overall": max(diffs) if diffs else None,
        "near_tie_eps": eps,
        "timings": {"load_s": subject.load_s, "recompute_s": t_rec, "incremental_s": t_inc, "control_s": t_ctrl, "logit_floor_s": t_floor,
                    "total_s": time.perf_counter() - t0},
        **guard.results(),
    }
    params = {"prompt_ids_source": b.source, "prompts": len(b.ids), "weights_source": subject.source,
              "decode": inc.decoder}
    path = record("gate_a", opts, subject.weights, params, results, records_root=records_root)
    log(f"{result.summary()} [{results['timings']['total_s']:.1f} s; record {shown_record(path)}]")
    return EXIT_PASS if result.passed else EXIT_FAIL
