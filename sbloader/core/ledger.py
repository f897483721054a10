"""The consumed ledger: which positions of an epoch's order were consumed (pure).

Positions are indices into the epoch's sample order (sampler positions), kept as
sorted, merged, half-open ``[start, stop)`` ranges, so a checkpoint grows with
the number of gaps (partitions touched out of order), not with the samples.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

Ranges = list[tuple[int, int]]


def merge(ranges: Iterable[Sequence[int]]) -> Ranges:
    """Sort and merge overlapping or touching ranges; empty ranges vanish."""
    out: Ranges = []
    for a, b in sorted((int(r[0]), int(r[1])) for r in ranges):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def from_positions(positions: Iterable[int]) -> Ranges:
    """Ranges covering exactly the given positions."""
    pos = np.unique(np.fromiter((int(p) for p in positions), dtype=np.int64))
    if len(pos) == 0:
        return []
    breaks = np.nonzero(np.diff(pos) != 1)[0] + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [len(pos)]))
    return [(int(pos[a]), int(pos[b - 1]) + 1) for a, b in zip(starts, stops)]


def to_positions(ranges: Sequence[Sequence[int]]) -> np.ndarray:
    """Every position the ranges cover, in order."""
    if not ranges:
        return np.empty(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in ranges])


def count(ranges: Sequence[Sequence[int]]) -> int:
    """Positions covered (each once: overlapping or reversed ranges are merged first)."""
    return int(sum(b - a for a, b in merge(ranges)))


def complement(ranges: Sequence[Sequence[int]], total: int) -> Ranges:
    """The ranges of ``[0, total)`` not covered by ``ranges``."""
    out: Ranges = []
    prev = 0
    for a, b in merge(ranges):
        a, b = max(0, a), min(total, b)
        if b <= a:  # wholly outside [0, total)
            continue
        if a > prev:
            out.append((prev, a))
        prev = max(prev, b)
    if prev < total:
        out.append((prev, total))
    return out


def cut(logs: Sequence[Sequence[int]], k: int, batch_ranges: Sequence[Sequence[Sequence[int]]],
        prior: Sequence[Sequence[int]] = ()) -> Ranges:
    """The consumed ledger after every rank's first ``k`` batches.

    Args:
        logs: per rank, the ordered batch ids delivered to it.
        k: batches per rank in the cut.
        batch_ranges: per batch id, the position ranges of its real (unpadded) rows.
        prior: positions already consumed before this epoch's run (a resumed epoch).

    Returns:
        Merged ranges of consumed positions.

    Raises:
        ValueError: a rank's log holds fewer than ``k`` batches.
    """
    short = [r for r, log in enumerate(logs) if len(log) < k]
    if short:
        raise ValueError(f"ranks {short} have fewer than {k} batches delivered")
    pieces = [tuple(r) for r in prior]
    for log in logs:
        for b in log[:k]:
            pieces.extend(tuple(r) for r in batch_ranges[b])
    return merge(pieces)


class IncrementalCut:
    """:func:`cut` kept as ``k`` grows: the cut at ``k`` is the last cut's ranges merged with
    the batches every rank received between the two ``k``.

    A ``state_dict()`` per step costs the batches since the last one, not the whole
    epoch; the same ``k`` again (every rank's ``state_dict()`` at one checkpoint) costs
    a copy; a ``k`` below the last is computed from scratch. Both the coordinator
    (over its delivery logs) and a rank (over the plan, ``in_order=True``) use it.

    Args:
        batch_ranges: per batch id, the position ranges of its real rows.
        prior: positions consumed before this run (a resumed epoch).
    """

    def __init__(self, batch_ranges: Sequence[Sequence[Sequence[int]]], prior: Sequence[Sequence[int]] = ()) -> None:
        self._batch_ranges = batch_ranges
        self._prior = [tuple(r) for r in prior]
        self._k = 0
        self._ranges = merge(self._prior)

    def after(self, k: int, logs: Sequence[Sequence[int]]) -> Ranges:
        """The consumed ledger after every rank's first ``k`` batches; ``logs[r]`` lists the
        batch ids rank ``r`` received, in order (at least ``k`` of them).

        Raises:
            ValueError: a rank's log holds fewer than ``k`` batches.
        """
        if k < self._k:
            return cut(logs, k, self._batch_ranges, self._prior)
        short = [r for r, log in enumerate(logs) if len(log) < k]
        if short:
            raise ValueError(f"ranks {short} have fewer than {k} batches delivered")
        if k > self._k:
            pieces = list(self._ranges)
            for log in logs:
                for b in log[self._k:k]:
                    pieces.extend(tuple(r) for r in self._batch_ranges[b])
            self._ranges, self._k = merge(pieces), k
        return list(self._ranges)


#: Partly consumed partitions above which a state packs their counts (:func:`pack_counts`).
PACK_ABOVE = 64


def pack_counts(counts: dict[int, int]) -> dict:
    """Counts per place, packed: ``{"first": p, "counts": base64(zlib(uint32 LE))}`` over the
    places ``first..last`` (0 where a place has none). A budget shuffle window can leave
    every partition of the epoch partly consumed; packed, a million samples in row groups
    of 64 take ~25 KB of state instead of ~170 KB as a JSON object."""
    import base64
    import zlib

    if not counts:
        return {"first": 0, "counts": ""}
    first, last = min(counts), max(counts)
    arr = np.zeros(last - first + 1, dtype="<u4")
    for p, n in counts.items():
        arr[p - first] = n
    return {"first": int(first), "counts": base64.b64encode(zlib.compress(arr.tobytes(), 9)).decode("ascii")}


def unpack_counts(packed: dict) -> dict[int, int]:
    """The counts :func:`pack_counts` packed (places with none left out)."""
    import base64
    import zlib

    if not packed.get("counts"):
        return {}
    arr = np.frombuffer(zlib.decompress(base64.b64decode(packed["counts"])), dtype="<u4")
    first = int(packed["first"])
    return {first + int(i): int(arr[i]) for i in np.flatnonzero(arr)}
