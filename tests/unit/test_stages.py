"""Tests of how a dataset's operators group into physical stages (no Ray)."""
from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from sbloader.executor.stages import Stage, build_stages, stage_concurrency
from sbloader.core.ops import Op


def _f(row: Any) -> Any:
    return row


def _g(row: Any) -> bool:
    return True


class _Encoder:
    def __call__(self, batch: dict) -> dict:
        return batch


class _Decoder:
    def __call__(self, batch: dict) -> dict:
        return batch


def fop(name: str = "f", kind: str = "map", **kw: Any) -> Op:
    return Op(kind, _g if kind == "filter" else _f, name, **kw)


def aop(name: str = "A", cls: type = _Encoder, **kw: Any) -> Op:
    return Op("map_batches", cls, name, **kw)


def _shape(stages: list[Stage]) -> list[tuple[str, tuple[str, ...]]]:
    return [(s.kind, tuple(op.name for op in s.ops)) for s in stages]


# ----- fusion rules -------------------------------------------------------------------


def test_read_alone() -> None:
    (read,) = build_stages("Items", [])
    assert read.name == "ReadItems" and read.kind == "read" and read.ops == ()
    assert read.ray_options == {"num_cpus": 1.0}


def test_same_resource_functions_fuse_into_read() -> None:
    ops = [fop("Map(a)"), fop("Filter(b)", "filter"), fop("FlatMap(c)", "flat_map"),
           fop("MapBatches(d)", "map_batches", batch_size=8), fop("Map(e)", num_cpus=1), fop("Map(g)", num_gpus=0)]
    (read,) = build_stages("Parquet", ops)
    assert read.kind == "read"
    assert read.ops == tuple(ops)
    assert read.name == "ReadParquet->Map(a)->Filter(b)->FlatMap(c)->MapBatches(d)->Map(e)->Map(g)"
    assert read.ray_options == {"num_cpus": 1.0}


@pytest.mark.parametrize("num_cpus", [0, 0.5, 2, 4])
def test_other_num_cpus_starts_a_task_stage(num_cpus: float) -> None:
    ops = [fop("a"), fop("b", num_cpus=num_cpus), fop("c", num_cpus=num_cpus), fop("d")]
    stages = build_stages("S", ops)
    assert _shape(stages) == [("read", ("a",)), ("task", ("b", "c")), ("task", ("d",))]
    assert stages[1].name == "b->c"
    assert stages[1].ray_options == {"num_cpus": num_cpus}
    assert stages[2].ray_options == {"num_cpus": 1.0}


def test_gpu_and_custom_resources_start_stages() -> None:
    ops = [
        fop("gpu", num_gpus=1), fop("gpu2", num_gpus=1),
        fop("res", resources={"cpu_node": 1}), fop("res2", resources={"cpu_node": 1}),
        fop("res3", resources={"cpu_node": 2}),
    ]
    stages = build_stages("S", ops)
    assert _shape(stages) == [("read", ()), ("task", ("gpu", "gpu2")), ("task", ("res", "res2")), ("task", ("res3",))]
    assert stages[1].ray_options == {"num_cpus": 1.0, "num_gpus": 1}
    assert stages[2].ray_options == {"num_cpus": 1.0, "resources": {"cpu_node": 1}}


def test_callable_class_gets_its_own_actor_stage() -> None:
    ops = [fop("a"), aop("Enc", num_gpus=1, concurrency=(1, 4)), fop("b"), aop("Dec", _Decoder), aop("Enc2"), fop("c")]
    stages = build_stages("S", ops)
    assert _shape(stages) == [
        ("read", ("a",)),
        ("actor", ("Enc",)),
        ("task", ("b",)),  # never fused into the read before the actor
        ("actor", ("Dec",)),
        ("actor", ("Enc2",)),
        ("task", ("c",)),
    ]
    assert stages[1].ray_options == {"num_cpus": 0.0, "num_gpus": 1}  # a GPU actor holds no CPU unless told
    assert stages[1].name == "Enc"


def test_class_first_takes_the_read_in() -> None:
    """A class right after the read, its pool left to the executor: its actors read."""
    stages = build_stages("S", [aop("Enc"), fop("a"), fop("b")])
    assert _shape(stages) == [("actor", ("Enc",)), ("task", ("a", "b"))]
    assert stages[0].reads and stages[0].name == "ReadS->Enc" and stages[0].actor_op.name == "Enc"
    # the functions fused into the read go into the pool with it, applied before the class
    stages = build_stages("S", [fop("a"), fop("b"), aop("Enc"), fop("c")])
    assert _shape(stages) == [("actor", ("a", "b", "Enc")), ("task", ("c",))]
    assert stages[0].reads and stages[0].name == "ReadS->a->b->Enc"
    # a class holds no CPU while it runs unless told (Ray's default for actors)
    assert stages[0].ray_options == {}


@pytest.mark.parametrize("kw", [dict(concurrency=2), dict(concurrency=(1, 4)), dict(num_cpus=1), dict(num_cpus=2),
                                dict(num_gpus=1), dict(resources={"x": 1})])
def test_class_whose_pool_the_user_sized_keeps_a_read_stage(kw: dict) -> None:
    stages = build_stages("S", [fop("a"), aop("Enc", **kw)])
    assert _shape(stages) == [("read", ("a",)), ("actor", ("Enc",))]
    assert not stages[1].reads


def test_only_the_first_class_takes_the_read() -> None:
    stages = build_stages("S", [aop("A"), aop("B")])
    assert _shape(stages) == [("actor", ("A",)), ("actor", ("B",))]
    stages = build_stages("S", [fop("x", num_cpus=2), aop("A")])
    assert _shape(stages) == [("read", ()), ("task", ("x",)), ("actor", ("A",))]


def test_concurrency_on_a_function_starts_a_stage() -> None:
    ops = [fop("a"), fop("lim", concurrency=2), fop("b"), fop("c")]
    stages = build_stages("S", ops)
    # The limited op runs alone: nothing fuses into it or after it.
    assert _shape(stages) == [("read", ("a",)), ("task", ("lim",)), ("task", ("b", "c"))]
    stages = build_stages("S", [fop("lim", concurrency=1), fop("lim2", concurrency=1)])
    assert _shape(stages) == [("read", ()), ("task", ("lim",)), ("task", ("lim2",))]


def _res(op: Op) -> Any:
    return sorted((k, sorted(v.items()) if isinstance(v, dict) else v) for k, v in op.ray_resources().items())


TEMPLATES = [
    lambda i: fop(f"f{i}"),
    lambda i: fop(f"k{i}", "filter", num_cpus=1),
    lambda i: fop(f"c{i}", num_cpus=2),
    lambda i: fop(f"h{i}", "flat_map", num_cpus=0.5),
    lambda i: fop(f"g{i}", "map_batches", num_gpus=1),
    lambda i: fop(f"r{i}", resources={"x": 1}),
    lambda i: fop(f"l{i}", concurrency=3),
    lambda i: aop(f"A{i}"),
    lambda i: aop(f"B{i}", _Decoder, num_gpus=1, concurrency=(1, 2)),
]


@pytest.mark.parametrize("length, seed", itertools.product([0, 1, 2, 3, 5, 8], range(25)))
def test_build_stages_invariants(length: int, seed: int) -> None:
    rng = np.random.default_rng(seed * 31 + length)
    ops = [TEMPLATES[int(rng.integers(len(TEMPLATES)))](i) for i in range(length)]
    stages = build_stages("X", ops)
    assert stages[0].reads and stages[0].name.startswith("ReadX")
    assert stages[0].kind == "read" or (stages[0].kind == "actor" and stages[0].actor_op.concurrency is None)
    assert all(s.kind != "read" and not s.reads for s in stages[1:])
    # Every operator once, in order.
    assert [op for s in stages for op in s.ops] == ops
    for s in stages:
        if s.kind == "actor":
            assert s.ops[-1].is_actor and not any(op.is_actor for op in s.ops[:-1])
            assert len(s.ops) == 1 or s.reads  # functions before a class only in a pool that reads
            continue
        assert not any(op.is_actor for op in s.ops)
        assert s.kind == "read" or s.ops
        # One set of resources per task stage: the stage's own.
        for op in s.ops:
            assert sorted(op.ray_resources().items(), key=lambda kv: kv[0]) == sorted(s.resources, key=lambda kv: kv[0])
        if any(op.concurrency is not None for op in s.ops):
            assert len(s.ops) == 1 and s.kind == "task"
        if s.kind == "task":
            assert s.name == "->".join(op.name for op in s.ops)
    # Fusion is maximal: a task stage starts only where it must.
    for prev, cur in zip(stages, stages[1:]):
        if cur.kind != "task" or cur.ops[0].concurrency is not None or prev.kind == "actor":
            continue
        if any(op.concurrency is not None for op in prev.ops):
            continue
        prev_res = _res(prev.ops[-1]) if prev.ops else _res(fop("default"))
        assert prev_res != _res(cur.ops[0]), (_shape(stages))


@pytest.mark.parametrize("kind, nops", [("bogus", 0), ("actor", 0), ("actor", 2)])
def test_stage_validation(kind: str, nops: int) -> None:
    ops = tuple(aop(f"A{i}") for i in range(nops))
    with pytest.raises(ValueError):
        Stage("s", kind, ops, ())
    with pytest.raises(ValueError, match="only an actor stage that reads"):
        Stage("s", "actor", (fop("a"), aop("A")), ())
    with pytest.raises(ValueError, match="its last operator"):
        Stage("s", "actor", (aop("A"), fop("a")), (), True)


# ----- stage_concurrency ------------------------------------------------------------------


CLUSTER_CPUS = [0.5, 1, 2, 3, 8, 64]
PER_TASK = [0.25, 0.5, 1, 2, 3, 4, 16]


@pytest.mark.parametrize("cluster, per", itertools.product(CLUSTER_CPUS, PER_TASK))
def test_stage_concurrency_fits_the_cluster(cluster: float, per: float) -> None:
    stage = build_stages("S", [fop("a", num_cpus=per)])[-1]  # per == 1: the read stage
    n = stage_concurrency(stage, cluster)
    assert n == max(1, math.floor(cluster / per)) + 1
    # Enough to keep every CPU busy plus one queued, never fewer than two.
    assert n >= 2
    assert (n - 1) * per <= max(cluster, per)


@pytest.mark.parametrize("cluster", CLUSTER_CPUS)
def test_stage_concurrency_zero_cpu(cluster: float) -> None:
    (_, stage) = build_stages("S", [fop("a", num_cpus=0)])
    assert stage_concurrency(stage, cluster) == max(2, int(2 * cluster))


@pytest.mark.parametrize("cluster, limit", itertools.product(CLUSTER_CPUS, [1, 2, 5, 100]))
def test_stage_concurrency_explicit(cluster: float, limit: int) -> None:
    (_, stage) = build_stages("S", [fop("a", concurrency=limit)])
    assert stage_concurrency(stage, cluster) == limit
    (_, stage) = build_stages("S", [fop("a", concurrency=limit, num_cpus=4)])
    assert stage_concurrency(stage, cluster) == limit


def test_read_stage_concurrency() -> None:
    (read,) = build_stages("S", [fop("a")])
    assert stage_concurrency(read, 8) == 9
    assert stage_concurrency(read, 0.5) == 2
