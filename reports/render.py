"""Render the suite's report from records alone: `<out>/index.html`, `<out>/SUMMARY.md`, `<out>/figures/*.png`.

    python -m reports.render [--records DIR] [--out reports/]

Every figure and table cites the records it was drawn from (short id, machine, commit). Lines `load()` could
not read are listed at the top, then the issues' targets judged from the records (`reports.targets`), then the
plots and tables; INVALID records close the report with their reasons (cut past REASON_CHARS) and are never
drawn into a speed plot, and the errata follow them. A section without records says so instead of failing.

Any records folder renders: `records.store.load` skips each line that is not a record of the shape the sections
read, and the report lists those lines with the reason (and says so on stderr). Text from records is escaped
wherever it lands: HTML-escaped in index.html, markdown-escaped in SUMMARY.md (`md_text`: no raw HTML, no link a
record could aim), and `$` escaped in plot text (`plot_text`), which matplotlib would otherwise read as mathtext.
A section that still fails on its records says so in its place and on stderr; the rest of the report is drawn.
Exit status of the command: 0 rendered, 2 could not run (no such records folder, an output it cannot write).
"""
from __future__ import annotations

import argparse
import functools
import html
import json
import re
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.categories import CATEGORY_NAMES  # noqa: E402
from records import store  # noqa: E402
from records.schema import (BENCH, CLOCKS, DECOMPOSITION, DIAGNOSIS, ERRATUM, GATE, GATE_B,  # noqa: E402
                            KERNEL, MARGINS, MEMORY, NIGHTLY, NOISE, PROMPT, RECORD, REGRESSION, SPOT_CHECK, STEP,
                            TRAIN, Field)
from reports import regress, targets  # noqa: E402

NO_RECORDS = "no records yet"
OURS_COLOR = "tab:green"  # ours is drawn in one colour in every speed plot
GiB = 1 << 30

# The seed's published decode decomposition (nsys on GB10). It is a document, not a record: cited as such.
SEED_CITATION = ("the seed pull request (PR #113, 'Kimi-Linear: paged-incremental decode', kept as "
                 "shared/seed/000_49c5fcef6bd17615.txt; GB10 nsys decode decomposition)")
SEED_LABEL = "seed (GB10, published)"
# Its "MoE glue" is router/top-k work, our moe_routing; "other" is what its four named shares leave.
SEED_SHARES = {"gemm": 0.90, "kda": 0.023, "moe_routing": 0.023, "cast": 0.03}
SEED_SHARES["other"] = 1 - sum(SEED_SHARES.values())
SEED_IDLE = 0.15


# ---- document model: sections of paragraphs, figures and tables, written out as HTML and Markdown ----

@dataclass
class Figure:
    file: str  # relative to the output directory
    title: str
    source: str  # the citation line


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]
    source: str = ""


class Prose(str):
    """A paragraph the renderer writes itself (no record text in it): its `code spans` render as code, the rest as
    any text does. Record text never becomes Prose, so a record cannot open a code span."""


_CODE_SPAN = re.compile(r"`([^`\n]+)`")


def _prose_parts(text: str) -> list[tuple[bool, str]]:
    """(is code, text) pieces of a Prose paragraph, in order."""
    parts, at = [], 0
    for m in _CODE_SPAN.finditer(text):
        parts += [(False, text[at:m.start()]), (True, m.group(1))]
        at = m.end()
    return parts + [(False, text[at:])]


@dataclass
class Section:
    title: str
    blocks: list = field(default_factory=list)  # str paragraphs, Figures and Tables, in order
    failed: str | None = None  # why the section could not be drawn from its records, where it could not


# ---- escaping: text from records, wherever it lands --------------------------------------------

PLOT_CHARS = 100  # plot text from records is cut to this many characters: a long one would widen a figure past
# what an image can hold


def plot_text(x) -> str:
    """Record text for a plot (title, label, legend, tick, annotation): `$` escaped, so matplotlib never reads it as
    mathtext (an unbalanced `$x^$` fails the whole figure), and cut past PLOT_CHARS."""
    text = str(x)
    if len(text) > PLOT_CHARS:
        text = text[:PLOT_CHARS - 1] + "…"
    return text.replace("$", r"\$")


_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~$])")  # inline markdown: code, emphasis, links, table cells, GFM strike, math


def md_text(x, block: bool = False) -> str:
    """Text for SUMMARY.md: on one line, `&`, `<`, `>` as entities (no raw HTML such as `<script>`, no autolink, bracketed or
    GFM's bare `www.`, `scheme://` and `user@host` forms, no entity a record spells out) and markdown's inline syntax backslash-escaped (no emphasis, code span, link,
    image, table cell or math can open). A `block` (a paragraph of its own) also has a heading, list or rule
    marker at its start escaped."""
    text = str(x).replace("\r", " ").replace("\n", " ")
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = _MD_SPECIAL.sub(r"\\\1", text)
    # GFM's extended autolinks (www., scheme://, user@host) need no brackets: break each with an escaped character
    text = re.sub(r"(?i)\b(www)\.", r"\1\\.", text)
    text = re.sub(r"(?i)([a-z][a-z0-9+.-]*):(?=//)", r"\1\\:", text)
    text = text.replace("@", "\\@")
    if block:
        text = re.sub(r"^(\s*)([#+=-])", r"\1\\\2", text)
        text = re.sub(r"^(\s*\d+)([.)])(?=\s|$)", r"\1\\\2", text)
    return text


def link_target(target: str) -> str | None:
    """`target` where it may be a link in the report: a relative path inside the output folder (what `save` makes)
    or an http(s) address; None for anything else (a `javascript:` target, an absolute path, `..`)."""
    if re.fullmatch(r"https?://[^\s<>\"'()]+", target):
        return target
    if re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_./-]*", target) and ".." not in target.split("/"):
        return target
    return None


# ---- record helpers ----------------------------------------------------------------------------

def short_id(r: dict) -> str:
    return str(r["id"])[:8]


def commit(r: dict) -> str:
    """The commit a record ran at; where git was unusable on the machine, the commit whose tree was sent there
    (`git.tree_commit`, marked `tree:`)."""
    git = RECORD.git
    sha, dirty = git.commit.get(r), git.dirty.get(r)
    if sha is None and git.tree_commit.get(r):
        return "tree:" + str(git.tree_commit.get(r))[:7] + ("+dirty" if git.tree_dirty.get(r) else "")
    return str(sha or "?")[:7] + ("+dirty" if dirty else "")


def machine(r: dict) -> str:
    return f"{RECORD.machine.gpu.get(r, 'no GPU')} @ {RECORD.machine.host.get(r, '?')}"


def when(r: dict) -> datetime:
    return datetime.fromisoformat(r["time"])


def cite(records: list[dict]) -> str:
    """'records ID1, ID2 (machine, commit SHA); ...' grouped by machine and commit."""
    if not records:
        return "no records"
    groups: dict[tuple, list[str]] = defaultdict(list)
    for r in sorted({r["id"]: r for r in records}.values(), key=lambda r: r["time"]):   # each record once
        groups[(machine(r), commit(r))].append(short_id(r))
    return "; ".join(f"records {', '.join(ids)} ({m}, commit {c})" for (m, c), ids in groups.items())


def latest_by(records: list[dict], key) -> dict:
    out = {}
    for r in sorted(records, key=lambda r: r["time"]):
        out[key(r)] = r
    return out


def usable(records: list[dict], fields: tuple[Field, ...], what: str) -> tuple[list[dict], list[str]]:
    """The records that have every one of `fields`, and a note naming those left out (never dropped silently)."""
    ok = [r for r in records if all(f.get(r) is not None for f in fields)]
    left = [r for r in records if r not in ok]
    if not left:
        return ok, []
    return ok, [f"{len(left)} {what} record(s) lack one of {', '.join(f.path for f in fields)} and are not drawn: "
                f"{cite(left)}"]


def fmt(x, spec: str | None = None) -> str:
    """'—' for a missing value; by default 4 significant digits, thousands as 41,000."""
    if x is None:
        return "—"
    return format(x, spec or (",.0f" if abs(x) >= 1000 else ".4g"))


def save(fig, out: Path, name: str) -> str:
    (out / "figures").mkdir(parents=True, exist_ok=True)
    rel = f"figures/{name}.png"
    with warnings.catch_warnings():
        # a legend placed beside the axes leaves tight_layout nothing it can do; bbox_inches keeps the legend whole
        warnings.filterwarnings("ignore", "Tight layout not applied", UserWarning)
        fig.tight_layout()
    fig.savefig(out / rel, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return rel


# ---- sections ----------------------------------------------------------------------------------

def problems_section(problems: list[str]) -> Section:
    s = Section("Unreadable record lines")
    if not problems:
        s.blocks.append("none: every line of the records files was read")
    else:
        s.blocks.append(f"{len(problems)} line(s) could not be read as records and are left out of everything "
                        f"below (file:line: why):")
        s.blocks.append(Table(["problem"], [[p] for p in problems]))
    return s


def targets_section(records: list[dict]) -> Section:
    s = Section("Targets")
    s.blocks.append(Prose("The issues' targets, each judged on its latest reading in the records "
                          "(`reports/targets.py` says which records measure each and how): a speed target only on "
                          "the H200, at the 48B-A3B preset or the kernel shapes its issue names; the gates at their "
                          "default precision."))
    rows, cited = [], {}
    for st in targets.judge(records):
        latest = st.latest
        rows.append([str(st.target.issue), st.target.name, st.target.bar, latest.text if latest else "—",
                     st.verdict, st.history,
                     ", ".join(f"{short_id(r)} ({commit(r)}, {when(r):%Y-%m-%d})" for r in latest.records)
                     if latest else "—"])
        cited.update({r["id"]: r for r in (latest.records if latest else ())})
    s.blocks.append(Table(["issue", "target", "bar", "latest", "verdict", "recent", "record"], rows,
                          cite(list(cited.values())) if cited else None))
    return s


NIGHTS = 30  # the nightly table shows this many of the latest runs


def nightly_section(nights: list[dict]) -> Section:
    """Nightly records as reports/nightly.py writes them: results.passed, results.steps {name: {returncode,
    seconds, gate, timed_out, tail (a failed step's last lines)}}, results.regressions [{key, verdict, message}]."""
    from reports.nightly import duration, step_status

    s = Section("Nightly runs")
    if not nights:
        s.blocks.append(NO_RECORDS)
        return s
    nights = sorted(nights, key=lambda r: r["time"])[-NIGHTS:][::-1]
    s.blocks.append(f"The latest {len(nights)} nightly runs, newest first: each step's status and time; the "
                    "regression check of the bench records the run wrote, each against the machine's own history "
                    "(reports/regress.py); and the last line a failed step printed (its record keeps the last "
                    "lines, the step's log the rest).")

    def step_cell(name: str, st: dict) -> str:
        status = step_status(STEP.returncode.get(st), STEP.gate.get(st, False), STEP.timed_out.get(st, False),
                             STEP.skipped.get(st, False))
        return f"{name} {status} {duration(STEP.seconds.get(st) or 0)}"

    def checked(judged: list[dict]) -> str:
        if not judged:
            return "nothing judged (no bench record)"
        flagged = [described(REGRESSION.key.get(g)) for g in judged if REGRESSION.verdict.get(g) == "regression"]
        short = sum(REGRESSION.verdict.get(g) == "insufficient-history" for g in judged)
        return ("REGRESSION: " + "; ".join(flagged) if flagged else f"none of {len(judged)} flagged") + \
            (f" ({short} with too little history to judge)" if short else "")

    def described(key) -> str:
        whole = isinstance(key, list) and len(key) == len(regress.KEY_FIELDS)
        return regress.describe(tuple(key)) if whole else f"configuration {key}"

    def last_line(name: str, st: dict) -> str:
        tail = STEP.tail.get(st)
        line = tail.splitlines()[-1] if tail else "(no output)"
        return f"{name}: {line}" + (" (killed: --step-timeout)" if STEP.timed_out.get(st) else "")

    rows = []
    for r in nights:
        steps = NIGHTLY.results.steps.get(r, {})
        why = [last_line(name, st) for name, st in steps.items() if STEP.returncode.get(st) != 0]
        rows.append([short_id(r), r["time"], machine(r), commit(r), str(r["preset"]),
                     "PASS" if NIGHTLY.results.passed.get(r) else "FAIL",
                     "; ".join(step_cell(n, st) for n, st in steps.items()) or "no steps",
                     checked(NIGHTLY.results.regressions.get(r, [])), "; ".join(why) or "—"])
    s.blocks.append(Table(["record", "time", "machine", "commit", "preset", "nightly", "steps", "regressions",
                           "last line of a failed step"], rows, cite(nights)))
    return s


REASON_CHARS = 240  # a reason longer than this is cut in the table (the record keeps it whole)
# An absolute path in a record's text (a run's scratch folder on the machine that wrote it): not a URL's path, which
# follows the host name.
_ABS_PATH = re.compile(r"(?<![\w.:/~-])/(?:[\w.+-]+/)+([\w.+-]+)")


def no_machine_path(text: str) -> str:
    """`text` with each absolute path shown by its last part (`…/name`): the report names no machine's folders."""
    return _ABS_PATH.sub(r"…/\1", text)


def invalid_section(records: list[dict]) -> Section:
    s = Section("INVALID records")
    bad = [r for r in records if r["verdict"] != "VALID"]
    if not bad:
        s.blocks.append("none")
        return s
    s.blocks.append(f"Kept for the record, left out of every plot and summary above; reasons past {REASON_CHARS} "
                    "characters are cut here (the record holds them whole).")

    def reasons(r):
        text = no_machine_path("; ".join(r["reasons"]))
        return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 1] + "…"
    s.blocks.append(Table(["record", "kind", "time", "machine", "commit", "reasons"],
                          [[short_id(r), r["kind"], r["time"], machine(r), commit(r), reasons(r)]
                           for r in bad], cite(bad)))
    return s


VOIDED = "VOIDED"  # the verdict an erratum voided: the record is left out as an INVALID one is, its reason shown


def apply_errata(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """Records with the fields named by later `erratum` records removed (copies; the files are untouched).

    `verdict` and `reasons` are not removed but replaced: an erratum that voids a record's verdict (say, one a
    harness bug produced) leaves it out of every summary as VOIDED, with the erratum's reason as its reason."""
    errata = [r for r in records if r["kind"] == "erratum" and r["verdict"] == "VALID"]
    void, why = defaultdict(set), defaultdict(list)
    for e in errata:
        void[ERRATUM.params.record.get(e)].update(ERRATUM.params.fields.get(e, []))
        why[ERRATUM.params.record.get(e)].append(f"erratum {short_id(e)}: {ERRATUM.results.reason.get(e, '')}")
    out = []
    for r in records:
        if r["kind"] == "erratum":
            continue
        if r["id"] in void:
            r = json.loads(json.dumps(r))
            for dotted in void[r["id"]]:
                if dotted in ("verdict", "reasons"):
                    r["verdict"], r["reasons"] = VOIDED, why[r["id"]]
                    continue
                *path, leaf = dotted.split(".")
                node = r
                for part in path:
                    node = node.get(part, {}) if isinstance(node, dict) else {}
                if isinstance(node, dict):
                    node.pop(leaf, None)
        out.append(r)
    return out, errata


def errata_section(errata: list[dict]) -> Section:
    s = Section("Errata")
    if not errata:
        s.blocks.append("none")
        return s
    s.blocks.append("Fields of earlier records that are not used above (records are never edited; these say why).")
    s.blocks.append(Table(["erratum", "record", "fields", "reason"],
                          [[short_id(e), str(ERRATUM.params.record.get(e))[:8],
                            ", ".join(ERRATUM.params.fields.get(e, [])), str(ERRATUM.results.reason.get(e))]
                           for e in errata], cite(errata)))
    return s


def bench_config(r: dict) -> tuple:
    return (BENCH.params.phase.get(r), BENCH.params.context.get(r), r["preset"], r["dtype"],
            RECORD.machine.gpu.get(r), RECORD.machine.host.get(r))


def config_order(config: tuple) -> tuple:
    """Sort key: phase, then context as a number, then the rest as text (any field may be None)."""
    phase, context, *rest = config
    return str(phase), context if isinstance(context, (int, float)) else float("inf"), str(rest)


def series_label(r: dict) -> str:
    return f"{r['preset']} {r['dtype']} ({RECORD.machine.gpu.get(r, 'no GPU')})"


P, R = BENCH.params, BENCH.results  # the bench fields the speed sections read


def speed_section(bench: list[dict], out: Path) -> Section:
    s = Section("Speed against context length")
    bench, s.blocks = usable(bench, (P.phase, P.context, R.tok_s), "bench")
    for phase in ("decode", "prefill"):
        rs = [r for r in bench if P.phase.get(r) == phase]
        if not rs:
            s.blocks.append(f"{phase}: {NO_RECORDS}")
            continue
        ours = latest_by(rs, bench_config)
        # A peer's rate is its record's peer_tok_s, calls over its timed span as ours is, the figure
        # speedup_vs_peer divides by (not its median step: HF's eager decode moves the two apart).
        peers = latest_by([r for r in rs if R.peer_tok_s.get(r) is not None],
                          lambda r: (bench_config(r), R.peer.get(r)))
        fig, ax = plt.subplots(figsize=(8, 4.5))
        lines = defaultdict(list)
        for r in ours.values():
            lines[("ours", series_label(r))].append((P.context.get(r), R.tok_s.get(r)))
            if R.roofline_fraction.get(r):
                lines[("roofline", series_label(r))].append(
                    (P.context.get(r), R.tok_s.get(r) / R.roofline_fraction.get(r)))
        for r in peers.values():  # a record that measured a peer without naming it still draws, as "peer"
            lines[(R.peer.get(r, "peer"), series_label(r))].append((P.context.get(r), R.peer_tok_s.get(r)))
        for (who, label), points in sorted(lines.items()):
            x, y = zip(*sorted(points))
            style = {"ours": dict(marker="o", lw=2, color=OURS_COLOR),
                     "roofline": dict(ls="--", color="black")}.get(who, dict(marker="s"))
            ax.plot(x, y, label=plot_text(f"{who}: {label}"), **style)
        ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="tokens/s",
               title=f"{phase} speed (latest run per configuration)")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        used = list(ours.values()) + [r for r in peers.values() if r not in ours.values()]
        s.blocks.append(Figure(save(fig, out, f"speed_{phase}"), f"{phase} speed vs context", cite(used)))
        s.blocks.append(Table(
            ["context", "config", "ours tok/s", "roofline fraction", "host us / eager launch (/ one of our kernels)",
             "GPU while timed (SM clock; samples at the power cap; prefill calls the host paced)", "record",
             "peers (tok/s as ours, calls over the timed span; record; first greedy tokens agreeing with ours; "
             "GPU clock)"],
            [[str(P.context.get(r)), series_label(r), fmt(R.tok_s.get(r)),
              fmt(R.roofline_fraction.get(r), ".1%"), host_probe_text(r),
              clock_text(R.clocks.get(r)) + regress.pacing_note(r), short_id(r),
              ", ".join(f"{R.peer.get(p)} {fmt(R.peer_tok_s.get(p))} "
                        f"({short_id(p)}{spot_text(p)}{peer_clock(p)})"
                        for (cfg, _), p in sorted(peers.items(), key=lambda kv: str(kv[0])) if cfg == key) or "—"]
             for key, r in sorted(ours.items(), key=lambda kv: config_order(kv[0]))], cite(used)))
    return s


def host_probe_text(r: dict) -> str:
    """The run's host probes for a table cell: one eager launch, and (records since the probe existed) one launch of
    our own Triton kernels through their wrappers (`benchmarks.roofline.measure_kernel_launch_us`)."""
    kernel = R.host_kernel_launch_us.get(r)
    return fmt(R.host_launch_us.get(r), ".2f") + ("" if kernel is None else f" / {kernel:.2f}")


def clock_text(c: dict | None) -> str:
    """The GPU's clocks over a timed run (`benchmarks.gpu_clocks`) for a table cell: mean SM clock against its
    maximum, and the share of samples the driver held under the power cap."""
    if not isinstance(c, dict) or CLOCKS.sm_mhz_mean.get(c) is None:
        return "—"
    top = f" of {CLOCKS.sm_mhz_max.get(c):,.0f}" if CLOCKS.sm_mhz_max.get(c) else ""
    cap = CLOCKS.power_cap_share.get(c)
    return f"{CLOCKS.sm_mhz_mean.get(c):,.0f}{top} MHz" + ("" if cap is None else f"; cap {cap:.0%}")


def peer_clock(r: dict) -> str:
    """A peer's clocks for its table cell (`clock_text`), after a separator; empty where none were sampled."""
    c = R.peer_clocks.get(r)
    return (f"; {clock_text(c)}" if c else "") + regress.pacing_note(r, "peer_")


def spot_text(r: dict) -> str:
    """A peer record's spot check (its first greedy tokens against ours, `bench_e2e.spot_result`) for a table cell:
    how many agree and, where they part, the verdict at the first divergence; empty without a spot check."""
    sc = R.spot_check.get(r)
    if not isinstance(sc, dict) or "agree" not in sc:
        return ""
    text = f"; {SPOT_CHECK.agree.lookup(sc)}/{SPOT_CHECK.total.get(sc, '?')}"
    if SPOT_CHECK.verdict.get(sc) not in (None, "match"):
        text += f", {SPOT_CHECK.verdict.get(sc)} at step {SPOT_CHECK.first_divergence.get(sc)}"
    return text


def history_section(bench: list[dict], out: Path) -> Section:
    s = Section("Speed history and regressions")
    if not bench:
        s.blocks.append(NO_RECORDS)
        return s
    verdicts = {r["id"]: regress.check(r, bench) for r in bench if regress.comparable(r)}
    bench, s.blocks = usable(bench, (P.phase, P.context, R.tok_s), "bench")
    for phase in ("decode", "prefill"):
        rs = sorted((r for r in bench if P.phase.get(r) == phase), key=lambda r: r["time"])
        if not rs:
            continue
        fig, ax = plt.subplots(figsize=(9, 4.5))
        by_config = defaultdict(list)
        for r in rs:
            by_config[bench_config(r)].append(r)
        for cfg, runs in sorted(by_config.items(), key=lambda kv: config_order(kv[0])):
            ax.plot([when(r) for r in runs], [R.tok_s.get(r) for r in runs], marker="o",
                    label=plot_text(f"ctx {cfg[1]}: {series_label(runs[0])}"))
        flagged = [r for r in rs if verdicts.get(r["id"]) and verdicts[r["id"]].verdict == "regression"]
        if flagged:
            ax.scatter([when(r) for r in flagged], [R.tok_s.get(r) for r in flagged], s=160,
                       facecolors="none", edgecolors="red", linewidths=2, label="regression", zorder=5)
        ticks = latest_by(rs, commit)  # one tick per commit, at its latest run
        ax.set_xticks([when(r) for r in ticks.values()], [plot_text(c) for c in ticks], rotation=45, fontsize=7)
        ax.set(xlabel="commit (by time of run)", ylabel="tokens/s", title=f"{phase} speed history")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        s.blocks.append(Figure(save(fig, out, f"history_{phase}"), f"{phase} speed history", cite(rs)))
    latest = latest_by([r for r in bench if r["id"] in verdicts], bench_config)
    shown = sorted({r["id"]: r for r in list(latest.values())
                    + [r for r in bench if r["id"] in verdicts and verdicts[r["id"]].verdict == "regression"]}.values(),
                   key=lambda r: (config_order(bench_config(r)), r["time"]))
    s.blocks.append(
        f"Each run against the earlier runs of its machine and configuration (reports/regress.py): flagged only when a "
        f"one-sided Mann-Whitney test (p < {regress.ALPHA}) AND a slowdown beyond the history's largest run median by "
        f"max({regress.MIN_SLOWDOWN:.0%}, {regress.MAD_FACTOR:g} MAD) agree; 'host-slower' where the host probe "
        f"(one eager launch) slowed past the same bar and at least as much as the run. Latest run per configuration, "
        f"plus every flagged run:")
    s.blocks.append(Table(["record", "time", "configuration", "verdict", "median ms", "vs history", "p", "why"],
                          [regression_row(r, verdicts[r["id"]]) for r in shown], cite(shown)))
    return s


def regression_row(r: dict, v: regress.Regression) -> list[str]:
    config = f"{P.phase.get(r)} ctx {P.context.get(r)} {series_label(r)} @ {RECORD.machine.host.get(r)}"
    change = None if v.ratio is None else v.ratio - 1
    verdict = v.verdict.upper() if v.verdict == "regression" else v.verdict  # stands out in a column of "ok"
    return [short_id(r), r["time"], config, verdict, fmt(v.new_median), fmt(change, "+.1%"), fmt(v.p_value, ".2g"),
            v.message]


def diagnosis_row(r: dict, d: dict) -> list[str]:
    """One `results.diagnoses` entry, as gates/compare.py's Divergence.to_dict() writes it."""
    side = lambda f, which: f"{f.name.get(d, which)}: {f.token.get(d, '?')}"
    margin = lambda f: ("≥ " if f.lower_bound.get(d) else "") + fmt(f.nats.get(d))
    D = DIAGNOSIS
    return [short_id(r), r["kind"], commit(r), str(D.prompt.get(d)), str(D.step.get(d)), side(D.ref, "ref"),
            side(D.test, "test"), f"{margin(D.ref_margin)} / {margin(D.test_margin)}", fmt(D.eps.get(d)),
            str(D.verdict.get(d)), noise_cell(r, D.prompt.get(d))]


def noise_cell(r: dict, prompt) -> str:
    """Gate A's control (gates/compare.py NoiseCheck) for one prompt, when the run made one."""
    n = next((PROMPT.noise.get(p) for p in GATE.results.per_prompt.get(r, []) if PROMPT.prompt.get(p) == prompt),
             None)
    if not n:
        return "—"
    ctrl = NOISE.control_first_divergence.get(n)
    return (f"{'within' if NOISE.within_noise.get(n) else 'BEYOND'} ({NOISE.control.get(n)} "
            f"{'never diverged' if ctrl is None else f'diverged at step {ctrl}'}; max|dlogit| test "
            f"{fmt(NOISE.test_noise.get(n))} vs control {fmt(NOISE.control_noise.get(n))})")


def gate_conditions(r: dict) -> str:
    """'48b-a3b float32, experts bf16': the model and the precision it ran at (gates/run.py: Gate A on CUDA runs
    in fp32 with the routed experts held in bf16)."""
    experts = GATE.params.expert_dtype.get(r)
    other = (r["preset"] == REFERENCE_LABEL and r.get("weights") not in (None, committed_reference_weights()))
    return (f"{r['preset']} {r['dtype']}" + (f", experts {experts}" if experts else "")
            + (f" (weights {r['weights']}, not the committed checkpoint's)" if other else ""))


def gate_reference(r: dict) -> str:
    """What a gate run was judged against: Gate A the recompute path; Gate B its golden, by who made it, at which
    precision and where (a self-made golden is a regression check, an HF one the independent oracle)."""
    if r["kind"] != "gate_b":
        return "recompute path"
    impl = GATE_B.params.golden_implementation.get(r)
    if impl is None:
        return "golden (not recorded)"
    return f"golden: {impl} {GATE_B.params.golden_dtype.get(r)} {GATE_B.params.golden_device.get(r)}"


def gates_section(gates: list[dict], out: Path) -> Section:
    s = Section("Gates")
    score, total, passed = GATE.results.score, GATE.results.total, GATE.results.passed
    gates, s.blocks = usable(sorted(gates, key=lambda r: r["time"]), (score, total), "gate")
    empty = [r for r in gates if not total.get(r)]
    if empty:  # k/0 is no score
        s.blocks.append(f"{len(empty)} gate record(s) have results.total 0 and are not drawn: {cite(empty)}")
        gates = [r for r in gates if r not in empty]
    if not gates:
        s.blocks.append(NO_RECORDS)
        return s
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for kind, marker in (("gate_a", "o"), ("gate_b", "s")):
        rs = [r for r in gates if r["kind"] == kind]
        if rs:
            ax.plot([when(r) for r in rs], [score.get(r) / total.get(r) for r in rs], marker=marker, label=kind)
            failed = [r for r in rs if not passed.get(r)]
            ax.scatter([when(r) for r in failed], [score.get(r) / total.get(r) for r in failed],
                       color="red", s=80, zorder=5, label=f"{kind} failed" if failed else None)
            for r in failed:
                ax.annotate(plot_text(f"{score.get(r)}/{total.get(r)}"),
                            (when(r), score.get(r) / total.get(r)), textcoords="offset points",
                            xytext=(8, 0), color="red")
    ticks = latest_by(gates, commit)
    ax.set_xticks([when(r) for r in ticks.values()], [plot_text(c) for c in ticks], rotation=45, fontsize=7)
    ax.set(ylabel="score k/N", title="gate scores per run")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    s.blocks.append(Figure(save(fig, out, "gates"), "gate history", cite(gates)))
    s.blocks.append(Table(["record", "time", "gate", "model, precision", "judged against", "machine", "commit",
                           "score", "passed", "verdict"],
                          [[short_id(r), r["time"], r["kind"], gate_conditions(r), gate_reference(r), machine(r),
                            commit(r),
                            f"{score.get(r)}/{total.get(r)}",
                            "PASS" if passed.get(r) else "FAIL", r["verdict"]] for r in gates], cite(gates)))
    diag = [(r, d) for r in gates for d in GATE.results.diagnoses.get(r, [])]
    if diag:
        s.blocks.append("Diagnoses of mismatches (gates/compare.py: first divergent step per prompt; near-tie = each "
                        "token in the other's top-5 and both margins under eps; noise floor = Gate A's control, the "
                        "recompute path run again on the other kernels, held against the reference):")
        s.blocks.append(Table(["record", "gate", "commit", "prompt", "step", "reference chose", "tested chose",
                               "margins (nats, ref / test)", "eps", "diagnosis", "noise floor"],
                              [diagnosis_row(r, d) for r, d in diag], cite([r for r, _ in diag])))
    return s


REFERENCE_LABEL = "kimi-linear-ref"  # the suite's trained reference checkpoint (checkpoints/): drawn where recorded
REFERENCE_PROVENANCE = store.REPO_ROOT / "checkpoints" / REFERENCE_LABEL / "provenance.json"


@functools.cache
def committed_reference_weights() -> str | None:
    """The weights id of the reference checkpoint in this checkout (its provenance.json), or None."""
    try:
        w = json.loads(REFERENCE_PROVENANCE.read_text()).get("weights")
    except (OSError, ValueError, AttributeError):
        return None
    return w if isinstance(w, str) else None


def train_section(trains: list[dict], out: Path, committed: str | None = None) -> Section:
    """The reference checkpoint's training (model/train.py `train` records): the loss at every step and the held-out
    evals of the record of the committed checkpoint's weights (`committed`), else the latest of REFERENCE_LABEL, else
    the latest record (a trial retrain that was not committed is not drawn as the reference), and every training
    run in a table."""
    s = Section("Reference checkpoint")
    P, R = TRAIN.params, TRAIN.results
    trains, s.blocks = usable(sorted(trains, key=lambda r: r["time"]), (R.curve, R.evals), "train")
    if not trains:
        s.blocks.append(NO_RECORDS)
        return s
    ref = max(trains, key=lambda r: (committed is not None and r["weights"] == committed,
                                     P.label.get(r) == REFERENCE_LABEL, r["time"]))
    curve, evals = R.curve.get(ref), R.evals.get(ref)
    pts = [(R.curve.each.step.get(c), R.curve.each.loss.get(c)) for c in curve]
    pts = [(x, y) for x, y in pts if x is not None and y is not None]
    ev = [(R.evals.each.step.get(e), R.evals.each.heldout_loss.get(e), R.evals.each.heldout_bpb.get(e))
          for e in evals]
    ev = [e for e in ev if e[0] is not None]
    final_loss, final_bpb, last = R.heldout_loss.get(ref), R.heldout_bpb.get(ref), P.steps.get(ref)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot([x for x, _ in pts], [y for _, y in pts], lw=0.8, label="training loss (one batch a step)")
    held = [(x, y) for x, y, _ in ev if y is not None]
    left.plot([x for x, _ in held], [y for _, y in held], "o-", color="tab:orange", label="held-out loss (eval)")
    if final_loss is not None and last is not None:
        left.scatter([last], [final_loss], marker="*", s=140, color="tab:red", zorder=5,
                     label=plot_text(f"checkpoint as written: {fmt(final_loss)}"))
    left.set(xlabel="step", ylabel="nats per token", title=plot_text(f"{P.label.get(ref, '?')}: loss"))
    left.legend(fontsize=7)
    left.grid(True, alpha=0.3)
    bpb = [(x, b) for x, _, b in ev if b is not None]
    right.plot([x for x, _ in bpb], [b for _, b in bpb], "o-", color="tab:orange", label="held-out (eval windows)")
    if final_bpb is not None and last is not None:
        right.scatter([last], [final_bpb], marker="*", s=140, color="tab:red", zorder=5,
                      label=plot_text(f"checkpoint as written, every held-out window: {fmt(final_bpb)}"))
    right.set(xlabel="step", ylabel="bits per byte", title="held-out bits per byte")
    right.legend(fontsize=7)
    right.grid(True, alpha=0.3)
    s.blocks.append(Figure(save(fig, out, "train"), f"training of {P.label.get(ref, '?')}", cite([ref])))
    corpus = P.corpus
    s.blocks.append(
        f"{P.label.get(ref, '?')} (weights {ref['weights']}): {fmt(P.model.parameters.get(ref))} parameters, layers "
        f"{P.model.layers.get(ref, '?')} (K KDA, M MLA), trained {last} steps of {P.batch.get(ref)} x "
        f"{P.seq_len.get(ref)} tokens on {P.device_name.get(ref, '?')} ({P.precision.get(ref, '?')}) in "
        f"{fmt(R.train_s.get(ref))} s; corpus {corpus.source.get(ref, '?')} of Python {corpus.python.get(ref, '?')} "
        f"({corpus.sha256.get(ref, '?')}), {fmt(corpus.train.files.get(ref))} train files, "
        f"{fmt(corpus.heldout.files.get(ref))} held out ({fmt(R.heldout_bytes.get(ref))} bytes, "
        f"{fmt(R.heldout_tokens.get(ref))} tokens); vocabulary {P.tokenizer.vocab.get(ref, '?')} "
        f"({P.tokenizer.sha256.get(ref, '?')}). Held-out loss of the checkpoint as written "
        f"{fmt(final_loss)} nats per token, {fmt(final_bpb)} bits per byte. Record made from: "
        f"{P.source.get(ref, '?')}.")
    loads = lambda r: [x for x in R.expert_load_max.get(r, []) if x is not None]
    s.blocks.append(Table(
        ["record", "time", "checkpoint", "weights", "machine", "commit", "steps", "batch x seq", "precision",
         "final train loss", "held-out loss", "held-out bits/byte", "expert load max (of even)", "train s"],
        [[short_id(r), r["time"], str(P.label.get(r, "?")), str(r["weights"] or "—"), machine(r), commit(r),
          fmt(P.steps.get(r)), f"{P.batch.get(r, '?')} x {P.seq_len.get(r, '?')}", str(P.precision.get(r, "?")),
          fmt(R.final_train_loss.get(r)), fmt(R.heldout_loss.get(r)), fmt(R.heldout_bpb.get(r)),
          fmt(max(loads(r)) if loads(r) else None), fmt(R.train_s.get(r))] for r in trains], cite(trains)))
    return s


MARGIN_FLOOR = 1e-6  # where a margin of 0 (an exact tie) is drawn on the log axis


def margin_label(r: dict) -> str:
    P = MARGINS.params
    return f"{P.label.get(r, r['preset'])} {P.golden_dtype.get(r, '?')} {P.golden_device.get(r, '?')} " \
           f"{P.source.get(r, '?')}"


def margins_section(margins: list[dict], out: Path) -> Section:
    """The greedy margins of each golden (gates/margins.py `margins` records, the latest per golden kind): their
    cumulative distribution on a log axis, with the near-tie epsilons of bf16 and fp32 marked."""
    s = Section("Greedy margins on the battery")
    P, R = MARGINS.params, MARGINS.results
    margins, s.blocks = usable(sorted(margins, key=lambda r: r["time"]), (R.margins,), "margins")
    latest = list(latest_by(margins, margin_label).values())
    if not latest:
        s.blocks.append(NO_RECORDS)
        return s
    s.blocks.append("The greedy margin of a step is the golden's top-1 minus top-2 log-probability (nats). Where it "
                    "lies under the near-tie epsilon of a precision, two correct implementations in that precision "
                    "may choose different tokens there, and every later step of that prompt is then another "
                    "context: the more of the battery lies under the bf16 epsilon, the more prompts on which a "
                    "correct bf16 run may part from a bf16 golden without any error. Margins of 0 (exact ties) are "
                    f"drawn at {MARGIN_FLOOR:g}.")
    fig, ax = plt.subplots(figsize=(9, 4))
    for r in latest:
        flat = sorted(max(m, MARGIN_FLOOR) for row in R.margins.get(r) for m in (row or []) if m is not None)
        if not flat:
            continue
        ys = [(i + 1) / len(flat) for i in range(len(flat))]
        ax.step(flat, ys, where="post", label=plot_text(
            f"{margin_label(r)}: {fmt(R.frac_below_bf16_eps.get(r), '.1%')} under bf16 eps"))
    for eps, name, style in ((R.bf16_eps, "bf16", "--"), (R.fp32_eps, "fp32/fp64", ":")):
        for value in sorted({eps.get(r) for r in latest if eps.get(r) is not None}):
            ax.axvline(value, color="gray", ls=style, lw=1)
            ax.annotate(plot_text(f"{name} near-tie eps {value:g}"), (value, 0.1), rotation=90, fontsize=7,
                        ha="right", va="bottom", color="dimgray")
    ax.set_xscale("log")
    ax.set(xlabel=f"greedy margin, top-1 minus top-2 log-prob (nats; an exact tie, 0, drawn at {MARGIN_FLOOR:g})",
           ylabel="fraction of steps at or below",
           ylim=(0, 1.02), title="greedy margins of the goldens, every prompt and step")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left")
    s.blocks.append(Figure(save(fig, out, "margins"), "greedy margin distributions", cite(latest)))
    s.blocks.append(Table(
        ["record", "golden", "implementation, device", "weights", "steps", "median nats", "min nats", "exact ties",
         "under bf16 eps", "under fp32 eps"],
        [[short_id(r), str(P.golden.get(r, "?")), f"{P.implementation.get(r, '?')}, {P.device_name.get(r, '?')}",
          str(r["weights"] or "—"), fmt(R.n.get(r)), fmt(R.median.get(r)), fmt(R.min.get(r)), fmt(R.zeros.get(r)),
          f"{fmt(R.frac_below_bf16_eps.get(r), '.1%')} (< {fmt(R.bf16_eps.get(r))})",
          f"{fmt(R.frac_below_fp32_eps.get(r), '.1%')} (< {fmt(R.fp32_eps.get(r))})"] for r in latest],
        cite(latest)))
    if len(latest) < len(margins):
        older = [r for r in margins if r not in latest]
        s.blocks.append(f"{len(older)} older margins record(s) of the same goldens are not drawn: {cite(older)}")
    return s


def decomposition_section(decomps: list[dict], out: Path) -> Section:
    s = Section("Decode time decomposition")
    if not decomps:
        s.blocks.append(f"{NO_RECORDS} for ours; the seed's published shares: "
                        + ", ".join(f"{k} {v:.1%}" for k, v in SEED_SHARES.items()) + f", idle {SEED_IDLE:.0%} "
                        f"({SEED_CITATION})")
        return s
    ours = max(decomps, key=decomposition_preference)
    others = [r for r in decomps if decomposition_preference(r)[:-1] != decomposition_preference(ours)[:-1]]
    res = DECOMPOSITION.results
    shares = res.shares.get(ours, {})
    cats = [c for c in CATEGORY_NAMES if c in shares or c in SEED_SHARES] + sorted(set(shares) - set(CATEGORY_NAMES))
    label = plot_text(f"ours ({short_id(ours)}, {commit(ours)})")
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    colors = plt.get_cmap("tab20")
    bottoms = [0.0, 0.0]
    for i, cat in enumerate(cats):
        heights = [shares.get(cat) or 0.0, SEED_SHARES.get(cat, 0.0)]   # null: a share that was not finite
        left.bar([label, SEED_LABEL], heights, bottom=bottoms, color=colors(i % 20), label=plot_text(cat))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    left.set(ylabel="share of GPU kernel time", ylim=(0, 1.0), title="decode kernel time by category")
    left.legend(fontsize=7, bbox_to_anchor=(1.0, 1.0), loc="upper left")
    right.bar(["ours", "seed"], [res.idle_fraction.get(ours, 0.0), SEED_IDLE], color=["tab:blue", "tab:gray"])
    right.set(ylabel="GPU idle fraction of wall time", title="idle between kernels")
    src = f"ours: {cite([ours])}; seed bar: {SEED_CITATION}"
    s.blocks.append(Figure(save(fig, out, "decomposition"), "decode decomposition, ours vs seed", src))
    # exclusive shares (of busy time; a kernel launched early is not charged for its wait), where the record has them
    excl = res.exclusive_shares.get(ours)
    rows = [[c, fmt(shares.get(c), ".1%"), fmt(SEED_SHARES.get(c), ".1%")] + ([fmt(excl.get(c), ".1%")] if excl else [])
            for c in cats]
    rows += [row + (["—"] if excl else []) for row in (
        ["idle (of wall time)", fmt(res.idle_fraction.get(ours), ".1%"), f"{SEED_IDLE:.0%}"],
        ["ms per step", fmt(res.step_ms.get(ours)), "—"])]
    s.blocks.append(Table(["category", "ours", SEED_LABEL] + (["ours, exclusive time"] if excl else []), rows, src))
    if others:
        newest = max(others, key=lambda r: r["time"])
        s.blocks.append(f"Drawn: the latest decomposition of the {DECOMPOSITION_PREFERRED} kind there is, or the one "
                        f"closest to it. {len(others)} decode decomposition(s) of other kinds are not drawn; the "
                        f"newest: {short_id(newest)} ({newest['preset']}, context "
                        f"{DECOMPOSITION.params.context.get(newest, '?')}, "
                        f"{DECOMPOSITION.params.mode.get(newest, '?')}, "
                        f"{machine(newest)}, commit {commit(newest)}).")
    return s


DECOMPOSITION_PREFERRED = "48b-a3b, GPU, 1k context, CUDA-graph"


def decomposition_preference(r: dict) -> tuple:
    """Which decode decomposition the seed's is set beside: the 48B model on a GPU at 1k context in graph mode
    (the configuration of the decode targets), then whichever comes closest, the latest of its kind. A tiny
    decomposition on a CPU (the nightly's) or one at 128k must not take its place for being newer."""
    return (r["preset"] == "48b-a3b", bool(RECORD.machine.gpu.get(r)), DECOMPOSITION.params.context.get(r) == 1024,
            DECOMPOSITION.params.mode.get(r) == "graph", r["time"])


def natural(text: str) -> list:
    """Sort key that orders 'T=8192' before 'T=32768'."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text)]


# bench_ab's parameters that the label leaves to the record: what a variant changed (the config column shows it),
# its rounds, and the model it ran in (the record's own preset and weights say that too)
AB_CONDITIONS = ("module", "changes", "rounds", "preset", "model_dtype", "weights")


def kernel_label(r: dict) -> str:
    """`op` (the kernel benchmarks' name; `kernel` alone in older records, the part of it in MoE records) and the shape
    parameters. Left to the record itself: the prose `*_scope` parameters, a dtype repeated from the record, and
    the launch `cfg`, so that a kernel shape keeps one row when its default tiles change (the latest is shown)."""
    params = KERNEL.params.get(r, {})
    op, part = KERNEL.params.op.get(r), KERNEL.params.kernel.get(r)
    name = f"{op} {part}" if op and part else (op or part or "?")
    rest = " ".join(f"{k}={v}" for k, v in sorted(params.items())
                    if k not in ("op", "kernel", "dtype", "cfg") + AB_CONDITIONS and not k.endswith("_scope"))
    return f"{name} {rest} {r['dtype'] or KERNEL.params.dtype.get(r, '')}".strip()


def superseded(latest: list[dict]) -> list[dict]:
    """Records of an experiment variant that the newest run of the same op and GPU dropped: a record whose parameters
    name a key (say `prep=blocked`) that no record of that newest run (the newest record's commit) carries. Shapes
    are not variants: a newest record with the same keys and other values (T=1024 against T=8192) drops nothing."""
    def op(r):
        return KERNEL.params.op.get(r), KERNEL.params.kernel.get(r), RECORD.machine.gpu.get(r)

    def run(r):
        return RECORD.git.commit.get(r) or r["time"]

    newest = {}
    for r in sorted(latest, key=lambda r: r["time"]):
        newest[op(r)] = r
    keys = {}
    for r in latest:
        if run(r) == run(newest[op(r)]):
            keys.setdefault(op(r), set()).update(targets.variant_keys(r))
    return [r for r in latest if run(r) != run(newest[op(r)]) and targets.variant_keys(r) - keys[op(r)]]


def kernels_section(kernels: list[dict], out: Path) -> Section:
    """The latest record per kernel shape. Sweep records (`params.sweep`: one per launch config tried, hundreds a
    run) are counted, not drawn: they are the evidence behind a default, cited where the default is set."""
    s = Section("Kernel timings, ours vs peer")
    sweeps = [r for r in kernels if KERNEL.params.sweep.get(r)]
    kernels = [r for r in kernels if not KERNEL.params.sweep.get(r)]
    if sweeps:
        s.blocks.append(Prose(f"{len(sweeps)} launch-config sweep record(s) are not drawn (see "
                              f"`python -m benchmarks.kernels --moe-sweep`, `--decode-sweep`, `--chunk-sweep` and "
                              f"`--conv-sweep`; the defaults cite them)."))
    if not kernels:
        s.blocks.append(NO_RECORDS)
        return s
    latest = sorted(latest_by(kernels, lambda r: (kernel_label(r), RECORD.machine.gpu.get(r))).values(),
                    key=lambda r: natural(kernel_label(r)))
    old = superseded(latest)
    if old:
        s.blocks.append(f"{len(old)} kernel variant(s) superseded by later records of the same op are not drawn or "
                        f"listed: " + ", ".join(f"{kernel_label(r)} ({short_id(r)})" for r in old) + ".")
        latest = [r for r in latest if r not in old]
    labels = [kernel_label(r) for r in latest]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(latest) + 1.5))
    y = range(len(latest))
    K = KERNEL.results
    ax.barh([i - 0.2 for i in y], [K.ours_ms.get(r, 0) for r in latest], height=0.4, label="ours")
    ax.barh([i + 0.2 for i in y], [K.peer_ms.get(r, 0) for r in latest], height=0.4,
            label=plot_text("peer: " + ", ".join(sorted({str(K.peer.get(r, "?")) for r in latest}))))
    ax.set_yticks(list(y), [plot_text(label) for label in labels], fontsize=7)
    ax.set(xscale="log", xlabel="ms per call")
    fig.suptitle("kernel timings (latest per kernel and GPU)", fontsize=10)
    ax.invert_yaxis()
    ax.legend(fontsize=7)
    s.blocks.append(Figure(save(fig, out, "kernels"), "kernel timings", cite(latest)))
    s.blocks.append(Table(["kernel", "ours ms", "peer", "peer ms", "speedup", "CUDA graph: ours / peer ms (speedup)",
                           "kernels (profiler): ours / peer ms (speedup)", "config", "record", "machine", "commit"],
                          [[kernel_label(r), fmt(K.ours_ms.get(r)), str(K.peer.get(r, "—")), fmt(K.peer_ms.get(r)),
                            fmt(K.peer_ms.get(r) and K.ours_ms.get(r) and K.peer_ms.get(r) / K.ours_ms.get(r), ".2f"),
                            paired_cell(r, "graph"), paired_cell(r, "kernel"), config_cell(r), short_id(r),
                            machine(r), commit(r)] for r in latest],
                          cite(latest)))
    return s


def paired_cell(r: dict, how: str) -> str:
    """Both sides by a second measure, `how` = "graph" (timed in CUDA graphs: `benchmarks.kernels`' ours_graph_ms /
    peer_graph_ms) or "kernel" (the kernels' device time by the profiler: ours_kernel_ms / peer_kernel_ms): for
    ~10 us kernels the do_bench columns beside them count a launch per call, and swing from run to run."""
    K = KERNEL.results
    ours, peer = K.field(f"ours_{how}_ms").get(r), K.field(f"peer_{how}_ms").get(r)
    if ours is None:
        return "—"
    if peer is None:
        return f"{fmt(ours)} / {K.field(f'peer_{how}_error').get(r) or '—'}"
    return f"{fmt(ours)} / {fmt(peer)} ({fmt(peer / ours if ours else None, '.2f')})"


def config_cell(r: dict) -> str:
    """The launch config a record ran (params.cfg), where it says: the label leaves it out so that a kernel keeps
    one row when its default changes."""
    cfg = KERNEL.params.cfg.get(r)
    if KERNEL.params.changes.get(r) is not None:  # a bench_ab variant: the config keys it changed
        return f"{KERNEL.params.module.get(r)}: {json.dumps(KERNEL.params.changes.get(r))}"
    return "—" if not cfg else " ".join(f"{k}={v}" for k, v in cfg.items())


def memory_section(memory: list[dict], out: Path) -> Section:
    """Memory records as gates/gate_memory.py writes them: results.decision ('ran'|'refused'|'tripped'|'skipped'),
    passed, projected_bytes, floor_bytes, free_before_bytes, measured_peak_bytes, min_free_bytes, audit {ok, ratio}."""
    s = Section("Memory audit")
    if not memory:
        s.blocks.append(NO_RECORDS)
        return s
    memory = sorted(memory, key=lambda r: r["time"])
    M = MEMORY.results
    measured = [r for r in memory if M.measured_peak_bytes.get(r) is not None]
    if measured:
        fig, ax = plt.subplots(figsize=(10, 0.5 * len(measured) + 2.5))
        y = range(len(measured))
        ax.barh([i - 0.2 for i in y], [M.projected_bytes.get(r, 0) / GiB for r in measured], height=0.4,
                label="projected peak")
        ax.barh([i + 0.2 for i in y], [M.measured_peak_bytes.get(r) / GiB for r in measured], height=0.4,
                label="measured peak")
        allowed = [(i, M.free_before_bytes.get(r) - M.floor_bytes.get(r))
                   for i, r in enumerate(measured)
                   if M.free_before_bytes.get(r) is not None and M.floor_bytes.get(r) is not None]
        if allowed:
            ax.scatter([a / GiB for _, a in allowed], [i for i, _ in allowed], marker="|", s=900, color="red",
                       zorder=5, label="free before - floor (largest allowed peak)")
        ax.set_yticks(list(y), [plot_text(f"{short_id(r)} {r['preset']} ctx {MEMORY.params.context.get(r, '?')}")
                                for r in measured], fontsize=7)
        ax.set(xlabel="GiB", title="memory: projected vs measured peak")
        ax.invert_yaxis()
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        s.blocks.append(Figure(save(fig, out, "memory"), "memory projected vs measured", cite(measured)))
    gib = lambda r, f: fmt(None if f.get(r) is None else f.get(r) / GiB, ".2f")
    audit = lambda r: ("—" if M.audit.get(r) is None else
                       ("OK" if M.audit.ok.get(r) else "FAILED") + f" ({fmt(M.audit.ratio.get(r), '.3f')}x)")
    s.blocks.append(Table(
        ["record", "time", "machine", "commit", "preset", "context", "floor decision", "free before GiB", "floor GiB",
         "projected GiB", "measured GiB", "min free GiB", "audit (measured/projected)", "reasons"],
        [[short_id(r), r["time"], machine(r), commit(r), str(r["preset"]), str(MEMORY.params.context.get(r, "—")),
          str(M.decision.get(r, "—")), gib(r, M.free_before_bytes), gib(r, M.floor_bytes),
          "—" if M.decision.get(r) == "skipped" else gib(r, M.projected_bytes),  # no device to project
          gib(r, M.measured_peak_bytes), gib(r, M.min_free_bytes), audit(r),
          "; ".join(r["reasons"])] for r in memory], cite(memory)))
    return s


def guarded(title: str, draw) -> Section:
    """`draw()`, or where it fails on its records a section titled `title` that says so: one section must not take
    the report down. Every figure it opened is closed either way."""
    try:
        return draw()
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
        return Section(title, [f"This section could not be drawn from its records ({why}); the rest of the report "
                               f"is."], failed=why)
    finally:
        plt.close("all")


def build(loaded, out: Path) -> list[Section]:
    records = loaded.records
    records, errata = apply_errata(records)
    valid = [r for r in records if r["verdict"] == "VALID"]
    of = lambda *kinds: [r for r in valid if r["kind"] in kinds]
    draws = (  # each section's title (for the note where it fails) and how to draw it
        ("Targets", lambda: targets_section(valid)),
        ("Nightly runs", lambda: nightly_section(of("nightly"))),
        ("Speed against context length", lambda: speed_section(of("bench"), out)),
        ("Speed history and regressions", lambda: history_section(of("bench"), out)),
        ("Gates", lambda: gates_section(of("gate_a", "gate_b"), out)),
        ("Reference checkpoint", lambda: train_section(of("train"), out, committed_reference_weights())),
        ("Greedy margins on the battery", lambda: margins_section(of("margins"), out)),
        ("Decode time decomposition", lambda: decomposition_section(
            [r for r in of("decomposition") if DECOMPOSITION.params.phase.get(r, "decode") == "decode"
             and not DECOMPOSITION.params.variant.get(r)], out)),
        ("Kernel timings, ours vs peer", lambda: kernels_section(of("kernel"), out)),
        ("Memory audit", lambda: memory_section(of("memory"), out)),
        ("INVALID records", lambda: invalid_section(records)),
        ("Errata", lambda: errata_section(errata)),
    )
    with matplotlib.rc_context({"text.usetex": False}):  # TeX would read record text as markup of its own
        return [problems_section(loaded.problems)] + [guarded(title, draw) for title, draw in draws]


# ---- writers -----------------------------------------------------------------------------------

def to_markdown(sections: list[Section], header: str) -> str:
    """SUMMARY.md: every text from the sections goes through `md_text`; the only links are the figures' own files."""
    m = md_text
    lines = ["# Kimi-Linear gating suite: report", "", m(header, block=True), ""]
    for s in sections:
        lines += [f"## {m(s.title)}", ""]
        for b in s.blocks:
            if isinstance(b, Figure):
                target = link_target(b.file)
                lines += [f"![{m(b.title)}]({target})" if target else f"(figure {m(b.file)})", "",
                          f"*{m(b.title)}.* Source: {m(b.source)}", ""]
            elif isinstance(b, Table):
                lines += ["| " + " | ".join(map(m, b.header)) + " |", "|" + "---|" * len(b.header)]
                lines += ["| " + " | ".join(map(m, row)) + " |" for row in b.rows]
                lines += ([""] + [f"Source: {m(b.source)}"] if b.source else []) + [""]
            elif isinstance(b, Prose):
                lines += ["".join(f"`{t}`" if code else m(t, block=i == 0)
                                  for i, (code, t) in enumerate(_prose_parts(b))), ""]
            else:
                lines += [m(b, block=True), ""]
    return "\n".join(lines)


def to_html(sections: list[Section], header: str) -> str:
    e = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>Kimi-Linear gating suite: report</title>",
             "<style>body{font-family:sans-serif;max-width:1200px;margin:auto;padding:1em}"
             "table{border-collapse:collapse;font-size:12px;margin:.5em 0}td,th{border:1px solid #bbb;padding:2px 6px}"
             "th{background:#eee}.src{color:#555;font-size:12px}img{max-width:100%}"
             ".problems{background:#fee;border:2px solid #c00;padding:.5em}</style></head><body>",
             "<h1>Kimi-Linear gating suite: report</h1>", f"<p>{e(header)}</p>"]
    for s in sections:
        problem = s.title == "Unreadable record lines" and any(isinstance(b, Table) for b in s.blocks)
        parts.append(f"<section{' class=problems' if problem else ''}><h2>{e(s.title)}</h2>")
        for b in s.blocks:
            if isinstance(b, Figure):
                target = link_target(b.file)
                img = f"<img src='{e(target)}' alt='{e(b.title)}'>" if target else ""
                parts.append(f"<figure>{img}<figcaption class=src><b>{e(b.title)}</b>. Source: {e(b.source)}"
                             f"</figcaption></figure>")
            elif isinstance(b, Table):
                parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in b.header) + "</tr>")
                parts += ["<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in row) + "</tr>" for row in b.rows]
                parts.append("</table>" + (f"<p class=src>Source: {e(b.source)}</p>" if b.source else ""))
            elif isinstance(b, Prose):
                parts.append("<p>" + "".join(f"<code>{e(t)}</code>" if code else e(t) for code, t in _prose_parts(b))
                             + "</p>")
            else:
                parts.append(f"<p>{e(b)}</p>")
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def render(records_root=None, out: str | Path = "reports") -> list[Section]:
    """Write the report of the records under `records_root` into `out`; the sections drawn. Lines the store could
    not use and sections that could not be drawn are listed in the report and said on stderr, one a line."""
    from records.store import REPO_ROOT, load, records_dir

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    before = set((out / "figures").glob("*.png"))
    loaded = load(root=records_root)
    sections = build(loaded, out)  # a failure here leaves the previous report's files in place
    drawn = {out / b.file for sec in sections for b in sec.blocks if isinstance(b, Figure)}
    for old in before - drawn:  # a figure whose section is now empty must not linger
        old.unlink()
    kinds = defaultdict(int)
    for r in loaded.records:
        kinds[r["kind"]] += 1
    failed = [s for s in sections if s.failed]
    where = records_dir(records_root).resolve()
    where = where.relative_to(REPO_ROOT) if where.is_relative_to(REPO_ROOT) else where  # no machine's path if in-tree
    header = (f"Rendered from {len(loaded.records)} records in {where} ("
              + (", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "none")
              + f"); {len(loaded.problems)} unreadable line(s)"
              + (f"; {len(failed)} section(s) could not be drawn" if failed else "") + ".")
    # backslashreplace: a folder name given in bytes that are not UTF-8 (a lone surrogate in Python) must not
    # stop the write
    (out / "index.html").write_text(to_html(sections, header), encoding="utf-8", errors="backslashreplace")
    (out / "SUMMARY.md").write_text(to_markdown(sections, header), encoding="utf-8", errors="backslashreplace")
    if loaded.problems:   # said where the one who ran this looks, not only inside the report
        print(f"warning: {len(loaded.problems)} record line(s) could not be read and are left out of the report "
              f"(its first section lists them too):", file=sys.stderr)
        for p in loaded.problems:
            print(f"  {p}", file=sys.stderr)
    for s in failed:
        print(f"warning: section {s.title!r} could not be drawn: {s.failed}", file=sys.stderr)
    return sections


def main(argv: list[str] | None = None) -> int:
    """0 rendered; 2 could not run (a records folder that is not there, an output that cannot be written), with one
    line saying which."""
    parser = argparse.ArgumentParser(description="Render reports/index.html and SUMMARY.md from records alone.")
    parser.add_argument("--records", default=None, help="records directory (default: the store's)")
    parser.add_argument("--out", default="reports", help="output directory (default: reports/)")
    args = parser.parse_args(argv)
    folder = store.records_dir(args.records)
    if not folder.is_dir():     # a mistyped KIMI_RECORDS_DIR would otherwise render an empty report
        parser.error(f"records folder {folder}: no such folder (--records or KIMI_RECORDS_DIR); "
                     f"expected a folder of <kind>.jsonl files")
    try:
        render(args.records, args.out)
    except OSError as e:
        print(f"render: --out {args.out}: cannot write the report ({e.filename or args.out}: {e.strerror or e})",
              file=sys.stderr)
        return 2
    print(f"wrote {Path(args.out) / 'index.html'} and {Path(args.out) / 'SUMMARY.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
