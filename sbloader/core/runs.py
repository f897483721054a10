"""A log of integers kept as arithmetic runs (pure): the coordinator's delivery logs.

A rank of an ``in_order`` epoch receives batches ``r, r + W, r + 2W, ...``; a rank
fed from the shared pool receives mostly rising runs. Stored as ``(start, step,
length)`` runs, a delivery log grows with the breaks in that pattern, not with
the batches, while it still reads as the ordered list of batch ids
(``len``, indexing, slicing, iteration), which is all
:class:`~sbloader.core.ledger.IncrementalCut` asks of it.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Iterable, Iterator, Union

Run = tuple[int, int, int]  # (start, step, length)


class RunLog:
    """Integers appended in order, stored as arithmetic runs.

    Args:
        values: the first values (e.g. what a rank reports after a coordinator death).
    """

    __slots__ = ("_runs", "_offsets", "_len")

    def __init__(self, values: Iterable[int] = ()) -> None:
        self._runs: list[list[int]] = []  # [start, step, length]; a run of one has step 0
        self._offsets: list[int] = []  # index of each run's first value
        self._len = 0
        for v in values:
            self.append(v)

    def append(self, value: int) -> None:
        """Add ``value`` at the end."""
        value = int(value)
        if self._runs:
            run = self._runs[-1]
            start, step, n = run
            if n == 1:
                run[1], run[2] = value - start, 2
                self._len += 1
                return
            if n > 1 and start + step * n == value:
                run[2] = n + 1
                self._len += 1
                return
        self._runs.append([value, 0, 1])
        self._offsets.append(self._len)
        self._len += 1

    def __len__(self) -> int:
        return self._len

    def _at(self, i: int) -> int:
        k = bisect_right(self._offsets, i) - 1
        start, step, _ = self._runs[k]
        return start + step * (i - self._offsets[k])

    def __getitem__(self, i: Union[int, slice]) -> Union[int, list[int]]:
        if isinstance(i, slice):
            return list(self._iter(*i.indices(self._len)))
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"RunLog index {i} out of range for {self._len} values")
        return self._at(i)

    def _iter(self, a: int, b: int, stride: int = 1) -> Iterator[int]:
        if stride != 1:
            for i in range(a, b, stride):
                yield self._at(i)
            return
        if a >= b:
            return
        k = bisect_right(self._offsets, a) - 1
        i = a
        while i < b:
            start, step, n = self._runs[k]
            off = self._offsets[k]
            for j in range(i - off, min(n, b - off)):
                yield start + step * j
            i = off + n
            k += 1

    def __iter__(self) -> Iterator[int]:
        return self._iter(0, self._len)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RunLog):
            return self._runs == other._runs
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def runs(self) -> list[Run]:
        """The runs ``(start, step, length)``, in order (the compact form, e.g. for JSON)."""
        return [tuple(r) for r in self._runs]  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"RunLog({len(self)} values in {len(self._runs)} runs)"
