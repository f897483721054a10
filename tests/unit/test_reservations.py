"""The allocation rule (executor/reservations.py) over a grid of stage lists and cluster shapes.

Every stage gets its reservation, the reservations and a grown pool never exceed the
cluster, a pool grows only into the room the others leave, and a cluster too small
for the reservations is named, stage by stage, before a pipeline starts.
"""
from __future__ import annotations

import itertools
from typing import Optional

import pytest

from sbloader.executor.reservations import StageNeeds, idle_limit_s, pool_limit, shortfall

READ = StageNeeds("ReadImages", actor=False, per_call={"CPU": 1.0})
TASK = StageNeeds("Map(f)", actor=False, per_call={"CPU": 1.0})
FREE_TASK = StageNeeds("Map(light)", actor=False, per_call={"CPU": 0.0})


def cpu_pool(name: str = "MapBatches(Crop)", lo: int = 1, hi: Optional[int] = None, cpus: float = 1.0) -> StageNeeds:
    return StageNeeds(name, actor=True, per_call={"CPU": cpus}, min_actors=lo, max_actors=hi)


def gpu_pool(lo: int = 1, hi: Optional[int] = None, cpus: float = 0.0) -> StageNeeds:
    per = {"GPU": 1.0, "CPU": cpus} if cpus else {"GPU": 1.0}
    return StageNeeds("MapBatches(Encoder)", actor=True, per_call=per, min_actors=lo, max_actors=hi)


PIPELINES = [
    [READ, cpu_pool()],
    [READ, cpu_pool(lo=1, hi=2)],
    [READ, cpu_pool(lo=2, hi=8)],
    [READ, cpu_pool(cpus=0.5)],
    [READ, TASK, cpu_pool(), FREE_TASK],
    [READ, cpu_pool("A"), cpu_pool("B")],
    [READ, cpu_pool("A", lo=2), TASK, cpu_pool("B", hi=3)],
    [READ, gpu_pool()],
    [READ, gpu_pool(hi=4)],
    [READ, gpu_pool(cpus=1.0), cpu_pool()],
    [READ, cpu_pool(lo=3, hi=3)],
]
CLUSTERS = [
    {"CPU": 1.0},
    {"CPU": 2.0},
    {"CPU": 3.0},
    {"CPU": 8.0},
    {"CPU": 2.0, "GPU": 1.0},
    {"CPU": 4.0, "GPU": 2.0},
    {"CPU": 64.0, "GPU": 8.0},
]


def _add(a: dict, b: dict, times: float = 1.0) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0.0) + v * times
    return out


@pytest.mark.parametrize("stages,total", list(itertools.product(PIPELINES, CLUSTERS)))
def test_reservations_and_limits(stages: list, total: dict) -> None:
    reserved: dict = {}
    for s in stages:
        reserved = _add(reserved, s.reservation())
    fits = all(v <= total.get(k, 0.0) + 1e-9 for k, v in reserved.items())
    message = shortfall(stages, total)
    assert (message is None) == fits
    if not fits:
        # Every resource short is named with what the cluster has, and each stage that asks for it.
        for k, v in reserved.items():
            if v > total.get(k, 0.0) + 1e-9:
                assert f"{k}={v:g}" in message and f"{k} {total.get(k, 0.0):g}" in message
                for s in stages:
                    if s.reservation().get(k):
                        assert s.name in message
        return
    for i, s in enumerate(stages):
        if not s.actor:
            with pytest.raises(ValueError, match="not an actor stage"):
                pool_limit(stages, total, i)
            continue
        limit = pool_limit(stages, total, i)
        assert s.min_actors <= limit
        if s.max_actors is not None:
            assert limit <= s.max_actors
        # The pool grown to its limit and every other stage's reservation fit in the cluster.
        others = {}
        for j, o in enumerate(stages):
            if j != i:
                others = _add(others, o.reservation())
        grown = _add(others, s.per_call, limit)
        assert all(v <= total.get(k, 0.0) + 1e-9 for k, v in grown.items()), (s, limit, grown)
        # ... and is the largest that does (or the user's maximum).
        if s.max_actors is None or limit < s.max_actors:
            one_more = _add(grown, s.per_call)
            assert any(v > total.get(k, 0.0) + 1e-9 for k, v in one_more.items() if s.per_call.get(k)), (s, limit)


def test_the_starvation_case() -> None:
    """The issue's case: on 2 CPUs a default-concurrency pool used to grow to 2 actors and
    leave its read stage no CPU; now it stops at 1 and the reads keep one."""
    stages = [READ, cpu_pool()]
    assert pool_limit(stages, {"CPU": 2.0}, 1) == 1
    assert pool_limit(stages, {"CPU": 8.0}, 1) == 7
    # a user maximum above the room is held to the room, not to the maximum
    assert pool_limit([READ, cpu_pool(lo=1, hi=2)], {"CPU": 2.0}, 1) == 1


def test_gpu_pool_leaves_cpus_to_the_reads() -> None:
    stages = [READ, gpu_pool()]
    assert shortfall(stages, {"CPU": 2.0, "GPU": 1.0}) is None
    assert pool_limit(stages, {"CPU": 2.0, "GPU": 1.0}, 1) == 1
    assert pool_limit(stages, {"CPU": 2.0, "GPU": 4.0}, 1) == 4
    msg = shortfall(stages, {"CPU": 16.0})
    assert msg is not None and "MapBatches(Encoder) needs GPU=1" in msg and "GPU 0" in msg


def test_shortfall_names_the_stage_and_the_way_out() -> None:
    msg = shortfall([READ, cpu_pool(lo=3, hi=3)], {"CPU": 2.0})
    assert msg is not None
    assert "MapBatches(Crop) needs CPU=3 (its pool's minimum of 3 actor(s))" in msg
    assert "ReadImages needs CPU=1 (one task)" in msg
    assert "CPU=4 in all" in msg and "have CPU 2" in msg
    assert "concurrency=(min, max)" in msg


def test_pool_of_zero_resources_defaults_to_one_per_cpu() -> None:
    free = StageNeeds("MapBatches(Free)", actor=True, per_call={"CPU": 0.0})
    assert pool_limit([READ, free], {"CPU": 4.0}, 1) == 4
    assert pool_limit([READ, StageNeeds("F", True, {}, 1, 2)], {"CPU": 4.0}, 1) == 2


@pytest.mark.parametrize("kwargs,match", [
    (dict(per_call={"CPU": -1.0}), ">= 0"),
    (dict(actor=True, min_actors=0), "min_actors"),
    (dict(actor=True, min_actors=3, max_actors=2), "min_actors"),
])
def test_stage_needs_validation(kwargs: dict, match: str) -> None:
    args = dict(name="S", actor=False)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        StageNeeds(**args)


@pytest.mark.parametrize("built,floor,want", [(None, 5.0, 5.0), (0.1, 5.0, 5.0), (4.0, 5.0, 8.0), (30.0, 2.0, 60.0)])
def test_idle_limit_is_longer_than_construction(built: Optional[float], floor: float, want: float) -> None:
    got = idle_limit_s(built, floor)
    assert got == want and got >= floor and got > (built or 0.0)


def test_stats_report_pools_and_a_starved_stage() -> None:
    from sbloader.core.stats import ExecutionStats, OperatorStats

    read = OperatorStats("ReadImages", rows=100, tasks=4, resource_wait_s=6.0)
    pool = OperatorStats("MapBatches(Crop)", rows=100, actors_created=2, actors_ready=2, actors_retired=1,
                         construction_s=3.0, pool_limit=3, resource_wait_s=0.2)
    st = ExecutionStats(operators=[read, pool], wall_s=10.0)
    assert st.starved() is read
    text = str(st)
    assert "pool: 2 constructed (limit 3), 1 retired, 0 lost, construction 1.50s each" in text
    assert "starved: ReadImages waited 6.00s" in text
    # a short wait, or a small share of the epoch, is not starvation
    assert ExecutionStats(operators=[OperatorStats("R", resource_wait_s=0.4)], wall_s=1.0).starved() is None
    assert ExecutionStats(operators=[OperatorStats("R", resource_wait_s=5.0)], wall_s=100.0).starved() is None
    # waiting less than working: the one task the executor keeps queued per stage
    assert ExecutionStats(operators=[OperatorStats("R", task_s=1.0, resource_wait_s=0.5)], wall_s=0.6).starved() is None
    assert "starved" not in str(ExecutionStats(operators=[OperatorStats("R")], wall_s=1.0))
