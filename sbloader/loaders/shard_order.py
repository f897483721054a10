"""The order of an ``IterableDataset``'s batches across worker shards: torch's round-robin.

torch's in-order ``DataLoader`` deals its tasks to the workers in turn and skips a worker once
its shard is exhausted, so the loop receives the ``k``-th batch of every shard before the
``k+1``-th of any, shards by id within a round: the epoch's order is the batches sorted by
``(k, shard)``. That order is a pure function of what each shard makes, whoever makes it (a
pool actor, a local worker, a resumed shard), so a run that starts on local workers and
hands over to the pool, or resumes from a state, gives the same order as one that ran on
the pool alone: each shard's next ``k`` is where it stands (its snapshot's ``batches``).

:class:`RoundRobin` merges the shards' batches as they arrive (a whole shard at once from a
pool actor, one batch at a time from a local worker) and releases each batch once no shard
can still send one that comes before it.
"""
from __future__ import annotations

import heapq
from typing import Any, Iterable, Iterator, Optional


class RoundRobin:
    """Merges shard batches into torch's round-robin order ``(k, shard)``.

    Args:
        next_k: per shard still to run, the ``k`` of its next batch (0 from its start; a resumed
            shard's snapshot ``batches``). A shard not named here sends nothing.
    """

    def __init__(self, next_k: dict[int, int]) -> None:
        self._floor = {int(w): int(k) for w, k in next_k.items()}  # open shard -> the least k it can still send
        self._heap: list = []
        self._seq = 0  # ties never compare the items

    def add(self, shard: int, k: int, item: Any) -> None:
        """Shard ``shard``'s batch ``k`` (its batches arrive in their order)."""
        heapq.heappush(self._heap, (k, shard, self._seq, item))
        self._seq += 1
        if shard in self._floor:
            self._floor[shard] = k + 1

    def end(self, shard: int) -> None:
        """Shard ``shard`` sends nothing more."""
        self._floor.pop(shard, None)

    def pop_ready(self) -> Iterator[Any]:
        """The buffered items that come next in order: each once no open shard can send one before it."""
        while self._heap:
            k, shard = self._heap[0][:2]
            if any((fk, w) < (k, shard) for w, fk in self._floor.items()):
                return
            yield heapq.heappop(self._heap)[3]

    def waiting(self) -> bool:
        """Whether a shard may still send batches (or some are buffered)."""
        return bool(self._floor or self._heap)

    def positions(self) -> dict[int, int]:
        """Per open shard, the ``k`` of the next batch it sends."""
        return dict(self._floor)


def merged(shards: Iterable[tuple[int, list]], next_k: dict[int, int]) -> Iterator[Any]:
    """Whole shards ``(shard, [(k, item), ...])`` in any arrival order, merged into ``(k, shard)`` order."""
    order = RoundRobin(next_k)
    for shard, items in shards:
        for k, item in items:
            order.add(shard, k, item)
        order.end(shard)
        yield from order.pop_ready()
    yield from order.pop_ready()


def shard_positions(resume: dict, num_workers: int) -> dict[int, int]:
    """Per worker shard still to run, the ``k`` of its next batch: its snapshot's ``batches`` (0 from its
    start). ``resume``: per shard, the snapshot it resumes from (None: from its start); an ``ended`` shard
    has nothing left to send."""
    shards: dict[int, Optional[dict]] = {w: resume.get(w) for w in range(max(1, num_workers))}
    return {w: int((r or {}).get("batches", 0)) for w, r in shards.items() if not (r or {}).get("ended")}
