"""The pure parts of remote reading: URI schemes, the retry rule, the disk cache's
eviction rule and atomic entries, and RemoteFiles over a filesystem that fails."""
from __future__ import annotations

import os
import random
import threading
import time

import pyarrow.fs as pafs
import pytest

from sbloader.core.context import task_context
from sbloader.sources import cache as cache_mod
from sbloader.sources.cache import CacheConfig, DiskCache, cache_config, entry_name
from sbloader.sources.fetch import RemoteFiles, RetryPolicy, is_retryable, remote_files
from sbloader.sources.filesystems import is_remote, list_uris, resolve, scheme_of


def test_schemes_and_local_paths():
    assert scheme_of("s3://b/k") == "s3" and scheme_of("GS://b/k") == "gs" and scheme_of("https://h/x") == "https"
    assert scheme_of("/data/x.jpg") == "" and scheme_of("file:///data/x") == "" and scheme_of("C://x") == ""
    assert is_remote("s3://b/k") and not is_remote("relative/path")
    fs, path = resolve("file:///tmp/x.jpg")
    assert isinstance(fs, pafs.LocalFileSystem) and path == "/tmp/x.jpg"


def test_user_filesystem_lists_and_names_objects_by_uri(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("b.jpg", "a.jpg", "sub/c.JPG", ".hidden.jpg", "notes.txt"):
        (tmp_path / "d" / name).write_bytes(b"12345")
    fs = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    objs = list_uris(["mem://d"], (".jpg",), "image", filesystem=fs)
    assert [o.uri for o in objs] == ["mem://d/a.jpg", "mem://d/b.jpg", "mem://d/sub/c.JPG"]
    assert all(o.size == 5 and o.mtime_ns > 0 for o in objs)
    with pytest.raises(FileNotFoundError, match="mem://nothing"):
        list_uris(["mem://nothing"], None, "image", filesystem=fs)
    with pytest.raises(ValueError, match="found no image objects"):
        list_uris(["mem://d"], (".png",), "image", filesystem=fs)


def test_which_failures_are_retried():
    assert is_retryable(OSError("AWS Error SLOW_DOWN during GetObject operation: HTTP response code: 503"))
    assert is_retryable(ConnectionResetError("reset")) and is_retryable(TimeoutError())
    assert is_retryable(OSError("AWS Error NETWORK_CONNECTION during GetObject: curlCode: 56"))
    assert not is_retryable(FileNotFoundError("x")) and not is_retryable(PermissionError("x"))
    assert not is_retryable(OSError("AWS Error ACCESS_DENIED (AccessDenied) HTTP response code: 403"))
    assert not is_retryable(ValueError("bad"))


def test_backoff_doubles_up_to_its_cap():
    policy, rng = RetryPolicy(attempts=8, base_s=0.1, max_s=0.5), random.Random(0)
    for retry in range(8):
        draws = [policy.backoff(retry, rng) for _ in range(200)]
        assert 0 <= min(draws) and max(draws) <= min(0.5, 0.1 * 2 ** retry)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="cache_max_bytes"):
        cache_config(True, None, -1)
    with pytest.raises(ValueError, match="cache must be True or False"):
        cache_config("yes", None, None)
    with pytest.raises(ValueError, match="max_in_flight"):
        remote_files({"s3://b/k": (1, 0)}, None, True, None, None, 0)
    assert remote_files({}, None, True, None, None, 4) is None


def test_entries_are_per_version_atomic_and_checked_by_size(tmp_path):
    c = DiskCache(str(tmp_path))
    assert entry_name("s3://b/k", "3-1") != entry_name("s3://b/k", "3-2")
    p = c.put("s3://b/k", "3-1", b"abc")
    assert c.get("s3://b/k", "3-1", 3) == p and open(p, "rb").read() == b"abc"
    assert c.get("s3://b/k", "3-2", 3) is None  # another version of the object
    assert c.get("s3://b/k", "3-1", 4) is None  # a size that does not match is a miss
    assert not [n for _, _, fs in os.walk(tmp_path) for n in fs if n.startswith(".tmp-")]


def test_a_full_cache_evicts_only_entries_not_read_lately_and_otherwise_admits_nothing(tmp_path, monkeypatch):
    c = DiskCache(str(tmp_path), max_bytes=10)
    old = c.put("s3://b/old", "4-0", b"oooo")
    assert c.put("s3://b/new", "4-0", b"nnnn") is not None
    # Both read just now: protected, so the next object is served without being cached.
    assert c.put("s3://b/third", "4-0", b"tttt") is None
    assert c.get("s3://b/old", "4-0", 4) and c.get("s3://b/new", "4-0", 4)
    # An entry not read for longer than PROTECT_S makes room (oldest first).
    past = time.time() - cache_mod.PROTECT_S - 5
    os.utime(old, (past, past))
    assert c.put("s3://b/third", "4-0", b"tttt") is not None
    assert c.get("s3://b/old", "4-0", 4) is None and c.used_bytes() == 8
    assert c.put("s3://b/huge", "11-0", b"x" * 11) is None  # larger than the whole cache


class _Flaky(pafs.FileSystemHandler):
    """A local directory whose first ``fail`` opens of each file fail as a throttled store does."""

    def __init__(self, root: str, fail: int, error: Exception, delay_s: float = 0.0) -> None:
        self.root, self.fail, self.error, self.opens, self.delay_s = root, fail, error, {}, delay_s

    def open_input_stream(self, path):
        n = self.opens[path] = self.opens.get(path, 0) + 1
        time.sleep(getattr(self, "slow_s", 0.0))  # every answer after a round trip
        if n <= self.fail:
            time.sleep(self.delay_s)  # a throttled store answers after a round trip
            raise self.error
        return pafs.LocalFileSystem().open_input_stream(os.path.join(self.root, path))

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def get_type_name(self):
        return "flaky"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return pafs.LocalFileSystem().get_file_info([os.path.join(self.root, p) for p in paths])

    def get_file_info_selector(self, selector):
        raise NotImplementedError

    def create_dir(self, *a): raise NotImplementedError
    def delete_dir(self, *a): raise NotImplementedError
    def delete_dir_contents(self, *a): raise NotImplementedError
    def delete_root_dir_contents(self, *a): raise NotImplementedError
    def delete_file(self, *a): raise NotImplementedError
    def move(self, *a): raise NotImplementedError
    def copy_file(self, *a): raise NotImplementedError
    def open_input_file(self, *a): raise NotImplementedError
    def open_output_stream(self, *a): raise NotImplementedError
    def open_append_stream(self, *a): raise NotImplementedError


def _flaky_files(tmp_path, fail, error, cache, delay_s=0.0):
    for i in range(5):
        (tmp_path / f"{i}.bin").write_bytes(bytes([i]) * (i + 1))
    handler = _Flaky(str(tmp_path), fail, error, delay_s)
    versions = {f"flaky://{i}.bin": (i + 1, 7) for i in range(5)}
    rf = RemoteFiles(pafs.PyFileSystem(handler), CacheConfig(cache, str(tmp_path / "cache")), versions, 3,
                     RetryPolicy(attempts=4, base_s=0.001, max_s=0.002))
    return rf, handler


def test_throttled_reads_are_retried_and_counted_then_served_from_the_cache(tmp_path, monkeypatch):
    from sbloader.sources import inflight

    monkeypatch.setattr(inflight, "_POOL", [])  # this process's fetch pool: max_in_flight=3 threads, no more
    rf, handler = _flaky_files(tmp_path, 2, OSError("HTTP response code: 503 SlowDown"), cache=True, delay_s=0.05)
    with task_context(0, 0, 0, "read", -1) as ctx:
        got = list(rf.read_many(sorted(rf.versions)))
    assert [b for _, b in got] == [bytes([i]) * (i + 1) for i in range(5)]
    c = dict(ctx.counters)
    # All 5 objects are asked for at once; the pool's 3 threads each hold a throttled open of
    # 50 ms, so 3 requests are in flight together. The first object needs two such opens before
    # its bytes come, and the reader waits for it at once (counted in whole ms).
    assert c.pop("peak_in_flight") == 3 and c.pop("store_wait_ms") >= 100
    assert c == {"retries": 10, "cache_hits": 0, "cache_misses": 5, "cache_hit_ratio": 0.0, "objects_read": 5,
                 "bytes_read": 15}
    with task_context(0, 0, 0, "read", -1) as ctx:
        assert rf.read("flaky://4.bin") == b"\x04" * 5
    c = dict(ctx.counters)
    c.pop("store_wait_ms", None)
    assert c == {"cache_hits": 1, "cache_misses": 0, "cache_hit_ratio": 1.0, "cache_bytes": 5}
    assert handler.opens["4.bin"] == 3


def test_a_cached_source_always_shows_hits_misses_and_their_ratio():
    from sbloader.core.context import merge_counters
    from sbloader.core.stats import ExecutionStats, OperatorStats

    op = OperatorStats("ReadImages")
    for task in ({"cache_hits": 3, "cache_bytes": 30}, {"cache_hits": 1, "cache_hit_ratio": 1.0}):
        merge_counters(op.counters, tuple(sorted(task.items())))  # as blocks' metadata carry them
    assert op.counters == {"cache_hits": 4, "cache_misses": 0, "cache_hit_ratio": 1.0, "cache_bytes": 30}
    merge_counters(op.counters, {"cache_misses": 4, "objects_read": 4, "cache_hit_ratio": 0.25})
    assert op.counters["cache_hit_ratio"] == 0.5  # derived from the sums, never summed itself
    assert "cache_hit_ratio 0.50, cache_hits 4, cache_misses 4" in str(ExecutionStats([op]))
    plain = {}
    merge_counters(plain, {"objects_read": 2, "bytes_read": 9})  # no cache (cache=False): no ratio
    assert plain == {"objects_read": 2, "bytes_read": 9}


def test_objects_fetched_ahead_count_as_misses_of_the_read_that_takes_them_then_hits(tmp_path, monkeypatch):
    """A cold epoch's hit ratio is 0 whatever was fetched ahead: the read that takes an entry
    fetched ahead of it (by an earlier task, while listing, for an index) counts a miss (the
    object came from the store for this epoch), the reads after it count hits. Before, the
    objects fetched ahead showed as hits, and a cold epoch read a hit ratio near 1."""
    from sbloader.sources import inflight

    monkeypatch.setattr(inflight, "_POOL", [])
    rf, handler = _flaky_files(tmp_path, 0, OSError("unused"), cache=True)
    first, ahead = ["flaky://0.bin", "flaky://1.bin"], ["flaky://2.bin", "flaky://3.bin", "flaky://4.bin"]
    with task_context(0, 0, 0, "read", -1) as ctx:  # a task fetching the next partition's objects ahead
        assert len(list(rf.read_many(first, ahead=ahead))) == 2
    assert (ctx.counters["cache_hits"], ctx.counters["cache_misses"], ctx.counters["objects_read"]) == (0, 2, 2)
    assert "prefetched" not in ctx.counters  # the GETs made ahead are counted by the reads that take them
    _wait_for_entries(rf, ahead)  # the read did not wait for its fetch-ahead
    assert rf.prefetch(ahead, collect=True) == []  # another task's look ahead: cached, the marks left on
    for u in ahead:
        rf._prefetch_one(u)  # a fetch ahead racing the look: finds the entry, leaves the mark
    for epoch, want, gets in ((0, (0, 3, 0.0), 3), (1, (3, 0, 1.0), 0)):  # the next task, then the next epoch
        with task_context(epoch, 0, 1, "read", -1) as ctx:
            assert [b for _, b in rf.read_many(ahead)] == [bytes([i]) * (i + 1) for i in (2, 3, 4)]
        c = ctx.counters
        assert (c["cache_hits"], c["cache_misses"], c["cache_hit_ratio"]) == want, c
        # fetched once, by the fetch ahead, and that GET counted once: by the read that took it
        assert (c.get("objects_read", 0), c.get("prefetched", 0), c.get("bytes_read", 0)) == (gets, gets, 12 * (gets > 0))
    src = RemoteFiles(rf.filesystem, rf.cache, rf.versions, 3)
    src.local("flaky://0.bin", ahead=True)  # already cached: not marked again
    with task_context(1, 0, 2, "read", -1) as ctx:
        src.local("flaky://0.bin")
    assert ctx.counters["cache_hits"] == 1 and ctx.counters["cache_misses"] == 0
    assert all(n == 1 for n in handler.opens.values()), handler.opens


def test_a_read_ends_without_waiting_for_its_fetch_ahead_and_the_reads_that_take_it_count_its_gets(
        tmp_path, monkeypatch):
    """Its objects back, a read task's block goes on while the next partitions' objects are still
    being fetched into the cache (before #47 it waited for them, to count their GETs itself: a
    decode in a following map_batches waited too); each GET is then counted once, by the read that
    takes the entry."""
    from sbloader.sources import inflight

    monkeypatch.setattr(inflight, "_POOL", [])  # 3 threads: objects 0, 1 and 2 start first, 3 and 4 after
    rf, handler = _flaky_files(tmp_path, 0, OSError("unused"), cache=True)
    handler.slow_s = 0.5
    own, ahead = ["flaky://0.bin", "flaky://1.bin"], ["flaky://2.bin", "flaky://3.bin", "flaky://4.bin"]
    with task_context(0, 0, 0, "read", -1) as ctx:
        assert [b for _, b in rf.read_many(own, ahead=ahead)] == [b"\x00", b"\x01" * 2]
        assert rf._cached("flaky://4.bin", take=False)[0] is None  # still on its way
    assert (ctx.counters["objects_read"], ctx.counters["bytes_read"]) == (2, 3) and "prefetched" not in ctx.counters
    _wait_for_entries(rf, ahead)
    with task_context(0, 0, 1, "read", -1) as ctx:
        assert [b for _, b in rf.read_many(ahead)] == [bytes([i]) * (i + 1) for i in (2, 3, 4)]
    c = ctx.counters
    assert (c["objects_read"], c["bytes_read"], c["prefetched"], c["cache_misses"], c["cache_hits"]) == (3, 12, 3, 3, 0)
    assert all(n == 1 for n in handler.opens.values()), handler.opens  # one GET per object


def test_a_reads_fetch_ahead_starts_once_its_own_objects_are_answered(tmp_path, monkeypatch):
    """A read task asks for its own objects first and for the next partitions' only once every
    one of its own is answered: the first partition of an epoch, whose task starts alone, had
    its 64 GETs share the process with the next partitions' and came 2-3 round trips late
    (86-109 ms at 20 ms a request in the bucket scenario, 39-48 ms after; #47)."""
    from sbloader.sources import inflight

    monkeypatch.setattr(inflight, "_POOL", [])
    rf, handler = _flaky_files(tmp_path, 0, OSError("unused"), cache=True)
    handler.slow_s = 0.1
    spans, lock = {}, threading.Lock()
    opened = handler.open_input_stream

    def timed(path):
        t0 = time.monotonic()
        try:
            return opened(path)
        finally:
            with lock:
                spans[path] = (t0, time.monotonic())

    handler.open_input_stream = timed
    own, ahead = ["flaky://0.bin", "flaky://1.bin"], ["flaky://2.bin", "flaky://3.bin", "flaky://4.bin"]
    with task_context(0, 0, 0, "read", -1):
        assert [b for _, b in rf.read_many(own, ahead=ahead)] == [b"\x00", b"\x01" * 2]
    _wait_for_entries(rf, ahead)
    own_answered = max(spans[p][1] for p in ("0.bin", "1.bin"))
    assert all(spans[p][0] >= own_answered for p in ("2.bin", "3.bin", "4.bin")), spans  # 3 threads: one was free
    assert all(n == 1 for n in handler.opens.values()), handler.opens


def test_a_reads_fetch_ahead_with_ahead_after_s_waits_for_a_round_trip_that_long(tmp_path, monkeypatch):
    """With ``ahead_after_s`` (the plan's first image partition) the next partitions are fetched
    ahead only when the read's own objects took that long to be answered: after a short round trip
    the next reads wait little for their own, and the fetch would share the first batch's process
    (#47)."""
    from sbloader.sources import inflight

    monkeypatch.setattr(inflight, "_POOL", [])
    rf, handler = _flaky_files(tmp_path, 0, OSError("unused"), cache=True)
    handler.slow_s = 0.05
    with task_context(0, 0, 0, "read", -1):
        got = rf.read_many(["flaky://0.bin"], ahead=["flaky://1.bin"], ahead_after_s=30.0)
        assert [b for _, b in got] == [b"\x00"]
        time.sleep(0.3)
        assert rf._cached("flaky://1.bin", take=False)[0] is None and set(handler.opens) == {"0.bin"}
        assert [b for _, b in rf.read_many(["flaky://2.bin"], ahead=["flaky://3.bin"], ahead_after_s=0.04)] \
            == [b"\x02" * 3]
    _wait_for_entries(rf, ["flaky://3.bin"])
    assert set(handler.opens) == {"0.bin", "2.bin", "3.bin"} and all(n == 1 for n in handler.opens.values())


def test_when_answered_calls_once_after_the_last_future_or_at_once_without_any():
    from concurrent.futures import Future

    from sbloader.sources.inflight import when_answered

    calls = []
    when_answered([], lambda: calls.append("none"))
    assert calls == ["none"]
    fs = [Future() for _ in range(3)]
    when_answered(fs, lambda: calls.append("all"))
    fs[2].set_result(1)
    fs[0].set_exception(OSError("a failed GET is answered too"))
    assert calls == ["none"]
    fs[1].set_result(2)
    assert calls == ["none", "all"]
    done = Future()
    done.set_result(0)
    when_answered([done], lambda: calls.append("done"))  # already answered: at once, in this thread
    assert calls[-1] == "done"


def test_an_object_being_fetched_ahead_is_not_asked_for_again_by_the_next_task(tmp_path, monkeypatch):
    """The next task's fetch-ahead skips the objects the last one is still fetching ahead (before,
    each was submitted again and held a fetch thread waiting on the entry's lock)."""
    from sbloader.sources import ahead as ahead_mod, inflight

    monkeypatch.setattr(inflight, "_POOL", [])
    rf, handler = _flaky_files(tmp_path, 0, OSError("unused"), cache=True)
    handler.slow_s = 0.3
    ahead = ["flaky://2.bin", "flaky://3.bin", "flaky://4.bin"]
    first = rf.prefetch(ahead, collect=True, count=True)
    assert len(first) == 3 and ahead_mod.not_in_flight(rf.cache.dir, ahead) == []
    assert len(rf.prefetch(ahead + ["flaky://1.bin"], collect=True, count=True)) == 1  # 1.bin only
    for f in first:
        assert f.result(timeout=20) == {}  # the GET is left to the read that takes the entry
    _wait_for_entries(rf, ahead + ["flaky://1.bin"])
    assert ahead_mod.not_in_flight(rf.cache.dir, ahead) == ahead
    assert all(n == 1 for n in handler.opens.values()), handler.opens


def test_a_fetch_aheads_retries_are_counted_by_the_read_that_takes_its_entry(tmp_path, monkeypatch):
    """The retries of a fetch ahead travel with its cache entry (``RETRY_MARK``) to the read that
    takes it, whichever process that read runs in. Before, they waited for the fetching process's
    next read: a fetch ahead that retried after that process's last read of the epoch went
    uncounted (``retries`` 4 of 5 in test_remote's injected faults, in CI)."""
    from sbloader.sources import ahead as ahead_mod, inflight

    monkeypatch.setattr(inflight, "_POOL", [])
    rf, handler = _flaky_files(tmp_path, 2, OSError("HTTP response code: 503 SlowDown"), cache=True)
    ahead = ["flaky://2.bin", "flaky://3.bin"]
    ahead_mod.take_background()
    rf.prefetch(ahead, count=True)  # as a read task does, not waiting for it
    _wait_for_entries(rf, ahead)
    time.sleep(0.05)  # the fetches' done callbacks
    assert ahead_mod.take_background() == {}  # nothing left for this process's next read
    for uri in ahead:
        with task_context(0, 0, 1, "read", -1) as ctx:
            assert [b for _, b in rf.read_many([uri])] == [handler_bytes(uri)]
        assert ctx.counters["retries"] == 2 and ctx.counters["objects_read"] == 1, ctx.counters
    with task_context(1, 0, 1, "read", -1) as ctx:  # the next epoch: a hit, no retries again
        assert [b for _, b in rf.read_many(ahead)] == [handler_bytes(u) for u in ahead]
    assert "retries" not in ctx.counters and ctx.counters["cache_hits"] == 2
    dirs = {os.path.dirname(rf._cached(u, take=False)[0]) for u in ahead}
    assert not [n for d in dirs for n in os.listdir(d) if n.endswith(".retries")]  # taken with the marks


def handler_bytes(uri: str) -> bytes:
    """What ``_flaky_files`` wrote at ``uri``."""
    i = int(uri.rsplit("/", 1)[1].split(".")[0])
    return bytes([i]) * (i + 1)


def _wait_for_entries(rf, uris, timeout=20.0):
    """Until every one of ``uris`` is in the cache (the fetch ahead runs after its read ended)."""
    deadline = time.monotonic() + timeout
    while any(rf._cached(u, take=False)[0] is None for u in uris):
        assert time.monotonic() < deadline, "the fetch ahead never filled the cache"
        time.sleep(0.01)


def test_readers_racing_for_an_entry_fetched_ahead_count_one_miss(tmp_path, monkeypatch):
    """Readers that all saw an entry's fetched-ahead mark count one miss between them, however they
    interleave (the mark is taken under a lock; before, each reader that saw it counted a miss: a
    WebDataset shard's partitions read at once counted two or three)."""
    cache = DiskCache(str(tmp_path / "cache"))
    p = cache.path_for("s3://b/k.bin", "v1")
    assert cache.put_at(p, b"x" * 10, ahead=True) == p
    real_stat, seen = os.stat, threading.Barrier(8)

    def stat_then_wait(path, *a, **kw):  # every reader has seen the mark before any takes it
        st = real_stat(path, *a, **kw)
        if path == p:
            seen.wait(timeout=10)
        return st
    monkeypatch.setattr(cache_mod.os, "stat", stat_then_wait)
    results: list = []
    readers = [threading.Thread(target=lambda: results.append(cache.check(p, 10))) for _ in range(8)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(timeout=20)
    assert len(results) == 8 and all(r[0] == p for r in results)
    assert sum(1 for _, ahead in results if ahead) == 1


def test_without_a_cache_no_hit_or_miss_is_counted(tmp_path):
    rf, _ = _flaky_files(tmp_path, 0, OSError("unused"), cache=False)
    with task_context(0, 0, 0, "read", -1) as ctx:
        assert [b for _, b in rf.read_many(sorted(rf.versions))][0] == b"\x00"
    assert ctx.counters["objects_read"] == 5 and not any(k.startswith("cache_") for k in ctx.counters)


class _Gated(_Flaky):
    """Holds the GET of ``4.bin`` until ``gate`` is set (``timed_out`` if it never was)."""

    def __init__(self, root):
        super().__init__(root, 0, None)
        self.gate, self.timed_out = threading.Event(), False

    def open_input_stream(self, path):
        if path == "4.bin":
            self.timed_out = not self.gate.wait(10)
        return super().open_input_stream(path)


@pytest.mark.parametrize("cache", [True, False])
def test_a_read_task_decodes_its_first_objects_while_its_last_is_still_in_flight(tmp_path, monkeypatch, cache):
    import numpy as np

    from sbloader.sources import images
    from sbloader.sources.base import Partition

    for i in range(5):
        (tmp_path / f"{i}.bin").write_bytes(bytes([i]) * (i + 1))
    handler = _Gated(str(tmp_path))
    versions = {f"flaky://{i}.bin": (i + 1, 7) for i in range(5)}
    rf = RemoteFiles(pafs.PyFileSystem(handler), CacheConfig(cache, str(tmp_path / "cache")), versions, 5)
    decoded = []

    def decode(data, size, mode, name=None):  # the last object cannot be in before the first decode lets it
        decoded.append((name, handler.gate.is_set()))
        handler.gate.set()
        return np.full((1, 1, 1), data[0], np.uint8)

    monkeypatch.setattr(images, "_decode_bytes", decode)
    block = images._read_image_files(None, Partition(0, 5, tuple(sorted(versions))), size=None, mode=None,
                                     on_error="raise", remote=rf)
    assert not handler.timed_out and decoded[0] == ("flaky://0.bin", False)
    assert [n for n, _ in decoded] == sorted(versions) and block["image"][:, 0, 0, 0].tolist() == [0, 1, 2, 3, 4]


def test_a_missing_object_or_too_many_failures_name_the_uri(tmp_path):
    rf, _ = _flaky_files(tmp_path, 9, OSError("HTTP response code: 500"), cache=False)
    with pytest.raises(OSError, match=r"cannot read 'flaky://1.bin' after 4 tries"):
        rf.read("flaky://1.bin")
    rf, _ = _flaky_files(tmp_path, 9, FileNotFoundError("gone"), cache=False)
    (got,) = list(rf.read_many(["flaky://0.bin"]))
    assert isinstance(got[1], FileNotFoundError) and "flaky://0.bin" in str(got[1])


def test_an_fsspec_filesystem_lists_and_reads_through_the_same_path(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    mem = fsspec.filesystem("memory")
    for name, data in (("bkt/x/b.png", b"bb"), ("bkt/x/a.png", b"a"), ("bkt/x/sub/c.png", b"ccc")):
        mem.pipe(f"memory://{name}", data)
    objs = list_uris(["memory://bkt/x"], (".png",), "image", filesystem=mem)
    assert [(o.uri, o.size) for o in objs] == [("memory://bkt/x/a.png", 1), ("memory://bkt/x/b.png", 2),
                                               ("memory://bkt/x/sub/c.png", 3)]
    rf = remote_files({o.uri: (o.size, o.mtime_ns) for o in objs}, mem, True, str(tmp_path), None, 2)
    assert [b for _, b in rf.read_many([o.uri for o in objs])] == [b"a", b"bb", b"ccc"]
    assert rf.read("memory://bkt/x/sub/c.png") == b"ccc"  # now from the cache
    src = rf.local("memory://bkt/x/b.png")  # a member of read_many's pack: in memory, not a file of its own
    if isinstance(src, str):
        with open(src, "rb") as f:
            assert f.read() == b"bb"
    else:
        assert src.read() == b"bb"


def test_files_ahead_are_the_next_distinct_files():
    from sbloader.sources.ahead import EpochAhead
    from sbloader.sources.fetch import files_ahead

    shared = EpochAhead.of(("a", "a", "b", "b", "c", "d"), 0, False)  # each partition's file, unshuffled
    assert files_ahead(shared, 0) == ["b", "c"] and files_ahead(shared, 4) == ["d"] and files_ahead(shared, 5) == []
    assert files_ahead(None, 0) == []


def test_only_the_plans_first_image_partition_fetches_ahead_after_a_long_round_trip_only():
    """The plan's first partition (its task runs alone and makes the batch the trainer waits for)
    fetches the next ones ahead only after a round trip of ``FIRST_AHEAD_AFTER_S``; every other
    partition fetches the next ``PREFETCH_PARTITIONS`` in the plan's order as soon as its own are in."""
    from sbloader.sources import images
    from sbloader.sources.ahead import EpochAhead
    from sbloader.sources.base import Partition

    members = tuple(tuple(f"s3://b/{p}-{i}" for i in range(2)) for p in range(6))
    shared = EpochAhead.of(members, 9, True)
    asked = {}

    class Remote:
        def read_many(self, uris, ahead=(), ahead_after_s=0.0):
            asked[uris[0]] = (list(ahead), ahead_after_s)
            return ((u, b"x") for u in uris)

    for pid in shared.order[:3]:
        block = images._read_image_files(shared, Partition(pid, 2, members[pid]), size=None, mode=None,
                                         on_error="raise", decode=False, remote=Remote())
        assert list(block["path"]) == list(members[pid])
    assert shared.order != tuple(range(6)) and shared.runs_first(shared.order[0])
    for at, pid in enumerate(shared.order[:3]):
        nxt = [u for p in shared.order[at + 1:at + 1 + images.PREFETCH_PARTITIONS] for u in members[p]]
        assert asked[members[pid][0]] == (nxt, images.FIRST_AHEAD_AFTER_S if at == 0 else 0.0)
    assert 0 < images.FIRST_AHEAD_AFTER_S < 0.1


def test_files_ahead_follow_the_epochs_plan_under_shuffle(tmp_path):
    """A Parquet, video or shard source's read task fetches ahead the files of the partitions the
    epoch's plan runs next: under ``shuffle`` a permutation, not the next ids (#47: the files of
    partitions running much later were fetched while the next one's waited for its GET)."""
    from sbloader.core.plan import make_epoch_plan
    from sbloader.sources.ahead import EpochAhead
    from sbloader.sources.cache import CacheConfig
    from sbloader.sources.fetch import RemoteFiles, files_ahead
    from sbloader.sources.base import Partition
    from sbloader.sources.files import IOUnitSource

    class Units(IOUnitSource):
        def __init__(self, paths):
            self._remote = RemoteFiles(None, CacheConfig(True, str(tmp_path / "c")), {})
            self._parts = [Partition(i, 1, type("U", (), {"path": p})(), p) for i, p in enumerate(paths)]

    src = Units([f"s3://b/f{i // 2}" for i in range(12)])  # two partitions a file
    src.partitions(3, 77, shuffle=True)
    shared = src.shared()
    order = make_epoch_plan(range(12), 3, 77, True).order
    assert isinstance(shared, EpochAhead) and shared.order == order and order != tuple(range(12))
    first = order[0]
    want = []
    for pid in order[1:]:
        f = f"s3://b/f{pid // 2}"
        if f != f"s3://b/f{first // 2}" and f not in want:
            want.append(f)
    assert files_ahead(shared, first, 2) == want[:2] and files_ahead(shared, order[-1], 2) == []
    src.partitions(3, 77, shuffle=False)
    assert files_ahead(src.shared(), 0, 2) == ["s3://b/f1", "s3://b/f2"]


def test_peaks_merge_as_maxima_and_other_counts_add_up():
    from sbloader.core.context import merge_counters
    from sbloader.sources.inflight import take_while_within

    into = {"peak_in_flight": 5, "bytes_read": 10}
    merge_counters(into, {"peak_in_flight": 3, "bytes_read": 5, "retries": 0})
    merge_counters(into, (("peak_in_flight", 7), ("objects_read", 1)))
    assert into == {"peak_in_flight": 7, "bytes_read": 15, "objects_read": 1}
    assert take_while_within([4, 4, 4], 8) == 2 and take_while_within([20, 1], 8) == 1
    assert take_while_within([None, None], 0) == 2 and take_while_within([], 8) == 0


def test_the_read_stage_s_bar_shows_the_bytes_from_the_store_and_the_cache(monkeypatch):
    import io as _io
    from types import SimpleNamespace

    import tqdm.auto
    import tqdm.std

    from sbloader.executor.diagnostics import ProgressBars

    made = []

    class Quiet(tqdm.std.tqdm):
        def __init__(self, *a, **kw):
            kw["file"] = _io.StringIO()
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(tqdm.auto, "tqdm", Quiet)
    bars = ProgressBars([SimpleNamespace(ops=[], name="ReadImages")], 10, True)
    bars.show_bytes(0, {"bytes_read": 3 * 2 ** 20, "cache_bytes": 2 ** 19})
    assert made[0].postfix == "store 3.0 MiB, cache 0.5 MiB"
    bars.close()


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_read_task_fetches_ahead_the_partitions_its_epoch_runs_next(shuffle):
    from sbloader.core.plan import make_epoch_plan
    from sbloader.sources.images import ImageSource

    uris = [f"s3://b/{i:03d}.jpg" for i in range(40)]
    rf = remote_files({u: (1, 0) for u in uris}, None, True, None, None)
    src = ImageSource(uris, 4, None, "RGB", "raise", remote=rf)
    parts = src.partitions(0, 11, shuffle=shuffle)
    order = make_epoch_plan([p.id for p in parts], 0, 11, shuffle).order  # as the executor runs them
    ahead = src.shared()
    for i, pid in enumerate(order):
        assert ahead.after(pid, 2) == list(order[i + 1:i + 3])
        assert ahead.members[pid] == parts[pid].payload
    assert (list(order) != sorted(order)) == shuffle  # shuffled, the next ids are not what runs next
    assert ImageSource(uris, 4, None, "RGB", "raise", remote=remote_files({u: (1, 0) for u in uris}, None, False,
                                                                           None, None)).shared() is None


def test_planning_fetches_side_by_side_within_the_byte_budget():
    from sbloader.sources.inflight import side_by_side

    assert side_by_side([10] * 100, 1000, 32) == 32  # the cap
    assert side_by_side([10, 300, 20], 1000, 32) == 3  # all of them
    assert side_by_side([10] * 50 + [400], 1000, 32) == 2  # two of the largest fit
    assert side_by_side([5000], 1000, 32) == 1 and side_by_side([], 1000, 32) == 1  # one at least


def test_remote_videos_are_probed_by_as_many_tasks_as_run_at_once(monkeypatch):
    """64 videos in a bucket on 2 CPUs: 2 probe tasks of 32, each fetching its videos side by side,
    one round trip for all (4 tasks of 16 ran two by two: two round trips, #47); local files: two
    tasks a CPU, as before (their probes are CPU)."""
    import ray

    from sbloader.runtime import session
    from sbloader.sources import video_probe
    from sbloader.sources.cache import CacheConfig
    from sbloader.sources.fetch import RemoteFiles

    chunks = []

    class _Task:
        def remote(self, paths, span, remote):
            chunks.append(len(paths))
            return [video_probe.VideoMeta(p, 1, ()) for p in paths]

    monkeypatch.setattr(video_probe, "_probe_task", _Task())
    monkeypatch.setattr(session, "ensure_initialized", lambda: None)
    monkeypatch.setattr(session, "cluster_cpus", lambda: 2)
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    uris = [f"s3://b/v{i:02d}.mp4" for i in range(64)]
    remote = RemoteFiles(None, CacheConfig(False), {u: (1000, 1) for u in uris})
    assert [m.path for m in video_probe.gather_probes(uris, None, remote)] == uris and chunks == [32, 32]
    chunks.clear()
    video_probe.gather_probes([f"/d/v{i:02d}.mp4" for i in range(64)], None, None)
    assert chunks == [16] * 4
