"""A rank that arrives after its epoch ended on the others (issue #41): the race made deterministic.

Two ranks of one job in this process, run one after the other: rank 1 starts only once
rank 0 has iterated the whole epoch and left it (the coordinator saw its ``finish``).
Before the fix, the coordinator dropped an epoch as soon as the ranks that had asked
were done, so rank 1 got ``epoch 0 was not started by rank 0 (known: [])``.
"""
from __future__ import annotations

import pytest
import ray
import torch
from torch.utils.data import IterableDataset, get_worker_info

import sbloader
from sbloader.core.errors import SbloaderError


class Filtered(IterableDataset):
    """Ids 0..n-1 without the multiples of 7, sharded over the worker shards (as under torch)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, self.n, nw):
            if i % 7:
                yield {"id": i, "x": torch.full((3,), float(i))}


def _one_after_the_other(loaders: list, states: dict | None = None) -> list:
    """Each rank's epoch as a list of id lists, rank 0 to its end first, then rank 1.

    ``states``: rank -> the loader's ``state_dict()`` taken after its last batch (inside the loop)."""
    out = []
    for r, loader in enumerate(loaders):
        got = []
        for batch in loader:
            got.append([int(i) for i in batch["id"]])
            if states is not None:
                states[r] = loader.state_dict()
        out.append(got)
    return out


def _stream(name: str, n: int, **kwargs) -> list:
    # local_start=False: a stream's first epoch started locally waits for every rank's report of its
    # local phase before the coordinator produces anything (loaders/stream_start.py), so no rank can end
    # it before the others arrived; a later epoch (or no local start) can, and that is this race
    return [sbloader.DataLoader(Filtered(n), rank=r, world_size=2, job_id=f"test-late-{name}", name=name,
                                split=True, local_start=False, **kwargs) for r in range(2)]


def test_an_empty_stream_ends_on_a_rank_that_arrives_after_the_epoch_ended(ray_session):
    assert _one_after_the_other(_stream("empty", 1, batch_size=4, num_workers=2)) == [[], []]


def test_a_one_batch_stream_gives_the_late_rank_its_share(ray_session):
    # ids 1 and 2 in one batch of one worker shard: one batch for two ranks, a short one each
    ranks = _one_after_the_other(_stream("one", 3, batch_size=4, num_workers=1))
    assert [len(r) for r in ranks] == [1, 1]
    assert sorted(i for r in ranks for b in r for i in b) == [1, 2]


def _native(job: str, rows: int, **kwargs) -> list:
    ds = sbloader.range(rows, num_partitions=1)
    return [ds.to_dataloader(batch_size=4, rank=r, world_size=2, job_id=job, name=job, **kwargs) for r in range(2)]


def test_a_native_pipeline_gives_the_late_rank_its_share(ray_session):
    ranks = _one_after_the_other(_native("test-late-native", 3))
    assert [len(r) for r in ranks] == [1, 1]
    real = sorted(i for r in ranks for b in r for i in b)
    assert set(real) == {0, 1, 2}  # a repeated row pads the shorter rank's batch


def test_a_resumed_epoch_with_nothing_left_ends_on_the_late_rank(ray_session):
    # 10 rows in batches of 4 without the short one: 2 batches, one a rank; checkpointed after it, the
    # epoch still has 2 rows, which make no batch: the resumed epoch is empty on both ranks
    states: dict = {}
    first = _one_after_the_other(_native("test-late-resume-a", 10, drop_last=True), states)
    assert [len(r) for r in first] == [1, 1]
    resumed = _native("test-late-resume-b", 10, drop_last=True)
    for r, loader in enumerate(resumed):
        loader.load_state_dict(states[r])
    assert _one_after_the_other(resumed) == [[], []]


def test_a_rank_ahead_of_rank_0_fails_saying_who_asked_for_what_and_what_rank_0_does(ray_session):
    from sbloader.distributed.naming import get_coordinator

    coord = get_coordinator("test-late-ahead", "ahead", 2, {"k": 1}, rank=1)
    with pytest.raises(SbloaderError, match=r"rank 1 asked for epoch 3, which rank 0 did not start within 1 s; "
                                            r"rank 0 has started no epoch on this coordinator"):
        ray.get(coord.wait_epoch.remote(3, 1.0, 1))
    assert ray.get(coord.wait_epoch.remote(3, 0.2)) is None  # a poll without a rank: None, as before
    ray.get(coord.shutdown.remote())
    ray.kill(coord)
