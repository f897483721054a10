"""WebDataset shards by fsspec URIs: ``http://`` (fsspec's HTTP filesystem, aiohttp) from a
plain HTTP server on 127.0.0.1 that counts the requests, by a brace pattern, with and
without the node-local cache: the same rows as the shards on local disk."""
from __future__ import annotations

import functools
import os
import re
import threading
from collections import Counter
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

import sbloader
from wds_shards import rows_by_key


class _Counting(SimpleHTTPRequestHandler):
    """Python's file server, counting requests, with single byte ranges (``Range: bytes=a-b``)
    as object stores and most HTTP servers answer them."""

    counts: Counter = Counter()

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        _Counting.counts[("GET", os.path.basename(self.path))] += 1
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        path = self.translate_path(self.path)
        if m is None or not os.path.isfile(path):
            return super().do_GET()
        with open(path, "rb") as f:
            data = f.read()
        start, end = int(m.group(1)), min(int(m.group(2) or len(data) - 1), len(data) - 1)
        body = data[start:end + 1]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:
        _Counting.counts[("HEAD", os.path.basename(self.path))] += 1
        super().do_HEAD()


@pytest.fixture()
def http_shards(tmp_path):
    """3 shards of 7 samples on disk, served over http://127.0.0.1:<port>/wds/."""
    pytest.importorskip("webdataset")
    pytest.importorskip("aiohttp")
    pytest.importorskip("fsspec")
    from wds_shards import write_shards

    local = write_shards(str(tmp_path / "wds"), shards=3, per_shard=7)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Counting, directory=str(tmp_path)))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _Counting.counts.clear()
    yield local, f"http://127.0.0.1:{httpd.server_address[1]}/wds"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("cache", [True, False])
def test_webdataset_shards_by_http_brace_pattern_equal_local(ray_session, http_shards, tmp_path, cache):
    from sbloader.sources import tar_index

    local, base = http_shards
    want = rows_by_key(sbloader.read_webdataset(local, decode=False, samples_per_partition=3))
    tar_index._INDEXES.clear()
    ds = sbloader.read_webdataset(f"{base}/train-{{000000..000002}}.tar", decode=False, samples_per_partition=3,
                                  cache=cache, cache_dir=str(tmp_path / "c"))
    assert ds.num_rows() == 21
    got = rows_by_key(ds)
    assert got == want and len(got) == 21
    assert all(str(p).startswith("http://127.0.0.1:") for p in {r["__url__"] for r in ds.iter_rows()})
    gets = sum(n for (m, _), n in _Counting.counts.items() if m == "GET")
    assert gets >= 3  # every shard was read over HTTP (fsspec's client may range-read a shard in parts)
    if cache:  # a later epoch reads the shards from the node-local cache: nothing over HTTP
        _Counting.counts.clear()
        assert rows_by_key(ds) == want
        assert sum(n for (m, _), n in _Counting.counts.items() if m == "GET") == 0
        assert ds.stats().operators[0].counters["cache_misses"] == 0


def test_a_missing_http_shard_is_named(ray_session, http_shards):
    _, base = http_shards
    with pytest.raises(FileNotFoundError, match="000003"):
        sbloader.read_webdataset(f"{base}/train-{{000001..000003}}.tar")
