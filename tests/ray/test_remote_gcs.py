"""``read_images("gs://...")`` through obstore in the read tasks, against the session's GCS
emulator (``STORAGE_EMULATOR_HOST``, set before Ray starts): the same rows as the folder on
local disk, one GET per object over the listing's fetch and the first epoch, none in the
second (the node-local cache)."""
from __future__ import annotations

import os

import numpy as np
import pytest
from PIL import Image

import sbloader
from sbloader.sources.filesystems import LAST_LISTING


def _rows(ds) -> dict:
    out = {}
    for b in ds.iter_batches(8):
        for p, im in zip(b["path"], b["image"]):
            assert str(p) not in out, f"{p} delivered twice"
            out[str(p)] = np.asarray(im)
    return out


def test_images_from_gs_through_obstore_equal_local_and_a_later_epoch_sends_no_get(ray_session, gcs_server,
                                                                                   tmp_path):
    pytest.importorskip("obstore")
    root = tmp_path / "images"
    rng = np.random.default_rng(1)
    objects = {}
    for i in range(15):
        d = root / f"class_{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (8 + i % 4, 9, 3), dtype=np.uint8)).save(d / f"{i:03d}.png")
        objects[f"gimgs/class_{i % 3}/{i:03d}.png"] = (d / f"{i:03d}.png").read_bytes()
    gcs_server.put_many("bkt", objects)
    local = _rows(sbloader.read_images(str(root), files_per_partition=4))
    gcs_server.gets.clear()
    ds = sbloader.read_images("gs://bkt/gimgs/", files_per_partition=4, cache_dir=str(tmp_path / "cache"),
                              max_in_flight=4)
    LAST_LISTING.fetched.wait()
    remote = _rows(ds)
    assert sorted(remote) == sorted(f"gs://bkt/gimgs/{os.path.relpath(p, root)}" for p in local)
    for p, arr in local.items():
        assert np.array_equal(remote[f"gs://bkt/gimgs/{os.path.relpath(p, root)}"], arr)
    assert dict(gcs_server.gets) == {k: 1 for k in objects}
    again = _rows(ds)
    assert sorted(again) == sorted(remote)
    assert dict(gcs_server.gets) == {k: 1 for k in objects}  # the second epoch from the cache
    c = ds.stats().operators[0].counters
    assert (c["cache_hits"], c["cache_misses"]) == (15, 0)


@pytest.mark.parametrize("cache", [True, False])
def test_webdataset_shards_from_gs_by_brace_pattern_equal_local(ray_session, gcs_server, tmp_path, cache):
    """``read_webdataset("gs://...{a..b}.tar")`` through obstore: the rows of the shards on local
    disk; with the cache, each shard one GET (when indexed) over two epochs; without it, ranged
    GETs (the headers, then one per partition), and every epoch reads the store again."""
    pytest.importorskip("obstore")
    pytest.importorskip("webdataset")
    from sbloader.sources import tar_index
    from wds_shards import rows_by_key, write_shards

    local = write_shards(str(tmp_path / "wds"), shards=3, per_shard=7)
    prefix = f"gwds-{int(cache)}"
    gcs_server.put_many("bkt", {f"{prefix}/{os.path.basename(p)}": open(p, "rb").read() for p in local})
    want = rows_by_key(sbloader.read_webdataset(local, decode=False, samples_per_partition=3))
    tar_index._INDEXES.clear()
    gcs_server.gets.clear()
    ds = sbloader.read_webdataset(f"gs://bkt/{prefix}/train-{{000000..000002}}.tar", decode=False,
                                  samples_per_partition=3, cache=cache, cache_dir=str(tmp_path / "cache"))
    got = rows_by_key(ds)
    assert got == want and len(got) == 21
    c = ds.stats().operators[0].counters  # the first epoch's
    assert all(str(u).startswith(f"gs://bkt/{prefix}/") for u in {r["__url__"] for r in ds.iter_rows()})
    shards = [f"{prefix}/train-{i:06d}.tar" for i in range(3)]
    def gets() -> dict:  # this test's objects only: a GET of an earlier test's still in flight is not ours
        return {k: n for k, n in dict(gcs_server.gets).items() if k.startswith(f"{prefix}/")}
    if cache:
        assert gets() == {k: 1 for k in shards}  # indexed whole into the cache, then read there
        assert (c["cache_hits"], c["cache_misses"], c.get("range_reads", 0)) == (6, 3, 0)
    else:
        assert sorted(gets()) == shards and c["range_reads"] == 9 and "cache_misses" not in c
        before = sum(gets().values())
        assert rows_by_key(ds) == want
        assert sum(gets().values()) - before == 9  # one ranged GET per partition, every epoch
