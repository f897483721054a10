"""``gs://`` through obstore, against a GCS emulator on 127.0.0.1 (``STORAGE_EMULATOR_HOST``):
listed (pyarrow's JSON-API listing, and page by page through obstore), read with one GET
per object, then from the cache with none; a byte range with one ranged GET; a missing
object named."""
from __future__ import annotations

import pytest

from sbloader.core.context import task_context
from sbloader.sources import filesystems, object_client
from sbloader.sources.fetch import remote_files
from sbloader.sources.filesystems import list_uris
from sbloader.sources.listing_pages import stream_pages
from sbloader.sources.object_client import ObstoreClient, client_for

OBJECTS = {f"imgs/{i:02d}.bin": bytes([i]) * (1000 + i) for i in range(12)}


@pytest.fixture(scope="module")
def gcs(gcs_server):
    pytest.importorskip("obstore")
    gcs_server.put_many("bkt", {**OBJECTS, "other/x.bin": b"x"})
    return gcs_server


@pytest.fixture
def emulated(gcs, monkeypatch):
    """``gs://`` goes to the emulator (as the session's environment says); clients built in
    this test only."""
    assert gcs.endpoint == filesystems.gcs_emulator()
    monkeypatch.setattr(object_client, "_STORES", {})
    monkeypatch.setattr(filesystems, "_FS_CACHE", {})
    gcs.gets.clear()
    return gcs


def test_gs_lists_and_reads_through_obstore_once_per_object_then_from_the_cache(emulated, tmp_path):
    listed = list_uris(["gs://bkt/imgs/"], (".bin",), "object")
    assert [o.uri for o in listed] == [f"gs://bkt/{k}" for k in sorted(OBJECTS)]
    assert [o.size for o in listed] == [len(OBJECTS[k]) for k in sorted(OBJECTS)]
    assert all(o.mtime_ns > 0 for o in listed)
    assert isinstance(client_for(listed[0].uri), ObstoreClient)
    rf = remote_files({o.uri: (o.size, o.mtime_ns) for o in listed}, None, True, str(tmp_path / "c"), None, 4)
    for epoch in range(2):
        with task_context(0, 0, 0, "read", -1) as ctx:
            got = dict(rf.read_many([o.uri for o in listed]))
        assert got == {f"gs://bkt/{k}": v for k, v in OBJECTS.items()}
        assert dict(emulated.gets) == {k: 1 for k in OBJECTS}  # one GET each, none in the second epoch
        c = ctx.counters
        assert (c["cache_hits"], c["cache_misses"]) == ((0, 12) if epoch == 0 else (12, 0))


def test_gs_lists_page_by_page_through_obstore(emulated):
    pages = list(stream_pages("gs://bkt/imgs/", "bkt/imgs", None))
    assert [p for page in pages for p, _, _ in page] == [f"bkt/{k}" for k in sorted(OBJECTS)]
    assert all(size == len(OBJECTS[p[4:]]) and ns > 0 for page in pages for p, size, ns in page)


def test_gs_lists_the_keys_after_a_key(emulated):
    """A key range's listing (``start-after``: what a long listing is cut into, #47)."""
    keys = [p for page in stream_pages("gs://bkt/imgs/", "bkt/imgs", None, after="bkt/imgs/05.bin") for p, _, _ in page]
    assert keys == [f"bkt/{k}" for k in sorted(OBJECTS) if k > "imgs/05.bin"]


def test_gs_byte_range_and_a_missing_object(emulated, tmp_path):
    uri = "gs://bkt/imgs/03.bin"
    rf = remote_files({uri: (1003, 1), "gs://bkt/imgs/nope.bin": (5, 1)}, None, False, None, None)
    with task_context(0, 0, 0, "read", -1) as ctx:
        assert rf.read_range(uri, 10, 20) == bytes([3]) * 10
    assert ctx.counters["range_reads"] == 1 and emulated.gets["imgs/03.bin"] == 1
    with pytest.raises(FileNotFoundError, match="gs://bkt/imgs/nope.bin"):
        rf.read("gs://bkt/imgs/nope.bin")
