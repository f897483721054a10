"""The schedule of a data mixture: pure functions over a seed and a weight history (no Ray, no I/O).

A mixture draws its ``i``-th sample from one of its sources. Which one is a pure
function of the mixture's seed, ``i`` and the weights in force at ``i``: a
counter-based draw (``u_i = hash(seed, i)`` in [0, 1)) against the cumulative
weights. Nothing depends on what ran before ``i``, on timing, on workers or on the
world size, so a resumed mixture needs only its position and its weight history
to draw exactly what the uninterrupted one would have.

The weight history is a list of :class:`WeightChange` (position, asked weights,
dropped sources): each holds from its position until the next. ``set_weights``,
a source dropped when it runs out (``on_exhausted="drop"``) and the start of a new
iteration after drops each append one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from sbloader.core.errors import StateDictError

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
ON_EXHAUSTED = ("restart", "stop", "drop")


@dataclass(frozen=True)
class WeightChange:
    """Weights in force from ``position`` (the mixture's sample index) on.

    Attributes:
        position: the first sample they apply to.
        weights: the asked weight of every source (0: not drawn).
        dropped: sources left out from here on (ran out under ``on_exhausted="drop"``).
    """

    position: int
    weights: tuple[tuple[str, float], ...]
    dropped: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.position < 0:
            raise ValueError(f"a weight change's position must be >= 0, found {self.position}")

    def effective(self, names: Sequence[str]) -> np.ndarray:
        """The probability of each source (in ``names``' order) at this change: asked weights,
        dropped sources zeroed, normalised. All zeros where no source is left."""
        asked = dict(self.weights)
        w = np.array([0.0 if n in self.dropped else float(asked.get(n, 0.0)) for n in names])
        total = w.sum()
        return w / total if total > 0 else w

    def to_json(self) -> list:
        """``[position, {name: weight}, [dropped]]``."""
        return [self.position, dict(self.weights), list(self.dropped)]

    @staticmethod
    def from_json(value: object, names: Sequence[str]) -> "WeightChange":
        """A change read from a state (checked against the mixture's ``names``)."""
        if (not isinstance(value, (list, tuple)) or len(value) != 3 or not isinstance(value[0], int)
                or not isinstance(value[1], dict) or not isinstance(value[2], (list, tuple))):
            raise StateDictError(f"mix weight history entry: found {value!r}, expected "
                                 "[position, {source: weight}, [dropped sources]]")
        unknown = (set(value[1]) | set(value[2])) - set(names)
        if unknown:
            raise StateDictError(f"mix weight history names sources {sorted(unknown)}; this mixture has "
                                 f"{list(names)}. Load it into a mixture of the same sources")
        return WeightChange(int(value[0]), check_weights(value[1], names), tuple(value[2]))


def check_weights(weights: Mapping[str, float], names: Sequence[str], *, partial: bool = False) -> tuple:
    """Weights as a sorted tuple of (name, weight) over every source, checked.

    Args:
        weights: name -> weight (>= 0, finite). They need not sum to 1 (they are normalised).
        names: the mixture's sources.
        partial: missing names keep weight 0 (else every source must be named).

    Raises:
        ValueError: an unknown or missing source, or a negative/non-finite weight.
    """
    if not isinstance(weights, Mapping):
        raise ValueError(f"weights must be a mapping of source name to weight, found {type(weights).__name__}")
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"weights name sources {unknown} that the mixture does not have; its sources: "
                         f"{list(names)}")
    missing = sorted(set(names) - set(weights))
    if missing and not partial:
        raise ValueError(f"weights give no weight to sources {missing}; give every source of {list(names)} "
                         "a weight (0 leaves one out)")
    out = []
    for n in names:
        w = weights.get(n, 0.0)
        try:
            w = float(w)
        except (TypeError, ValueError):
            raise ValueError(f"the weight of source {n!r} must be a number, found {w!r}") from None
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"the weight of source {n!r} must be finite and >= 0, found {w}")
        out.append((n, w))
    if sum(w for _, w in out) <= 0:
        raise ValueError(f"the weights {dict(out)} are all 0; give at least one source a positive weight")
    return tuple(sorted(out))


def uniforms(seed: int, start: int, stop: int) -> np.ndarray:
    """The mixture's draws for samples ``start..stop-1``: a splitmix64 hash of (seed, i) in [0, 1)."""
    i = np.arange(start, stop, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * np.uint64(0x9E3779B97F4A7C15) + i * np.uint64(0xBF58476D1CE4E5B9)
             + np.uint64(0x94D049BB133111EB)) & _M64
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def change_at(history: Sequence[WeightChange], position: int) -> WeightChange:
    """The change in force at ``position`` (the last one starting at or before it)."""
    found = None
    for change in history:
        if change.position <= position:
            found = change
    if found is None:
        raise ValueError(f"the weight history starts after position {position}; its first change must be at 0")
    return found


def schedule(seed: int, history: Sequence[WeightChange], names: Sequence[str], start: int,
             stop: int) -> np.ndarray:
    """Which source (index into ``names``) each sample ``start..stop-1`` of the mixture comes from.

    Raises:
        ValueError: at a position where every source has weight 0 or was dropped.
    """
    out = np.empty(max(0, stop - start), dtype=np.int64)
    u = uniforms(seed, start, stop)
    bounds = sorted({start, stop, *(c.position for c in history if start < c.position < stop)})
    for lo, hi in zip(bounds, bounds[1:]):
        p = change_at(history, lo).effective(names)
        if p.sum() <= 0:
            raise ValueError(f"no source left to draw sample {lo} from (every weight is 0 or dropped)")
        cum = np.cumsum(p)
        cum[-1] = 1.0  # rounding must not leave u near 1 past the last source
        idx = np.searchsorted(cum, u[lo - start:hi - start], side="right")
        # a weight-0 source has an empty interval; searchsorted never lands in it
        out[lo - start:hi - start] = idx
    return out


def append_change(history: Sequence[WeightChange], change: WeightChange) -> tuple[WeightChange, ...]:
    """The history with ``change`` appended (replacing a change at the same position)."""
    if history and change.position < history[-1].position:
        raise ValueError(f"a weight change at {change.position} comes before the last one "
                         f"({history[-1].position}); the history only grows")
    kept = tuple(c for c in history if c.position != change.position)
    return kept + (change,)


def counts(sources: Iterable[int], n: int) -> np.ndarray:
    """Samples per source index (``n`` sources) in a schedule."""
    return np.bincount(np.asarray(list(sources) if not isinstance(sources, np.ndarray) else sources,
                                  dtype=np.int64), minlength=n)
