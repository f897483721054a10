"""Tests of blocks and of how each operator transforms one block (no Ray)."""
from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from sbloader.core.block import (
    ROW_COLUMN,
    BlockMeta,
    Provenance,
    block_nbytes,
    column_names,
    concat,
    from_rows,
    iter_rows,
    num_rows,
    provenance_runs,
    slice_block,
    strip_hidden,
    take,
    to_column,
)
from sbloader.core.ops import Op, apply_op, op_name

LENGTHS = [1, 2, 5, 64, 65, 200]


def _values(kind: str, n: int) -> list[Any]:
    rng = np.random.default_rng(n)
    if kind == "int":
        return [int(x) for x in rng.integers(-1000, 1000, n)]
    if kind == "float":
        return [float(x) for x in rng.random(n)]
    if kind == "bool":
        return [bool(x) for x in rng.integers(0, 2, n)]
    if kind == "np_float32":
        return [np.float32(x) for x in rng.random(n)]
    if kind == "str":
        return [f"s{i}" * (i % 4 + 1) for i in range(n)]
    if kind == "bytes":
        return [bytes([65 + i % 26]) * (i % 5 + 1) for i in range(n)]
    if kind == "array":
        return [rng.random((3, 2)).astype(np.float32) for _ in range(n)]
    if kind == "ragged":
        return [np.arange(i % 3 + 1) for i in range(n)]
    if kind == "tensor":
        return [torch.full((2,), float(i)) for i in range(n)]
    if kind == "list":
        return [[i, i + 1] for i in range(n)]
    if kind == "dict":
        return [{"k": i} for i in range(n)]
    if kind == "none_mixed":
        return [None if i % 2 else i for i in range(n)]
    raise AssertionError(kind)


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        b = b.numpy()
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b and type(a) is type(b) if isinstance(a, (list, dict)) else a == b


KINDS = ["int", "float", "bool", "np_float32", "str", "bytes", "array", "ragged", "tensor", "list", "dict", "none_mixed"]


# ----- to_column / from_rows ----------------------------------------------------


@pytest.mark.parametrize("kind, n", itertools.product(KINDS, LENGTHS))
def test_to_column_keeps_every_row(kind: str, n: int) -> None:
    values = _values(kind, n)
    col = to_column(values)
    assert isinstance(col, np.ndarray)
    assert len(col) == n
    for i in range(n):
        assert _same(col[i], values[i]), (kind, i, col[i], values[i])


@pytest.mark.parametrize("n", LENGTHS)
def test_to_column_dtypes(n: int) -> None:
    assert to_column(_values("int", n)).dtype.kind == "i"
    assert to_column(_values("float", n)).dtype == np.float64
    assert to_column(_values("bool", n)).dtype == np.bool_
    assert to_column(_values("np_float32", n)).dtype == np.float32
    stacked = to_column(_values("array", n))
    assert stacked.shape == (n, 3, 2) and stacked.dtype == np.float32
    tensors = to_column(_values("tensor", n))
    assert tensors.shape == (n, 2) and tensors.dtype == np.float32
    # Rows that cannot stack stay whole: one object per row, never split.
    for kind in ("list", "dict") + (("ragged", "none_mixed") if n > 1 else ()):
        col = to_column(_values(kind, n))
        assert col.dtype == object and col.shape == (n,)


def test_to_column_empty() -> None:
    col = to_column([])
    assert col.shape == (0,) and col.dtype == object


def test_to_column_huge_int_stays_exact() -> None:
    col = to_column([2**70, 1])
    assert col[0] == 2**70 and col[1] == 1


@pytest.mark.parametrize("n", LENGTHS)
def test_from_rows(n: int) -> None:
    rows = [{"a": i, "b": f"x{i}", "c": np.full(2, i)} for i in range(n)]
    block = from_rows(rows)
    assert list(block) == ["a", "b", "c"]
    assert num_rows(block) == n
    assert block["c"].shape == (n, 2)
    assert list(iter_rows(block))[n - 1]["b"] == f"x{n - 1}"
    for i, row in enumerate(iter_rows(block)):
        assert row["a"] == i and row["b"] == f"x{i}" and np.array_equal(row["c"], rows[i]["c"])


def test_from_rows_accepts_reordered_keys() -> None:
    block = from_rows([{"a": 1, "b": 2}, {"b": 4, "a": 3}])
    assert block["a"].tolist() == [1, 3] and block["b"].tolist() == [2, 4]


@pytest.mark.parametrize(
    "rows",
    [
        [{"a": 1}, {"b": 2}],
        [{"a": 1, "b": 2}, {"a": 3}],
        [{"a": 1}, {"a": 2, "b": 3}],
        [{"a": 1}, {"a": 2}, {"a": 3, "z": 0}],
    ],
)
def test_from_rows_rejects_mismatched_keys(rows: list) -> None:
    with pytest.raises(ValueError, match=f"row {len(rows) - 1} has"):
        from_rows(rows)


def test_from_rows_empty() -> None:
    assert from_rows([]) == {}


# ----- concat / slice / take -------------------------------------------------------


@pytest.mark.parametrize("sizes", [(0,), (3,), (1, 1), (0, 4, 0), (5, 2, 7), (64, 1, 100, 3)])
def test_concat_numeric_and_strings(sizes: tuple) -> None:
    blocks, start = [], 0
    for n in sizes:
        r = np.arange(start, start + n)
        blocks.append({"x": r.astype(np.int64), "y": r * 0.5, "s": np.array([f"v{i}" for i in r], dtype=str)})
        start += n
    out = concat(blocks)
    total = sum(sizes)
    assert np.array_equal(out["x"], np.arange(total))
    assert np.array_equal(out["y"], np.arange(total) * 0.5)
    assert out["s"].tolist() == [f"v{i}" for i in range(total)]
    assert out["x"].dtype == np.int64


def test_concat_mixed_object_and_numeric() -> None:
    a = {"x": np.array([1, 2])}
    b = {"x": to_column([[3], {"k": 4}])}
    out = concat([a, b])
    assert out["x"].dtype == object
    assert out["x"].tolist() == [1, 2, [3], {"k": 4}]


def test_concat_unstackable_shapes_become_objects() -> None:
    a = {"img": np.zeros((2, 3, 3))}
    b = {"img": np.ones((1, 4, 4))}
    out = concat([a, b])
    assert out["img"].dtype == object and len(out["img"]) == 3
    assert out["img"][0].shape == (3, 3) and out["img"][2].shape == (4, 4)
    assert np.array_equal(out["img"][2], np.ones((4, 4)))


def test_concat_edge_cases() -> None:
    assert concat([]) == {}
    assert concat([{}, {}]) == {}
    block = {"x": np.arange(3)}
    single = concat([{}, block])
    assert single is not block and single.keys() == block.keys()
    single["y"] = np.zeros(3)
    assert "y" not in block  # a new dict, not the input


@pytest.mark.parametrize("n", [0, 1, 5, 17])
def test_slice_block_grid(n: int) -> None:
    block = {"x": np.arange(n), "m": np.arange(2 * n).reshape(n, 2), ROW_COLUMN: np.arange(n)[::-1].copy()}
    for start, stop in itertools.product(range(n + 2), repeat=2):
        part = slice_block(block, start, stop)
        for k, v in block.items():
            assert np.array_equal(part[k], v[start:stop])
            if len(part[k]):
                assert np.shares_memory(part[k], v)  # a view, no copy


def test_take_copies() -> None:
    block = {"x": np.arange(5), "o": to_column([[i] for i in range(5)])}
    out = take(block, np.array([4, 0, 2]))
    assert out["x"].tolist() == [4, 0, 2] and out["o"].tolist() == [[4], [0], [2]]
    assert not np.shares_memory(out["x"], block["x"])


def test_small_helpers() -> None:
    block = {"a": np.arange(3), ROW_COLUMN: np.arange(3)}
    assert strip_hidden(block).keys() == {"a"}
    assert ROW_COLUMN in block  # not mutated
    assert num_rows({}) == 0 and num_rows(block) == 3
    assert column_names([{"b": 1}, {"a": 2, "b": 3}, {}]) == ["a", "b"]
    assert list(iter_rows({})) == []


# ----- provenance -------------------------------------------------------------------


def _expand(runs: tuple[Provenance, ...]) -> list[tuple[int, int]]:
    return [(r.partition_id, row) for r in runs for row in range(*r.row_range)]


def _random_rows(rng: np.random.Generator, segments: int) -> tuple[np.ndarray, np.ndarray]:
    pids, rows = [], []
    for _ in range(segments):
        pid = int(rng.integers(-2, 4))
        start = int(rng.integers(0, 30))
        length = int(rng.integers(1, 6))
        if pids and pids[-1] == pid and rows[-1] == start:
            start += 1  # no repeated row here (see the test with repeats)
        pids += [pid] * length
        rows += list(range(start, start + length))
    return np.array(pids, dtype=np.int64), np.array(rows, dtype=np.int64)


@pytest.mark.parametrize("segments, seed", itertools.product([0, 1, 2, 3, 5, 10, 40], range(6)))
def test_provenance_runs_reconstruct_input(segments: int, seed: int) -> None:
    pids, rows = _random_rows(np.random.default_rng(seed), segments)
    runs = provenance_runs(7, pids, rows)
    assert _expand(runs) == list(zip(pids.tolist(), rows.tolist()))
    for r in runs:
        assert isinstance(r, Provenance) and r.epoch == 7
        assert r.row_range[0] < r.row_range[1]
    # Runs are maximal: no two neighbours could be merged.
    for a, b in zip(runs, runs[1:]):
        assert not (a.partition_id == b.partition_id and a.row_range[1] == b.row_range[0])


@pytest.mark.parametrize("segments, seed", itertools.product([1, 3, 10], range(4)))
def test_provenance_runs_with_repeated_rows(segments: int, seed: int) -> None:
    # flat_map repeats a source row: the repeat stays in the run.
    rng = np.random.default_rng(100 + seed)
    pids, rows = _random_rows(rng, segments)
    reps = rng.integers(1, 4, size=len(rows))
    runs = provenance_runs(0, np.repeat(pids, reps), np.repeat(rows, reps))
    assert runs == provenance_runs(0, pids, rows)


def test_provenance_runs_cases() -> None:
    assert provenance_runs(0, np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == ()
    assert provenance_runs(1, np.array([3, 3, 3]), np.array([4, 5, 6])) == (Provenance(1, 3, (4, 7)),)
    # Same rows, other partition: a new run.
    assert provenance_runs(0, np.array([1, 2]), np.array([0, 1])) == (
        Provenance(0, 1, (0, 1)),
        Provenance(0, 2, (1, 2)),
    )
    # A gap or a step back: a new run.
    assert len(provenance_runs(0, np.array([0, 0]), np.array([0, 2]))) == 2
    assert len(provenance_runs(0, np.array([0, 0]), np.array([5, 4]))) == 2


@pytest.mark.parametrize("row_range", [(-1, 3), (5, 4), (-3, -1), (1, 0)])
def test_provenance_validation(row_range: tuple) -> None:
    with pytest.raises(ValueError, match="row_range"):
        Provenance(0, 0, row_range)


@pytest.mark.parametrize("row_range", [(0, 0), (0, 1), (5, 5), (3, 10**9)])
def test_provenance_valid(row_range: tuple) -> None:
    assert Provenance(2, -1, row_range).row_range == row_range


@pytest.mark.parametrize("num_rows_, nbytes", [(-1, 0), (0, -1), (-5, -5)])
def test_block_meta_validation(num_rows_: int, nbytes: int) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        BlockMeta(0, 0, 0, num_rows_, nbytes, (0, 0))


# ----- block_nbytes ------------------------------------------------------------------


@pytest.mark.parametrize("n, dtype", itertools.product([0, 1, 7, 100], [np.int8, np.int64, np.float32, np.float64]))
def test_block_nbytes_numeric(n: int, dtype: type) -> None:
    block = {"a": np.zeros((n, 3), dtype=dtype), "b": np.zeros(n, dtype=np.int16)}
    assert block_nbytes(block) == n * 3 * np.dtype(dtype).itemsize + 2 * n


@pytest.mark.parametrize("n, size", itertools.product([1, 10, 64, 65, 500], [0, 1, 100]))
def test_block_nbytes_objects(n: int, size: int) -> None:
    ptr = np.dtype(object).itemsize
    payload = np.empty(n, dtype=object)
    for i in range(n):
        payload[i] = b"x" * size
    assert block_nbytes({"p": payload}) == n * ptr + n * size
    arrays = np.empty(n, dtype=object)
    for i in range(n):
        arrays[i] = np.zeros(size, dtype=np.float32)
    assert block_nbytes({"p": arrays}) == n * ptr + n * size * 4


def test_block_nbytes_small_object_columns_are_exact() -> None:
    col = np.empty(3, dtype=object)
    col[:] = [b"a", "bcd", np.zeros(10, np.uint8)]
    assert block_nbytes({"c": col}) == 3 * np.dtype(object).itemsize + 1 + 3 + 10
    assert block_nbytes({}) == 0
    assert block_nbytes({"e": np.empty(0, dtype=object)}) == 0


# ----- apply_op ------------------------------------------------------------------------


def _block(n: int, seed: int = 0) -> dict:
    """A block whose row column is shuffled (as after the epoch's row shuffle)."""
    rows = np.random.default_rng(seed).permutation(n).astype(np.int64) + 1000
    return {"x": rows * 10, "s": np.array([f"r{r}" for r in rows], dtype=str), ROW_COLUMN: rows}


def _aligned(out: dict) -> None:
    """The data still names the source row it came from."""
    assert out[ROW_COLUMN].dtype == np.int64
    assert len(out[ROW_COLUMN]) == num_rows(out)
    assert np.array_equal(np.asarray(out["x"], dtype=np.int64) // 10 % 100000, out[ROW_COLUMN])


@pytest.mark.parametrize("n", [0, 1, 2, 9, 64])
def test_apply_map(n: int) -> None:
    op = Op("map", lambda r, k, *, plus: {"x": r["x"] + plus, "k": k}, "Map(f)", fn_args=(5,), fn_kwargs={"plus": 3})
    block = _block(n)
    out = apply_op(op, op.fn, block)
    assert np.array_equal(out[ROW_COLUMN], block[ROW_COLUMN])
    assert out[ROW_COLUMN] is not block[ROW_COLUMN]
    assert np.array_equal(out["x"], block["x"] + 3)
    if n:
        assert out["k"].tolist() == [5] * n
        assert list(out) == ["x", "k", ROW_COLUMN]


def test_apply_map_rejects_non_dict() -> None:
    op = Op("map", lambda r: 1, "Map(bad)")
    with pytest.raises(TypeError, match="Map\\(bad\\)"):
        apply_op(op, op.fn, _block(3))


@pytest.mark.parametrize("n, batch_size", itertools.product([0, 1, 2, 7, 10, 33], [None, 1, 2, 3, 7, 10, 100]))
def test_apply_map_batches_one_to_one(n: int, batch_size: Any) -> None:
    calls = []

    def double(batch: dict, offset: int = 0) -> dict:
        calls.append(num_rows(batch))
        assert ROW_COLUMN not in batch  # user code never sees the hidden column
        return {"x": batch["x"] * 1 + offset, "y": [str(v) for v in batch["x"]]}

    op = Op("map_batches", double, "MapBatches(double)", batch_size=batch_size, fn_kwargs={"offset": 0})
    block = _block(n, seed=n)
    out = apply_op(op, op.fn, block)
    _aligned(out)
    assert np.array_equal(out[ROW_COLUMN], block[ROW_COLUMN])
    if n:
        assert out["y"].tolist() == [str(v) for v in block["x"]]
    size = batch_size or max(1, n)
    assert sum(calls) == n
    assert all(c <= size for c in calls)
    assert len(calls) == -(-n // size)


@pytest.mark.parametrize("n, batch_size", itertools.product([1, 5, 12], [None, 1, 4, 5]))
def test_apply_map_batches_changing_row_count(n: int, batch_size: Any) -> None:
    # A batch function that drops or duplicates rows: every output row of a chunk
    # is attributed to the chunk's first source row (chunk-exact provenance).
    block = _block(n, seed=3)
    size = batch_size or n
    firsts = [block[ROW_COLUMN][s] for s in range(0, n, size)]
    for fn, per_chunk in (
        (lambda b: {"x": b["x"][:1]}, lambda m: 1 if m != 1 else None),
        (lambda b: {"x": np.concatenate([b["x"], b["x"]])}, lambda m: 2 * m),
        (lambda b: {"x": b["x"][:0]}, lambda m: 0 if m != 0 else None),
    ):
        op = Op("map_batches", fn, "MapBatches(f)", batch_size=batch_size)
        out = apply_op(op, fn, block)
        assert out[ROW_COLUMN].dtype == np.int64
        pos = 0
        for k, s in enumerate(range(0, n, size)):
            m = min(size, n - s)
            expected = per_chunk(m)
            if expected is None:  # same row count: one to one
                assert np.array_equal(out[ROW_COLUMN][pos:pos + m], block[ROW_COLUMN][s:s + m])
                pos += m
                continue
            assert (out[ROW_COLUMN][pos:pos + expected] == firsts[k]).all()
            pos += expected
        assert pos == num_rows(out) == len(out[ROW_COLUMN])


@pytest.mark.parametrize(
    "ret, exc, match",
    [
        (lambda b: [1, 2], TypeError, "dict of column"),
        (lambda b: {"a": np.arange(2), "b": np.arange(3)}, ValueError, "different lengths"),
    ],
)
def test_apply_map_batches_bad_output(ret: Any, exc: type, match: str) -> None:
    op = Op("map_batches", ret, "MapBatches(bad)")
    with pytest.raises(exc, match=match):
        apply_op(op, ret, _block(4))


def test_apply_map_batches_with_instance() -> None:
    class Scale:
        def __init__(self, k: int) -> None:
            self.k = k

        def __call__(self, batch: dict) -> dict:
            return {"x": batch["x"] * self.k}

    op = Op("map_batches", Scale, "MapBatches(Scale)", batch_size=3, fn_constructor_args=(1,))
    inst = Scale(*op.fn_constructor_args)
    block = _block(8)
    out = apply_op(op, inst, block)
    _aligned(out)
    assert np.array_equal(out[ROW_COLUMN], block[ROW_COLUMN])


@pytest.mark.parametrize("n, mod", itertools.product([0, 1, 2, 10, 50], [1, 2, 3, 7, 10**9]))
def test_apply_filter(n: int, mod: int) -> None:
    op = Op("filter", lambda r, m: r["x"] // 10 % m == 0, "Filter(f)", fn_args=(mod,))
    block = _block(n, seed=mod)
    out = apply_op(op, op.fn, block)
    keep = block[ROW_COLUMN] % mod == 0
    assert np.array_equal(out[ROW_COLUMN], block[ROW_COLUMN][keep])
    assert out["s"].tolist() == block["s"][keep].tolist()
    _aligned(out)


@pytest.mark.parametrize("n, max_copies", itertools.product([0, 1, 2, 10, 30], [0, 1, 3]))
def test_apply_flat_map(n: int, max_copies: int) -> None:
    def explode(r: dict) -> list:
        return [{"x": r["x"], "copy": c} for c in range(int(r["x"]) // 10 % (max_copies + 1))]

    op = Op("flat_map", explode, "FlatMap(explode)")
    block = _block(n, seed=n)
    out = apply_op(op, op.fn, block)
    counts = block[ROW_COLUMN] % (max_copies + 1)
    assert np.array_equal(out[ROW_COLUMN], np.repeat(block[ROW_COLUMN], counts))
    assert out[ROW_COLUMN].dtype == np.int64
    if len(out[ROW_COLUMN]):
        _aligned(out)
        assert out["copy"].tolist() == [c for k in counts for c in range(k)]


def test_apply_flat_map_rejects_non_dict() -> None:
    op = Op("flat_map", lambda r: [1], "FlatMap(bad)")
    with pytest.raises(TypeError, match="FlatMap\\(bad\\)"):
        apply_op(op, op.fn, _block(2))


def test_apply_ops_in_sequence_keep_provenance() -> None:
    block = _block(40, seed=9)
    ops = [
        Op("filter", lambda r: r["x"] // 10 % 3 != 0, "Filter(a)"),
        Op("flat_map", lambda r: [r, r], "FlatMap(b)"),
        Op("map", lambda r: {"x": r["x"], "s": r["s"]}, "Map(c)"),
        Op("map_batches", lambda b: {"x": b["x"], "s": b["s"]}, "MapBatches(d)", batch_size=4),
    ]
    for op in ops:
        block = apply_op(op, op.fn, block)
        _aligned(block)
    assert block["s"].tolist() == [f"r{r}" for r in block[ROW_COLUMN]]


# ----- Op validation -----------------------------------------------------------------------


class _Model:
    def __call__(self, batch: dict) -> dict:
        return batch


def _fn(x: Any) -> Any:
    return x


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(kind="map", fn=_fn, concurrency=0), ValueError, "concurrency"),
        (dict(kind="map", fn=_fn, concurrency=-2), ValueError, "concurrency"),
        (dict(kind="map", fn=_fn, concurrency=1.5), ValueError, "concurrency"),
        (dict(kind="map", fn=_fn, concurrency="2"), ValueError, "concurrency"),
        (dict(kind="map_batches", fn=_fn, concurrency=(1, 2)), ValueError, "callable class"),
        (dict(kind="map_batches", fn=_Model, concurrency=(0, 2)), ValueError, "1 <= min <= max"),
        (dict(kind="map_batches", fn=_Model, concurrency=(3, 2)), ValueError, "1 <= min <= max"),
        (dict(kind="map_batches", fn=_Model, concurrency=(1, 2, 3)), ValueError, "concurrency"),
        (dict(kind="filter", fn=_Model), TypeError, "callable classes are for map_batches"),
        (dict(kind="map", fn=_Model), TypeError, "callable classes are for map_batches"),
        (dict(kind="flat_map", fn=_Model), TypeError, "callable classes are for map_batches"),
        (dict(kind="map", fn=_fn, num_cpus=-1), ValueError, "num_cpus"),
        (dict(kind="map", fn=_fn, num_gpus=-0.5), ValueError, "num_gpus"),
        (dict(kind="map_batches", fn=_fn, batch_size=0), ValueError, "batch_size"),
        (dict(kind="map_batches", fn=_fn, batch_size=-4), ValueError, "batch_size"),
        (dict(kind="reduce", fn=_fn), ValueError, "unknown operator kind"),
        (dict(kind="map", fn=42), TypeError, "needs a callable"),
        (dict(kind="map_batches", fn=_fn, fn_constructor_args=(1,)), ValueError, "callable class"),
        (dict(kind="map_batches", fn=_fn, fn_constructor_kwargs={"a": 1}), ValueError, "callable class"),
    ],
)
def test_op_validation(kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        Op(name="X", **kwargs)


def test_op_valid_configurations() -> None:
    assert Op("map_batches", _Model, "M", concurrency=(1, 4), num_gpus=1).is_actor
    assert Op("map_batches", _Model, "M", concurrency=(2, 2), fn_constructor_args=(1,)).pool_range() == (2, 2)
    assert Op("map_batches", _Model, "M", concurrency=3).pool_range() == (3, 3)
    # no maximum: the room the other stages' reservations leave (executor/reservations.py)
    assert Op("map_batches", _Model, "M", num_cpus=2).pool_range() == (1, None)
    # a GPU operator holds no CPU unless told: it would take it from the stages feeding it
    assert Op("map_batches", _Model, "M", num_gpus=1).ray_resources() == {"num_cpus": 0.0, "num_gpus": 1}
    assert Op("map_batches", _Model, "M", num_gpus=1, num_cpus=2).ray_resources()["num_cpus"] == 2
    f = Op("map", _fn, "F", concurrency=4, num_cpus=0, num_gpus=0, batch_size=1)
    assert not f.is_actor
    assert f.ray_resources() == {"num_cpus": 0}
    assert Op("map", _fn, "F").ray_resources() == {"num_cpus": 1.0}
    assert Op("map", _fn, "F", num_gpus=0.5, resources={"r": 1}).ray_resources() == {
        "num_cpus": 1.0,
        "num_gpus": 0.5,
        "resources": {"r": 1},
    }


def test_op_name() -> None:
    assert op_name("map", _fn) == "Map(_fn)"
    assert op_name("map_batches", _Model) == "MapBatches(_Model)"
    assert op_name("filter", lambda r: True) == "Filter(<lambda>)"
    assert op_name("flat_map", _Model()) == "FlatMap(_Model)"
