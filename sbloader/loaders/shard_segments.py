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

import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from sbloader.loaders.iterable_resume import batches_before

SHARD_SEGMENT_MIN = 8  # batches per segment at least: a round costs one execution's start


def segment_size(batches_per_partition: int) -> int:
    """Batches per segment of a shard: the loader's ``batches_per_partition``, at least
    :data:`SHARD_SEGMENT_MIN`."""
    return max(int(batches_per_partition), SHARD_SEGMENT_MIN)


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


class ShardRounds:
    """(Trainer) The pool's executions of an ``IterableDataset`` epoch, one round of segments after another.

    Looks like one executor to the loader (``get_next``, ``fetch``, ``release``, ``shutdown``,
    ``pools_up``, ``estimates``, ``stats``): when a round's execution has handed out its last
    block, the next one starts on the shards still open, each from its last snapshot.

    Args:
        start: starts the execution of one round: ``start(resume)``, ``resume`` per shard to run
            (its snapshot, None from its start).
        resume: per shard, where the epoch resumes it (absent or None: from its start).
        num_shards: the loader's ``num_workers``.
        segment: batches per shard per round.
        shard_state: the name of the block column of ``(shard, snapshot)`` per batch.
    """

    def __init__(self, start: Callable[[dict], Any], resume: dict, num_shards: int, segment: int,
                 shard_state: str) -> None:
        self._start, self.segment, self._column = start, segment, shard_state
        self.positions = {w: resume.get(w) for w in range(max(1, num_shards)) if not (resume.get(w) or {}).get("ended")}
        self._made = {w: 0 for w in self.positions}
        self._done: set = set()
        self._lock = threading.Lock()
        self._stopped = False
        self._finished: list = []  # the statistics of the rounds before this one
        self.rounds = 1
        self.executor = start(dict(self.positions))

    def get_next(self) -> Any:
        """The next ready block of the epoch (starting the next round when this one is over), or None."""
        while True:
            item = self.executor.get_next()
            if item is not None:
                return item
            nxt = {w: self.positions[w] for w, n in self._made.items() if not self.shard_done(w)}
            self._done.update(w for w in self._made if w not in nxt)
            if not nxt or not self._next_round(nxt):
                return None

    def _next_round(self, resume: dict) -> bool:
        with self._lock:
            if self._stopped:
                return False
            self.executor.shutdown()  # its actors go back to the cache the next round takes them from
            self._finished.append(self.executor.stats())
            self.executor = self._start(resume)
            self._made = {w: 0 for w in resume}
            self.rounds += 1
            return True

    def fetch(self, item: Any) -> Any:
        """The block of ``item``; notes where its shard stands."""
        block = self.executor.fetch(item)
        snaps = block.get(self._column)
        shard = item.meta.partition_id
        if snaps is not None and len(snaps):
            self._made[shard] = self._made.get(shard, 0) + len(snaps)
            self.positions[shard] = snaps[-1][1]
        return block

    def shard_done(self, shard: int) -> bool:
        """(After its block of this round was fetched) whether shard ``shard`` has nothing more."""
        pos = self.positions.get(shard)
        return shard in self._done or self._made.get(shard, 0) < self.segment or bool((pos or {}).get("ended"))

    def release(self, nbytes: int) -> None:
        self.executor.release(nbytes)

    def shutdown(self) -> None:
        """Stop the current round's execution; no further round starts."""
        with self._lock:
            self._stopped = True
            executor = self.executor
        executor.shutdown()

    def pools_up(self) -> bool:
        return self.executor.pools_up()

    def estimates(self) -> list:
        return self.executor.estimates()

    def stats(self) -> Any:
        """The epoch's statistics so far: every round's, as one execution's."""
        from sbloader.core.stats import combined

        return combined(self._finished + [self.executor.stats()])
