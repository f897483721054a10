"""The executions of an ``IterableDataset`` epoch in segments, one round after another.

A shard run as one block would come back only at its end (never, for a stream that never
ends) and hold the whole shard in memory. Instead each worker shard runs in **segments** of
``segment`` batches, one round after another (:class:`ShardRounds`): each round is one
execution over the shards still open, each resumed where its last segment stopped. Where a
shard stands after a block is in the block's metadata (``BlockMeta.shard_state``: the
``(shard, snapshot)`` of its last batch), so the rounds go on without reading a block: in
the trainer's loader (:mod:`sbloader.loaders.dropin_epoch`) and in the split coordinator,
which never fetches the blocks it hands the ranks (:mod:`sbloader.distributed.stream_epoch`).
A shard whose segment comes back short, or whose last batch is its end, is done. The worker
side (a shard's generator kept between its segments) is :mod:`sbloader.loaders.shard_segments`.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator, Optional

from sbloader.core.errors import ExecutorShutdownError

SHARD_SEGMENT_MIN = 8  # batches per segment at least: a round costs one execution's start


def segment_size(batches_per_partition: int) -> int:
    """Batches per segment of a shard: the loader's ``batches_per_partition``, at least
    :data:`SHARD_SEGMENT_MIN`."""
    return max(int(batches_per_partition), SHARD_SEGMENT_MIN)


def segments(segment: int, largest: Optional[int] = None) -> Iterator[int]:
    """Each round's batches per shard: a quarter, a half, then ``segment`` from the third round on
    (the epoch's first batch waits for a short segment; later rounds are made while the loop
    consumes the one before); with ``largest``, twice the last one each round after, up to it
    (fewer rounds, each an execution's start, for a long shard)."""
    yield max(1, segment // 4)
    yield max(1, segment // 2)
    n = segment
    while True:
        yield n
        n = min(2 * n, largest) if largest is not None and largest > n else n


class _Round:
    """One round as the consumer sees it: its segment size, where each shard started it and
    what each made in it."""

    def __init__(self, segment: int, start: dict) -> None:
        self.segment = segment
        self.start = dict(start)  # shard -> the snapshot it resumed from (None: its start)
        self.made = {w: 0 for w in start}
        self.pos: dict = {}  # where each shard stands after its block of this round


class ShardRounds:
    """The executions of an ``IterableDataset`` epoch, one round of segments after another.

    Looks like one executor to its consumer (``get_next``, ``release``, ``shutdown``,
    ``pools_up``, ``estimates``, ``stats``; with ``fetch_blocks``, ``fetch`` and ``owner``). A
    thread of its own takes each round's blocks as they are ready (where each shard stands is in
    its metadata) and starts the next round, on the shards still open, each from its last
    snapshot, as soon as the last block of this one is in: the pool makes round ``r + 1`` while
    the loop consumes round ``r``. The first rounds are shorter (:func:`segments`), so a later
    epoch's first batch waits for one small segment, not a whole one. At most one round of
    blocks waits in the queue.

    Args:
        start: starts the execution of one round: ``start(resume, segment)``, ``resume`` per shard to
            run (its snapshot, None from its start), ``segment`` its batches per shard.
        resume: per shard, where the epoch resumes it (absent or None: from its start).
        num_shards: the loader's ``num_workers``.
        segment: batches per shard per round, once the rounds are full size.
        largest: the segments double from ``segment`` up to this many batches (None: they stay at
            ``segment``).
        fetch_blocks: the thread also fetches each block, ahead of the consumer (the trainer's loader;
            its bytes are then released on the round that made it: :meth:`owner`). Off (the split
            coordinator, which hands the refs to the ranks): each new round is charged the bytes the
            consumer still holds from the rounds before (:meth:`release` frees them there), so a
            stream read slower than it is made never holds more than one execution's budget.
    """

    def __init__(self, start: Callable[[dict, int], Any], resume: dict, num_shards: int, segment: int,
                 fetch_blocks: bool = True, largest: Optional[int] = None) -> None:
        self._start, self._fetch_blocks = start, fetch_blocks
        self._sizes = segments(segment, largest)
        self.positions = {w: resume.get(w) for w in range(max(1, num_shards)) if not (resume.get(w) or {}).get("ended")}
        self._lock = threading.Lock()
        self._stopped = False
        self._finished: list = []  # the statistics of the rounds before this one
        self._ready: queue.Queue = queue.Queue(maxsize=max(1, len(self.positions)))
        self._held: dict = {}  # id(item) -> (block, its execution)
        self._view: Optional[_Round] = None  # the round of the block the consumer took last
        self._outstanding = 0  # bytes of blocks taken from the rounds and not yet released
        self.rounds = 1
        self._round = _Round(next(self._sizes), self.positions)
        self.executor = start(dict(self.positions), self._round.segment)
        self._thread = threading.Thread(target=self._run, name="sbloader-shard-rounds", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                executor, rnd = self.executor, self._round
                while True:
                    item = executor.get_next()
                    if item is None:
                        break
                    with self._lock:
                        self._outstanding += item.meta.nbytes
                    block = executor.fetch(item) if self._fetch_blocks else None
                    self._note(rnd, item.meta)
                    if not self._put((item, block, executor, rnd)):
                        return
                nxt = {w: self.positions[w] for w in rnd.made if not self._ended(rnd, w)}
                if not nxt or not self._next_round(nxt):
                    break
            self._put(None)
        except BaseException as exc:  # carried to the consumer's get_next
            if not self._stopped:
                self._put(exc)

    def _note(self, rnd: _Round, meta: Any) -> None:
        """Where the block's shard stands: the snapshot after its last batch (in its metadata)."""
        if meta.shard_state is not None:
            shard, snap = meta.shard_state
            rnd.made[shard] = rnd.made.get(shard, 0) + len(meta.batch_rows)
            self.positions[shard] = rnd.pos[shard] = snap

    def _ended(self, rnd: _Round, shard: int) -> bool:
        return rnd.made.get(shard, 0) < rnd.segment or bool((rnd.pos.get(shard) or {}).get("ended"))

    def _put(self, entry: Any) -> bool:
        while not self._stopped:
            try:
                self._ready.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _next_round(self, resume: dict) -> bool:
        with self._lock:
            if self._stopped:
                return False
            self.executor.shutdown()  # its actors go back to the cache the next round takes them from
            self._finished.append(self.executor.stats())
            self._round = _Round(next(self._sizes), resume)
            self.executor = self._start(resume, self._round.segment)
            if not self._fetch_blocks:
                self.executor.charge(self._outstanding)
            self.rounds += 1
            return True

    def get_next(self) -> Any:
        """The next ready block of the epoch, or None at its end.

        Raises:
            the error of the round's execution (a failed task), as the execution raises it;
            ExecutorShutdownError: (without ``fetch_blocks``) :meth:`shutdown` stopped the rounds.
        """
        while True:
            try:
                entry = self._ready.get(timeout=0.5)
                break
            except queue.Empty:
                if self._stopped and not self._fetch_blocks:
                    raise ExecutorShutdownError("the epoch's rounds were shut down; start a new iteration")
                if self._stopped or not self._thread.is_alive() and self._ready.empty():
                    return None
        if entry is None:
            self._put(None)  # every later call ends too
            return None
        if isinstance(entry, BaseException):
            raise entry
        item, block, executor, rnd = entry
        if self._fetch_blocks:
            self._held[id(item)] = (block, executor)
        self._view = rnd
        return item

    def fetch(self, item: Any) -> Any:
        """(``fetch_blocks``) The block of ``item`` (taken by the rounds' thread)."""
        return self._held[id(item)][0]

    def owner(self, item: Any) -> Any:
        """(``fetch_blocks``) The execution whose budget holds the bytes of ``item``'s block (release
        them there)."""
        executor = self._held.pop(id(item))[1]
        with self._lock:
            self._outstanding -= item.meta.nbytes
        return executor

    def shard_done(self, shard: int) -> bool:
        """(After its block of the round the consumer is in was taken) whether shard ``shard`` has nothing more."""
        rnd = self._view
        return rnd is None or shard not in rnd.made or self._ended(rnd, shard)

    def round_start(self, shard: int) -> tuple[Optional[dict], int]:
        """(After its block was taken) where shard ``shard`` started the round of that block, and the
        round's batches per shard: what makes the block again (a lost block's remake)."""
        rnd = self._view
        return rnd.start.get(shard), rnd.segment

    def release(self, nbytes: int) -> None:
        """The consumer is done with ``nbytes`` of blocks (of any round)."""
        with self._lock:
            self._outstanding -= nbytes
            executor = self.executor
        executor.release(nbytes)

    def shutdown(self) -> None:
        """Stop the current round's execution; no further round starts. Idempotent."""
        with self._lock:
            self._stopped = True
            executor = self.executor
        executor.shutdown()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._held.clear()

    def pools_up(self) -> bool:
        return self.executor.pools_up()

    def estimates(self) -> list:
        return self.executor.estimates()

    def stats(self) -> Any:
        """The epoch's statistics so far: every round's, as one execution's."""
        from sbloader.core.stats import combined

        return combined(self._finished + [self.executor.stats()])

    def current_stats(self) -> Any:
        """The statistics of the round running now (a count added there shows in :meth:`stats`)."""
        return self.executor.stats()
