"""How an epoch's rows are cut into batches and split across ranks (pure).

Every rank gets the same number of batches, so DDP never waits on a rank with
fewer. Full batches come first; the rows that do not fill a batch for every rank
are spread as one short last batch per rank; only when fewer such rows remain
than there are ranks are rows repeated, and those repeats are marked as padding
(never counted as consumed). With ``drop_last`` the plan drops them instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class BatchSpec:
    """One batch of the epoch: positions ``[start, stop)`` of the sample order.

    Attributes:
        index: the batch's position in the epoch's plan.
        start: first sample position.
        stop: one past the last sample position.
        pad: repeated rows appended after the real ones (marked as padding).
        rank: the rank the plan assigns it to (deterministic mode).
    """

    index: int
    start: int
    stop: int
    pad: int = 0
    rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop or self.pad < 0:
            raise ValueError(f"invalid batch spec {self}")

    @property
    def rows(self) -> int:
        """Real (unpadded) rows."""
        return self.stop - self.start


@dataclass(frozen=True)
class SplitPlan:
    """The epoch's batches and how many each rank receives.

    Attributes:
        batches: every batch, in plan order.
        world_size: ranks sharing the epoch.
        per_rank: batches each rank receives.
        dropped: sample positions dropped by ``drop_last`` (at the end of the order).
    """

    batches: tuple[BatchSpec, ...]
    world_size: int
    per_rank: int
    dropped: int = 0

    def for_rank(self, rank: int) -> list[BatchSpec]:
        """The batches the plan assigns to ``rank`` (deterministic mode), in order."""
        return [b for b in self.batches if b.rank == rank]


def split_epoch(num_rows: int, batch_size: int, world_size: int, drop_last: bool) -> SplitPlan:
    """Cut ``num_rows`` sample positions into equal per-rank batch counts.

    Args:
        num_rows: samples in the epoch's order.
        batch_size: rows per full batch.
        world_size: ranks.
        drop_last: drop the rows that cannot fill a batch on every rank.

    Returns:
        The plan; batch ``i`` of the full part goes to rank ``i % world_size`` and
        tail batch ``t`` to rank ``t``.
    """
    if batch_size < 1 or world_size < 1 or num_rows < 0:
        raise ValueError(
            f"need batch_size >= 1, world_size >= 1, num_rows >= 0; found {batch_size}, {world_size}, {num_rows}"
        )
    full_rounds = num_rows // (batch_size * world_size)
    batches = [
        BatchSpec(i, i * batch_size, (i + 1) * batch_size, 0, i % world_size)
        for i in range(full_rounds * world_size)
    ]
    pos = full_rounds * world_size * batch_size
    rem = num_rows - pos
    if drop_last or rem == 0:
        return SplitPlan(tuple(batches), world_size, full_rounds, rem if drop_last else 0)
    base, extra = divmod(rem, world_size)
    n0 = len(batches)
    for t in range(world_size):
        size = base + (1 if t < extra else 0)
        if size > 0:
            batches.append(BatchSpec(n0 + t, pos, pos + size, 0, t))
            pos += size
        else:  # fewer rows than ranks: one repeated row, marked as padding
            batches.append(BatchSpec(n0 + t, pos, pos, 1, t))
    return SplitPlan(tuple(batches), world_size, full_rounds + 1, 0)


def batch_positions(spec: BatchSpec, num_rows: int) -> list[int]:
    """Sample positions of a batch, padding repeats included (cycling from the tail's start)."""
    real = list(range(spec.start, spec.stop))
    if spec.pad:
        anchor = max(0, min(spec.start, num_rows) - 1) if not real else spec.start
        real += [(anchor + k) % max(1, num_rows) for k in range(spec.pad)]
    return real


def pick_local(ready_nodes: Sequence[str], rank_node: Optional[str]) -> int:
    """Index of the ready batch to hand to a rank: the oldest made on its node, else the oldest.

    Args:
        ready_nodes: node id of each ready batch, oldest first (non-empty).
        rank_node: the asking rank's node id (None: no preference).
    """
    if not ready_nodes:
        raise ValueError("pick_local needs at least one ready batch")
    if rank_node is not None:
        for i, node in enumerate(ready_nodes):
            if node == rank_node:
                return i
    return 0
