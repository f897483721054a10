"""The machine's load during a measurement: /proc/stat (CPU busy, ours and others') and
/proc/loadavg, and the mark of a quiet round.

The accounting is pure (:func:`cpu_account`, :func:`is_quiet`) so it can be tested on
numbers; :class:`LoadWindow` reads the files at a window's start and end.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

# BENCHMARKING.md: repeat runs where other processes took more than ~5% of the CPU.
QUIET_OUTSIDE_FRAC = 0.05


def parse_proc_stat(text: str) -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs from /proc/stat's text (busy = total - idle - iowait)."""
    fields = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])  # guest time is already inside user/nice
    return total - fields[3] - fields[4], total


def machine_busy_ticks() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs now."""
    return parse_proc_stat(Path("/proc/stat").read_text())


def parse_loadavg(text: str) -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages from /proc/loadavg's text."""
    a, b, c = text.split()[:3]
    return float(a), float(b), float(c)


def loadavg() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages now."""
    return parse_loadavg(Path("/proc/loadavg").read_text())


def cpu_account(busy_ticks: int, total_ticks: int, ours_cpu_s: float, clk_tck: int) -> dict[str, float]:
    """The machine's CPU over a window split into ours and others'.

    Args:
        busy_ticks, total_ticks: the window's /proc/stat deltas (all CPUs).
        ours_cpu_s: CPU seconds the measured processes used in the window (negative
            or above the machine's busy time is clamped).
        clk_tck: ticks per second.

    Returns:
        ``machine_cpu_frac`` (busy / capacity) and ``outside_cpu_frac`` (busy time not
        ours / capacity), both in [0, 1].
    """
    if total_ticks <= 0:
        return {"machine_cpu_frac": 0.0, "outside_cpu_frac": 0.0}
    busy_s, cap_s = busy_ticks / clk_tck, total_ticks / clk_tck
    outside = min(max(0.0, busy_s - max(0.0, ours_cpu_s)), busy_s)
    return {"machine_cpu_frac": round(busy_s / cap_s, 4), "outside_cpu_frac": round(outside / cap_s, 4)}


def is_quiet(outside_cpu_frac: Optional[float], limit: float = QUIET_OUTSIDE_FRAC) -> bool:
    """A quiet round: other processes took at most ``limit`` of the machine's CPU (unknown: not quiet)."""
    return outside_cpu_frac is not None and outside_cpu_frac <= limit


@dataclass
class Load:
    """The load over one window."""

    wall_s: float
    machine_cpu_frac: float
    outside_cpu_frac: Optional[float]
    loadavg: list
    quiet: bool

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return asdict(self)


class LoadWindow:
    """Reads /proc/stat and /proc/loadavg at :meth:`start` and :meth:`stop`.

    ``stop(ours_cpu_s)`` splits the busy time into the measured processes' and the
    others'; without ``ours_cpu_s`` only the machine's busy fraction is known and the
    window counts as quiet only if the whole machine was busy at most the limit.
    """

    def __init__(self) -> None:
        self._t0 = 0.0
        self._stat0 = (0, 0)
        self._avg0: tuple = (0.0, 0.0, 0.0)

    def start(self) -> "LoadWindow":
        """Open the window."""
        self._t0, self._stat0, self._avg0 = time.perf_counter(), machine_busy_ticks(), loadavg()
        return self

    def stop(self, ours_cpu_s: Optional[float] = None, clk_tck: int = 100) -> Load:
        """Close the window; ``ours_cpu_s``: CPU the measured processes used in it."""
        b1, t1 = machine_busy_ticks()
        busy, total = b1 - self._stat0[0], t1 - self._stat0[1]
        acc = cpu_account(busy, total, ours_cpu_s or 0.0, clk_tck)
        outside = acc["outside_cpu_frac"] if ours_cpu_s is not None else None
        quiet = is_quiet(outside) if ours_cpu_s is not None else is_quiet(acc["machine_cpu_frac"])
        return Load(round(time.perf_counter() - self._t0, 3), acc["machine_cpu_frac"], outside,
                    [list(self._avg0), list(loadavg())], quiet)


def summarize_loads(loads: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Over a scenario's runs (dicts with ``outside_cpu_frac`` — None where unknown, then
    ``machine_cpu_frac`` stands in —, ``loadavg`` [[1, 5, 15 min] at start, at end] and
    ``quiet``): rounds, quiet rounds, the median and max of others' CPU share, the
    1-minute load averages seen."""
    outs = sorted(x["outside_cpu_frac"] if x.get("outside_cpu_frac") is not None else x.get("machine_cpu_frac", 0.0)
                  for x in loads)
    avgs = [a[0] for x in loads for a in x.get("loadavg") or ()]
    return {
        "rounds": len(loads),
        "quiet_rounds": sum(bool(x.get("quiet")) for x in loads),
        "other_cpu_frac_median": outs[len(outs) // 2] if outs else None,
        "other_cpu_frac_max": outs[-1] if outs else None,
        "loadavg1_min": min(avgs) if avgs else None,
        "loadavg1_max": max(avgs) if avgs else None,
    }


def load_line(s: dict[str, Any], nproc: int) -> str:
    """One sentence for a figure: the load it was taken under."""
    if not s.get("rounds") or s.get("other_cpu_frac_median") is None:
        return "load: not recorded"
    if s.get("loadavg1_min") is None:
        s = {**s, "loadavg1_min": float("nan"), "loadavg1_max": float("nan")}
    return (f"load: other processes took {100 * s['other_cpu_frac_median']:.0f}% of the {nproc} cores "
            f"(median; max {100 * s['other_cpu_frac_max']:.0f}%), 1-min loadavg "
            f"{s['loadavg1_min']:.1f}–{s['loadavg1_max']:.1f}; {s['quiet_rounds']} of {s['rounds']} runs quiet "
            f"(others ≤{100 * QUIET_OUTSIDE_FRAC:.0f}%)")
