"""shuffle=True mixes the whole dataset in every native pipeline (issue #17).

The statistical checks against torch's DataLoader on class-sorted data (fixed
seeds, no timing), in one process and split over two ranks, and exactly-once
resumes. The pure parts (the epoch's members, the cut plan, the consumed ledger,
over grids) are in ``tests/unit/test_cut.py``.
"""
from __future__ import annotations

import itertools
import json
import os
import threading

import numpy as np
import pytest

import sbloader

CLASSES = 10
PER_CLASS = 128
BATCH = 64


# ----- the data ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def class_folder(tmp_path_factory) -> str:
    from PIL import Image

    root = tmp_path_factory.mktemp("classes")
    for c in range(CLASSES):
        d = root / f"class{c}"
        d.mkdir()
        for i in range(PER_CLASS):
            Image.new("RGB", (4, 4), (c * 20, i, 0)).save(d / f"{i:03d}.jpg")
    return str(root)


@pytest.fixture(scope="module")
def sorted_parquet(tmp_path_factory) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path_factory.mktemp("sorted") / "sorted.parquet"
    labels = np.repeat(np.arange(CLASSES), PER_CLASS)
    pq.write_table(pa.table({"label": labels, "x": np.arange(len(labels))}), path, row_group_size=256)
    return str(path)


def label_from_path(batch: dict) -> dict:
    return {"label": np.array([int(os.path.basename(os.path.dirname(p))[5:]) for p in batch["path"]]),
            "x": np.array([int(os.path.basename(os.path.dirname(p))[5:]) * PER_CLASS
                           + int(os.path.basename(p)[:3]) for p in batch["path"]])}


def torch_distinct(labels: np.ndarray, world_size: int = 1, epochs: int = 2) -> float:
    """Mean distinct labels per batch of torch's DataLoader(shuffle=True) (DistributedSampler per rank)."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    out = []
    for rank in range(world_size):
        if world_size == 1:
            loader = DataLoader(labels, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
        else:
            sampler = DistributedSampler(labels, num_replicas=world_size, rank=rank, seed=0)
            loader = DataLoader(labels, batch_size=BATCH, sampler=sampler)
        for e in range(epochs):
            if world_size > 1:
                sampler.set_epoch(e)
            out += [len(set(b.tolist())) for b in loader]
    return float(np.mean(out))


def run_ranks(make_loader, world_size: int, epochs: int = 2) -> dict:
    """Every rank's batches (label and x arrays) per epoch, the ranks in threads."""
    out: dict = {}
    errors: list = []

    def go(rank: int) -> None:
        try:
            loader = make_loader(rank)
            out[rank] = []
            for e in range(epochs):
                loader.set_epoch(e)
                out[rank].append([(np.asarray(b["label"]), np.asarray(b["x"]),
                                   np.asarray(b.get("sbloader_padding", np.zeros(len(b["x"]), bool))))
                                  for b in loader])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


_NAMES = itertools.count()


def check_mixing(make_dataset, world_size: int) -> None:
    labels = np.repeat(np.arange(CLASSES), PER_CLASS)
    name = f"mix{next(_NAMES)}"
    out = run_ranks(lambda r: make_dataset().to_dataloader(BATCH, shuffle=True, seed=0, rank=r,
                                                           world_size=world_size, name=name), world_size)
    distinct = [len(set(lab.tolist())) for batches in out.values() for epoch in batches for lab, _, _ in epoch]
    assert np.mean(distinct) >= 0.95 * torch_distinct(labels, world_size), np.mean(distinct)
    for e in range(2):  # every sample once per epoch, across ranks
        xs = np.concatenate([x[~pad] for batches in out.values() for _, x, pad in batches[e]])
        assert sorted(xs.tolist()) == list(range(CLASSES * PER_CLASS))
    first = {frozenset(x.tolist()) for batches in out.values() for _, x, _ in batches[0]}
    second = {frozenset(x.tolist()) for batches in out.values() for _, x, _ in batches[1]}
    assert not first & second, "a batch composition repeated from one epoch to the next"


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_class_sorted_image_folder_mixes_like_torch(ray_session, class_folder, world_size) -> None:
    check_mixing(lambda: sbloader.read_images(class_folder, decode=False).map_batches(label_from_path), world_size)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_label_sorted_parquet_file_mixes_like_torch(ray_session, sorted_parquet, world_size) -> None:
    check_mixing(lambda: sbloader.read_parquet(sorted_parquet), world_size)


def test_iter_batches_and_the_torch_dataset_mix_too(ray_session, sorted_parquet, class_folder) -> None:
    ds = sbloader.read_parquet(sorted_parquet)
    distinct = [len(set(b["label"].tolist())) for b in ds.iter_batches(BATCH, shuffle=True, seed=0)]
    assert np.mean(distinct) >= 0.95 * torch_distinct(np.repeat(np.arange(CLASSES), PER_CLASS))
    it = ds.to_torch_dataset(BATCH, shuffle=True, seed=1)
    assert np.mean([len(set(b["label"].tolist())) for b in it]) >= 9.4
    images = sbloader.read_images(class_folder, decode=False).map_batches(label_from_path)
    assert np.mean([len(set(b["label"].tolist())) for b in images.iter_batches(BATCH, shuffle=True, seed=0)]) >= 9.4


def test_without_shuffle_the_listing_order_is_kept(ray_session, class_folder, sorted_parquet) -> None:
    paths = [p for b in sbloader.read_images(class_folder, decode=False).iter_batches(100, deterministic=True)
             for p in b["path"]]
    assert paths == sorted(paths)
    loader = sbloader.read_parquet(sorted_parquet).to_dataloader(BATCH, deterministic=True)
    assert np.concatenate([b["x"].numpy() for b in loader]).tolist() == list(range(CLASSES * PER_CLASS))


def test_the_shuffle_window_is_validated(ray_session, sorted_parquet) -> None:
    ds = sbloader.read_parquet(sorted_parquet)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="shuffle_window"):
            ds.to_dataloader(BATCH, shuffle=True, shuffle_window=bad)
    for bad in ("0 rows", "ten rows", "5 parsecs", 1.0):
        with pytest.raises(ValueError, match="shuffle_window"):
            ds.to_dataloader(BATCH, shuffle=True, shuffle_window=bad)
    from sbloader.core.window import DEFAULT_SHARE, WindowSpec

    assert ds.to_dataloader(BATCH, shuffle=True).shuffle_window == WindowSpec(share=DEFAULT_SHARE)
    assert ds.to_dataloader(BATCH, shuffle=True, shuffle_window=3).shuffle_window == WindowSpec(partitions=3)
    assert ds.to_dataloader(BATCH, shuffle=True, shuffle_window="2 MiB").shuffle_window == WindowSpec(bytes=2**20 * 2)
    assert ds.to_dataloader(BATCH, shuffle=True, shuffle_window="500 rows").shuffle_window == WindowSpec(rows=500)
    assert sbloader.from_items(list(range(10))).to_dataloader(2).shuffle_window == WindowSpec(partitions=1)


# ----- exactly once across a resume --------------------------------------------------------


def _take(loader, n: int) -> list:
    out = []
    for b in loader:
        out.append(b["x"].numpy()[~b.get("sbloader_padding", np.zeros(len(b["x"]), bool)).numpy()]
                   if "sbloader_padding" in b else b["x"].numpy())
        if len(out) == n:
            break
    return out


@pytest.mark.parametrize("source", ["parquet", "images"])
def test_a_mid_epoch_resume_in_one_process_is_exactly_once_and_in_the_same_order(
        ray_session, sorted_parquet, class_folder, source) -> None:
    def make():
        if source == "parquet":
            ds = sbloader.read_parquet(sorted_parquet)
        else:
            ds = sbloader.read_images(class_folder, decode=False).map_batches(label_from_path)
        return ds.to_dataloader(BATCH, shuffle=True, seed=4, deterministic=True)

    whole = [b["x"].numpy() for b in make()]
    first = make()
    head = _take(first, 7)
    state = json.loads(json.dumps(first.state_dict()))
    second = make()
    second.load_state_dict(state)
    rest = [b["x"].numpy() for b in second]
    assert [h.tolist() for h in head + rest] == [w.tolist() for w in whole]


@pytest.mark.parametrize("world_size,new_world_size", [(2, 2), (2, 1), (1, 2)])
def test_a_mid_epoch_resume_across_world_sizes_is_exactly_once(ray_session, sorted_parquet, world_size,
                                                               new_world_size) -> None:
    name = f"resume{next(_NAMES)}"

    def make(rank: int, ws: int, suffix: str):
        return sbloader.read_parquet(sorted_parquet).to_dataloader(
            BATCH, shuffle=True, seed=2, rank=rank, world_size=ws, name=name + suffix, deterministic=True)

    states: dict = {}
    seen: list = []
    lock = threading.Lock()

    def first(rank: int):
        loader = make(rank, world_size, "a")
        head = _take(loader, 3)
        with lock:
            seen.extend(np.concatenate(head).tolist())
            states[rank] = json.loads(json.dumps(loader.state_dict()))
        return loader

    errors: list = []

    def wrap(fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(first, r)) for r in range(world_size)]
    [t.start() for t in threads]
    [t.join(240) for t in threads]
    assert not errors, errors
    assert all(states[r] == states[0] for r in states)  # every rank at the same step records the same

    def second(rank: int):
        loader = make(rank, new_world_size, "b")
        loader.load_state_dict(states[0])
        got = []
        for b in loader:
            x = b["x"].numpy()
            if "sbloader_padding" in b:
                x = x[~b["sbloader_padding"].numpy()]
            got.append(x)
        with lock:
            seen.extend(np.concatenate(got).tolist() if got else [])

    threads = [threading.Thread(target=wrap, args=(second, r)) for r in range(new_world_size)]
    [t.start() for t in threads]
    [t.join(240) for t in threads]
    assert not errors, errors
    assert sorted(seen) == list(range(CLASSES * PER_CLASS))


def test_a_version_1_state_loads_unshuffled_and_is_refused_shuffled(ray_session, sorted_parquet) -> None:
    ds = sbloader.read_parquet(sorted_parquet)
    plain = ds.to_dataloader(BATCH, deterministic=True)
    v1 = {"format": "sbloader.PipelineLoader", "version": 1, "fingerprint": plain._fingerprint(), "epoch": 0,
          "epoch_seed": 123, "done": [[0, 2]], "partial": {"2": 10}}
    plain.load_state_dict(v1)
    rest = np.concatenate([b["x"].numpy() for b in plain])
    assert rest.tolist() == list(range(2 * 256 + 10, CLASSES * PER_CLASS))
    shuffled = ds.to_dataloader(BATCH, shuffle=True)
    v1s = dict(v1, fingerprint=shuffled._fingerprint())
    with pytest.raises(sbloader.StateDictError, match="found 1, expected 2"):
        shuffled.load_state_dict(v1s)
