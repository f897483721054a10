"""The checkpoint state of a mixture loader (format ``sbloader.Mix``) and its statistics.

The body: ``position`` (samples the loop took from the mixture, in all),
``start`` (the position the current iteration began at), ``history`` (the weight
history, :class:`~sbloader.core.mix_plan.WeightChange` as JSON) and ``sources``
(per source, :class:`~sbloader.loaders.mix_source.CursorState`: its own loader's
state before the batch it is in, the rows of that batch used, rows taken, its
epoch). The schedule is a pure function of the seed, the position and the history,
so nothing else is needed to draw on exactly as the uninterrupted run would.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from sbloader.core.errors import StateDictError
from sbloader.core.state import StateFormat

STATE_VERSION = 1
FORMAT = StateFormat("sbloader.Mix", STATE_VERSION, ("position", "start", "history", "sources"))


def check_body(state: dict, names: list) -> None:
    """Raise a "found X, expected Y" error unless the body fits a mixture of ``names``."""
    for key in ("position", "start"):
        if not isinstance(state[key], int) or state[key] < 0:
            raise StateDictError(f"mix state {key}: found {state[key]!r}, expected an int >= 0")
    if state["start"] > state["position"]:
        raise StateDictError(f"mix state start: found {state['start']}, expected <= position {state['position']}")
    if not isinstance(state["history"], list) or not state["history"]:
        raise StateDictError(f"mix state history: found {state['history']!r}, expected a non-empty list")
    if not isinstance(state["sources"], dict) or sorted(state["sources"]) != sorted(names):
        found = sorted(state["sources"]) if isinstance(state["sources"], dict) else state["sources"]
        raise StateDictError(f"mix state sources: found {found!r}, expected {sorted(names)} (this mixture's). "
                             "Load it into a mixture of the same sources")


def refuse_partway(name: str, used: int, found: int, world_size: int, strict: bool = True) -> None:
    """Refuse (or, with ``strict=False``, warn of) a source a state of ``found`` ranks was partway
    through a batch of, resumed on ``world_size`` ranks by a loader that cuts its batches anew for
    the world size but cannot credit the used rows (it counts batches, not rows).

    A native source's loader credits the used rows of every old rank's batch in its own state
    (``credit_rows``); an ``IterableDataset`` source is iterated by every rank, its batches the
    same on any world size, so its batch comes again and the used rows are skipped. Neither
    comes here.
    """
    if not strict:
        import warnings

        warnings.warn(f"mix state of world size {found} resumed on {world_size} rank(s) with strict=False: source "
                      f"{name!r} was partway through a batch, so up to {used * found} of its samples come again "
                      "in its current epoch", stacklevel=4)
        return
    raise StateDictError(
        f"mix state world_size: found {found}, expected {world_size} (this job's), and source {name!r} was "
        f"partway through a batch ({used} rows used) when it was taken; its loader cuts its batches anew for "
        f"the world size and counts batches, not rows, so such a state resumes exactly only on {found} "
        f"rank(s). Resume on {found} rank(s), from a state taken where its 'used' is 0, or pass strict=False "
        "to resume anyway (those rows of each old rank come again)")


@dataclass(frozen=True)
class SourceStats:
    """One source of a mixture, as :meth:`MixLoader.stats` reports it.

    Attributes:
        taken: samples the loop took from it, in all.
        share: its share of all samples taken.
        share_since_change: its share of the samples since the last weight change.
        weight: the weight in force now, normalised (0 where dropped).
        epoch: the source's epoch being read.
        ended: it ran out of its epoch and has not started the next.
        wait_s: seconds the mixture waited on its pipeline (the slowest source waits most).
        pipeline: its loader's execution statistics of the latest epoch (its throughput).
    """

    taken: int
    share: float
    share_since_change: float
    weight: float
    epoch: int
    ended: bool
    wait_s: float
    pipeline: Optional[Any]

    @property
    def rows_per_s(self) -> Optional[float]:
        """Its pipeline's rows per second over its latest epoch (None where its loader does not say)."""
        ops, wall = getattr(self.pipeline, "operators", None), getattr(self.pipeline, "wall_s", 0.0)
        return ops[-1].rows / wall if ops and wall else None


@dataclass(frozen=True)
class MixStats:
    """A mixture's statistics: per source, and the position in the mixture.

    Attributes:
        position: samples taken from the mixture, in all.
        since_change: samples since the last weight change.
        sources: name -> :class:`SourceStats`.
    """

    position: int
    since_change: int
    sources: dict

    def bottleneck(self) -> Optional[str]:
        """The source the mixture waited on longest (None before any wait)."""
        waits = {n: s.wait_s for n, s in self.sources.items() if s.wait_s > 0}
        return max(waits, key=waits.get) if waits else None

    def __str__(self) -> str:
        lines = [f"mixture: {self.position} samples ({self.since_change} since the last weight change)"]
        for n, s in self.sources.items():
            weight = "dropped (ran out)" if s.ended and not s.weight else f"vs weight {s.weight:.3f}"
            rate = f", its pipeline {s.rows_per_s:,.0f} rows/s" if s.rows_per_s else ""
            lines.append(f"  {n}: {s.taken} taken, share {s.share:.3f} ({s.share_since_change:.3f} since the "
                         f"change) {weight}, epoch {s.epoch}{rate}, waited {s.wait_s:.2f}s")
        if self.bottleneck() is not None:
            lines.append(f"  the mixture waited longest on {self.bottleneck()!r} (its bottleneck)")
        return "\n".join(lines)
