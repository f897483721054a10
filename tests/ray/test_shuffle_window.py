"""The shuffle window as a memory budget (issue #39): label-sorted Parquet, videos and
WebDataset shards mix like torch's shuffle when they fit the default window, on 1 and
2 ranks, every epoch and after a mid-epoch resume; a dataset larger than a small
budget mixes as widely as it allows, says so once, and holds no more than its budget
(counted bytes, not timings). The pure parts are in ``tests/unit/test_window.py``."""
from __future__ import annotations

import itertools
import json
import warnings

import numpy as np
import pytest

import sbloader
from test_shuffle import run_ranks

_NAMES = itertools.count()


def torch_distinct(labels: np.ndarray, batch: int, world_size: int = 1, epochs: int = 2) -> float:
    """Mean distinct labels per batch of torch's DataLoader(shuffle=True) (DistributedSampler per rank)."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    out = []
    for rank in range(world_size):
        sampler = DistributedSampler(labels, num_replicas=world_size, rank=rank, seed=0) if world_size > 1 else None
        loader = DataLoader(labels, batch_size=batch, shuffle=sampler is None, sampler=sampler,
                            generator=torch.Generator().manual_seed(0))
        for e in range(epochs):
            if sampler is not None:
                sampler.set_epoch(e)
            out += [len(set(b.tolist())) for b in loader]
    return float(np.mean(out))


def _parquet(path, groups: int, rows: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    labels = np.repeat(np.arange(groups), rows)  # one label per row group: the hardest case
    pq.write_table(pa.table({"label": labels, "x": np.arange(len(labels))}), path, row_group_size=rows)
    return str(path)


def _video_ids(batch: dict) -> dict:
    import os

    label = np.array([int(os.path.basename(p).split("_")[1].split(".")[0]) for p in batch["path"]])
    return {"label": label, "x": label * 1000 + np.asarray(batch["frame_index"])}


def _shard_ids(batch: dict) -> dict:
    cls = np.asarray(batch["cls"])
    return {"label": cls // 1000, "x": cls}


@pytest.fixture(scope="module")
def sorted_data(tmp_path_factory) -> dict:
    """Label-sorted datasets that fit the default window: (make dataset, labels per row, batch size)."""
    from sbloader.datagen import write_video_folder
    from wds_shards import write_shards

    root = tmp_path_factory.mktemp("sorted39")
    p10 = _parquet(root / "g10.parquet", 10, 256)
    p100 = _parquet(root / "g100.parquet", 100, 64)
    vids = write_video_folder(str(root / "videos"), 10, frames=64, width=16, height=16, gop_size=16)
    shards = write_shards(str(root / "shards"), shards=10, per_shard=64, images=False)
    return {
        "parquet 10x256": (lambda: sbloader.read_parquet(p10), np.repeat(np.arange(10), 256), 64),
        "parquet 100x64": (lambda: sbloader.read_parquet(p100), np.repeat(np.arange(100), 64), 64),
        "videos by class": (lambda: sbloader.read_videos(vids, frames_per_partition=16).map_batches(_video_ids),
                            np.repeat(np.arange(10), 64), 32),
        "label-sorted shards": (lambda: sbloader.read_webdataset(shards, samples_per_partition=16)
                                .map_batches(_shard_ids), np.repeat(np.arange(10), 64), 32),
    }


def _ids(labels: np.ndarray, kind: str) -> list:
    if kind.startswith("parquet"):
        return list(range(len(labels)))
    per = int(np.bincount(labels)[0])
    return sorted(int(lab) * 1000 + i for lab in range(labels.max() + 1) for i in range(per))


@pytest.mark.parametrize("kind", ["parquet 10x256", "parquet 100x64", "videos by class", "label-sorted shards"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_label_sorted_data_that_fits_mixes_like_torch_every_epoch(ray_session, sorted_data, kind, world_size):
    make, labels, batch = sorted_data[kind]
    name = f"w39-{next(_NAMES)}"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # it fits: no warning
        # deterministic: the mix is the plan's, not the order blocks happened to arrive in on a busy machine
        out = run_ranks(lambda r: make().to_dataloader(batch, shuffle=True, seed=0, rank=r, world_size=world_size,
                                                       name=name, deterministic=True), world_size)
    want = torch_distinct(labels, batch, world_size)
    for e in range(2):
        distinct = [len(set(lab.tolist())) for batches in out.values() for lab, _, _ in batches[e]]
        assert np.mean(distinct) >= 0.95 * want, (kind, e, np.mean(distinct), want)
        xs = np.concatenate([x[~pad] for batches in out.values() for _, x, pad in batches[e]])
        assert sorted(xs.tolist()) == _ids(labels, kind)  # every sample once per epoch


@pytest.mark.parametrize("world_size,new_world_size", [(1, 1), (2, 1)])
def test_after_a_mid_epoch_resume_the_rest_mixes_like_torch(ray_session, sorted_data, world_size, new_world_size):
    make, labels, batch = sorted_data["parquet 10x256"]
    name = f"w39r-{next(_NAMES)}"
    head: dict = {}

    def first(rank: int):
        loader = make().to_dataloader(batch, shuffle=True, seed=3, rank=rank, world_size=world_size,
                                      name=name + "a", deterministic=True)
        it = iter(loader)
        head[rank] = [next(it) for _ in range(5)]
        head[rank] = ([(b["label"].numpy(), b["x"].numpy()) for b in head[rank]],
                      json.loads(json.dumps(loader.state_dict())))
        return loader

    import threading

    threads = [threading.Thread(target=first, args=(r,)) for r in range(world_size)]
    [t.start() for t in threads]
    [t.join(240) for t in threads]
    state = head[0][1]
    out: dict = {}

    def second(rank: int):
        loader = make().to_dataloader(batch, shuffle=True, seed=3, rank=rank, world_size=new_world_size,
                                      name=name + "b", deterministic=True)
        loader.load_state_dict(state)
        out[rank] = [(b["label"].numpy(), b["x"].numpy()) for b in loader]

    threads = [threading.Thread(target=second, args=(r,)) for r in range(new_world_size)]
    [t.start() for t in threads]
    [t.join(240) for t in threads]
    rest = [b for r in out for b in out[r]]
    done = [b for r in head for b in head[r][0]]
    assert sorted(np.concatenate([x for _, x in done + rest]).tolist()) == list(range(len(labels)))
    distinct = [len(set(lab.tolist())) for lab, x in rest if len(x) == batch]
    assert np.mean(distinct) >= 0.95 * torch_distinct(labels, batch), np.mean(distinct)


def test_data_larger_than_a_small_budget_mixes_as_it_allows_and_says_so(ray_session, sorted_data):
    """100 row groups of 64 rows (one label each), a budget whose half holds ~12 of their blocks."""
    make, labels, batch = sorted_data["parquet 100x64"]
    block = 64 * 3 * 8  # label, x and the row column: int64
    budget = 24 * block + 4096
    ds = make()
    loader = ds.to_dataloader(batch, shuffle=True, seed=0, memory_budget=budget)
    with pytest.warns(UserWarning, match=r"shuffle window: a batch drew from at most \d+ of 100 partitions") as got:
        first = [(b["label"].numpy(), b["x"].numpy()) for b in loader]
    assert sum("shuffle_window" in str(w.message) for w in got) == 1
    st = loader.stats()
    assert "of 100 partitions" in st.shuffle_note and "shuffle_window" in st.shuffle_note
    assert st.shuffle_note in str(st)  # the one line of stats()
    assert 0 < st.peak_held_bytes <= st.memory_budget == budget  # counted, not timed
    assert (st.operators[0].rows, st.operators[0].blocks) == (6400, 100)  # every row group read once
    widest = int(st.shuffle_note.split("at most ")[1].split(" ")[0])
    assert 8 < widest <= 16  # wider than the old 8, within half the budget (+ the blocks a batch needs)
    distinct = [len(set(lab.tolist())) for lab, _ in first]
    assert 8 < np.mean(distinct) <= widest  # mixes as widely as the budget allows
    assert sorted(np.concatenate([x for _, x in first]).tolist()) == list(range(len(labels)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # once per dataset: the second epoch is quiet
        second = ds.to_dataloader(batch, shuffle=True, seed=1, memory_budget=budget)
        assert sum(len(x) for x in (b["x"] for b in second)) == len(labels)
    assert second.stats().shuffle_note
