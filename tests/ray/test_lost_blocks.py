"""A ready block lost before this process read it is made again: one process, no coordinator (issue #48).

A call can finish (its metadata came back, the partition counted done) while its block still lives on the
node that made it; when that node (or the pool actor holding the block) dies before the consumer reads it,
the read raises ``ActorDiedError`` or ``ObjectLostError``. CI29 saw it in ``tests/e2e/test_failures.py``'s
``node_removed_actors`` (a native pipeline's class stage on a removed node): the error reached the script.
Here the read of chosen blocks fails as it did there (``executor._read`` replaced: a lost block stays lost
whoever reads it again), and the epoch must still hold every sample exactly once, the stages applied.
"""
from __future__ import annotations

import pytest
import ray

import sbloader
from sbloader.core.errors import TaskLostError
from sbloader.executor import executor as executor_mod
from sbloader.executor.failures import MAX_RERUNS
from sbloader.executor.launcher import Launcher

N = 40


class Shifted:
    """A callable class stage: its pool actors hold the blocks it made."""

    def __call__(self, batch):
        return {"id": [i + 1000 for i in batch["id"]]}


def doubled(batch):
    return {"id": [i * 2 for i in batch["id"]]}


def lose_first(monkeypatch, count: int, error=ray.exceptions.ActorDiedError) -> list:
    """The first ``count`` blocks read are lost (for good: reading one again fails again)."""
    lost: list = []
    read = executor_mod._read

    def losing(ref):
        if len(lost) < count and ref.hex() not in lost:
            lost.append(ref.hex())
        if ref.hex() in lost:
            raise error()
        return read(ref)

    monkeypatch.setattr(executor_mod, "_read", losing)
    return lost


@pytest.mark.parametrize("stages", ["class", "class then function"])
def test_a_native_pipelines_lost_blocks_are_made_again_through_every_stage(ray_session, monkeypatch, stages):
    lost = lose_first(monkeypatch, 2)
    ds = sbloader.from_items([{"id": i} for i in range(N)], rows_per_partition=5).map_batches(Shifted, concurrency=2)
    if stages == "class then function":
        ds = ds.map_batches(doubled)
    want = sorted((i + 1000) * (2 if stages == "class then function" else 1) for i in range(N))
    got = sorted(int(i) for b in ds.iter_batches(batch_size=10) for i in b["id"])
    assert got == want
    assert len(lost) == 2
    assert ds.stats().rerun_partitions == 2


def test_the_drop_ins_lost_blocks_are_made_again_on_a_pool(ray_session, monkeypatch):
    """The map-style drop-in's pool (no local start): the blocks lost with their node, as Ray says it."""
    lost = lose_first(monkeypatch, 2, lambda: ray.exceptions.ObjectLostError("ab" * 14, None, ""))
    loader = sbloader.DataLoader(list(range(N)), batch_size=4, shuffle=True, num_workers=2, seed=1,
                                 local_start=False)
    got = sorted(int(x) for batch in loader for x in batch)
    assert got == list(range(N))
    assert len(lost) == 2
    assert loader.stats().rerun_partitions == 2


def test_a_block_lost_again_and_again_names_its_partition(ray_session, monkeypatch):
    """Every remake lost too: after MAX_RERUNS the consumer gets a TaskLostError naming the partition."""
    lose_first(monkeypatch, 1)
    calls: list = []

    def remake(self, part, seq):
        calls.append(part.id)
        raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(Launcher, "remake", remake)
    ds = sbloader.from_items([{"id": i} for i in range(N)], rows_per_partition=5).map_batches(Shifted, concurrency=2)
    with pytest.raises(TaskLostError) as info:
        list(ds.iter_batches(batch_size=10))
    assert len(calls) == MAX_RERUNS and len(set(calls)) == 1
    assert "Shifted" in str(info.value) and str(calls[0]) in str(info.value)
