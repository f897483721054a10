"""An ``IterableDataset``'s shards on the pool in segments: a shard that never ends keeps yielding.

torch's worker ``w`` runs its shard as one generator and sends each batch as it is made; a
stream that never ends is read for as long as the loop wants. The pool's unit of work is a
block, so a shard run as one block would come back only at its end (never, for a stream) and
hold the whole shard in memory. Instead each shard runs in **segments** of ``segment``
batches, one round after another (:class:`ShardRounds`, in the trainer): each round is one
execution of the pool over the shards still open, each resumed where its last segment
stopped (the snapshot of its last batch, :mod:`~sbloader.loaders.iterable_resume`). A shard
whose segment comes back short, or whose last batch is its end, is done.

In the worker (:class:`LiveShards`) the shard's generator outlives its segment: the next
segment of the same shard, in the same epoch, on the same actor goes on from it (with the
worker's RNG streams as the segment left them), so the batches and their random draws are
those of the shard run in one piece. A segment that lands on another actor (a lost actor's
shard, a resumed run) opens the shard from the snapshot instead, as any resume does.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from sbloader.loaders.iterable_resume import batches_before

SHARD_SEGMENT_MIN = 8  # batches per segment at least: a round costs one execution's start


def segment_size(batches_per_partition: int) -> int:
    """Batches per segment of a shard: the loader's ``batches_per_partition``, at least
    :data:`SHARD_SEGMENT_MIN`."""
    return max(int(batches_per_partition), SHARD_SEGMENT_MIN)


def segments(segment: int) -> Iterator[int]:
    """Each round's batches per shard: a quarter, a half, then ``segment`` from the third round on
    (the epoch's first batch waits for a short segment; later rounds are made while the loop
    consumes the one before)."""
    yield max(1, segment // 4)
    yield max(1, segment // 2)
    while True:
        yield segment


@dataclass
class _Live:
    gen: Iterator[tuple]
    next_k: int  # the shard's batches made so far: the next segment's resume must say the same
    rng: Any  # the worker's RNG streams where the segment left them


class LiveShards:
    """(Worker) Each shard's generator between its segments, keyed by shard and epoch.

    The epoch key is the same for every shard of the epoch (``(epoch, epoch seed)``), never a
    partition's seed: an actor that runs several shards keeps each one's generator.

    Args:
        rng_states: returns the worker's RNG streams; ``set_rng_states`` restores them.
    """

    def __init__(self, rng_states: Callable[[], Any], set_rng_states: Callable[[Any], None]) -> None:
        self._live: dict = {}
        self._rng_states, self._set_rng_states = rng_states, set_rng_states

    def take(self, shard: int, epoch: Any, resume: Optional[dict], limit: Optional[int],
             open_shard: Callable[[], Iterator[tuple]]) -> Iterator[tuple]:
        """Shard ``shard``'s next batches in ``epoch`` (a hashable key of the epoch) as ``(batch,
        samples, snapshot)``: at most ``limit`` (None: to its end), from ``resume`` on. ``open_shard``
        starts the shard at ``resume`` (used unless this worker holds the shard's generator at exactly
        that batch)."""
        key = (int(shard), epoch)
        live = self._live.pop(key, None)
        for stale in [k for k in self._live if k[1] != key[1]]:  # an earlier epoch's (persistent workers)
            del self._live[stale]
        if limit is None:
            yield from open_shard()
            return
        if live is not None and live.next_k == batches_before(resume):
            gen = live.gen
            self._set_rng_states(live.rng)
        else:
            gen = open_shard()
        made = 0
        for item in gen:
            yield item
            made += 1
            if item[2].get("ended"):
                return
            if made >= limit:
                self._live[key] = _Live(gen, int(item[2]["batches"]), self._rng_states())
                return


class _Round:
    """One round as the consumer sees it: its segment size and what each of its shards made."""

    def __init__(self, segment: int, shards: Any) -> None:
        self.segment = segment
        self.made = {w: 0 for w in shards}
        self.pos: dict = {}  # where each shard stands after its block of this round


class ShardRounds:
    """(Trainer) The pool's executions of an ``IterableDataset`` epoch, one round of segments after another.

    Looks like one executor to the loader (``get_next``, ``fetch``, ``owner``, ``shutdown``,
    ``pools_up``, ``estimates``, ``stats``). A thread of its own takes each round's blocks as they
    are ready (where each shard stands is in its block) and starts the next round, on the shards
    still open, each from its last snapshot, as soon as the last block of this one is in: the pool
    makes round ``r + 1`` while the loop consumes round ``r`` (a round started only when the loop
    asked for its next block left the workers idle for a whole segment each round). The first
    rounds are shorter (:func:`segments`), so a later epoch's first batch waits for one small
    segment, not a whole one. At most one round of blocks waits for the loop.

    Args:
        start: starts the execution of one round: ``start(resume, segment)``, ``resume`` per shard to
            run (its snapshot, None from its start), ``segment`` its batches per shard.
        resume: per shard, where the epoch resumes it (absent or None: from its start).
        num_shards: the loader's ``num_workers``.
        segment: batches per shard per round, once the rounds are full size.
        shard_state: the name of the block column of ``(shard, snapshot)`` per batch.
    """

    def __init__(self, start: Callable[[dict, int], Any], resume: dict, num_shards: int, segment: int,
                 shard_state: str) -> None:
        self._start, self._column = start, shard_state
        self._sizes = segments(segment)
        self.positions = {w: resume.get(w) for w in range(max(1, num_shards)) if not (resume.get(w) or {}).get("ended")}
        self._lock = threading.Lock()
        self._stopped = False
        self._finished: list = []  # the statistics of the rounds before this one
        self._ready: queue.Queue = queue.Queue(maxsize=max(1, len(self.positions)))
        self._held: dict = {}  # id(item) -> (block, its execution, its round)
        self._view: Optional[_Round] = None  # the round of the block the loop took last
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
                    block = executor.fetch(item)
                    self._note(rnd, item.meta.partition_id, block.get(self._column))
                    if not self._put((item, block, executor, rnd)):
                        return
                nxt = {w: self.positions[w] for w in rnd.made if not self._ended(rnd, w)}
                if not nxt or not self._next_round(nxt):
                    break
            self._put(None)
        except BaseException as exc:  # carried to the loop's get_next
            if not self._stopped:
                self._put(exc)

    def _note(self, rnd: _Round, shard: int, snaps: Any) -> None:
        if snaps is not None and len(snaps):
            rnd.made[shard] = rnd.made.get(shard, 0) + len(snaps)
            self.positions[shard] = rnd.pos[shard] = snaps[-1][1]

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
            self.rounds += 1
            return True

    def get_next(self) -> Any:
        """The next ready block of the epoch, or None at its end.

        Raises:
            the error of the round's execution (a failed task), as the execution raises it.
        """
        while True:
            try:
                entry = self._ready.get(timeout=0.5)
                break
            except queue.Empty:
                if self._stopped or not self._thread.is_alive() and self._ready.empty():
                    return None
        if entry is None:
            self._put(None)  # every later call ends too
            return None
        if isinstance(entry, BaseException):
            raise entry
        item, block, executor, rnd = entry
        self._held[id(item)] = (block, executor)
        self._view = rnd
        return item

    def fetch(self, item: Any) -> Any:
        """The block of ``item`` (taken by the rounds' thread)."""
        return self._held[id(item)][0]

    def owner(self, item: Any) -> Any:
        """The execution whose budget holds the bytes of ``item``'s block (release them there)."""
        return self._held.pop(id(item))[1]

    def shard_done(self, shard: int) -> bool:
        """(After its block of the round the loop is in was taken) whether shard ``shard`` has nothing more."""
        rnd = self._view
        return rnd is None or shard not in rnd.made or self._ended(rnd, shard)

    def release(self, nbytes: int) -> None:
        self.executor.release(nbytes)

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
