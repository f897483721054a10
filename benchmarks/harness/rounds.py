"""Rounds and their summaries: contenders interleaved (A B C A B C ...), rounds re-run
when others disturbed them, medians with min–max.

:func:`interleave_order` and :func:`summarize` are pure; :func:`interleave` runs them.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from .load import QUIET_OUTSIDE_FRAC
from .measure import Result


def interleave_order(names: Sequence[str], rounds: int, rotate: bool = False) -> list[tuple[int, str]]:
    """(round, name) in the order an interleaved run takes them: every name once per round.

    Args:
        rotate: start round r with the r-th name (A B C, B C A, C A B, ...), so no
            contender always runs first (after an idle gap) or last.
    """
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    out = []
    for r in range(rounds):
        k = r % len(names) if (rotate and names) else 0
        out.extend((r, n) for n in list(names[k:]) + list(names[:k]))
    return out


def interleave(contenders: Mapping[str, Callable[[], Any]], rounds: int, *,
               accept: Optional[Callable[[Any], bool]] = None, max_retries: int = 2,
               before_round: Optional[Callable[[], Any]] = None,
               on_result: Optional[Callable[[str, int, Any], None]] = None) -> dict[str, list[Any]]:
    """Run every contender once per round, in turn (A B C A B C ...).

    Args:
        contenders: name -> zero-argument callable returning that run's result.
        rounds: rounds (BENCHMARKING.md asks for at least 3).
        accept: a result check (e.g. :func:`quiet`); a round with a rejected result
            is run again, up to ``max_retries`` times, and the attempt with the
            most accepted results is kept (the later one on a tie).
        max_retries: extra attempts per round.
        before_round: called before each round and retry.
        on_result: called with (name, round, result) after each run (progress).

    Returns:
        name -> list of results, one per round. A :class:`Result` records its
        round's attempts in ``extra["round_attempts"]``.
    """
    out: dict[str, list[Any]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        best: Optional[dict] = None
        best_ok = -1
        for attempt in range(max_retries + 1):
            if before_round is not None:
                before_round()
            got = {}
            for _, name in interleave_order(names, 1):
                got[name] = contenders[name]()
                if on_result is not None:
                    on_result(name, r, got[name])
            ok = len(got) if accept is None else sum(bool(accept(v)) for v in got.values())
            if ok >= best_ok:
                best, best_ok = got, ok
            if ok == len(got):
                break
        for name, v in best.items():
            if isinstance(v, Result):
                v.extra["round_attempts"] = attempt + 1
            out[name].append(v)
    return out


def quiet(result: Result, max_outside_frac: float = QUIET_OUTSIDE_FRAC) -> bool:
    """True when processes outside the measured tree took at most ``max_outside_frac`` of the CPU."""
    return result.outside_cpu_frac <= max_outside_frac


def median(values: Iterable[Optional[float]]) -> Optional[float]:
    """The median of the numbers (None values are left out); None if none are left."""
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def summarize(values: Sequence[Optional[float]]) -> dict[str, Any]:
    """Median, min, max and n of the numbers (None values are left out)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def fmt_range(s: Mapping[str, Any], fmt: str = "{:.3g}", scale: float = 1.0) -> str:
    """``median (min–max)`` of a :func:`summarize` dict."""
    if not s or s.get("median") is None:
        return "–"
    f = lambda v: fmt.format(v * scale)  # noqa: E731
    return f"{f(s['median'])} ({f(s['min'])}–{f(s['max'])})"


