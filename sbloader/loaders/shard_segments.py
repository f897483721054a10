"""(Worker) An ``IterableDataset``'s shard between its segments: a shard that never ends keeps yielding.

torch's worker ``w`` runs its shard as one generator and sends each batch as it is made; a
stream that never ends is read for as long as the loop wants. On the pool each shard runs in
**segments**, one round of executions after another
(:class:`~sbloader.executor.shard_rounds.ShardRounds`), each segment resumed where the last
one stopped (the snapshot of its last batch, :mod:`~sbloader.loaders.iterable_resume`).

In the worker (:class:`LiveShards`) the shard's generator outlives its segment: the next
segment of the same shard, in the same epoch, on the same actor goes on from it (with the
worker's RNG streams as the segment left them), so the batches and their random draws are
those of the shard run in one piece. A segment that lands on another actor (a lost actor's
shard, a resumed run) opens the shard from the snapshot instead, as any resume does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from sbloader.loaders.iterable_resume import batches_before


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
