"""A read task's objects are cached as one pack while its operators run, not before its block
goes on (#47: ~20 ms of a 64-object read on 2 cores, in front of every block's decode):
against the S3 test server, with the cache's pack write held back until the test has seen
the read return (ordered events, not timings)."""
from __future__ import annotations

import threading

import pytest

from sbloader.core.context import join_deferred
from sbloader.executor.tasks import EpochInfo, read_partition
from sbloader.sources import cache as cache_mod
from sbloader.sources import images
from sbloader.sources.base import Partition
from sbloader.sources.fetch import remote_files
from sbloader.sources.filesystems import list_uris

BUCKET = "sbloader-packlater"


@pytest.fixture(scope="module")
def objects(s3_server):
    pytest.importorskip("obstore")
    s3_server.ensure_bucket(BUCKET)
    s3_server.put_many(BUCKET, {f"o/{i:02d}.jpg": bytes([i]) * (100 + i) for i in range(8)})
    return s3_server


def _reader(tmp_path, cache_max_bytes=None):
    listed = list_uris([f"s3://{BUCKET}/o/"], (".jpg",), "image")
    remote = remote_files({o.uri: (o.size, o.mtime_ns) for o in listed}, None, True, str(tmp_path / "c"),
                          cache_max_bytes)
    read = images.ImageSource([o.uri for o in listed], 8, None, None, "raise", decode=False, remote=remote).reader()
    return read, Partition(0, len(listed), tuple(o.uri for o in listed))


def test_a_read_hands_its_block_on_before_its_pack_is_written_and_its_task_waits_for_it(objects, tmp_path,
                                                                                       monkeypatch):
    read, part = _reader(tmp_path)
    events: list = []
    gate = threading.Event()
    put_pack = cache_mod.DiskCache.put_pack

    def held_put_pack(self, items, *a, **kw):
        gate.wait(20)  # the old read waited here before returning: the test fails, it does not hang
        events.append(("pack", len(items)))
        return put_pack(self, items, *a, **kw)

    monkeypatch.setattr(cache_mod.DiskCache, "put_pack", held_put_pack)
    counters: dict = {}
    deferred: list = []
    block, _ = read_partition((read, None), part, EpochInfo(0, 0, False), "read", counters, deferred)
    events.append(("block", len(block["image"])))
    gate.set()
    join_deferred(deferred, counters)
    assert events == [("block", 8), ("pack", 8)]
    assert [bytes(b) for b in block["image"]] == [bytes([i]) * (100 + i) for i in range(8)]
    assert counters["cache_misses"] == 8 and "not_admitted" not in counters and not deferred
    objects.proxy.reset_counts()  # written: a second read takes every object from the cache
    again, _ = read_partition((read, None), part, EpochInfo(1, 0, False), "read", {})
    assert objects.proxy.object_gets == 0 and [bytes(b) for b in again["image"]] == \
        [bytes(b) for b in block["image"]]


def test_what_a_deferred_pack_did_not_admit_is_counted_in_its_task_and_untaken_ones_are_joined_at_exit(
        objects, tmp_path):
    read, part = _reader(tmp_path / "small", cache_max_bytes=300)  # room for two or so of the eight
    counters: dict = {}
    read_partition((read, None), part, EpochInfo(0, 0, False), "read", counters)  # no list: joined at exit
    assert counters["cache_misses"] == 8 and 1 <= counters["not_admitted"] <= 8
    deferred: list = []
    read2, part2 = _reader(tmp_path / "small2", cache_max_bytes=300)
    counters2: dict = {}
    read_partition((read2, None), part2, EpochInfo(0, 0, False), "read", counters2, deferred)
    assert len(deferred) == 1 and "not_admitted" not in counters2
    join_deferred(deferred, counters2)
    assert counters2["not_admitted"] == counters["not_admitted"] and counters2["cache_misses"] == 8
