"""A partition's consumed rows: a prefix, and ranges consumed ahead of it (pure).

A partition's output rows are taken in order by one consumer, so what it gave is a
prefix, recorded as a count. Split across ranks, every rank's next batch takes the
next rows of the same partitions in turn; a state that credits the first rows of
each rank's pending batch (a mixture resumed on another world size, see
:mod:`~sbloader.loaders.mix_loader`) consumes rows *ahead* of the prefix too: the
prefix ``[0, prefix)`` plus a few ranges further on. A resumed consumer sees only
the rows left, counted from its first one; :func:`absolute` maps those counts
back to the partition's rows and :func:`credit` adds them to the ledger.
"""
from __future__ import annotations

from typing import Sequence

from sbloader.core import ledger
from sbloader.core.ledger import Ranges


def normal(prefix: int, ahead: Sequence[Sequence[int]]) -> tuple[int, Ranges]:
    """The same consumed rows with every range that touches the prefix joined to it."""
    rest: Ranges = []
    for a, b in ledger.merge(ahead):
        if a <= prefix:
            prefix = max(prefix, b)
        else:
            rest.append((a, b))
    return prefix, rest


def consumed(prefix: int, ahead: Sequence[Sequence[int]]) -> int:
    """Rows consumed in all (the prefix and the ranges ahead of it)."""
    prefix, rest = normal(prefix, ahead)
    return prefix + sum(b - a for a, b in rest)


def live(total: int, prefix: int, ahead: Sequence[Sequence[int]]) -> Ranges:
    """The rows of a partition of ``total`` rows not consumed yet, as ranges."""
    prefix, rest = normal(prefix, ahead)
    return ledger.complement([(0, prefix)] + rest, total)


def absolute(prefix: int, ahead: Sequence[Sequence[int]], start: int, stop: int) -> Ranges:
    """The partition's rows of the rows left ``[start, stop)`` (counted from the first row
    not consumed, skipping the ranges consumed ahead)."""
    prefix, rest = normal(prefix, ahead)
    free = [(prefix, rest[0][0])] if rest else []
    free += [(rest[i][1], rest[i + 1][0]) for i in range(len(rest) - 1)]
    free.append((rest[-1][1] if rest else prefix, None))  # every row past the last range
    out: Ranges = []
    seen = 0  # rows left before the current free run
    for a, b in free:
        n = (b - a) if b is not None else stop - seen
        lo, hi = max(start, seen), min(stop, seen + n)
        if hi > lo:
            out.append((a + lo - seen, a + hi - seen))
        seen += n
        if seen >= stop:
            break
    return out


def credit(prefix: int, ahead: Sequence[Sequence[int]], left: Sequence[Sequence[int]]) -> tuple[int, Ranges]:
    """The ledger with the rows left ``left`` (ranges counted as :func:`absolute` counts) consumed too."""
    rows = [r for a, b in left for r in absolute(prefix, ahead, a, b)]
    return normal(prefix, list(ahead) + rows)
