"""Interleaved trials of a scenario's contenders, each run inside a load window, and
their tables: median (min–max) per contender, paired ratios against a baseline, quiet
rounds marked.

A contender is a zero-argument callable returning a dict of numbers (its metrics);
``cpu_s`` in that dict, when given, is the CPU the contender's processes used, so the
window can tell others' load from ours. :func:`paired_ratios` and :func:`table_rows`
are pure.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from .load import is_quiet
from .measure import Result, measure
from .procs import ProcTree
from .rounds import interleave_order, summarize
from .render import ratio_words


#: A wall-clock time (``time.time()``) after which no new round starts (set by ``report``).
DEADLINE_ENV = "SBLOADER_BENCH_DEADLINE"
#: Rounds a scenario runs even past that time (a median of one round has no spread to show).
MIN_ROUNDS = 2


@dataclass
class Trial:
    """One run of one contender in one round."""

    round: int
    contender: str
    metrics: dict
    load: dict
    error: Optional[str] = None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return {"round": self.round, "contender": self.contender, "metrics": self.metrics,
                "load": self.load, "error": self.error}


@dataclass
class Trials:
    """All trials of a scenario, in the order they ran."""

    trials: list = field(default_factory=list)
    rounds_planned: int = 0
    rounds_run: int = 0  # fewer than planned when the report's time budget ran out

    def of(self, contender: str) -> list[Trial]:
        """The contender's trials."""
        return [t for t in self.trials if t.contender == contender]

    def contenders(self) -> list[str]:
        """Contender names in first-run order."""
        return list(dict.fromkeys(t.contender for t in self.trials))

    def as_list(self) -> list[dict]:
        """JSON-serialisable."""
        return [t.as_dict() for t in self.trials]


def run_interleaved(contenders: Mapping[str, Callable[[], Mapping[str, Any]]], rounds: int, *,
                    rotate: bool = True, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
                    keep_going: bool = True, pss: bool = False, by_class: bool = False,
                    before_round: Optional[Callable[[int], Any]] = None, tree: Optional[ProcTree] = None) -> Trials:
    """Run the contenders in turn for ``rounds`` rounds (see :func:`interleave_order`),
    each run inside :func:`measure` (CPU of this process tree, others' load, loadavg).

    Args:
        pss: sample the PSS of the process tree too (costs CPU; off for throughput runs).
        by_class: also record ``cpu_s_<class>`` (trainer, workers, raylet, gcs, ray_daemons, other).
        before_round: called with the round's number before its first run, outside any
            measurement (a calibration taken once per round).
        tree: the processes each run accounts for (a :class:`~.procs.ProcTree`; default: this one's).
        keep_going: a contender that raises is recorded with its error (and not run
            again); otherwise the error propagates.
    """
    out, failed = Trials(rounds_planned=rounds), set()
    deadline = float(os.environ.get(DEADLINE_ENV, "inf"))
    last_round = -1
    for r, name in interleave_order(list(contenders), rounds, rotate=rotate):
        if r != last_round:
            if r >= MIN_ROUNDS and time.time() > deadline:
                log(f"  the time budget is spent: {r} of {rounds} rounds run")
                break
            if before_round is not None:
                before_round(r)
            out.rounds_run = r + 1
        last_round = r
        if name in failed:
            continue
        err = None
        with measure(name, pss=pss, tree=tree) as m:
            try:
                metrics = dict(contenders[name]())
            except Exception as e:  # noqa: BLE001 - recorded, the others go on
                if not keep_going:
                    raise
                metrics, err = {}, f"{type(e).__name__}: {e}"
                failed.add(name)
        load = trial_load(m.result, metrics.get("cpu_s"))
        metrics.setdefault("wall_s", round(m.result.wall_s, 4))
        metrics.setdefault("cpu_s", m.result.cpu_s_tree)
        if by_class:
            for c, v in m.result.cpu_s_by_class.items():
                metrics.setdefault(f"cpu_s_{c}", v)
        if pss:
            metrics.setdefault("peak_pss_mib", round(m.result.peak_pss_bytes / 2**20, 1))
        out.trials.append(Trial(r, name, metrics, load, err))
        log(f"  round {r} {name}: " + (err or ", ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()))
            + ("" if load["quiet"] else f"  [loaded: others {100 * load['outside_cpu_frac']:.0f}%]"))
    return out


def trial_load(r: Result, own_cpu_s: Optional[float] = None) -> dict[str, Any]:
    """A run's load from its :class:`Result`; ``own_cpu_s`` (the contender's own count of
    its processes' CPU, e.g. of a cluster outside this process tree) replaces the tree's."""
    outside = r.outside_cpu_frac
    if own_cpu_s is not None and r.wall_s > 0:
        cap = r.wall_s * len(os.sched_getaffinity(0))
        outside = round(max(0.0, r.machine_cpu_frac - max(own_cpu_s, r.cpu_s_tree) / cap), 4)
    return {"wall_s": round(r.wall_s, 3), "machine_cpu_frac": r.machine_cpu_frac, "outside_cpu_frac": outside,
            "loadavg": r.loadavg, "quiet": is_quiet(outside)}


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def smart(v: float) -> str:
    """A figure as a reader wants it: ``1,480`` rather than ``1.48e+03``, ``0.241`` (3 digits) below 100."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def smart_range(s: Mapping[str, Any]) -> str:
    """``median (min–max)`` of a summary with :func:`smart` numbers."""
    if not s or s.get("median") is None:
        return "–"
    return f"{smart(s['median'])} ({smart(s['min'])}–{smart(s['max'])})"


def paired_ratios(trials: Trials, metric: str, contender: str, baseline: str,
                  higher_is_better: bool = True) -> list[float]:
    """Per round, contender / baseline (higher is better) or baseline / contender (a time):
    above 1 means the contender did better in that round. Rounds missing either are left out."""
    base = {t.round: t.metrics.get(metric) for t in trials.of(baseline)}
    out = []
    for t in trials.of(contender):
        a, b = t.metrics.get(metric), base.get(t.round)
        if a is None or b is None or a <= 0 or b <= 0:
            continue
        out.append(a / b if higher_is_better else b / a)
    return out


def table_rows(trials: Trials, metric: str, unit: str, *, baseline: Optional[str] = None,
               higher_is_better: bool = True, extra: Sequence[str] = (),
               timing: bool = True) -> list[dict]:
    """One row per contender: the metric's median (min–max), rounds, quiet rounds, the
    median paired ratio to ``baseline`` in words, and the medians of ``extra`` metrics.

    ``timing=False``: the metric is not a speed (e.g. labels per batch), so the load does
    not qualify its ratio."""
    rows = []
    for name in trials.contenders():
        ts = trials.of(name)
        errs = [t.error for t in ts if t.error]
        s = summarize([t.metrics.get(metric) for t in ts if not t.error])
        quiet = sum(bool(t.load.get("quiet")) for t in ts)
        row = {"contender": name, f"{metric} ({unit})": smart_range(s), "rounds": len(ts),
               "quiet rounds": f"{quiet}/{len(ts)}"}
        if baseline is not None:
            rs = paired_ratios(trials, metric, name, baseline, higher_is_better)
            word = "better" if higher_is_better else "faster"
            row[f"vs {baseline}"] = ("1 (baseline)" if name == baseline else
                                     ratio_words(statistics.median(rs) if rs else None, baseline,
                                                 not timing or (quiet == len(ts) and all(
                                                     t.load.get("quiet") for t in trials.of(baseline))),
                                                 f">1: {word}"))
        for k in extra:
            row[k] = smart_range(summarize([t.metrics.get(k) for t in ts if not t.error]))
        if errs:
            row["error"] = errs[0][:160]
        rows.append(row)
    return rows


def bars(trials: Trials, metric: str) -> list[dict]:
    """Figure bars: per contender the metric's median, min, max, and whether all its rounds were quiet."""
    out = []
    for name in trials.contenders():
        ts = [t for t in trials.of(name) if not t.error]
        s = summarize([t.metrics.get(metric) for t in ts])
        out.append({"label": name, **s, "quiet": bool(ts) and all(t.load.get("quiet") for t in ts)})
    return out
