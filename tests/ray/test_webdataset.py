"""``read_webdataset`` against the ``webdataset`` package: shards written by its ``TarWriter``, rows
equal to its reader's in both decode modes; brace patterns, directories and lists; truncated and
corrupt shards raised or skipped; shuffled batches mixing shards; resume exactly once."""
from __future__ import annotations

import os

import numpy as np
import pytest

import sbloader
from harness import check_resume_everywhere
from sbloader.core.errors import SourceReadError
from wds_shards import assert_rows_equal, write_shards, wds_rows

pytest.importorskip("webdataset")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(str(tmp_path_factory.mktemp("wds")), shards=3, per_shard=7)


def _rows(ds, **kw):
    return [{k: v for k, v in r.items()} for r in ds.iter_rows(deterministic=True, **kw)]


@pytest.mark.parametrize("decode", [True, False])
def test_rows_equal_webdataset_s_reader(ray_session, shards, decode):
    ds = sbloader.read_webdataset(shards, decode=decode, samples_per_partition=3)
    assert ds.num_rows() == 21 and ds.num_partitions() == 9
    ours = _rows(ds)
    assert_rows_equal(ours, wds_rows(shards, decode))
    assert sorted(k for k in ours[0] if not k.startswith("_sb")) == ["__key__", "__url__", "cls", "jpg", "json",
                                                                     "png", "txt"]
    if decode:
        assert ours[0]["png"] is None and isinstance(ours[0]["jpg"], np.ndarray) and ours[0]["txt"] == "caption 0"
    else:
        assert isinstance(ours[0]["jpg"], bytes) and ours[0]["cls"] == b"0"


def test_brace_patterns_directories_globs_and_lists_read_the_same_shards(ray_session, shards):
    root = os.path.dirname(shards[0])
    want = [r["__key__"] for r in wds_rows(shards[:2], False)]
    for spec in (os.path.join(root, "train-{000000..000001}.tar"), [shards[0], shards[1]],
                 [os.path.join(root, "train-{000000,000001}.tar")], os.path.join(root, "train-00000[01].tar")):
        assert [r["__key__"] for r in _rows(sbloader.read_webdataset(spec, decode=False))] == want, spec
    assert len(_rows(sbloader.read_webdataset(root, decode=False, samples_per_partition=None))) == 21


def test_a_partition_per_shard_or_per_range(ray_session, shards):
    whole = sbloader.read_webdataset(shards, samples_per_partition=None)
    assert [p.num_rows for p in whole.source.partitions(0, 0)] == [7, 7, 7]
    labels = [p.label for p in sbloader.read_webdataset(shards[:1], samples_per_partition=5).source.partitions(0, 0)]
    assert labels == [f"{shards[0]} samples [0, 5)", f"{shards[0]} samples [5, 7)"]
    with pytest.raises(ValueError, match="samples_per_partition"):
        sbloader.read_webdataset(shards, samples_per_partition=0)
    with pytest.raises(ValueError, match="on_error"):
        sbloader.read_webdataset(shards, on_error="ignore")


def _cut(src: str, dst: str, keep: float) -> str:
    data = open(src, "rb").read()
    with open(dst, "wb") as f:
        f.write(data[:int(len(data) * keep) + 100])
    return dst


def test_a_truncated_shard_is_named_or_skipped_and_counted(ray_session, shards, tmp_path):
    bad = _cut(shards[1], str(tmp_path / "train-000001.tar"), 0.6)
    files = [shards[0], bad, shards[2]]
    ds = sbloader.read_webdataset(files, samples_per_partition=3)
    with pytest.raises(SourceReadError, match="train-000001.tar") as info:
        _rows(ds)
    assert info.value.path == bad and "truncated" in str(info.value) and "on_error='skip'" in str(info.value)
    skip = sbloader.read_webdataset(files, samples_per_partition=3, on_error="skip")
    rows = _rows(skip)
    keys = [r["__key__"] for r in rows]
    good = skip.source.files[1].keys
    assert 0 < len(good) < 6 and keys == [f"s0_{i:03d}" for i in range(7)] + list(good) + \
        [f"s2_{i:03d}" for i in range(7)]
    assert skip.stats().skipped == 1


def test_a_corrupt_image_is_named_with_its_key_or_skipped(ray_session, tmp_path):
    import webdataset as wds

    path = str(tmp_path / "c.tar")
    with wds.TarWriter(path) as sink:
        for i in range(4):
            sink.write({"__key__": f"k{i}", "jpg": b"\xff\xd8 not a jpeg" if i == 2 else _jpeg(i), "cls": i})
    with pytest.raises(SourceReadError, match="k2"):
        _rows(sbloader.read_webdataset(path))
    ds = sbloader.read_webdataset(path, on_error="skip")
    rows = _rows(ds)
    assert [r["cls"] for r in rows] == [0, 1, 3] and ds.stats().skipped == 1


def _jpeg(i: int) -> bytes:
    from sbloader.datagen import jpeg_bytes, synthetic_image

    return jpeg_bytes(synthetic_image(np.random.default_rng(i), 16, 16))


def test_shuffled_batches_mix_shards_and_cover_the_epoch_once(ray_session, tmp_path):
    paths = write_shards(str(tmp_path / "m"), shards=4, per_shard=16, images=False)
    ds = sbloader.read_webdataset(paths, samples_per_partition=4)
    plain = [b["cls"] // 1000 for b in ds.iter_batches(8, shuffle=False, deterministic=True)]
    assert all(len(set(s)) == 1 for s in plain)  # without shuffle a batch is a run of one shard
    for seed in (0, 1):
        batches = list(ds.iter_batches(8, shuffle=True, seed=seed, deterministic=True))
        ids = np.concatenate([b["cls"] for b in batches])
        assert sorted(ids) == sorted(s * 1000 + i for s in range(4) for i in range(16))
        mixed = [len(set(b["cls"] // 1000)) for b in batches]
        assert np.mean(mixed) >= 2.5, mixed  # 8 partitions in the window: most batches hold 3-4 shards
    first = [b["__key__"] for b in ds.iter_batches(8, shuffle=True, seed=0, deterministic=True)]
    again = [b["__key__"] for b in ds.iter_batches(8, shuffle=True, seed=0, deterministic=True)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


def test_resumed_mid_epoch_every_sample_once(ray_session, tmp_path):
    write_shards(str(tmp_path / "r"), shards=3, per_shard=8, images=False)
    ids = [s * 1000 + i for s in range(3) for i in range(8)]

    def make(rank, world_size, name):
        ds = sbloader.read_webdataset(os.path.join(str(tmp_path / "r"), "train-{000000..000002}.tar"),
                                      samples_per_partition=3)
        return ds.to_dataloader(4, shuffle=True, seed=5, deterministic=True, rank=rank, world_size=world_size,
                                name=name)

    check_resume_everywhere(make, ids, key="cls", resume_world_sizes=(2,), same_order=True, steps=[0, 3, 6],
                            states_in_one_run=True)
