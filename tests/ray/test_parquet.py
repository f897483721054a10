"""read_parquet: footers, row-group and row-range partitions, columns, bad files, on_error."""
from __future__ import annotations

import collections
import io
import os
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import sbloader
from sbloader.core.errors import SourceReadError
from sbloader.sources.parquet import DRIVER_FOOTER_MAX_FILES, ParquetSource


def _write(path: Path, ids: range, row_group_size: int, **extra_columns) -> Path:
    """A Parquet file with an ``id`` column, a ``value`` column and any extra columns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ids_arr = np.asarray(ids, dtype=np.int64)
    table = pa.table({"id": ids_arr, "value": ids_arr.astype(np.float32) * 0.5, **extra_columns})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def _files(root: Path, n_files: int, rows: int, row_group_size: int) -> list[Path]:
    return [
        _write(root / f"part-{k:02d}.parquet", range(k * rows, (k + 1) * rows), row_group_size)
        for k in range(n_files)
    ]


def _ids(ds: sbloader.Dataset, **kwargs) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for batch in ds.iter_batches(7, **kwargs):
        out.update(batch["id"].tolist())
    return out


def test_row_groups_end_to_end_every_row_once(ray_session, tmp_path):
    _files(tmp_path / "d", n_files=3, rows=25, row_group_size=10)  # row groups of 10, 10, 5
    (tmp_path / "d" / "_SUCCESS").write_text("")

    def double(batch):
        batch["twice"] = batch["id"] * 2
        return batch

    ds = sbloader.read_parquet(tmp_path / "d").map_batches(double)
    parts = ds.source.partitions(0, 0)
    assert [p.num_rows for p in parts] == [10, 10, 5] * 3
    assert ds.source.num_rows() == 75
    seen: collections.Counter = collections.Counter()
    for batch in ds.iter_batches(8):
        assert batch["id"].dtype == np.int64 and batch["value"].dtype == np.float32
        assert (batch["twice"] == batch["id"] * 2).all()
        assert np.allclose(batch["value"], batch["id"] * 0.5)
        seen.update(batch["id"].tolist())
    assert seen == collections.Counter(range(75))
    assert ds.stats().skipped == 0


def test_many_files_footers_read_in_remote_tasks(ray_session, tmp_path, monkeypatch):
    n = DRIVER_FOOTER_MAX_FILES + 5
    _files(tmp_path / "d", n_files=n, rows=6, row_group_size=4)

    def no_footer_in_driver(*args, **kwargs):
        raise AssertionError("the driver read a footer")

    # Remote workers are other processes: only footers read in the driver fail.
    monkeypatch.setattr(pq, "read_metadata", no_footer_in_driver)
    ds = sbloader.read_parquet(tmp_path / "d", rows_per_partition=3)
    assert all(fm.error == "" for fm in ds.source.files)
    assert [p.num_rows for p in ds.source.partitions(0, 0)] == [3, 1, 2] * n
    assert _ids(ds) == collections.Counter(range(6 * n))


def test_few_files_footers_read_in_driver(tmp_path, monkeypatch):
    _files(tmp_path / "d", n_files=2, rows=6, row_group_size=4)
    calls = []
    real = pq.read_metadata
    monkeypatch.setattr(pq, "read_metadata", lambda p, *a, **k: calls.append(p) or real(p, *a, **k))
    ds = sbloader.read_parquet(tmp_path / "d")
    assert len(calls) == 2 and ds.source.num_rows() == 12


def test_row_range_partitioning(ray_session, tmp_path):
    path = _write(tmp_path / "big.parquet", range(100), row_group_size=50)
    ds = sbloader.read_parquet(path, rows_per_partition=20)
    parts = ds.source.partitions(0, 0)
    assert [p.num_rows for p in parts] == [20, 20, 10, 20, 20, 10]
    assert [p.id for p in parts] == list(range(6))
    reader = ds.source.reader()
    start = 0
    for p in parts:
        block = reader(None, p)
        assert block["id"].tolist() == list(range(start, start + p.num_rows))  # exact range, in order
        start += p.num_rows
    assert _ids(ds, shuffle=True, seed=3) == collections.Counter(range(100))


def test_partition_reread_is_identical(tmp_path):
    strings = pa.array([f"s{i}" if i % 3 else None for i in range(30)])
    _write(tmp_path / "a.parquet", range(30), row_group_size=12, name=strings,
           vec=pa.array([[i, -i] for i in range(30)], pa.list_(pa.int32(), 2)))
    source = sbloader.read_parquet(tmp_path / "a.parquet", rows_per_partition=5).source
    reader = source.reader()
    for part in source.partitions(0, 0):
        a, b = reader(source.shared(), part), reader(source.shared(), part)
        assert list(a) == list(b) == ["id", "value", "name", "vec"]
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].tolist() == b[k].tolist()
        assert a["vec"].shape == (part.num_rows, 2)  # fixed-size list -> 2-D
        assert (a["vec"][:, 0] == a["id"]).all()


def test_footer_parsed_once_per_process_while_the_file_is_unchanged(tmp_path, monkeypatch):
    from sbloader.sources import parquet as sp

    path = _write(tmp_path / "a.parquet", range(40), row_group_size=5)
    source = sbloader.read_parquet(path).source
    monkeypatch.setattr(sp, "_FOOTERS", collections.OrderedDict())
    calls = []
    real = pq.read_metadata
    monkeypatch.setattr(pq, "read_metadata", lambda p, *a, **k: calls.append(p) or real(p, *a, **k))
    reader = source.reader()
    blocks = [reader(None, part) for part in source.partitions(0, 0)]
    assert len(blocks) == 8 and calls == [str(path)]
    assert np.concatenate([b["id"] for b in blocks]).tolist() == list(range(40))

    # rewritten (another size): parsed again, never read with the old footer
    _write(path, range(100, 140), row_group_size=5, extra=np.zeros(40, np.int8))
    fresh = sbloader.read_parquet(path).source
    block = fresh.reader()(None, fresh.partitions(0, 0)[3])
    assert block["id"].tolist() == list(range(115, 120)) and "extra" in block
    assert len(calls) == 3  # the new dataset's footer, then the read's


def test_footer_cache_is_bounded_by_footer_bytes(tmp_path, monkeypatch):
    from sbloader.sources import parquet as sp

    paths = _files(tmp_path / "d", n_files=4, rows=10, row_group_size=5)
    monkeypatch.setattr(sp, "_FOOTERS", collections.OrderedDict())
    one = pq.read_metadata(paths[0]).serialized_size
    monkeypatch.setattr(sp, "FOOTER_CACHE_BYTES", 2 * one + one // 2)  # room for two footers
    for p in paths:
        sp.cached_footer(str(p))
    assert [k[0] for k in sp._FOOTERS] == [str(p) for p in paths[2:]]  # the newest two
    monkeypatch.setattr(sp, "FOOTER_CACHE_BYTES", 1)
    sp.cached_footer(str(paths[0]))
    assert [k[0] for k in sp._FOOTERS] == [str(paths[0])]  # always the newest one


def test_reader_is_small_and_picklable(tmp_path):
    _files(tmp_path / "d", n_files=3, rows=10, row_group_size=5)
    source = sbloader.read_parquet(tmp_path / "d", columns=["id"]).source
    assert isinstance(source, ParquetSource) and source.shared() is None
    blob = pickle.dumps(source.reader())
    assert len(blob) < 1000
    assert pickle.loads(blob).func.__module__ == "sbloader.sources.parquet"


def test_columns_selected_in_order(ray_session, tmp_path):
    _write(tmp_path / "a.parquet", range(10), row_group_size=4, label=pa.array(list("abcdefghij")))
    batches = list(sbloader.read_parquet(tmp_path / "a.parquet", columns=["label", "id"]).iter_batches(None))
    assert all(list(b) == ["label", "id"] for b in batches)
    assert sorted(x for b in batches for x in b["label"].tolist()) == list("abcdefghij")


def _png_bytes(value: int, size: tuple[int, int]) -> bytes:
    arr = np.full((size[1], size[0], 3), value, dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def test_binary_image_column_decoded_in_map_batches(ray_session, tmp_path):
    n = 14
    images = pa.array([_png_bytes(10 * i, (5 + i % 3, 4)) for i in range(n)], pa.binary())
    _write(tmp_path / "img.parquet", range(n), row_group_size=5, image=images)

    def decode(batch):
        assert batch["image"].dtype == object and isinstance(batch["image"][0], bytes)
        decoded = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in batch["image"]]
        return {"id": batch["id"], "pixels": np.array([d[0, 0, 0] for d in decoded]),
                "width": np.array([d.shape[1] for d in decoded])}

    ds = sbloader.read_parquet(tmp_path / "img.parquet", columns=["id", "image"]).map_batches(decode)
    rows = {int(r["id"]): (int(r["pixels"]), int(r["width"])) for r in ds.iter_rows()}
    assert rows == {i: (10 * i, 5 + i % 3) for i in range(n)}


def test_wrong_column_detected_in_driver(tmp_path):
    _files(tmp_path / "d", n_files=2, rows=5, row_group_size=5)
    with pytest.raises(ValueError) as info:
        sbloader.read_parquet(tmp_path / "d", columns=["id", "labels"])
    msg = str(info.value)
    assert "'labels'" in msg and "part-00.parquet" in msg and "['id', 'value']" in msg


def test_column_missing_at_read_time_raises_naming_file(ray_session, tmp_path):
    paths = _files(tmp_path / "d", n_files=2, rows=5, row_group_size=5)
    ds = sbloader.read_parquet(tmp_path / "d", columns=["value"])
    pq.write_table(pa.table({"id": np.arange(5, 10)}), paths[1])  # rewritten without the column
    with pytest.raises(SourceReadError, match="part-01.parquet") as info:
        list(ds.iter_rows())
    assert info.value.path == str(paths[1]) and info.value.partition_id == 1
    assert "'value'" in str(info.value)


def _with_garbage(root: Path) -> tuple[list[Path], Path]:
    good = _files(root, n_files=3, rows=8, row_group_size=4)
    bad = root / "part-01b.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file")
    return good, bad


def test_unreadable_file_raises_in_consumer(ray_session, tmp_path):
    _, bad = _with_garbage(tmp_path / "d")
    ds = sbloader.read_parquet(tmp_path / "d")  # the footer error waits for the read
    bad_part = next(p for p in ds.source.partitions(0, 0) if p.payload.path == str(bad))
    assert bad_part.num_rows is None and ds.source.num_rows() is None
    with pytest.raises(SourceReadError, match="part-01b.parquet") as info:
        list(ds.iter_batches(5))
    err = info.value
    assert err.path == str(bad) and err.partition_id == bad_part.id
    assert f"partition {bad_part.id}" in str(err) and "on_error='skip'" in str(err)


def test_unreadable_file_skipped_and_counted(ray_session, tmp_path):
    _with_garbage(tmp_path / "d")
    ds = sbloader.read_parquet(tmp_path / "d", on_error="skip")
    assert ds.source.num_rows() == 24
    assert _ids(ds) == collections.Counter(range(24))
    assert ds.stats().skipped == 1


def test_row_group_unreadable_at_read_time(ray_session, tmp_path):
    paths = _files(tmp_path / "d", n_files=2, rows=8, row_group_size=4)
    raise_ds = sbloader.read_parquet(tmp_path / "d")
    skip_ds = sbloader.read_parquet(tmp_path / "d", on_error="skip")
    paths[0].write_bytes(b"corrupted after the footers were read")
    with pytest.raises(SourceReadError, match="part-00.parquet") as info:
        list(raise_ds.iter_rows())
    assert info.value.partition_id in (0, 1)
    assert _ids(skip_ds) == collections.Counter(range(8, 16))
    assert skip_ds.stats().skipped == 8  # every row of the two row groups of the file


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"on_error": "warn"}, "on_error must be 'raise'.*'warn'"),
        ({"rows_per_partition": 0}, "rows_per_partition must be a positive integer.*0"),
        ({"columns": "id"}, r"columns must be a list of column names, found 'id'; write columns=\['id'\]"),
        ({"columns": []}, "at least one column"),
        ({"columns": ["id", "id"]}, "more than once"),
    ],
)
def test_invalid_arguments(tmp_path, kwargs, match):
    _files(tmp_path / "d", n_files=1, rows=4, row_group_size=4)
    with pytest.raises(ValueError, match=match):
        sbloader.read_parquet(tmp_path / "d", **kwargs)


def test_missing_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        sbloader.read_parquet(tmp_path / "nope.parquet")
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="found no parquet files"):
        sbloader.read_parquet(tmp_path / "d")
    paths = _files(tmp_path / "e", n_files=2, rows=3, row_group_size=3)
    assert [fm.path for fm in sbloader.read_parquet(str(tmp_path / "e" / "*.parquet")).source.files] == [
        os.fspath(p) for p in paths
    ]
