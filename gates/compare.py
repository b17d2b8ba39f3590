"""Token-by-token comparison of two greedy generations, with the diagnosis of each divergence.

Score: positions counted one by one (the seed's k/N): step i of a prompt scores when both sides chose the
same token there. Only the first divergence of a prompt is diagnosed; after it the two sides continue from
different contexts, so later steps explain nothing about the cause.

Diagnosis at the first divergent step, in the spirit of vLLM's `check_logprobs_close`: both tokens, both
sides' top-k log-probabilities, and each side's margin -- how far its own choice beats the other side's
token in its own distribution (a log-probability difference, which equals the logit difference). If the
other token fell outside the kept top-k, the margin is at least (own choice - last kept), reported as a
lower bound. The verdict is `near-tie` when each token is in the other side's top-5 and both margins are
below epsilon (and not negative: a side whose own distribution prefers the other token did not choose
greedily), else `real`. A near-tie still fails a gate (the gates are token-exact); the verdict says
whether the mismatch is rounding deciding between two almost equal logits or a wrong computation.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

NEAR_TIE_TOP = 5

# Near-tie epsilon in nats, by the dtype the model under test computes in: a divergence whose margins lie under it is
# one that rounding the final logits alone could decide. It labels a divergence; the gate fails either way.
# - bf16, fp16: logits leave lm_head rounded to the dtype, so two top logits differ by a whole number of spacings, and
#   two paths that round one true value differently land a spacing apart: one side's tie is the other's margin of one
#   spacing. Epsilon is two spacings at the top logit's magnitude (0 and 1 spacing are near-ties, 2 and up are not),
#   and never less than two spacings in [8, 16), where a trained model's top logits sit when nothing else is known.
# - fp32, fp64: the paths' logits differ by <1e-5 on tiny and more with depth and width; 1e-4 leaves two orders of
#   magnitude for the 27-layer model, still far below a real bug's effect. Our model keeps the KDA state in fp32
#   whatever its dtype, and the fp64 golden is only ever held against runs of ours.
# docs/GATE_A.md#near-ties has the measurements behind these.
NEAR_TIE_EPS = {torch.bfloat16: 2.0 ** -3, torch.float16: 2.0 ** -6, torch.float32: 1e-4, torch.float64: 1e-4}
SPACINGS = 2


def spacing(dtype: torch.dtype, x: float) -> float:
    """The gap between consecutive values of `dtype` at magnitude |x| (normal range)."""
    info = torch.finfo(dtype)
    return info.eps * 2.0 ** math.floor(math.log2(max(abs(x), info.tiny)))


def eps_note(*dtypes: torch.dtype) -> str:
    """How the epsilon grows with the top logit, for a header line ("" where no dtype of `dtypes` rounds logits)."""
    half = [str(d).removeprefix("torch.") for d in dtypes if NEAR_TIE_EPS.get(d, 0) > NEAR_TIE_EPS[torch.float32]]
    return f" (or {SPACINGS} {'/'.join(sorted(set(half)))} spacings of the top logit, where more)" if half else ""


def near_tie_eps(dtype: torch.dtype, top_logit: float | None = None) -> float:
    """Epsilon for `dtype`; with the top logit's value known, at least SPACINGS of the dtype's spacing there."""
    if dtype not in NEAR_TIE_EPS:
        raise ValueError(f"no near-tie epsilon for dtype {dtype}; known: {', '.join(map(str, NEAR_TIE_EPS))}")
    base = NEAR_TIE_EPS[dtype]
    if top_logit is None or not math.isfinite(top_logit):
        return base
    return max(base, SPACINGS * spacing(dtype, top_logit))


def near_tie_eps_at(*dtypes: torch.dtype) -> Callable[[float | None], float]:
    """The epsilon of the less precise of `dtypes` (a gate's own and its golden's) as a function of the divergent
    step's top logit, as `compare_prompt` takes it."""
    return lambda top: max(near_tie_eps(d, top) for d in dtypes)


@dataclass(frozen=True)
class Side:
    """One implementation's view of one step: its choice and its kept top-k (ids, log-probabilities)."""
    name: str
    token: int
    topk_ids: list[int]
    topk_logprobs: list[float]
    top_logit: float | None = None   # the chosen token's logit, where the generation kept it

    def logprob(self, token: int) -> float | None:
        return self.topk_logprobs[self.topk_ids.index(token)] if token in self.topk_ids else None


@dataclass(frozen=True)
class Margin:
    nats: float
    lower_bound: bool  # the other token was outside the kept top-k: the true margin is at least `nats`

    def __str__(self) -> str:
        return f"{'>= ' if self.lower_bound else ''}{self.nats:.3g} nats"


def margin(side: Side, other_token: int) -> Margin:
    """How far `side`'s choice beats `other_token` in `side`'s own distribution."""
    own = side.logprob(side.token)
    if own is None:
        raise ValueError(f"{side.name}'s choice {side.token} is not in its own top-k {side.topk_ids}")
    other = side.logprob(other_token)
    if other is None:
        return Margin(own - min(side.topk_logprobs), True)
    return Margin(own - other, False)


@dataclass(frozen=True)
class Divergence:
    prompt: int
    step: int
    ref: Side
    test: Side
    ref_margin: Margin
    test_margin: Margin
    in_each_others_top: bool
    eps: float
    verdict: str  # 'near-tie' | 'real'

    def explain(self) -> str:
        """One line: both choices, both margins, each of the near-tie's two conditions and whether it holds (so a
        `real` says which failed), then both sides' top-5 log-probabilities."""
        r, t = self.ref, self.test
        small = all(0 <= m.nats < self.eps for m in (self.ref_margin, self.test_margin))
        yes = lambda ok: "yes" if ok else "no"
        top = lambda s: ", ".join(f"{i} {lp:.4g}" for i, lp in zip(s.topk_ids[:NEAR_TIE_TOP], s.topk_logprobs))
        return (f"prompt {self.prompt} step {self.step}: {r.name} chose {r.token}, {t.name} chose {t.token}; "
                f"margins {self.ref_margin} ({r.token} over {t.token}, {r.name}) and {self.test_margin} "
                f"({t.token} over {r.token}, {t.name}){self._tops()}; near-tie needs each token in the other's "
                f"top-{NEAR_TIE_TOP} ({yes(self.in_each_others_top)}) and both margins in [0, {self.eps:.3g}) "
                f"({yes(small)}) "
                f"-> {self.verdict}; top-{NEAR_TIE_TOP} log-probs {r.name}: {top(r)}; {t.name}: {top(t)}")

    def _tops(self) -> str:
        kept = [(s.name, s.top_logit) for s in (self.ref, self.test) if s.top_logit is not None]
        return "; top logits " + ", ".join(f"{v:.6g} ({n})" for n, v in kept) if kept else ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["explanation"] = self.explain()
        return d


def diagnose(prompt: int, step: int, ref: Side, test: Side, eps: float) -> Divergence:
    """Classify one divergent step: near-tie when each token is in the other's top-5 and both margins < eps."""
    if ref.token == test.token:
        raise ValueError(f"prompt {prompt} step {step}: both sides chose {ref.token}; nothing diverges")
    if eps <= 0:
        raise ValueError(f"near-tie epsilon must be > 0, got {eps}")
    for s in (ref, test):
        if len(s.topk_ids) < NEAR_TIE_TOP or len(s.topk_ids) != len(s.topk_logprobs):
            raise ValueError(f"{s.name} keeps {len(s.topk_ids)} ids / {len(s.topk_logprobs)} logprobs per step; "
                             f"a diagnosis needs at least the top-{NEAR_TIE_TOP} of both")
    rm, tm = margin(ref, test.token), margin(test, ref.token)
    inside = test.token in ref.topk_ids[:NEAR_TIE_TOP] and ref.token in test.topk_ids[:NEAR_TIE_TOP]
    # a negative margin: that side did not choose its own most likely token, which no rounding explains
    tie = inside and 0 <= rm.nats < eps and 0 <= tm.nats < eps
    return Divergence(prompt, step, ref, test, rm, tm, inside, eps, "near-tie" if tie else "real")


# A divergence is within the noise floor when the test path strays from the reference no more than this
# many times as far as a second, independent implementation of the reference does (see `noise_check`).
NOISE_FACTOR = 2.0


@dataclass(frozen=True)
class NoiseCheck:
    """The reference path run a second time with other kernels (the control), held against the reference.

    Two correct implementations of the same math differ by rounding; in a deep bf16 model with random
    weights that difference alone can flip an expert choice and then a token. The control measures that
    floor in the same run: if the control also diverges from the reference by the test's divergent step, or
    the test's logits stray no further than NOISE_FACTOR times the control's over the steps all three saw
    the same context, the test's divergence is indistinguishable from rounding noise. A wrong computation
    (a dropped state carry, a shifted cache) strays far beyond it. The gate still fails either way.
    """
    control: str
    control_first_divergence: int | None
    test_noise: float | None      # max |logit_ref - logit_test| over the common steps
    control_noise: float | None   # max |logit_ref - logit_control| over the same steps
    within_noise: bool

    def explain(self) -> str:
        cd = "never" if self.control_first_divergence is None else f"at step {self.control_first_divergence}"
        tn = "-" if self.test_noise is None else f"{self.test_noise:.3g}"
        cn = "-" if self.control_noise is None else f"{self.control_noise:.3g}"
        return (f"control {self.control} diverges from the reference {cd}; max|dlogit| test {tn} vs control {cn} "
                f"-> {'within' if self.within_noise else 'beyond'} the noise floor")


def noise_check(test: "PromptResult", control: "PromptResult", control_name: str,
                factor: float = NOISE_FACTOR) -> NoiseCheck:
    """Hold a divergent test path against a control run of the reference (both compared with the reference)."""
    if test.divergence is None:
        raise ValueError(f"prompt {test.prompt}: the test path did not diverge; nothing to hold against noise")
    common = min(len(test.max_abs_logit_diff), len(control.max_abs_logit_diff))
    tn = max(test.max_abs_logit_diff[:common]) if common else None
    cn = max(control.max_abs_logit_diff[:common]) if common else None
    early = control.first_divergence is not None and control.first_divergence <= test.first_divergence
    close = tn is not None and cn is not None and cn > 0 and tn <= factor * cn
    return NoiseCheck(control_name, control.first_divergence, tn, cn, early or close)


# The logit criterion (Gate A in the exact modes): the test path's logits may stray from the reference's by at
# most LOGIT_FACTOR times the noise floor, the largest difference between the reference and a second correct
# computation of the same logits measured in the same run. A planted error that moves some step's logits by twice
# the bound's factor of the floor or more fails; clean runs stay within ~1.2x of the floor (docs/GATE_A.md).
LOGIT_FACTOR = 10.0
FP32_RESOLUTION = 2.0 ** -23    # the floor is never taken below one fp32 unit of the largest logit


@dataclass(frozen=True)
class LogitBound:
    """How far the test path's logits may stray from the reference's at any step, and where that comes from."""
    control: str                  # the second computation of the reference's logits
    floor: float                  # max |logit_reference - logit_control| over every prompt and step
    floor_at: tuple[int, int]     # (prompt, step) of that maximum
    resolution: float             # FP32_RESOLUTION x the largest |logit| of the reference
    factor: float
    enforced: bool                # False in bf16: reported, never failing

    @property
    def bound(self) -> float:
        return self.factor * max(self.floor, self.resolution)

    def derivation(self) -> str:
        return (f"logit bound {self.bound:.3g} = {self.factor:g} x max(noise floor {self.floor:.3g} "
                f"[reference vs {self.control}, prompt {self.floor_at[0]} step {self.floor_at[1]}], "
                f"fp32 resolution {self.resolution:.3g})" + ("" if self.enforced else "; reported, not enforced"))

    def to_dict(self) -> dict:
        return {**asdict(self), "bound": self.bound, "derivation": self.derivation()}


def logit_bound(reference: list[list[torch.Tensor]], control: list[list[torch.Tensor]], control_name: str,
                enforced: bool, factor: float = LOGIT_FACTOR) -> LogitBound:
    """The bound from per-prompt, per-step logits rows of the reference and of the control (same contexts)."""
    floor, at, top = 0.0, (0, 0), 0.0
    for p, (ref, ctl) in enumerate(zip(reference, control)):
        for step, (a, b) in enumerate(zip(ref, ctl)):
            d = float((a.double() - b.double()).abs().max())
            if d > floor or (p, step) == (0, 0):
                floor, at = d, (p, step)
            top = max(top, float(a.abs().max()))
    return LogitBound(control_name, floor, at, FP32_RESOLUTION * top, factor, enforced)


@dataclass
class PromptResult:
    prompt: int
    k: int
    n: int
    divergence: Divergence | None
    # per step, while both sides saw the same context (steps 0..first divergence): max |logit_ref - logit_test|
    max_abs_logit_diff: list[float] = field(default_factory=list)
    noise: NoiseCheck | None = None  # set by a gate that ran a control (Gate A on the Triton kernels)

    def logit_excess(self, bound: LogitBound | None) -> tuple[int, float] | None:
        """(step, size) of the largest logit difference when it passes the bound, else None."""
        if bound is None or not self.max_abs_logit_diff:
            return None
        worst = max(range(len(self.max_abs_logit_diff)), key=self.max_abs_logit_diff.__getitem__)
        size = self.max_abs_logit_diff[worst]
        return (worst, size) if not size <= bound.bound else None     # NaN passes no bound

    @property
    def first_divergence(self) -> int | None:
        return None if self.divergence is None else self.divergence.step

    @property
    def verdict(self) -> str:
        return "match" if self.divergence is None else self.divergence.verdict


def compare_prompt(prompt: int, ref, test, eps: float | Callable[[float | None], float], ref_name: str,
                   test_name: str) -> PromptResult:
    """`ref`/`test`: generations (`.tokens`, `.topk_ids`, `.topk_logprobs`; `.top_logits` and `.logits` rows if
    kept). `eps`: the near-tie epsilon, or a function of the divergent step's top logit (the larger in magnitude of
    the sides that kept it; None when neither did) that gives it."""
    n = len(ref.tokens)
    if len(test.tokens) != n:
        raise ValueError(f"prompt {prompt}: {ref_name} has {n} tokens, {test_name} {len(test.tokens)}")
    same = [a == b for a, b in zip(ref.tokens, test.tokens)]
    first = same.index(False) if not all(same) else None
    div = None
    if first is not None:
        top = lambda g: g.top_logits[first] if len(getattr(g, "top_logits", ())) > first else None
        side = lambda name, g: Side(name, g.tokens[first], list(g.topk_ids[first]), list(g.topk_logprobs[first]),
                                    top(g))
        tops = [t for t in (top(ref), top(test)) if t is not None]
        at = eps(max(tops, key=abs) if tops else None) if callable(eps) else eps
        div = diagnose(prompt, first, side(ref_name, ref), side(test_name, test), at)
    diffs = []
    if getattr(ref, "logits", None) and getattr(test, "logits", None):
        last = n - 1 if first is None else first
        diffs = [float((ref.logits[i].double() - test.logits[i].double()).abs().max()) for i in range(last + 1)]
    return PromptResult(prompt, sum(same), n, div, diffs)


@dataclass
class GateResult:
    gate: str        # 'Gate A' | 'Gate B'
    ref_name: str
    test_name: str
    prompts: list[PromptResult]
    logit_bound: LogitBound | None = None   # Gate A's logit criterion; None: tokens only (Gate B)

    @property
    def score(self) -> int:
        return sum(p.k for p in self.prompts)

    @property
    def total(self) -> int:
        return sum(p.n for p in self.prompts)

    def failed_criteria(self, p: PromptResult) -> str:
        """Which criteria the prompt fails: 'tokens', 'logits', 'both' or '-' (a logit excess counts only where
        the bound is enforced; in bf16 it is shown, marked 'logits (reported)')."""
        tokens, logits = p.divergence is not None, p.logit_excess(self.logit_bound) is not None
        if logits and not self.logit_bound.enforced:
            return "tokens" if tokens else "logits (reported)"
        return {(True, True): "both", (True, False): "tokens", (False, True): "logits"}.get((tokens, logits), "-")

    @property
    def logits_passed(self) -> bool:
        b = self.logit_bound
        return b is None or not b.enforced or all(p.logit_excess(b) is None for p in self.prompts)

    @property
    def passed(self) -> bool:
        return self.score == self.total and self.logits_passed

    @property
    def diagnoses(self) -> list[Divergence]:
        return [p.divergence for p in self.prompts if p.divergence is not None]

    def table(self) -> str:
        fails = self.logit_bound is not None
        rows = [f"{'prompt':>6}  {'k/n':>7}  {'first div':>9}  {'max|dlogit|':>11}  {'verdict':<8}"
                + ("  failed" if fails else "")]
        for p in self.prompts:
            dl = f"{max(p.max_abs_logit_diff):.2e}" if p.max_abs_logit_diff else "-"
            fd = "-" if p.first_divergence is None else str(p.first_divergence)
            rows.append(f"{p.prompt:>6}  {f'{p.k}/{p.n}':>7}  {fd:>9}  {dl:>11}  {p.verdict:<8}"
                        + (f"  {self.failed_criteria(p)}" if fails else ""))
        if fails:
            rows.append(self.logit_bound.derivation())
            for p in self.prompts:
                if (x := p.logit_excess(self.logit_bound)) is not None:
                    rows.append(f"prompt {p.prompt}: logits stray {x[1]:.3g} at step {x[0]}, "
                                f"{x[1] / self.logit_bound.bound:.3g}x the bound {self.logit_bound.bound:.3g}")
        rows += [d.explain() for d in self.diagnoses]
        rows += [f"prompt {p.prompt}: {p.noise.explain()}" for p in self.prompts if p.noise is not None]
        return "\n".join(rows)

    def summary(self) -> str:
        counts = {}
        for d in self.diagnoses:
            counts[d.verdict] = counts.get(d.verdict, 0) + 1
        checked = [p.noise for p in self.prompts if p.noise is not None]
        noise = (f"; {sum(c.within_noise for c in checked)} of {len(checked)} within the noise floor of "
                 f"{checked[0].control}" if checked else "")
        why = "" if self.score == self.total else (
            " (" + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) + noise + ")")
        logits = ""
        if self.logit_bound is not None:
            over = [p for p in self.prompts if p.logit_excess(self.logit_bound) is not None]
            state = "enforced" if self.logit_bound.enforced else "reported"
            logits = (f"; logits {len(self.prompts) - len(over)}/{len(self.prompts)} prompts within "
                      f"{self.logit_bound.bound:.3g} ({state})")
        return (f"{self.gate} {'PASS' if self.passed else 'FAIL'} {self.score}/{self.total}{logits}: "
                f"{self.test_name} vs {self.ref_name}{why}")

    def results(self) -> dict:
        """The record's `results` fields shared by both gates."""
        b = self.logit_bound
        excess = lambda p: p.logit_excess(b)
        return {
            "score": self.score, "total": self.total, "passed": self.passed,
            **({"tokens_passed": self.score == self.total, "logits_passed": self.logits_passed,
                "logit_bound": b.to_dict()} if b is not None else {}),
            "per_prompt": [{"prompt": p.prompt, "k": p.k, "n": p.n, "first_divergence": p.first_divergence,
                            "verdict": p.verdict, **({"noise": asdict(p.noise)} if p.noise else {}),
                            **({"failed": self.failed_criteria(p),
                                "logit_excess": None if excess(p) is None else
                                {"step": excess(p)[0], "max_abs_logit_diff": excess(p)[1]}} if b is not None else {})}
                           for p in self.prompts],
            "diagnoses": [d.to_dict() for d in self.diagnoses],
        }
