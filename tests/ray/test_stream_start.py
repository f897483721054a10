"""A split (torchrun) IterableDataset's first batches from each rank's own shards, made on local workers.

Two or three ranks driven in one process (a thread each, ``rank=``/``world_size=``), as in
``test_split_stream.py``. A sample says where it was made: a local worker is a child of this
process, a pool actor is not. The handover is forced after each rank's ``h``-th local batch
(``SBLOADER_HANDOVER_AT``); the pure rule that keeps the counts equal is tested without Ray in
``tests/unit/test_stream_start_rule.py``.
"""
from __future__ import annotations

import collections
import os

import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

import sbloader
from harness import CountsIterCalls, in_rank_threads

INIT: dict = {}  # in a worker: the id worker_init_fn was called with


def note_init(worker_id: int) -> None:
    INIT["id"] = worker_id


class Sized(IterableDataset):
    """Worker shard ``w`` yields ``sizes[w]`` ids (``w * 1000 + j``); each sample says where it was made
    (``local``: a child of the test process), the worker info it saw and its worker's seed."""

    def __init__(self, sizes: list) -> None:
        self.sizes, self.parent = list(sizes), os.getpid()

    def __iter__(self):
        info = get_worker_info()
        for j in range(self.sizes[info.id]):
            yield {"id": info.id * 1000 + j, "local": int(os.getppid() == self.parent),
                   "worker": torch.tensor([info.id, info.num_workers, INIT.get("id", -1)]),
                   "seed": info.seed}


def run(name: str, ws: int, sizes: list, stop_at: dict | None = None, dataset: type = Sized, **kwargs) -> list:
    """One epoch on ``ws`` ranks; per rank its batches as dicts of lists. ``stop_at``: rank -> batches
    after which that rank's loop breaks. ``dataset``: :class:`Sized` or a subclass."""
    loaders = [sbloader.DataLoader(dataset(sizes), rank=r, world_size=ws, job_id=f"test-stream-start-{name}",
                                   name=name, split=True, **kwargs) for r in range(ws)]
    out: list = [None] * ws

    def loop(r: int) -> None:
        got = []
        for batch in loaders[r]:
            got.append({k: v.tolist() for k, v in batch.items()})
            if (stop_at or {}).get(r) == len(got):
                break
        out[r] = got

    in_rank_threads(loop, ws, timeout=150)
    return out


def ids(ranks: list) -> list:
    """Every real (not padding) sample id the ranks received, sorted."""
    return sorted(i for got in ranks for b in got
                  for i, p in zip(b["id"], b.get("sbloader_padding") or [False] * len(b["id"])) if not p)


def expected(sizes: list) -> list:
    return sorted(w * 1000 + j for w, n in enumerate(sizes) for j in range(n))


def local_counts(ranks: list) -> list:
    """Per rank, how many of its batches were made locally; they must be its first ones."""
    counts = []
    for got in ranks:
        flags = [all(b["local"]) if all(b["local"]) or not any(b["local"]) else None for b in got]
        assert None not in flags, "a batch mixes local and pool samples"
        k = sum(flags)
        assert flags[:k] == [True] * k, f"local batches after pool ones: {flags}"
        counts.append(k)
    return counts


@pytest.mark.parametrize("h", [0, 1])
def test_the_handover_after_each_ranks_hth_local_batch_gives_every_sample_once_in_equal_counts(
        ray_session, monkeypatch, h):
    # 2 ranks, 2 shards of 40 ids in batches of 4: 10 batches each; rank r runs shard r locally and
    # may deliver made // 2 of its batches there (at most 5: the rule that keeps counts equal).
    # h: none, or one (below the bound). Every sample once in equal counts with h at the bound is
    # checked by the four-worker test (h = 4, its bound 4), with h past it by the three-rank test
    # (h = 6, bound 3) and the long-shard test (h = 8, rank 0's bound 5)
    monkeypatch.setenv("SBLOADER_HANDOVER_AT", str(h))
    ranks = run(f"every-{h}", 2, [40, 40], batch_size=4, num_workers=2)
    assert ids(ranks) == expected([40, 40])
    assert [len(got) for got in ranks] == [10, 10]
    assert local_counts(ranks) == [min(h, 5)] * 2


class CountsOnly(CountsIterCalls, Sized):
    """The same samples, with a state that does not say where its shard stands (torchdata's CountIterCalls)."""


def test_the_handover_of_a_dataset_whose_state_holds_no_position_is_exactly_once(ray_session, monkeypatch):
    """The coordinator's pool resumes each shard after the rank's local batches by the samples taken, not
    by the dataset's own state (as the single-process handover: ``test_iterable_start.py``)."""
    monkeypatch.setenv("SBLOADER_HANDOVER_AT", "2")
    loaders = [sbloader.DataLoader(CountsOnly([40, 40]), rank=r, world_size=2, job_id="test-stream-start-counts",
                                   name="counts", split=True, batch_size=4, num_workers=2) for r in range(2)]
    out: list = [None] * 2

    def loop(r: int) -> None:
        out[r] = [{k: v.tolist() for k, v in batch.items()} for batch in loaders[r]]

    in_rank_threads(loop, 2, timeout=150)
    assert ids(out) == expected([40, 40])
    assert local_counts(out) == [2, 2]


def test_four_workers_two_ranks_each_rank_runs_its_two_shards(ray_session, monkeypatch):
    monkeypatch.setenv("SBLOADER_HANDOVER_AT", "4")
    ranks = run("four", 2, [12, 12, 12, 12], batch_size=3, num_workers=4)
    assert ids(ranks) == expected([12] * 4) and [len(got) for got in ranks] == [8, 8]
    assert local_counts(ranks) == [4, 4]
    for r, got in enumerate(ranks):  # rank r's local batches come from shards r and r + 2, in round-robin
        shards = [b["id"][0] // 1000 for b in got[:4]]
        assert shards == [r, r + 2, r, r + 2], shards


def test_a_rank_whose_shard_is_long_delivers_locally_only_what_every_rank_will_reach(ray_session, monkeypatch):
    # shard 0 has 10 batches, shard 1 one: 11 in all, 5 whole ones per rank and one left over (cut in two).
    # Rank 0 made its 10 locally but may deliver only 5 there; without the rule it would have taken 8.
    monkeypatch.setenv("SBLOADER_HANDOVER_AT", "8")
    ranks = run("uneven", 2, [40, 4], batch_size=4, num_workers=2)
    assert ids(ranks) == expected([40, 4])
    assert [len(got) for got in ranks] == [6, 6], [len(got) for got in ranks]
    assert local_counts(ranks) == [5, 0]


def test_a_shards_short_last_batch_is_never_delivered_locally(ray_session, monkeypatch):
    # rank 0 runs shards 0 (4 + 4 + 2 ids) and 2 (10 batches of 4): it made 13, may deliver 6, and the
    # short batch would be its 5th in round-robin; it is left to the coordinator (whose tail, or a rank
    # that asks before the stream's end, takes it), so rank 0's 6 local batches are all whole.
    monkeypatch.setenv("SBLOADER_HANDOVER_AT", "8")
    ranks = run("short", 2, [10, 40, 40, 40], batch_size=4, num_workers=4)
    assert ids(ranks) == expected([10, 40, 40, 40])
    assert [len(got) for got in ranks] == [17, 17]
    assert local_counts(ranks) == [6, 8]
    assert [len(b["id"]) for b in ranks[0][:6]] == [4] * 6
    assert [b["id"][0] // 1000 for b in ranks[0][:6]] == [0, 2, 0, 2, 2, 2]


def test_more_ranks_than_shards_the_rank_without_one_waits_for_the_coordinator(ray_session, monkeypatch):
    monkeypatch.setenv("SBLOADER_HANDOVER_AT", "6")
    ranks = run("three", 3, [36, 36], batch_size=4, num_workers=2)
    assert ids(ranks) == expected([36, 36]) and [len(got) for got in ranks] == [6, 6, 6]
    assert local_counts(ranks) == [3, 3, 0]  # 9 made each: 9 // 3 = 3


def test_worker_info_seeds_and_worker_init_fn_are_the_pools_in_the_local_phase(ray_session, monkeypatch):
    monkeypatch.setenv("SBLOADER_HANDOVER_AT", "5")
    args = dict(batch_size=4, num_workers=4, worker_init_fn=note_init, seed=7)
    started = run("seen-local", 2, [20] * 4, **args)
    assert local_counts(started) == [5, 5]
    monkeypatch.setenv("SBLOADER_LOCAL_START", "0")
    pool = run("seen-pool", 2, [20] * 4, **args)
    assert local_counts(pool) == [0, 0]

    def seen(ranks: list) -> dict:
        return {i: (w[0], w[1], s) for got in ranks for b in got for i, w, s in zip(b["id"], b["worker"], b["seed"])}

    assert seen(started) == seen(pool)  # every sample: its worker id (= its shard), num_workers 4, the seed
    # a local worker is torch's worker w of shard w: worker_init_fn(w), as under torch (a pool actor runs
    # worker_init_fn with its own index once, then whichever shards it is given)
    local = {(w[0], w[2]) for got in started for b in got[:5] for w in b["worker"]}
    assert local == {(0, 0), (2, 2)} | {(1, 1), (3, 3)}


def test_a_rank_that_leaves_in_its_local_phase_lets_the_others_finish(ray_session, monkeypatch):
    monkeypatch.setenv("SBLOADER_HANDOVER_AT", "4")
    ranks = run("leave", 2, [40, 40], stop_at={0: 2}, batch_size=4, num_workers=2)
    assert len(ranks[0]) == 2 and local_counts(ranks) == [2, 4]
    got = [i for gotten in ranks for b in gotten for i in b["id"]]
    assert len(got) == len(set(got)), collections.Counter(got).most_common(2)


class StuckLocally(Sized):
    """:class:`Sized`, but shard 1, on a local worker (a child of the test's process), waits for good (using no
    CPU) at its third sample: a worker stuck on a lock its fork left held."""

    def __iter__(self):
        for j, sample in enumerate(super().__iter__()):
            if j == 2 and get_worker_info().id == 1 and sample["local"]:
                import threading

                threading.Event().wait()
            yield sample


@pytest.mark.timeout(180)
def test_a_rank_whose_local_worker_stalls_hands_over_and_the_epoch_is_every_sample_once(ray_session, monkeypatch):
    """A local worker that uses no CPU for a whole wait (``SBLOADER_LOCAL_STALL_S``) ends its rank's local phase
    (before: that rank, and every rank with it, waited for good): the rank reports what it delivered, and the
    coordinator makes the rest; every sample once, in equal counts."""
    from sbloader.loaders import stalled_workers

    monkeypatch.setenv(stalled_workers.STALL_ENV, "1")
    monkeypatch.setenv("SBLOADER_HANDOVER_AT", "3")
    out = run("stuck", 2, [40, 40], dataset=StuckLocally, batch_size=4, num_workers=2)
    assert ids(out) == expected([40, 40])
    assert [len(got) for got in out] == [10, 10]
    assert local_counts(out)[1] == 0  # rank 1's worker stalled before its first batch
