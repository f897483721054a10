"""Whether ``sbloader.DataLoader`` splits epochs across ranks (world size above 1).

Pure construction under a faked world (``rank=``/``world_size=`` overrides, or
torchrun's variables in the environment): no Ray is started, which the
``no_ray`` fixture enforces (every way to start or join Ray raises).

A loader the coordinator can split safely (no sampler, or torch's RandomSampler,
SequentialSampler, DistributedSampler) splits by default; anything else must say
``split=`` or the constructor raises, naming what it found and only the choices
that work for it (a batch_sampler: split=False only). An IterableDataset without
``split=`` is iterated by every rank, as under torch (split=False), with one info line.
"""
from __future__ import annotations

import pytest
from torch.utils.data import (BatchSampler, Dataset, DistributedSampler, IterableDataset, RandomSampler, Sampler,
                              SequentialSampler)

import sbloader
import sbloader.runtime.session
import sbloader.loaders.dataloader


class Squares(Dataset):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> int:
        return i * i


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(20))


class EveryOther(Sampler):
    """A user's sampler: not one the coordinator knows how to split."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self) -> int:
        return (self.n + 1) // 2


class MyRandomSampler(RandomSampler):
    """A subclass of a known sampler may change its order: custom too."""


class PairBatches(Sampler):
    def __iter__(self):
        return iter([[i, i + 1] for i in range(0, 20, 2)])

    def __len__(self) -> int:
        return 10


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Construction must not start (or join) Ray: every entry point raises."""
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("DataLoader construction tried to start Ray")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(sbloader.runtime.session, "ensure_initialized", refuse)
    if hasattr(sbloader.loaders.dataloader, "ensure_initialized"):
        monkeypatch.setattr(sbloader.loaders.dataloader, "ensure_initialized", refuse)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def loader(dataset=None, *, world_size=2, rank=1, **kwargs) -> sbloader.DataLoader:
    return sbloader.DataLoader(Squares() if dataset is None else dataset, rank=rank, world_size=world_size,
                               job_id="test-split-decision", **kwargs)


# ----- what splits by default --------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {},  # no sampler: SequentialSampler
    {"shuffle": True},  # no sampler: RandomSampler
    {"sampler": SequentialSampler(range(20))},
    {"sampler": RandomSampler(range(20))},
    {"sampler": "distributed"},
    {"sampler": "distributed", "shuffle_sampler": False, "batch_size": 4},
    {"batch_size": None},
], ids=["none", "shuffle", "sequential", "random", "distributed", "distributed-batched", "unbatched"])
@pytest.mark.parametrize("world_size", [2, 5])
def test_known_samplers_split_by_default(kwargs, world_size):
    kwargs = dict(kwargs)
    if kwargs.get("sampler") == "distributed":  # the job's own world: the coordinator splits its whole order
        kwargs["sampler"] = DistributedSampler(range(20), num_replicas=world_size, rank=1,
                                               shuffle=kwargs.pop("shuffle_sampler", True))
    lo = loader(world_size=world_size, **kwargs)
    assert lo.split is True, f"{kwargs} at world size {world_size}: split={lo.split}"
    assert lo.world.world_size == world_size and lo.world.rank == 1


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_distributed_sampler_of_another_world_is_followed_not_split(world_size):
    """A DistributedSampler sharded by hand for another world is the split: never a second one."""
    sampler = DistributedSampler(range(20), num_replicas=3, rank=2)
    assert loader(world_size=world_size, rank=0, sampler=sampler).split is False
    if world_size > 1:
        with pytest.raises(ValueError, match=r"num_replicas=3, rank=2 in a job of world size"):
            loader(world_size=world_size, rank=0, sampler=sampler, split=True)


def test_world_of_one_never_splits_and_never_asks():
    assert loader(world_size=1, rank=0).split is False
    assert loader(world_size=1, rank=0, sampler=EveryOther(20)).split is False
    assert loader(Stream(), world_size=1, rank=0).split is False


def test_world_from_torchrun_environment(monkeypatch):
    """No overrides: WORLD_SIZE/RANK as torchrun sets them decide, exactly like the overrides."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    lo = sbloader.DataLoader(Squares(), shuffle=True, job_id="test-split-decision")
    assert (lo.world.world_size, lo.world.rank, lo.split) == (2, 1, True)
    with pytest.raises(ValueError, match=r"custom sampler \(EveryOther\)"):
        sbloader.DataLoader(Squares(), sampler=EveryOther(20), job_id="test-split-decision")


# ----- what must say split= ----------------------------------------------------------


@pytest.mark.parametrize("sampler", [EveryOther(20), MyRandomSampler(range(20))], ids=lambda s: type(s).__name__)
def test_custom_sampler_without_split_raises_naming_it(sampler):
    with pytest.raises(ValueError) as info:
        loader(sampler=sampler)
    msg = str(info.value)
    assert f"custom sampler ({type(sampler).__name__})" in msg, msg
    assert "world size is 2" in msg, msg
    assert "split=True" in msg and "split=False" in msg, msg


@pytest.mark.parametrize("split", [True, False])
def test_custom_sampler_with_split_is_accepted(split):
    lo = loader(sampler=EveryOther(20), split=split)
    assert lo.split is split
    assert lo.sampler is not None and type(lo.sampler) is EveryOther


def test_iterable_dataset_without_split_is_iterated_by_every_rank_as_under_torch(caplog):
    # issue #41: torch's DataLoader accepts it (every rank iterates the dataset, which shards itself by
    # rank); one import swapped must keep working, and one info line says what split=True would give
    import logging

    with caplog.at_level(logging.INFO, logger="sbloader.loaders.dropin_args"):
        assert loader(Stream(), batch_size=4).split is False
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert len(caplog.records) == 1, msg
    assert "IterableDataset" in msg and "world size is 2" in msg and "as under torch (split=False" in msg, msg
    assert "split=True would iterate it once for the job and split its output across ranks" in msg, msg
    # both choices, said explicitly, work
    assert loader(Stream(), batch_size=4, split=False).split is False
    lo = loader(Stream(), batch_size=4, split=True)
    assert lo.split is True
    with pytest.raises(TypeError, match="has no len()"):  # the per-rank count is unknown until the end
        len(lo)
    with pytest.raises(sbloader.core.errors.StateDictError):
        lo.state_dict()
    # the short last batches need rows to cut: no auto-batching is refused
    with pytest.raises(ValueError, match="needs batch_size"):
        loader(Stream(), batch_size=None, split=True)


def test_batch_sampler_without_split_says_split_false_only():
    with pytest.raises(ValueError) as info:
        loader(batch_sampler=PairBatches())
    msg = str(info.value)
    assert "batch_sampler (PairBatches)" in msg and "world size is 2" in msg, msg
    assert "split=False" in msg and "split=True" not in msg, msg
    with pytest.raises(ValueError, match="split=True needs a sampler or an IterableDataset"):
        loader(batch_sampler=PairBatches(), split=True)
    assert loader(batch_sampler=PairBatches(), split=False).split is False
    # torch's own BatchSampler over a known sampler is still a user's batch_sampler
    with pytest.raises(ValueError, match=r"batch_sampler \(BatchSampler\)"):
        loader(batch_sampler=BatchSampler(SequentialSampler(range(20)), 4, False))


def test_split_false_with_known_sampler_is_respected():
    lo = loader(shuffle=True, split=False)
    assert lo.split is False
    assert isinstance(lo.sampler, RandomSampler)


def test_len_of_a_split_loader_is_the_per_rank_count():
    """The split decision shows in len(): 20 rows in batches of 3 over 2 ranks, without Ray."""
    split = loader(batch_size=3)
    whole = loader(batch_size=3, split=False)
    assert len(whole) == 7
    assert len(split) == 4  # 3 full batches each (18 rows), the last 2 rows one short batch each
