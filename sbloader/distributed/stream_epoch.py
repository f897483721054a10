"""An epoch of unknown length in the split coordinator: an ``IterableDataset`` split across ranks.

The coordinator iterates the dataset once for the job; each produced batch joins a
pool, and a rank may take its ``k``-th batch only while every other rank can
still reach ``k`` from what was produced (:func:`~sbloader.core.split.stream_allowance`).
Once production ended, every rank's count is ``produced // world_size`` whole
batches, and the rows of the batches left over are spread as one short last
batch per rank (:func:`~sbloader.core.split.stream_tail`), or dropped with ``drop_last``.

With a ``segment`` in its spec, each worker shard runs in segments, round after round
(:class:`~sbloader.executor.shard_rounds.ShardRounds`, told where each shard stands by its
blocks' metadata: the coordinator never fetches a block): the ranks' first batches wait for
a short segment, not a whole shard, and a stream that never ends keeps yielding. The bytes
the ranks still hold count against each new round's budget.

A stream the ranks started on their local workers (``spec.reports``) starts production once
every rank said how many batches it delivered and where its shards stand (:meth:`StreamEpoch.report`):
each rank's count starts at its local one, each shard resumes from its snapshot.

A block lost with the node that made it before every rank fetched its batches is made
again from its worker shard, once (:meth:`StreamEpoch.remake`): a segment from the snapshot
its round started it at, for as many batches; the ranks that ask get the new block, and
what the ranks take afterwards names it instead of the lost one.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sbloader.core.errors import SbloaderError
from sbloader.core.plan import make_epoch_plan
from sbloader.core.split import pick_local, stream_allowance, stream_tail
from sbloader.distributed.epoch import Epoch
from sbloader.distributed.specs import EpochSpec, StreamBatch
from sbloader.executor.options import OutputBlock
from sbloader.executor.shard_rounds import ShardRounds

logger = logging.getLogger(__name__)

#: At the coordinator a shard's segments double from the spec's ``segment`` up to this many times
#: it: a long shard runs in a few rounds (each an execution's start; 40 rounds per shard of 313
#: batches cost a cheap stream's epoch ~10%), its blocks held against the ranks' budget.
SEGMENT_GROWTH = 8


@dataclass(frozen=True)
class _Produced:
    """(Unknown total) a produced batch: batch ``pos`` of block ``ref``."""

    ref: Any
    pos: int
    rows: int
    nbytes: int
    node: str
    id: int  # production order: the batch's id in the delivery logs


class StreamEpoch(Epoch):
    """An epoch whose total is unknown until its pipeline produced everything."""

    def __init__(self, spec: EpochSpec, world_size: int, actor_cache: dict, estimates: Optional[list] = None,
                 earlier: tuple = (), ledger: bool = True) -> None:
        super().__init__(spec, world_size, actor_cache, estimates, earlier, ledger=ledger)
        self.produced = 0  # batches produced so far
        self.tail: Optional[list] = None  # per rank its short last batch, once production ended
        self.made: dict[str, tuple] = {}  # block ref hex -> (seq, partition id, its round's source or None)
        self.remade: dict[str, Any] = {}  # a lost block's ref hex -> the ref of the block made again
        self._remake_lock = threading.Lock()  # one remake at a time: a block lost is made again once
        self.reports: dict[int, dict] = {}  # rank -> its shards' snapshots after its local phase (spec.reports)
        self._said_missing = False  # the ranks that never reported were named once

    def report(self, rank: int, delivered: int, positions: dict) -> None:
        """Rank ``rank`` delivered ``delivered`` batches from its own shards on local workers
        (:mod:`~sbloader.loaders.stream_start`); ``positions``: each of those shards' snapshot after
        its last delivered batch. Its count starts there, ``produced`` counts them, and production
        resumes each shard from its snapshot once every rank reported (a repeated report is ignored)."""
        with self.cond:
            if rank in self.reports:
                return
            self.reports[rank] = dict(positions)
            log = self.logs[rank]
            log.count = log.acked = int(delivered)
            self.produced += int(delivered)
            self.cond.notify_all()

    def _await_start(self) -> None:
        """(Pump) With ``spec.reports``, every rank's report of its local phase (or the epoch's stop)."""
        if not self.spec.reports:
            return
        with self.cond:
            while len(self.reports) < self.world_size and not self._executor_stopped:
                self.cond.wait(timeout=0.2)

    def _check_stuck(self, rank: int, stall_report_s: float) -> None:
        missing = [r for r in range(self.world_size) if r not in self.reports] if self.spec.reports else []
        if not missing:
            super()._check_stuck(rank, stall_report_s)
        elif time.monotonic() - self.logs[missing[0]].last_seen > stall_report_s and not self._said_missing:
            self._said_missing = True
            logger.warning("sbloader epoch %d: rank(s) %s have not begun the loader's first epoch for %.0f s while "
                           "rank %d waits: each rank starts its own shards locally, and the stream goes on once every "
                           "rank has; every rank must iterate this loader", self.spec.epoch, missing, stall_report_s,
                           rank)

    def _new_executor(self, estimates: Optional[list]) -> Any:
        """The epoch's shards in segments, round after round (``spec.segment``), or whole."""
        spec = self.spec
        if spec.segment is None:  # (``stream_spec`` gives a locally started epoch segments: its shards resume)
            return super()._new_executor(estimates)

        def start(resume: dict, segment: int) -> Any:
            source = spec.source.segment(resume, segment)
            plan = make_epoch_plan([p.id for p in source.partitions(spec.epoch, spec.epoch_seed)], spec.epoch,
                                   spec.epoch_seed, shuffle=False)
            return self.run_source(source, plan, estimates)

        n = len(spec.source.partitions(spec.epoch, spec.epoch_seed))
        resume = {w: snap for positions in self.reports.values() for w, snap in positions.items()}
        return ShardRounds(start, resume, n, spec.segment, fetch_blocks=False, largest=SEGMENT_GROWTH * spec.segment)

    def _deliver(self, item: OutputBlock) -> None:
        self._add_batches(item)

    def _end_of_production(self) -> None:
        self._plan_tail()

    def _add_batches(self, item: OutputBlock) -> None:
        """(Pump, lock held) A produced block's batches join the pool, its bytes shared among them."""
        meta = item.meta
        rows = meta.batch_rows or (1,) * meta.num_rows
        n = len(rows)
        source = None
        if isinstance(self.executor, ShardRounds):  # the segment: where its round started the shard, how long
            at, segment = self.executor.round_start(meta.partition_id)
            source = self.spec.source.segment({meta.partition_id: at}, segment)
        self.made[item.ref.hex()] = (meta.seq, meta.partition_id, source)
        if n == 0:  # a shard that yielded nothing: no rank will acknowledge its bytes
            self.executor.release(meta.nbytes)
        for pos, r in enumerate(rows):
            share = meta.nbytes // n + (meta.nbytes % n if pos == 0 else 0)
            self.pool.append(_Produced(item.ref, pos, int(r), share, meta.node_id, self.produced))
            self.produced += 1

    def _plan_tail(self) -> None:
        """(Pump, lock held) Production ended: set the left-over batches aside as the tail.

        Every rank's quota is ``produced // world_size`` whole batches; the rest
        (the shortest undelivered batches, so the whole batches stay full) is
        dropped with ``drop_last`` or cut into one short last batch per rank.
        """
        ws = self.world_size
        quota = self.produced // ws
        left = self.produced - quota * ws
        if left == 0:
            self.tail = [None] * ws
            return
        by_rows = sorted(range(len(self.pool)), key=lambda i: (self.pool[i].rows, i))[:left]
        spare = [self.pool[i] for i in sorted(by_rows)]
        keep = set(by_rows)
        self.pool = deque(b for i, b in enumerate(self.pool) if i not in keep)
        for b in spare:  # out of the budget: nothing more is produced
            self.executor.release(b.nbytes)
        if self.spec.drop_last:
            self.tail = [None] * ws
            return
        plan = stream_tail([b.rows for b in spare], ws)
        self.tail = [StreamBatch(tuple((spare[i].ref, spare[i].pos, a, z) for i, a, z in pieces),
                                 sum(z - a for _, a, z in pieces), pad, whole=False)
                     for pieces, pad in zip(plan.pieces, plan.pad)]

    @property
    def per_rank(self) -> Optional[int]:
        """Batches each rank receives: None while the total is unknown."""
        if self.tail is None:
            return None
        return self.produced // self.world_size + (1 if self.tail[0] is not None else 0)

    def take(self, rank: int, max_n: int, node: Optional[str], wait_s: float,
                    stall_report_s: float) -> list:
        """(Unknown total) up to ``max_n`` batches for ``rank`` as :class:`StreamBatch`; waits at
        most ``wait_s`` for one (an empty list: nothing yet; see :meth:`done`)."""
        log = self.logs[rank]
        log.last_seen = time.monotonic()
        log.node = node
        log.asked = True
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                if not self._open():
                    return []
                whole = self.produced // self.world_size if self.produced_all else None
                if whole is not None and log.count >= whole:  # its whole batches: the short last one
                    last = self.tail[rank]
                    if last is None or log.count > whole:
                        return []
                    self._log(log, -1, 0)
                    return [self._current(last)]
                allow = stream_allowance(self.produced, [lg.count for lg in self.logs], rank, self.produced_all)
                if allow > 0:
                    break
                if not self._wait(deadline, rank, stall_report_s):
                    return []
            out = []
            while self.pool and len(out) < min(max_n, allow):
                idx = pick_local([b.node for b in self.pool], node)
                b = self.pool[idx]
                del self.pool[idx]
                out.append(StreamBatch(((self._ref(b.ref), b.pos, 0, b.rows),), b.rows))
                self._log(log, b.id, b.nbytes)
            return out

    def _ref(self, ref: Any) -> Any:
        """The ref that holds the block of ``ref`` now: the last one made again, if it was lost."""
        while ref.hex() in self.remade:
            ref = self.remade[ref.hex()]
        return ref

    def _current(self, batch: StreamBatch) -> StreamBatch:
        """``batch`` with each piece's block ref as :meth:`_ref` gives it."""
        if not self.remade:
            return batch
        pieces = tuple((self._ref(ref), pos, a, z) for ref, pos, a, z in batch.pieces)
        return StreamBatch(pieces, batch.rows, batch.pad, batch.whole)

    def remake(self, ref_hex: str, make: Callable[[int, int, Any], Any]) -> Any:
        """The block ``ref_hex`` made again by ``make(seq, partition id, source)`` (``source``: the
        segment of its round, None for the epoch's own source), once: a rank that asks after another
        did gets the same new ref (a new one only if that one was lost too).

        Raises:
            SbloaderError: no block of this epoch has that ref.
        """
        with self._remake_lock:
            if ref_hex in self.remade:
                return self._ref(self.remade[ref_hex])
            if ref_hex not in self.made:
                raise SbloaderError(f"epoch {self.spec.epoch} made no block {ref_hex}: it cannot be made again "
                                    f"({len(self.made)} blocks made here; was the coordinator replaced?)")
            seq, pid, source = self.made[ref_hex]
            new = make(seq, pid, source)
            self.made[new.hex()] = (seq, pid, source)
            with self.cond:  # take() reads remade under cond
                self.remade[ref_hex] = new
            return new
