"""The scenario format: a module under ``benchmarks/scenarios/`` (see benchmarks/README.md).

A scenario module defines

- ``TITLE``: one line; the module docstring's first paragraph says what it measures;
- ``PARAMS``: its parameters at full size (name -> JSON value) and ``QUICK``: the
  overrides ``--quick`` applies;
- ``plan(**params) -> Plan``: what a run would do, cheaply (no Ray, no data): the
  contenders, the rounds, the optional peers that are not installed;
- ``run(**params) -> Outcome``: runs it (usually :func:`~benchmarks.harness.trials.run_interleaved`).

This module finds scenarios, merges their parameters and turns an :class:`Outcome` into
a section (a JSON-serialisable dict that :mod:`.report` renders).
"""
from __future__ import annotations

import ast
import importlib
import shlex
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Mapping, Optional, Sequence

from .load import load_line, summarize_loads
from .machine import BENCH_DIR, git_state, machine_info
from .trials import Trials, bars, table_rows

SCENARIO_DIR = BENCH_DIR / "scenarios"


@dataclass
class Plan:
    """What a scenario's run would do."""

    contenders: list
    rounds: int
    skipped: dict = field(default_factory=dict)  # contender -> why it will not run (not installed)
    notes: str = ""


@dataclass
class Outcome:
    """What a scenario's run produced: its trials and how to tabulate them."""

    trials: Trials
    metric: str  # the headline metric (a key of each trial's metrics)
    unit: str
    higher_is_better: bool = True
    baseline: Optional[str] = None  # the contender ratios are taken against
    extra: Sequence[str] = ()  # more metric columns (medians with min–max)
    skipped: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    raw: dict = field(default_factory=dict)
    timing: bool = True  # False: the metric is not a speed (the load does not qualify its ratios)


def names(report_only: bool = False) -> list[str]:
    """The scenarios, in report order (``ORDER`` in each module, then by name); with
    ``report_only``, those of the first-contact report (``REPORT = False`` marks a
    component benchmark that ``report --all`` adds)."""
    found = [p.stem for p in SCENARIO_DIR.glob("*.py") if not p.stem.startswith("_")]
    if report_only:
        found = [n for n in found if getattr(load(n), "REPORT", True)]
    return sorted(found, key=lambda n: (getattr(load(n), "ORDER", 100), n))


def load(name: str) -> ModuleType:
    """Import ``benchmarks.scenarios.<name>`` and check it has the scenario's parts."""
    if not (SCENARIO_DIR / f"{name}.py").exists():
        known = sorted(p.stem for p in SCENARIO_DIR.glob("*.py") if not p.stem.startswith("_"))
        raise SystemExit(f"no scenario {name!r}: benchmarks/scenarios/ has {', '.join(known)}")
    mod = importlib.import_module(f"benchmarks.scenarios.{name}")
    missing = [a for a in ("TITLE", "PARAMS", "QUICK", "plan", "run") if not hasattr(mod, a)]
    if missing:
        raise TypeError(f"scenario {name} lacks {missing}: see benchmarks/README.md for the format")
    return mod


def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """``key=value`` words to a dict; values read as Python literals, else kept as text."""
    out = {}
    for p in pairs:
        if "=" not in p:
            raise SystemExit(f"parameter {p!r} is not key=value")
        k, v = p.split("=", 1)
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def merge_params(defaults: Mapping[str, Any], quick: Mapping[str, Any], use_quick: bool,
                 overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Full-size defaults, then the quick ones (if asked), then the command line's; an
    unknown name is an error that lists the known ones."""
    unknown = sorted(set(quick) - set(defaults)) + sorted(set(overrides) - set(defaults))
    if unknown:
        raise SystemExit(f"unknown parameter(s) {unknown}; known: {sorted(defaults)}")
    out = dict(defaults)
    if use_quick:
        out.update(quick)
    out.update(overrides)
    return out


def command_for(name: str, use_quick: bool, overrides: Mapping[str, Any]) -> str:
    """The command that reruns one scenario as it ran."""
    words = ["python", "-m", "benchmarks", "run", name] + (["--quick"] if use_quick else [])
    words += [f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in overrides.items()]
    return shlex.join(words)


def plan_of(name: str, use_quick: bool, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A scenario's plan as a dict (for ``--dry-run``)."""
    mod = load(name)
    params = merge_params(mod.PARAMS, mod.QUICK, use_quick, overrides)
    p = mod.plan(**params)
    if not isinstance(p, Plan) or not p.contenders or p.rounds < 1:
        raise TypeError(f"scenario {name}: plan() must return a Plan with contenders and rounds >= 1, got {p!r}")
    return {"name": name, "title": mod.TITLE, "params": params, "contenders": p.contenders, "rounds": p.rounds,
            "skipped": p.skipped, "notes": p.notes, "command": command_for(name, use_quick, overrides)}


def what(mod: ModuleType) -> str:
    """The first paragraph of a scenario's docstring."""
    return " ".join((mod.__doc__ or "").strip().split("\n\n")[0].split())


def section(name: str, outcome: Outcome, *, title: str, what_text: str, params: Mapping[str, Any],
            command: str, machine: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The JSON-serialisable section of a run (pure but for ``machine_info`` when not given)."""
    machine = dict(machine or machine_info())
    loads = [t.load for t in outcome.trials.trials]
    summary = summarize_loads(loads)
    rows = table_rows(outcome.trials, outcome.metric, outcome.unit, baseline=outcome.baseline,
                      higher_is_better=outcome.higher_is_better, extra=outcome.extra, timing=outcome.timing)
    notes = list(outcome.notes)
    t = outcome.trials
    if t.rounds_planned and t.rounds_run < t.rounds_planned:
        notes.insert(0, f"**{t.rounds_run} of {t.rounds_planned} rounds**: the report's time budget ran out")
    return {"name": name, "title": title, "what": what_text, "status": "ok", "command": command,
            "machine": machine, "params": dict(params), "metric": outcome.metric, "unit": outcome.unit,
            "higher_is_better": outcome.higher_is_better, "baseline": outcome.baseline, "rows": rows,
            "bars": bars(outcome.trials, outcome.metric), "load": summary,
            "load_line": load_line(summary, machine["nproc"]), "skipped": dict(outcome.skipped),
            "notes": notes, "raw": outcome.raw, "trials": outcome.trials.as_list()}


def run_scenario(name: str, use_quick: bool, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Run one scenario; its section (with the commit it ran)."""
    mod = load(name)
    params = merge_params(mod.PARAMS, mod.QUICK, use_quick, overrides)
    outcome = mod.run(**params)
    sec = section(name, outcome, title=mod.TITLE, what_text=what(mod), params=params,
                  command=command_for(name, use_quick, overrides))
    sec["git"] = git_state()
    return sec
