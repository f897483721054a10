"""Rounds and their summaries: contenders interleaved (A B C A B C ...), rounds re-run
when others disturbed them, medians with min–max; a function's CPU cost alone.

:func:`interleave_order` and :func:`summarize` are pure; :func:`interleave` runs them.
"""
from __future__ import annotations

import os
import signal
import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

from .load import QUIET_OUTSIDE_FRAC, machine_busy_ticks
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


def cpu_ms_per_item(fn: Callable[[Sequence[Any]], Any], items: Sequence[Any], batch: int, batches: int = 6, *,
                    warm: bool = True, outputs: Optional[list] = None) -> float:
    """Thread CPU ms per item of ``fn`` alone, called on ``batches`` chunks of ``batch`` items.

    The chunks are the ones after the first chunk of ``items``; ``fn`` is called on that
    first one beforehand to warm it up (imports, page cache) unless ``warm=False``.

    Args:
        outputs: a list that receives what ``fn`` returned for each timed chunk (else
            each is dropped at once).
    """
    chunks = [items[s:s + batch] for s in range(0, min(len(items), (batches + 1) * batch), batch)]
    if warm:
        fn(chunks[0])
    n = sum(len(c) for c in chunks[1:])
    t = time.thread_time()
    if outputs is None:
        for c in chunks[1:]:
            fn(c)
    else:
        outputs.extend(fn(c) for c in chunks[1:])
    return (time.thread_time() - t) * 1e3 / n


def timed_calls(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """(thread CPU s, wall s) per call of ``fn()`` over ``reps`` calls, after one call to warm up."""
    fn()
    c, w = time.thread_time(), time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.thread_time() - c) / reps, (time.perf_counter() - w) / reps


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
        before_round: called before each round and retry (e.g. :func:`wait_quiet`).
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


def wait_quiet(max_busy_frac: float = 0.05, window_s: float = 1.0, timeout_s: float = 20.0) -> float:
    """Wait (at most ``timeout_s``) until the machine's CPUs were busy at most
    ``max_busy_frac`` over a ``window_s`` window; returns the last window's busy fraction."""
    deadline = time.monotonic() + timeout_s
    while True:
        b0, t0 = machine_busy_ticks()
        time.sleep(window_s)
        b1, t1 = machine_busy_ticks()
        frac = (b1 - b0) / max(1, t1 - t0)
        if frac <= max_busy_frac or time.monotonic() >= deadline:
            return frac


@contextmanager
def paused(pids: Iterable[int]) -> Iterator[int]:
    """Stop the processes ``pids`` (``SIGSTOP``) for the block, then continue them;
    yields how many were stopped.

    A benchmark that keeps every contender alive for interleaved rounds (idle Rays,
    persistent workers) pauses the contenders it is not measuring: an idle Ray's
    timers and polls wake a dozen threads all the time, and even at idle priority
    (``SCHED_IDLE``) they took ~1% of a busy 2-core machine from the measured
    contender, as if it were not alone (side by side: alone-by-pausing +2.7%, at idle
    priority +1%, over leaving them as they are). Stops last one run (seconds); Ray's
    health checks (5 misses of 3 s each) and connections ride them out. Processes that
    are gone by the end are skipped.

    Never pause processes of the caller's own process group: if the group becomes
    orphaned while one is stopped (the shell that started it exits), the kernel sends
    the whole group SIGHUP. Put what you pause in a session of its own (``setsid``).
    """
    stopped = []
    for pid in sorted(set(pids)):
        try:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        except OSError:
            continue
    try:
        yield len(stopped)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass


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


