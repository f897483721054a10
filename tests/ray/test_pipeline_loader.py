"""The native pipeline loader (``ds.to_dataloader``) in one process: batches, length,
persistent actor pools, and mid-epoch resume of exactly the rows not consumed."""
from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

import sbloader

# No module-level torch import: Ray workers import this module to run the functions
# below (pickled by reference), and they need no torch for that.


def _square(batch: dict) -> dict:
    batch["sq"] = batch["id"] * batch["id"]
    return batch


def _keep_odd(row: dict) -> bool:
    return int(row["id"]) % 2 == 1


class _Counted:
    """A pool class that leaves one marker file per construction (named by its pid) and
    stamps its pid on every row it maps."""

    def __init__(self, marker_dir: str) -> None:
        self.pid = os.getpid()
        open(os.path.join(marker_dir, f"{self.pid}-{uuid.uuid4().hex}"), "w").close()

    def __call__(self, batch: dict) -> dict:
        batch["twice"] = batch["id"] * 2
        batch["pid"] = np.full(len(batch["id"]), self.pid)
        return batch


def test_batches_are_dicts_of_tensors_with_a_length(ray_session):
    import torch

    loader = sbloader.range(100, rows_per_partition=16).map_batches(_square).to_dataloader(8, shuffle=True, seed=1)
    assert len(loader) == 13
    batches = list(loader)
    assert len(batches) == 13 and [len(b["id"]) for b in batches][-1] == 4
    assert all(isinstance(b["sq"], torch.Tensor) for b in batches)
    ids = torch.cat([b["id"] for b in batches])
    assert sorted(ids.tolist()) == list(range(100))
    assert torch.equal(torch.cat([b["sq"] for b in batches]), ids * ids)
    dropped = sbloader.range(100, rows_per_partition=16).to_dataloader(8, drop_last=True)
    assert len(dropped) == 12 and all(len(b["id"]) == 8 for b in dropped)


def test_a_later_epoch_starts_from_the_last_epochs_block_size_estimates(ray_session, monkeypatch):
    """Without estimates a stage runs one task until its first block is measured: every
    epoch would start on one core. The loader hands the last epoch's to the next."""
    ds = sbloader.range(64, rows_per_partition=8).map_batches(_square)
    loader = ds.to_dataloader(8, shuffle=True, seed=3)
    seen = []
    from sbloader.loaders import pipeline_epoch

    start = pipeline_epoch.start_execution

    def spy(*args, **kwargs):
        executor = start(*args, **kwargs)
        seen.append((kwargs.get("estimates"), executor))
        return executor

    monkeypatch.setattr(pipeline_epoch, "start_execution", spy)
    for _ in range(2):
        assert sum(len(b["id"]) for b in loader) == 64
    (first_given, first), (second_given, _) = seen
    assert first_given is None
    measured = first.estimates()
    assert len(measured) == 1 and measured[0] > 0  # bytes per output block of the fused stage
    assert second_given == measured


def test_unknown_length_raises_type_error_until_an_epoch_counted_it(ray_session):
    loader = sbloader.range(40, rows_per_partition=8).filter(_keep_odd).to_dataloader(4)
    with pytest.raises(TypeError, match="no length known"):
        len(loader)
    assert sum(len(b["id"]) for b in loader) == 20
    assert len(loader) == 5  # counted by the complete epoch


@pytest.mark.parametrize("persistent,warm", [(False, False), (True, False), (False, True)])
def test_persistent_workers_construct_the_pool_once(ray_session, tmp_path, monkeypatch, persistent, warm):
    """With persistent_workers=True the pool's actors (a model, in practice) are built once for
    the loader's life; with warm actors (the default) once while they stay warm in the process;
    without either (SBLOADER_WARM_WORKERS=0), once per epoch, as torch's DataLoader does with its workers."""
    monkeypatch.setenv("SBLOADER_WARM_WORKERS", "1" if warm else "0")
    ds = sbloader.range(64, rows_per_partition=8).map_batches(
        _Counted, concurrency=(2, 2), num_cpus=0.5, fn_constructor_args=(str(tmp_path),))
    loader = ds.to_dataloader(16, shuffle=True, seed=0, persistent_workers=persistent)
    served = []  # per epoch, the pids of the actors that mapped its rows
    for _ in range(3):
        rows, pids = [], set()
        for b in loader:
            rows += b["twice"].tolist()
            pids.update(int(p) for p in b["pid"])
        assert sorted(rows) == [2 * i for i in range(64)]
        served.append(pids)
    constructed = [int(name.split("-")[0]) for name in os.listdir(tmp_path)]
    assert len(constructed) == len(set(constructed)), "an actor constructed its class twice"
    assert set().union(*served) <= set(constructed)
    if persistent or warm:  # the first epoch's actors map the last epoch's rows; no more than the pool's 2, ever
        assert served[0] & served[2], served
        assert len(constructed) <= 2, constructed
    else:  # every epoch its own actors, as torch's non-persistent workers
        assert not (served[0] & served[1]) and not (served[1] & served[2]), served
        assert len(constructed) >= 3, constructed
    del loader  # a persistent loader's actors go with it


@pytest.mark.parametrize("deterministic", [False, True])
def test_resume_mid_epoch_delivers_exactly_the_rest(ray_session, deterministic):
    """state_dict() after k batches, load_state_dict() into a fresh loader: the rest of the epoch
    arrives, nothing consumed comes back, and the next epoch is whole again."""
    def make():
        return (sbloader.range(203, rows_per_partition=16).map_batches(_square)
                .to_dataloader(10, shuffle=True, seed=7, deterministic=deterministic))

    first = make()
    it = iter(first)
    taken = [x for _ in range(7) for x in next(it)["id"].tolist()]
    state = first.state_dict()
    it.close()
    assert state["epoch"] == 0 and (state["done"] or state["partial"])

    resumed = make()
    resumed.load_state_dict(state)
    rest = [x for b in resumed for x in b["id"].tolist()]
    assert len(taken) + len(rest) == 203
    assert sorted(taken + rest) == list(range(203))  # every row once across the two runs
    nxt = [x for b in resumed for x in b["id"].tolist()]  # epoch 1: whole, reshuffled
    assert sorted(nxt) == list(range(203))
    assert np.array_equal(np.sort(nxt), np.arange(203)) and nxt != sorted(nxt)


@pytest.mark.parametrize("n", [100, 98])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_get_equal_batch_counts_every_row_once_and_padding_marked(ray_session, n, drop_last):
    """world_size > 1 without torchrun (rank/world_size given; the ranks in threads): the
    job's pipeline runs once, every rank gets the same number of batches, every row once;
    a rank left without rows in the last round gets a marked repeat (with drop_last the
    rows that cannot fill a batch on every rank are dropped)."""
    import threading

    import torch

    world = 3
    ds = sbloader.range(n, rows_per_partition=10).map_batches(_square)
    name = f"ranks-{n}-{drop_last}"
    out: dict = {}

    def rank_loop(rank: int) -> None:
        loader = ds.to_dataloader(8, shuffle=True, seed=5, rank=rank, world_size=world, drop_last=drop_last,
                                  name=name)
        out[rank] = (list(loader), len(loader))

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(out) == list(range(world))
    seen, pads = [], 0
    counts = [len(out[r][0]) for r in range(world)]
    for rank in range(world):
        batches, length = out[rank]
        assert len(batches) == length
        for b in batches:
            assert torch.equal(b["sq"], b["id"] * b["id"])
            pad = b.get("sbloader_padding")
            keep = ~pad if pad is not None else torch.ones(len(b["id"]), dtype=torch.bool)
            pads += int((~keep).sum())
            seen.extend(b["id"][keep].tolist())
    assert len(set(counts)) == 1
    assert len(seen) == len(set(seen))  # no row twice across ranks
    if drop_last:
        assert counts[0] == n // 24 and len(seen) == 24 * (n // 24) and pads == 0
    else:
        assert counts[0] == n // 24 + 1 and sorted(seen) == list(range(n))
        assert pads == (1 if n == 98 else 0)  # 2 rows left for 3 ranks: one repeat


def test_batches_are_made_ahead_in_a_fetch_thread_that_ends_with_the_iteration(ray_session):
    import threading

    made_in = []

    def collate(batch):
        made_in.append(threading.current_thread().name)
        return dict(batch)

    def fetch_threads():
        return {t for t in threading.enumerate() if t.name == "sbloader-fetch" and t.is_alive()}

    # an earlier test's iterator, dropped without close, may still be ending on the closer thread
    before = fetch_threads()
    loader = sbloader.range(64, rows_per_partition=8).to_dataloader(8, collate_fn=collate)
    it = iter(loader)
    first = next(it)
    assert len(first["id"]) == 8
    assert made_in and all(name == "sbloader-fetch" for name in made_in)
    ours = fetch_threads() - before
    assert len(ours) == 1
    next(it)
    it.close()  # the training loop breaks out early
    assert not [t for t in ours if t.is_alive()]
    from sbloader.core import ledger

    state = loader.state_dict()  # what the loop took, not what the thread made ahead
    assert sum(state["partial"].values()) + 8 * len(ledger.to_positions(state["done"])) == 16


def _epoch_ids(it) -> list:
    return [int(i) for b in it for i in b["id"].tolist()]


def test_the_next_epoch_begun_ahead_is_the_one_iter_gives_and_the_state_waits_for_it(ray_session):
    """``start_ahead()`` (a mixture's source near the end of its epoch, sbloader/loaders/epoch_ahead.py):
    the next epoch begins on a background thread while the last batches are read; ``state_dict()``
    stays this epoch's; the next ``iter()`` returns that epoch, the rows and states those of a loader
    that never began ahead. A state loaded or an epoch set drops it (its rows never delivered)."""
    ds = sbloader.from_items([{"id": i} for i in range(40)], num_partitions=4).map_batches(_square)

    def make():
        return ds.to_dataloader(8, shuffle=True, seed=3, deterministic=True)  # as a mixture reads its sources

    plain = make()
    expect = [_epoch_ids(iter(plain)) for _ in range(3)]
    end_state = plain.state_dict()
    loader = make()
    it = iter(loader)
    head = [next(it) for _ in range(4)]
    before = loader.state_dict()
    assert loader.start_ahead() is True and loader.start_ahead() is False  # one epoch ahead at a time
    assert loader.state_dict() == before
    ahead = loader._ahead.take()
    rest = list(it)
    assert [int(i) for b in head + rest for i in b["id"].tolist()] == expect[0]
    nxt = iter(loader)
    assert nxt is ahead, "iter() gives the epoch begun ahead"
    assert _epoch_ids(nxt) == expect[1]
    assert loader.start_ahead() is True  # between epochs too: the one after the epoch just read
    assert _epoch_ids(iter(loader)) == expect[2]
    assert loader.state_dict() == end_state

    loader = make()
    it = iter(loader)
    first = next(it)["id"].tolist()
    saved = loader.state_dict()
    assert loader.start_ahead() is True
    loader.load_state_dict(saved)  # drops the epoch begun ahead: the rest of epoch 0 comes, then epoch 1
    assert loader._ahead is None
    assert first + _epoch_ids(iter(loader)) == expect[0]
    assert _epoch_ids(iter(loader)) == expect[1]
    assert loader.start_ahead() is True
    loader.set_epoch(2)
    assert _epoch_ids(iter(loader)) == expect[2]


def test_a_pool_stage_never_begins_ahead(ray_session, tmp_path):
    """Two epochs of one loader side by side would share a pool's actors: a callable-class stage keeps
    one epoch at a time."""
    ds = sbloader.from_items([{"id": i} for i in range(16)], num_partitions=2).map_batches(
        _Counted, fn_constructor_args=(str(tmp_path),), concurrency=1)
    loader = ds.to_dataloader(8, seed=0)
    it = iter(loader)
    next(it)
    assert loader.start_ahead() is False
    assert len(list(it)) == 1
