"""Requests in flight are bounded per dataset and per process: two datasets read in one
process share the process's limit, each keeps its own ``max_in_flight`` (counted at the
store: a filesystem that counts the requests it is serving at once)."""
from __future__ import annotations

import os
import threading
import time
from typing import Optional

import pytest
from fsspec.implementations.local import LocalFileSystem

from sbloader.sources import inflight
from sbloader.sources.cache import CacheConfig
from sbloader.sources.fetch import RemoteFiles
from sbloader.sources.inflight import Gauge, env_cap

N = 24  # objects per dataset


class _Counting(LocalFileSystem):
    """A local filesystem whose every open is a request taking 20 ms, counted while it runs,
    per folder (dataset) and in all; the peaks are kept."""

    latency_s = 0.02

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.lock = threading.Lock()
        self.now: dict = {}
        self.peak: dict = {}

    def _count(self, key: str, d: int) -> None:
        with self.lock:
            self.now[key] = self.now.get(key, 0) + d
            self.peak[key] = max(self.peak.get(key, 0), self.now[key])

    def _open(self, path, mode="rb", **kw):
        ds = path.rstrip("/").split("/")[-2]
        self._count(ds, 1)
        self._count("all", 1)
        try:
            time.sleep(self.latency_s)
            f = super()._open(path, mode=mode, **kw)
            self._count("bytes ahead", os.path.getsize(path))  # served, not yet consumed
            return f
        finally:
            self._count(ds, -1)
            self._count("all", -1)


def _dataset(root, fs, name: str, max_in_flight: int, size: int = 100, max_bytes: int = 2 ** 20) -> RemoteFiles:
    d = root / name
    d.mkdir()
    versions = {}
    for i in range(N):
        (d / f"{i:03d}.bin").write_bytes(bytes([i]) * size)
        versions[str(d / f"{i:03d}.bin")] = (size, 1)
    return RemoteFiles(fs, CacheConfig(False), versions, max_in_flight, max_bytes=max_bytes)


def _read_both(a: RemoteFiles, b: RemoteFiles, fs: Optional[_Counting] = None) -> list:
    """Both datasets read at once by two threads; with ``fs``, each object's bytes are counted
    as consumed once handed on, and the reader takes 10 ms over each (slower than the store)."""
    out: list = [None, None]

    def read(i: int, rf: RemoteFiles) -> None:
        out[i] = []
        for _, data in rf.read_many(sorted(rf.versions)):
            out[i].append(data)
            if fs is not None:
                fs._count("bytes ahead", -len(data))
                time.sleep(0.01)

    threads = [threading.Thread(target=read, args=(i, rf)) for i, rf in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture
def gauge(monkeypatch):
    """A fresh gauge and fetch pool for this process (no limit left from earlier tests)."""
    g = Gauge()
    monkeypatch.setattr(inflight, "_POOL", [])
    monkeypatch.setattr("sbloader.sources.fetch.GAUGE", g)
    return g


def test_two_datasets_in_one_process_each_keep_their_limit_and_share_the_largest(tmp_path, gauge):
    fs = _Counting(skip_instance_cache=True)  # fsspec would hand back the last test's, peaks and all
    a, b = _dataset(tmp_path, fs, "a", 2), _dataset(tmp_path, fs, "b", 6)
    got = _read_both(a, b)
    assert got == [[bytes([i]) * 100 for i in range(N)]] * 2
    # The fetch pool has 6 threads (b's max_in_flight); a never has more than its 2 requests
    # at the store, and the two together never more than 6.
    assert fs.peak["a"] == 2
    assert fs.peak["all"] == 6 and fs.peak["b"] >= 4
    assert gauge.now == 0


def test_the_process_limit_caps_every_dataset_together(tmp_path, gauge):
    gauge.cap = 3  # $SBLOADER_MAX_IN_FLIGHT=3
    fs = _Counting(skip_instance_cache=True)  # fsspec would hand back the last test's, peaks and all
    a, b = _dataset(tmp_path, fs, "a", 4), _dataset(tmp_path, fs, "b", 4)
    got = _read_both(a, b)
    assert got == [[bytes([i]) * 100 for i in range(N)]] * 2
    assert fs.peak["all"] == 3
    assert gauge.now == 0


def test_two_datasets_in_one_process_share_the_bytes_fetched_ahead_of_their_readers(tmp_path, gauge, monkeypatch):
    monkeypatch.setattr(inflight, "BYTES", inflight.ByteBudget())
    monkeypatch.setattr("sbloader.sources.fetch.BYTES", inflight.BYTES)
    fs = _Counting(skip_instance_cache=True)
    fs.latency_s = 0.002  # a store faster than the readers: the bytes pile up to the budget
    # 24 objects of 10 KB each; each dataset alone may ask for 60 KB ahead of its reader.
    a, b = _dataset(tmp_path, fs, "a", 16, 10_000, 60_000), _dataset(tmp_path, fs, "b", 16, 10_000, 60_000)
    got = _read_both(a, b, fs)
    assert got == [[bytes([i]) * 10_000 for i in range(N)]] * 2
    # Served by the store and not yet handed to a reader, both datasets together: at most the
    # process's 60 KB, plus one object per reader (a reader with nothing outstanding takes one).
    assert 50_000 <= fs.peak["bytes ahead"] <= 60_000 + 2 * 10_000
    assert inflight.BYTES.held == 0 and fs.now["bytes ahead"] == 0


def test_the_process_limit_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(inflight.MAX_IN_FLIGHT_ENV, raising=False)
    assert env_cap() is None
    monkeypatch.setenv(inflight.MAX_IN_FLIGHT_ENV, "16")
    assert env_cap() == 16
    monkeypatch.setenv(inflight.MAX_IN_FLIGHT_ENV, "0")
    with pytest.raises(ValueError, match="SBLOADER_MAX_IN_FLIGHT must be a positive integer"):
        env_cap()


def test_two_s3_datasets_in_one_process_counted_at_the_lean_s3_server(s3_server, gauge):
    """The same, through obstore against the lean S3 server (20 ms a request), whose proxy
    counts the object GETs it serves at once, by prefix."""
    pytest.importorskip("obstore")
    s3_server.ensure_bucket("inflight47")
    s3_server.put_many("inflight47", {f"{d}/{i:03d}.bin": bytes([i]) * 500 for d in "ab" for i in range(N)})
    a, b = (RemoteFiles(None, CacheConfig(False), {f"s3://inflight47/{d}/{i:03d}.bin": (500, 1) for i in range(N)}, m)
            for d, m in (("a", 2), ("b", 5)))
    proxy = s3_server.proxy
    latency, proxy.latency_s = proxy.latency_s, 0.02
    try:
        proxy.reset_counts()
        got = _read_both(a, b)
    finally:
        proxy.latency_s = latency
    assert got == [[bytes([i]) * 500 for i in range(N)]] * 2
    peak = proxy.peak_in_flight
    assert (peak["inflight47/a"], peak["all"]) == (2, 5) and peak["inflight47/b"] >= 3
    assert proxy.counts[("GET", "object")] == 2 * N  # one GET per object


def test_a_forked_child_has_its_own_fetch_pool_and_nothing_in_flight():
    """A local worker forked from a process whose fetch pool's threads were all started (and whose
    requests and bytes were in flight) gets a new pool and empty counts: the parent's executor would
    queue its work for threads the child does not have, for good."""
    import os
    import threading

    from sbloader.sources import inflight

    ex = inflight.pool(2)
    gate = threading.Event()
    busy = [ex.submit(gate.wait, 30) for _ in range(2)]  # both threads started (then idle again)
    gate.set()
    [f.result() for f in busy]
    inflight.BYTES.take(100, 1000)
    from sbloader.sources import ahead
    ahead.started("/c", ["s3://b/being-fetched-ahead"])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answers within 5 s, or its parent reads a timeout
        try:
            got = inflight.pool(2).submit(lambda: 7).result(timeout=5)
            ok = got == 7 and inflight.BYTES.held == 0 and inflight.GAUGE.now == 0 and inflight.pool(2) is not ex \
                and ahead.not_in_flight("/c", ["s3://b/being-fetched-ahead"]) == ["s3://b/being-fetched-ahead"]
            os.write(w, b"ok" if ok else b"bad")
        except BaseException as e:  # noqa: BLE001 - reported through the pipe
            os.write(w, repr(e).encode()[:200])
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    ahead.done("/c", "s3://b/being-fetched-ahead", 100)  # hands back the 100 bytes too
    assert os.read(r, 300) == b"ok"
