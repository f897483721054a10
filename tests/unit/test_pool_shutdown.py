"""An execution's pools let go of every actor at shutdown: kept ones live only in the actor cache.

Before, the pools' table of actors still constructing (``pending``) kept their handles after
``shutdown``: with the executor's loop in a reference cycle, those actors lived until a garbage
collection, though their loader had dropped the cache. In one test process that held every CPU
of the session's Ray (the CI's hang: ``test_videos`` waiting for a CPU for good).
"""
from __future__ import annotations

from sbloader.core.stats import OperatorStats
from sbloader.executor import pools
from sbloader.executor.options import ExecutionOptions
from sbloader.executor.stages import build_stages
from sbloader.core.ops import Op


class _Identity:
    def __call__(self, batch):
        return batch


def test_shutdown_keeps_a_starting_actor_only_in_the_cache():
    stages = build_stages("Range", [Op("map_batches", _Identity, "I", concurrency=(1, 1))])
    handle, ready_ref = object(), object()  # stand-ins: nothing here calls Ray
    cache = {1: [pools.PrestartedActor(handle, ready_ref)]}
    pool = pools.ActorPools(stages, {1: (1, 1)}, ExecutionOptions(), [OperatorStats(s.name) for s in stages], cache)
    assert ready_ref in pool.pending  # adopted while still constructing
    pool.shutdown()
    assert [a.handle for a in cache[1]] == [handle]  # kept for the next execution, still starting
    assert pool.pending == {} and all(not actors for actors in pool.pools.values())
