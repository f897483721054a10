"""The drop-in keeps torch's DataLoader contract where torch's own tests check it (issue #30).

One test per behaviour, each comparing ``sbloader.DataLoader`` with what torch's
``DataLoader`` does with the same arguments (or, where a cluster cannot match it,
with the documented difference). Everything used in the remote workers is defined
at module level (conftest puts tests/ on the workers' PYTHONPATH).
"""
from __future__ import annotations

import gc
import os
import threading
import time
import warnings
from typing import List

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset

import sbloader

TorchDataLoader = torch.utils.data.DataLoader


class Ids(Dataset):
    """``dataset[i] == i``."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class FailsOnMultiplesOf(Ids):
    """``dataset[i]`` raises ``IndexError`` for every multiple of ``k``."""

    def __init__(self, n: int, k: int) -> None:
        super().__init__(n)
        self.k = k

    def __getitem__(self, i: int) -> int:
        if i % self.k == 0:
            raise IndexError(f"sample {i} is broken")
        return i


class SeedOf(Ids):
    """``dataset[i]``: ``torch.initial_seed()`` and a draw from torch's RNG, where the sample is made."""

    def __getitem__(self, i: int) -> tuple:
        return torch.initial_seed(), float(torch.rand(1))


def seed_12345(worker_id: int) -> None:
    torch.manual_seed(12345)


def broken_init(worker_id: int) -> None:
    raise ValueError(f"no config for worker {worker_id}")


def flat_ids(batches) -> list:
    return [int(i) for b in batches for i in b]


# ----- 1. an explicit DistributedSampler is followed, never split again ---------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_explicit_distributed_sampler_shards_outside_torchrun(ray_session, num_workers):
    """Four loaders sharded by hand (num_replicas=4, rank=i) see the dataset once together, each its
    sampler's shard exactly, as torch's loaders do."""
    ds = Ids(32)
    seen = []
    for rank in range(4):
        sampler = DistributedSampler(ds, num_replicas=4, rank=rank, shuffle=True, seed=7)
        sampler.set_epoch(3)
        ours = flat_ids(sbloader.DataLoader(ds, batch_size=3, sampler=sampler, num_workers=num_workers))
        theirs = flat_ids(TorchDataLoader(ds, batch_size=3, sampler=sampler))
        assert ours == theirs == list(sampler), f"rank {rank}: {ours} vs torch {theirs}"
        seen += ours
    assert sorted(seen) == list(range(32)), f"{len(seen)} seen, {len(set(seen))} unique"


def test_distributed_sampler_of_another_world_under_torchrun(ray_session):
    """In a job of world size 2, a sampler sharded for 4 replicas is followed as is (no second split)."""
    ds = Ids(32)
    sampler = DistributedSampler(ds, num_replicas=4, rank=3, shuffle=False)
    lo = sbloader.DataLoader(ds, batch_size=4, sampler=sampler, rank=1, world_size=2, job_id="contract-1")
    assert lo.split is False
    assert len(lo) == 2
    assert flat_ids(lo) == list(range(3, 32, 4))


# ----- 2. an error in __getitem__ is that batch's; the next batch follows ------------------------------


def _errors_and_batches(loader) -> tuple[int, list]:
    errors, batches = 0, []
    it = iter(loader)
    while True:
        try:
            batches.append(next(it))
        except StopIteration:
            return errors, batches
        except IndexError as e:
            assert "is broken" in str(e), str(e)
            errors += 1
        if errors + len(batches) > 1000:
            raise AssertionError("the iterator does not end")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_getitem_error_raises_for_its_batch_and_iteration_goes_on(ray_session, num_workers):
    ds = FailsOnMultiplesOf(40, 7)  # 0, 7, 14, 21, 28, 35: 6 of 20 batches of 2 fail
    errors, batches = _errors_and_batches(sbloader.DataLoader(ds, batch_size=2, num_workers=num_workers))
    t_errors, t_batches = _errors_and_batches(TorchDataLoader(ds, batch_size=2))
    assert (errors, flat_ids(batches)) == (t_errors, flat_ids(t_batches)) == (6, flat_ids(t_batches))
