"""shuffle=True mixes the whole dataset in every native pipeline (issue #17).

Pure parts first (the epoch's members, the cut plan, the consumed ledger, over
grids), then the statistical checks against torch's DataLoader on class-sorted
data (fixed seeds, no timing), in one process and split over two ranks, and
exactly-once resumes.
"""
from __future__ import annotations

import itertools
import json
import os
import threading

import numpy as np
import pytest

import sbloader
from sbloader.core.cut import Cutter, consumed_after, cut_plan, last_use, progress
from sbloader.core.plan import cut_counts, cut_members, make_epoch_plan, member_positions

CLASSES = 10
PER_CLASS = 128
BATCH = 64


# ----- pure: the epoch's members ------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 65, 1000])
@pytest.mark.parametrize("seed", [0, 1, 2**62 + 7])
def test_members_are_a_permutation_drawn_from_the_epoch_seed(n: int, seed: int) -> None:
    a = member_positions(n, seed, True)
    assert sorted(a.tolist()) == list(range(n))
    assert np.array_equal(a, member_positions(n, seed, True))
    assert np.array_equal(member_positions(n, seed, False), np.arange(n))
    if n >= 64:
        assert not np.array_equal(a, member_positions(n, seed + 1, True))
        assert not np.array_equal(a, np.arange(n))


@pytest.mark.parametrize("n,per", [(0, 1), (1, 1), (10, 3), (64, 64), (65, 64), (1000, 7)])
def test_cut_members_covers_every_place_once_in_runs(n: int, per: int) -> None:
    chunks = cut_members(member_positions(n, 5, True), per)
    assert [len(c) for c in chunks[:-1]] == [per] * (len(chunks) - 1) if chunks else n == 0
    assert sorted(np.concatenate(chunks).tolist() if chunks else []) == list(range(n))


def test_a_class_sorted_listing_is_mixed_in_every_partition() -> None:
    labels = np.repeat(np.arange(CLASSES), PER_CLASS)
    for seed in range(5):
        for chunk in cut_members(member_positions(len(labels), seed, True), 64):
            assert len(set(labels[chunk].tolist())) >= 7


# ----- pure: the cut --------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 3])
def test_cut_counts_draw_without_replacement_deterministically(seed: int) -> None:
    for remaining, rows in [([5, 0, 7], 12), ([100], 30), ([3, 3, 3, 3], 5), ([1, 1], 1)]:
        c = cut_counts(remaining, rows, seed, 4)
        assert c.sum() == rows and (c <= np.asarray(remaining)).all() and (c >= 0).all()
        assert np.array_equal(c, cut_counts(remaining, rows, seed, 4))
    with pytest.raises(ValueError, match="cannot take"):
        cut_counts([2, 2], 5, 0, 0)


def _rows_grid() -> list[list[int]]:
    return [[64] * 5, [256, 256, 1, 0, 100], [3], [10] * 37, [1000], [0, 0, 7], [5, 9, 2, 64, 64, 64, 13]]


@pytest.mark.parametrize("rows", _rows_grid())
@pytest.mark.parametrize("batch_size", [1, 7, 64])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("window", [1, 4, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_cut_plan_takes_every_row_once_with_equal_counts(rows, batch_size, world_size, window, drop_last) -> None:
    plan = cut_plan(rows, batch_size, world_size, drop_last, window, epoch_seed=11)
    taken = {i: [] for i in range(len(rows))}
    for b in plan.batches:
        assert b.rank == b.index % world_size
        assert b.rows <= batch_size
        for p in b.pieces:
            taken[p.key].append((p.start, p.stop))
    for i, n in enumerate(rows):
        ranges = sorted(taken[i])
        covered = sum(b - a for a, b in ranges)
        assert all(a == prev_b for (a, _), (_, prev_b) in zip(ranges[1:], ranges))  # a prefix, in order
        if not drop_last:
            assert covered == n
    assert sum(b.rows for b in plan.batches) + plan.dropped == sum(rows)
    counts = [len(plan.for_rank(r)) for r in range(world_size)]
    assert counts == [plan.per_rank] * world_size
    assert plan == cut_plan(rows, batch_size, world_size, drop_last, window, epoch_seed=11)


def test_a_window_draws_each_batch_from_every_open_partition() -> None:
    plan = cut_plan([256] * 5, 64, 1, False, 8, epoch_seed=1)
    assert all(len(b.pieces) == 5 for b in plan.batches[:-2])
    in_turn = cut_plan([256] * 5, 64, 1, False, 1, epoch_seed=1)
    assert all(len(b.pieces) == 1 for b in in_turn.batches)


@pytest.mark.parametrize("world_size,new_world_size", [(1, 1), (2, 2), (2, 3), (3, 1), (4, 2)])
@pytest.mark.parametrize("window", [1, 8])
def test_consumed_after_k_then_replanning_the_rest_takes_every_row_once(world_size, new_world_size, window) -> None:
    rows = [64, 64, 30, 100, 64, 7, 64, 64]
    plan = cut_plan(rows, 16, world_size, False, window, epoch_seed=3)
    for k in range(plan.per_rank + 1):
        done = consumed_after(plan, k)
        assert all(0 <= n <= rows[key] for key, n in done.items())
        left = [rows[i] - done.get(i, 0) for i in range(len(rows))]
        again = cut_plan(left, 16, new_world_size, False, window, epoch_seed=3, first_index=k * world_size)
        seen = {i: done.get(i, 0) for i in range(len(rows))}
        for b in again.batches:
            for p in b.pieces:
                seen[p.key] += p.rows
        assert seen == dict(enumerate(rows))


def test_a_resumed_cut_continues_the_uninterrupted_one() -> None:
    rows = [256] * 5
    whole = cut_plan(rows, 64, 1, False, 8, epoch_seed=9)
    k = 7
    done = consumed_after(whole, k)
    rest = cut_plan([rows[i] - done.get(i, 0) for i in range(5)], 64, 1, False, 8, epoch_seed=9, first_index=k)

    def absolute(plan, offsets):
        return [tuple((p.key, offsets.get(p.key, 0) + p.start, offsets.get(p.key, 0) + p.stop) for p in b.pieces)
                for b in plan.batches]

    assert absolute(rest, done) == absolute(whole, {})[k:]


def test_last_use_and_progress_release_a_partition_once_every_rank_is_past_it() -> None:
    plan = cut_plan([64] * 6, 32, 2, False, 2, epoch_seed=0)
    uses = last_use(plan)
    assert set(uses) == set(range(6))
    assert progress([0, 0]) == 0 and progress([1, 0]) == 1 and progress([1, 1]) == 2 and progress([3, 1]) == 3
    assert max(uses.values()) == len(plan.batches) - 1


def test_the_cutter_cuts_in_turn_with_a_window_of_one() -> None:
    c = Cutter(1, 0)
    c.add("a", 5)
    c.add("b", 5)
    assert [(p.key, p.start, p.stop) for p in c.cut(7)] == [("a", 0, 5), ("b", 0, 2)]
    assert [(p.key, p.start, p.stop) for p in c.cut(3)] == [("b", 2, 5)]


def test_the_plan_does_not_depend_on_the_world_size() -> None:
    """The epoch's members and order come from the epoch seed only (there is no world size to give)."""
    for seed in (0, 7):
        ids = [c.tolist() for c in cut_members(member_positions(500, seed, True), 64)]
        assert ids == [c.tolist() for c in cut_members(member_positions(500, seed, True), 64)]
        order = make_epoch_plan(range(len(ids)), 0, seed, True).order
        assert order == make_epoch_plan(range(len(ids)), 0, seed, True).order


# ----- state size ---------------------------------------------------------------------------


def test_the_state_of_a_million_sample_shuffled_epoch_stays_small() -> None:
    from sbloader.loaders.pipeline_run import PipelineRun
    from sbloader.loaders.pipeline_state import make_state

    ds = sbloader.range(1_000_000, rows_per_partition=64)
    loader = ds.to_dataloader(64, shuffle=True, seed=0)
    plan = ds.plan(epoch=0, seed=0, shuffle=True)
    rng = np.random.default_rng(0)
    half = len(plan.order) // 2
    # consumed roughly in plan order: the first half, with a few holes still in flight
    holes = set(rng.choice(half, 16, replace=False).tolist())
    run = PipelineRun(0, plan.epoch_seed, order=plan.order, batches=half)
    run.done = {plan.order[i] for i in range(half) if i not in holes}
    run.taken = {plan.order[i]: 10 for i in holes}
    state = make_state(loader._fingerprint(), 0, run)
    assert len(json.dumps(state)) <= 64 * 1024
    assert len(state["done"]) <= 17


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
    assert ds.to_dataloader(BATCH, shuffle=True).shuffle_window == 8
    assert sbloader.from_items(list(range(10))).to_dataloader(2).shuffle_window == 1


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
