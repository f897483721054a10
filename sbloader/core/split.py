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


# ----- an epoch of unknown length (an IterableDataset split by the coordinator) -------------


def stream_allowance(produced: int, delivered: Sequence[int], rank: int, ended: bool) -> int:
    """How many more whole batches ``rank`` may take now, in an epoch whose total is unknown.

    While the pipeline produces, rank ``r`` may take its ``k``-th batch only if
    ``produced >= sum_s max(delivered[s], k)``: every other rank can still reach
    ``k`` from what was produced, so a fast rank never takes a batch a slow rank
    will need to keep the counts equal. That keeps every rank at or below
    ``produced // world_size``; once production ended with ``produced`` batches in
    all, each rank's quota of whole batches is ``produced // world_size``.

    Args:
        produced: batches produced so far (the total once ``ended``).
        delivered: whole batches delivered to each rank so far.
        rank: the asking rank.
        ended: whether the pipeline produced everything.
    """
    if ended:
        return max(0, produced // len(delivered) - delivered[rank])
    more = 0
    while produced >= sum(max(d, delivered[rank] + more + 1) for d in delivered):
        more += 1
    return more


def local_allowance(made: int, delivered: int, world_size: int) -> int:
    """How many more batches a rank may deliver from its own shards' local workers, before the
    coordinator knows of any (a split stream's local start, :mod:`~sbloader.loaders.stream_start`).

    Every batch its workers made is one the job's stream has (the coordinator makes again those
    not delivered), so the stream's total is at least ``made`` and every rank's final share of
    whole batches (``total // world_size``) at least ``made // world_size``: delivering no more
    than that keeps the counts equal with no word between the ranks.
    """
    return max(0, made // world_size - delivered)


@dataclass(frozen=True)
class StreamTail:
    """How the rows of the batches left after the equal whole batches are spread over the ranks.

    The rows of the left-over batches, taken in order, are cut into one short last
    batch per rank, as evenly as possible. A rank with no row left (fewer rows
    than ranks) gets one repeated row, marked as padding.

    Attributes:
        pieces: per rank, its short batch as ``(left-over batch, row start, row stop)``
            pieces in order (padding pieces last); empty when nothing is left over.
        pad: per rank, how many of its rows are repeats (at the end of its batch).
    """

    pieces: tuple[tuple[tuple[int, int, int], ...], ...]
    pad: tuple[int, ...]


def stream_tail(rows: Sequence[int], world_size: int) -> StreamTail:
    """Spread the rows of the left-over batches (``rows[i]`` rows each) as one short batch per rank.

    Args:
        rows: rows of each left-over batch, in order (each at least 1); empty: no tail.
        world_size: ranks.
    """
    if world_size < 1 or any(n < 1 for n in rows):
        raise ValueError(f"need world_size >= 1 and batches of at least one row; found {world_size}, {list(rows)}")
    total = sum(rows)
    if total == 0:
        return StreamTail(tuple(() for _ in range(world_size)), (0,) * world_size)
    starts = [0]
    for n in rows:
        starts.append(starts[-1] + n)

    def cut(a: int, b: int) -> tuple:
        """Pieces covering positions ``[a, b)`` of the left-over rows."""
        out = []
        for i, n in enumerate(rows):
            lo, hi = max(a, starts[i]), min(b, starts[i] + n)
            if lo < hi:
                out.append((i, lo - starts[i], hi - starts[i]))
        return tuple(out)

    base, extra = divmod(total, world_size)
    pieces, pads, pos = [], [], 0
    for t in range(world_size):
        size = base + (1 if t < extra else 0)
        if size:
            pieces.append(cut(pos, pos + size))
            pads.append(0)
            pos += size
        else:  # fewer rows than ranks: repeat a row, cycling over the left-over rows
            r = t % total
            pieces.append(cut(r, r + 1))
            pads.append(1)
    return StreamTail(tuple(pieces), tuple(pads))
