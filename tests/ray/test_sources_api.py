"""The in-memory sources (``from_items``, ``range``, ``from_torch``) and the row operators end to end."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import RandomSampler

import sbloader
from sbloader.sources.memory import ItemsSource, RangeSource, TorchSource


class Squares(torch.utils.data.Dataset):
    """A map-style dataset of dict samples: an index, a float vector, a label."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"idx": i, "x": np.full(3, i * i, dtype=np.float32), "label": i % 5}


class Scalars(torch.utils.data.Dataset):
    """A map-style dataset of plain ints (a column ``item``)."""

    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int) -> int:
        return 100 + i


def _read(source, partition):
    """Read one partition as ``Source.read`` would in a task: a dict of columns."""
    return source.reader()(source.shared(), partition)


def _seeded_sampler(ds, seed: int) -> RandomSampler:
    return RandomSampler(ds, generator=torch.Generator().manual_seed(seed))


# ----- from_items / range ------------------------------------------------------


def test_from_items_dicts_become_columns_and_other_items_one_column(ray_session):
    items = [{"a": i, "b": f"s{i}"} for i in range(17)]
    ds = sbloader.from_items(items, num_partitions=4)
    assert ds.num_partitions() == 4 and ds.count() == 17
    rows = list(ds.iter_rows(deterministic=True))
    assert [(int(r["a"]), str(r["b"])) for r in rows] == [(i, f"s{i}") for i in range(17)]

    plain = sbloader.from_items(["x", "y", "z"], num_partitions=2)
    assert [str(r["item"]) for r in plain.iter_rows(deterministic=True)] == ["x", "y", "z"]


def test_range_yields_0_to_n_in_order_with_rows_per_partition(ray_session):
    ds = sbloader.range(37, rows_per_partition=10)
    assert ds.num_partitions() == 4
    assert [int(r["id"]) for r in ds.iter_rows(deterministic=True)] == list(range(37))
    assert sorted(int(r["id"]) for r in ds.iter_rows()) == list(range(37))
    assert list(sbloader.range(0).iter_rows()) == []
    with pytest.raises(ValueError):
        sbloader.range(-1)
    with pytest.raises(ValueError):
        sbloader.range(10, num_partitions=2, rows_per_partition=5)


@pytest.mark.parametrize("make", [
    lambda: sbloader.range(53, num_partitions=6).source,
    lambda: sbloader.from_items([{"v": i * 3} for i in range(53)], num_partitions=6).source,
    lambda: sbloader.from_torch(Squares(53), num_partitions=6).source,
])
def test_partitions_have_stable_ids_and_read_the_same_rows_twice(make):
    src = make()
    parts = src.partitions(0, 11)
    assert [p.id for p in parts] == list(range(6)) and len({p.id for p in parts}) == 6
    assert sum(p.num_rows for p in parts) == 53 == src.num_rows()
    # the same ids in another epoch and under another epoch seed, and from a fresh source
    assert [p.id for p in src.partitions(1, 99)] == [p.id for p in parts]
    assert [p.id for p in make().partitions(0, 11)] == [p.id for p in parts]
    seen = []
    for p in parts:
        a, b, c = _read(src, p), _read(src, p), _read(make(), p)
        assert len(next(iter(a.values()))) == p.num_rows, p
        for col in a:
            assert np.array_equal(a[col], b[col]) and np.array_equal(a[col], c[col]), (p, col)
        seen.append(next(iter(a.values())))
    # partitions cover the input exactly once
    first = np.concatenate(seen)
    assert len(first) == 53 and len({x.tobytes() if isinstance(x, np.ndarray) else x for x in first}) == 53


def test_sources_are_what_the_api_builds():
    assert isinstance(sbloader.range(3).source, RangeSource)
    assert isinstance(sbloader.from_items([1]).source, ItemsSource)
    assert isinstance(sbloader.from_torch(Scalars()).source, TorchSource)


# ----- from_torch ----------------------------------------------------------------


def test_from_torch_reproduces_a_seeded_random_sampler_exactly(ray_session):
    data = Squares(60)
    ds = sbloader.from_torch(data, sampler=_seeded_sampler(data, 1234), num_partitions=7)
    reference = _seeded_sampler(data, 1234)  # the same seed: the same sequence of permutations
    for epoch in range(2):
        expected = [int(i) for i in reference]
        assert sorted(expected) == list(range(60)) and expected != list(range(60))
        got = [int(r["idx"]) for r in ds.iter_rows(epoch=epoch, deterministic=True)]
        assert got == expected, f"epoch {epoch}: rows do not follow the sampler's order"
    # not any permutation: another seed gives another order
    assert [int(i) for i in _seeded_sampler(data, 1235)] != [int(i) for i in _seeded_sampler(data, 1234)]


def test_from_torch_partitions_are_ranges_of_sampler_positions():
    data = Squares(20)
    src = sbloader.from_torch(data, sampler=_seeded_sampler(data, 7), rows_per_partition=6).source
    order = [int(i) for i in _seeded_sampler(data, 7)]
    parts = src.partitions(0, 0)
    assert [p.num_rows for p in parts] == [6, 6, 6, 2]
    assert [int(i) for p in parts for i in _read(src, p)["idx"]] == order
    assert src.partitions(0, 0)[1].payload.tolist() == order[6:12]  # the epoch's order is drawn once


def test_from_torch_dict_samples_become_columns_and_plain_samples_a_column_item(ray_session):
    rows = list(sbloader.from_torch(Squares(9), num_partitions=3).iter_rows(deterministic=True))
    assert [int(r["idx"]) for r in rows] == list(range(9))
    assert [int(r["label"]) for r in rows] == [i % 5 for i in range(9)]
    assert all(np.array_equal(r["x"], np.full(3, i * i, np.float32)) for i, r in enumerate(rows))

    items = [int(r["item"]) for r in sbloader.from_torch(Scalars(), num_partitions=4).iter_rows(deterministic=True)]
    assert items == list(range(100, 123))
    as_item = list(sbloader.from_torch(Squares(4), columns="item", num_partitions=1).iter_rows(deterministic=True))
    assert [r["item"]["idx"] for r in as_item] == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        sbloader.from_torch(Squares(4), columns="bad")
    with pytest.raises(TypeError):
        sbloader.from_torch(iter(range(4)), sampler=range(4))


# ----- map / flat_map / filter / iter_torch_batches -------------------------------


def _with_square(row: dict) -> dict:
    return {"id": row["id"], "sq": row["id"] * row["id"]}


def _twice(row: dict) -> list:
    return [{"id": row["id"], "sq": row["sq"], "copy": 0}, {"id": row["id"], "sq": -row["sq"], "copy": 1}]


def _odd_id(row: dict) -> bool:
    return row["id"] % 2 == 1


def test_map_flat_map_filter_end_to_end(ray_session):
    ds = sbloader.range(40, num_partitions=5).map(_with_square).flat_map(_twice).filter(_odd_id)
    assert ds.num_rows() is None  # unknown before running: flat_map and filter change the count
    rows = [(int(r["id"]), int(r["sq"]), int(r["copy"])) for r in ds.iter_rows(deterministic=True)]
    expected = [(i, s * i * i, c) for i in range(1, 40, 2) for c, s in ((0, 1), (1, -1))]
    assert rows == expected
    assert ds.count() == 40
    # without deterministic order: the same multiset
    assert sorted((int(r["id"]), int(r["sq"])) for r in ds.iter_rows()) == sorted((i, s) for i, s, _ in expected)
    # the three row operators fuse with the read: one stage, whose row count is the output's
    stats = ds.stats()
    assert [o.name for o in stats.operators] == ["ReadRange->Map(_with_square)->FlatMap(_twice)->Filter(_odd_id)"]
    assert (stats.operators[0].rows, stats.operators[0].blocks) == (40, 5)


def test_flat_map_may_yield_nothing_and_filter_may_drop_whole_partitions(ray_session):
    ds = sbloader.range(30, num_partitions=3).flat_map(lambda r: [] if r["id"] < 15 else [r]).filter(
        lambda r: r["id"] >= 20)
    assert [int(r["id"]) for r in ds.iter_rows(deterministic=True)] == list(range(20, 30))


def test_iter_torch_batches_dtypes_and_shapes(ray_session):
    items = [{"x": np.arange(4, dtype=np.float32) + i, "y": i, "name": f"n{i}"} for i in range(10)]
    ds = sbloader.from_items(items, num_partitions=3).map(lambda r: {**r, "y2": r["y"] * 2})
    batches = list(ds.iter_torch_batches(batch_size=4, deterministic=True))
    assert [len(b["y"]) for b in batches] == [4, 4, 2]
    b0 = batches[0]
    assert isinstance(b0["x"], torch.Tensor) and b0["x"].dtype == torch.float32 and b0["x"].shape == (4, 4)
    assert b0["y"].dtype == torch.int64 and b0["y"].shape == (4,)
    assert torch.equal(b0["x"][:, 0], torch.tensor([0.0, 1.0, 2.0, 3.0]))
    assert torch.equal(torch.cat([b["y2"] for b in batches]), torch.arange(10) * 2)
    assert list(b0["name"]) == ["n0", "n1", "n2", "n3"]  # strings stay as they are
    b0["x"][0, 0] = -1.0  # writable by default, as torch's DataLoader gives

    dropped = list(ds.iter_torch_batches(batch_size=4, drop_last=True, deterministic=True,
                                         dtypes={"x": torch.float64, "y": torch.int32}))
    assert [len(b["y"]) for b in dropped] == [4, 4]
    assert dropped[0]["x"].dtype == torch.float64 and dropped[0]["y"].dtype == torch.int32

    ids = list(sbloader.range(10, num_partitions=2).iter_torch_batches(batch_size=None, deterministic=True))
    assert [tuple(b["id"].shape) for b in ids] == [(5,), (5,)] and ids[0]["id"].dtype == torch.int64
