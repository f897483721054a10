"""The translations between StatefulDataLoader's state layout and sbloader's (issue #45), without Ray.

The states here are written by torchdata's own ``StatefulDataLoader`` (0 workers: in this
process) or built in its multi-worker layout; tests/ray/test_torchdata_crossover.py resumes them.
"""
from __future__ import annotations

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from sbloader.core.errors import StateDictError
from sbloader.loaders import torchdata_state as tds


def workers_state(step: int, since: int, workers: dict, finished: bool = False, num_workers: int = 2) -> dict:
    """A state in StatefulDataLoader's multi-worker layout."""
    return {tds.SNAPSHOT: {tds.SNAPSHOT_STEP: step, tds.LAST_YIELDED_WORKER_ID: (step - 1) % num_workers,
                           tds.MAIN_SNAPSHOT: {tds.NUM_WORKERS: num_workers, tds.SAMPLER_ITER_STATE: None},
                           tds.WORKER_SNAPSHOTS: workers},
            tds.STEPS_SINCE_SNAPSHOT: since, tds.ITERATOR_FINISHED: finished}


def worker(w: int, ds=None, it=None, ended=False) -> dict:
    return {"worker_id": w, tds.FETCHER_STATE: {tds.DATASET_ITER_STATE: it, tds.FETCHER_ENDED: ended},
            tds.DATASET_STATE: ds}


def test_a_statefuldataloader_state_is_told_from_an_sbloader_one():
    sdl = StatefulDataLoader(list(range(10)), batch_size=2)
    it = iter(sdl)
    next(it)
    assert tds.is_torchdata_state(sdl.state_dict())
    assert tds.is_torchdata_state(workers_state(1, 0, {}))
    assert not tds.is_torchdata_state({"format": "sbloader.DataLoader", tds.NUM_YIELDED: 0})
    assert not tds.is_torchdata_state({})


def test_map_progress_counts_the_batches_after_the_snapshot_too():
    p = tds.progress(workers_state(3, 2, {"worker_0": worker(0), "worker_1": worker(1)}))
    assert (p.batches, p.since_snapshot, p.num_workers, sorted(p.workers)) == (5, 2, 2, [0, 1])
    shape = tds.LoaderShape(2, 4, 50, sampler="SequentialSampler")
    body = tds.map_body(workers_state(3, 2, {}), shape, epoch=0, epoch_seed=11)
    assert body["consumed"] == [[0, 20]] and body["order"] == {"kind": "sequential"} and body["epoch_seed"] == 11


def test_map_body_of_a_real_shuffled_state_recomputes_its_order():
    g = torch.Generator().manual_seed(3)
    sdl = StatefulDataLoader(list(range(30)), batch_size=4, shuffle=True, generator=g)
    it = iter(sdl)
    taken = [next(it) for _ in range(2)]
    body = tds.map_body(sdl.state_dict(), tds.LoaderShape(0, 4, 30, sampler="RandomSampler"), 0, 5)
    assert body["consumed"] == [[0, 8]] and body["order"]["kind"] == "rng" and body["order"]["generator"]
    # the order the state describes starts with the batches already taken
    from sbloader.loaders.dropin_state import recompute_order
    from torch.utils.data import RandomSampler

    order = recompute_order(RandomSampler(range(30)), 30, body["order"])
    assert order[:8].tolist() == torch.cat(taken).tolist()


def test_map_body_at_and_after_the_epoch_end():
    shape = tds.LoaderShape(0, 4, 10, sampler="SequentialSampler")
    inside = tds.map_body({tds.NUM_YIELDED: 3, tds.ITERATOR_FINISHED: False}, shape, 2, 7)
    assert inside["empty_remainder"] and inside["epoch"] == 2
    after = tds.map_body({tds.NUM_YIELDED: 3, tds.ITERATOR_FINISHED: True}, shape, 2, 7)
    assert after == {"epoch": 2, "epoch_seed": None, "order": None, "consumed": []}
    dropped = tds.map_body({tds.NUM_YIELDED: 2, tds.ITERATOR_FINISHED: False},
                           tds.LoaderShape(0, 4, 10, drop_last=True, sampler="SequentialSampler"), 0, 7)
    assert dropped.get("empty_remainder")  # the short batch never comes under drop_last


def test_samplers_the_translation_cannot_recompute_are_refused_with_the_reason():
    with pytest.raises(StateDictError, match="no RandomSampler generator state.*shuffle=False"):
        tds.sampler_order({tds.SAMPLER_ITER_STATE: {"samples_yielded": 4}}, "RandomSampler")
    with pytest.raises(StateDictError, match="DistributedSampler.*RandomSampler and SequentialSampler"):
        tds.sampler_order({}, "DistributedSampler")


def test_iterable_body_maps_worker_n_to_shard_n_and_counts_round_robin_batches():
    state = workers_state(5, 0, {"worker_0": worker(0), "worker_1": worker(1, ended=True)})
    body = tds.iterable_body(state, tds.LoaderShape(2, 3, None), epoch=4)
    # torch dealt batches 0, 2, 4 to worker 0 and 1, 3 to worker 1
    assert body["shards"]["0"]["samples"] == 9 and body["shards"]["1"]["samples"] == 6
    assert body["shards"]["1"]["ended"] and body["epoch_seed"] is None and body["epoch"] == 4
    stateful = workers_state(5, 0, {"worker_0": worker(0, ds={"i": 9}), "worker_1": worker(1, it={"j": 6})})
    shards = tds.iterable_body(stateful, tds.LoaderShape(2, 3, None), 0)["shards"]
    assert shards["0"]["dataset_state"] == {"i": 9} and shards["1"]["iter_state"] == {"j": 6}


def test_iterable_body_refuses_another_worker_count_and_batches_past_a_stateful_snapshot():
    with pytest.raises(StateDictError, match="num_workers=2, this loader has num_workers=3"):
        tds.iterable_body(workers_state(1, 0, {}), tds.LoaderShape(3, 1, None), 0)
    past = workers_state(4, 2, {"worker_0": worker(0, ds={"i": 1}), "worker_1": worker(1, ds={"i": 1})})
    with pytest.raises(StateDictError, match="2 batches after its workers' snapshots.*snapshot_every_n_steps=1"):
        tds.iterable_body(past, tds.LoaderShape(2, 1, None), 0)


def test_the_view_of_an_sbloader_state_has_statefuldataloaders_keys():
    state = {"format": "sbloader.DataLoader", "fingerprint": {"batch_size": 2},
             "iterable": {"epoch": 0, "epoch_seed": 9, "shards": {
                 "1": {"samples": 3, "dataset_state": {"i": 3}, "iter_state": None, "ended": True}}}}
    view = tds.torchdata_view(state, 2)
    snap = view[tds.SNAPSHOT]
    assert snap[tds.SNAPSHOT_STEP] == 2 and view[tds.STEPS_SINCE_SNAPSHOT] == 0
    assert snap[tds.WORKER_SNAPSHOTS]["worker_1"] == worker(1, ds={"i": 3}, ended=True)
    assert snap[tds.WORKER_SNAPSHOTS]["worker_0"] == worker(0)
    inline = tds.torchdata_view({"fingerprint": {"batch_size": 4, "len": 10}, "consumed": [[0, 8]],
                                 "dataset_state": {"k": 1}}, 0)
    assert inline[tds.NUM_YIELDED] == 2 and inline[tds.DATASET_STATE] == {"k": 1}
    assert inline[tds.FETCHER_STATE] is None and inline[tds.ITERATOR_FINISHED] is False
