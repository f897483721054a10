"""Sources over s3:// against moto's S3 server on 127.0.0.1 (tests/s3_server.py), behind a
proxy that injects latency and faults and counts the requests that reach the store."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

import sbloader
from sbloader.core.errors import SourceReadError
from sbloader.datagen import write_image_parquet, write_video
from sbloader.sources import filesystems, prefix_listing, tar_index
from sbloader.sources.filesystems import LAST_LISTING, list_uris
from sbloader.sources.listing_pages import stream_pages
from wds_shards import rows_by_key

BUCKET = "sbloader-tests"


def _upload(server, root: str, prefix: str) -> list[str]:
    client = server.client()
    paths = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    keys = [f"{prefix}/{os.path.relpath(p, root)}" for p in paths]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda pk: client.upload_file(pk[0], BUCKET, pk[1]), zip(paths, keys)))
    return keys


@pytest.fixture(scope="module")
def bucket(s3_server):
    client = s3_server.client()
    try:
        client.create_bucket(Bucket=BUCKET)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return s3_server


@pytest.fixture(scope="module")
def images(bucket, tmp_path_factory):
    """24 small PNGs of distinct pixels, on local disk and under s3://BUCKET/images/."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i in range(24):
        d = root / f"class_{i % 3}"
        d.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (8 + i % 5, 10, 3), dtype=np.uint8)).save(d / f"{i:03d}.png")
    _upload(bucket, str(root), "images")
    return str(root), f"s3://{BUCKET}/images"


_SERVER: list = []


@pytest.fixture(autouse=True)
def _reads_in_the_read_tasks(monkeypatch):
    """Nothing fetched while listing (tests of the read tasks' faults and counts); a test
    of the listing's fetch turns it back on (``monkeypatch.delenv``)."""
    monkeypatch.setenv("SBLOADER_LISTING_PREFETCH_BYTES", "0")


@pytest.fixture(autouse=True)
def _remember_server(s3_server):
    _SERVER[:] = [s3_server]


def _server():
    """The session's S3 server (its proxy counts the requests)."""
    return _SERVER[0]


def _rows(ds, **kw) -> dict:
    out = {}
    for b in ds.iter_batches(8, **kw):
        for p, im in zip(b["path"], b["image"]):
            assert str(p) not in out, f"{p} delivered twice"
            out[str(p)] = np.asarray(im)
    return out


def _same(local: dict, remote: dict, root: str, uri: str) -> None:
    assert sorted(remote) == sorted(uri + "/" + os.path.relpath(p, root) for p in local)
    for p, arr in local.items():
        assert np.array_equal(remote[uri + "/" + os.path.relpath(p, root)], arr)


def test_images_over_s3_equal_local_and_a_later_epoch_reads_no_object_bytes(ray_session, images, tmp_path,
                                                                           monkeypatch):
    monkeypatch.delenv("SBLOADER_LISTING_PREFETCH_BYTES")
    root, uri = images
    local = _rows(sbloader.read_images(root, files_per_partition=5))
    s3 = _server()
    s3.proxy.reset_counts()
    ds = sbloader.read_images(uri + "/", files_per_partition=5, cache_dir=str(tmp_path / "cache"))
    while_listing = LAST_LISTING.fetched.wait()  # the first pages' objects, fetched into the cache while listing
    _same(local, _rows(ds), root, uri)
    assert s3.proxy.object_gets == 24  # each object once, whether read, fetched ahead or fetched while listing
    # No HEAD: the size is listed, and a URI ending in "/" is a prefix (not asked whether it is an object).
    assert s3.proxy.counts[("HEAD", "object")] == 0
    st = ds.stats().operators[0].counters
    # A cold epoch: every object a miss, those fetched while listing or ahead of their task included.
    assert (st["cache_hits"], st["cache_misses"], st["cache_hit_ratio"]) == (0, 24, 0.0)
    assert st.get("objects_read", 0) + while_listing.get("objects_read", 0) == 24
    assert st.get("bytes_read", 0) + while_listing.get("bytes_read", 0) == s3.proxy.object_get_bytes
    # What the read tasks still fetched (the listing may have fetched all): a task's 5 objects and the
    # next PREFETCH_PARTITIONS partitions' 5 each at most, never the pool's 64 threads.
    assert st.get("peak_in_flight", 0) <= 5 * (1 + sbloader.sources.images.PREFETCH_PARTITIONS) == 15
    s3.proxy.reset_counts()
    _same(local, _rows(ds, shuffle=True, seed=1), root, uri)
    assert s3.proxy.object_gets == 0 and s3.proxy.object_get_bytes == 0
    st = ds.stats().operators[0].counters
    assert st["cache_hits"] == 24 and st["cache_misses"] == 0 and st["cache_hit_ratio"] == 1.0
    assert "cache_hit_ratio 1.00, cache_hits 24, cache_misses 0" in str(ds.stats())


def test_the_first_pages_objects_are_fetched_before_the_listing_ends_and_each_once(ray_session, bucket, tmp_path,
                                                                                  monkeypatch):
    """2,100 keys of a flat prefix, one in 14 an image: the prefix is listed page by page (its top
    level is not listed first to count sub-prefixes, which on a flat prefix pages through every
    key before the first GET; after the first page the rest by key ranges side by side), the
    first GET reaches the store after the first page (at most one more page may be answered
    meanwhile: the listing goes on); over the listing and the epoch, every image is read once,
    and the rows are the listing's (the plan is cut from the whole listing, whatever the pages'
    speed)."""
    monkeypatch.delenv("SBLOADER_LISTING_PREFETCH_BYTES")
    s3 = _server()
    every = {f"paged/{i:05d}.{'png' if i % 14 == 0 else 'txt'}": b"%05d" % i for i in range(2100)}
    s3.put_many(BUCKET, every)
    keys = {k: v for k, v in every.items() if k.endswith(".png")}
    s3.proxy.reset_counts()
    s3.proxy.latency_s = 0.02
    s3.proxy.record()
    try:
        ds = sbloader.read_images(f"s3://{BUCKET}/paged/", decode=False, files_per_partition=10,
                                  cache_dir=str(tmp_path / "cache"))
        fetched = LAST_LISTING.fetched.wait()
        order = list(s3.proxy.order)
    finally:
        s3.proxy.latency_s, s3.proxy.order = 0.0, None
    pages = [i for i, e in enumerate(order) if e == ("list", "out")]
    gets = [i for i, e in enumerate(order) if e == ("get", "in")]
    assert len(pages) == s3.proxy.counts[("GET", "list")] >= 3 and gets and gets[0] < pages[-1], order[:5]
    assert all(e[2] == "page" for e in order if e[:2] == ("list", "in")), order  # no top level
    assert sum(1 for i in pages if i < gets[0]) <= 2, order[:8]  # reading starts after the first page
    assert fetched["objects_read"] == s3.proxy.object_gets >= 1
    rows = {}
    for b in ds.iter_batches(32, shuffle=True, seed=3):
        for p, data in zip(b["path"], b["image"]):
            assert str(p) not in rows
            rows[str(p)] = bytes(data)
    assert rows == {f"s3://{BUCKET}/{k}": v for k, v in keys.items()}
    assert s3.proxy.object_gets == 150  # each image once: fetched while listing or by a read task
    assert [p.payload for p in ds._source.partitions(0, 5, shuffle=True)] == \
        [p.payload for p in sbloader.read_images(f"s3://{BUCKET}/paged/", decode=False, files_per_partition=10,
                                                 cache=False)._source.partitions(0, 5, shuffle=True)]


def test_with_the_cache_off_the_listing_is_streamed_all_the_same(ray_session, bucket):
    """``cache=False`` fetches nothing while listing, but lists page by page as the cached read does
    (a nested prefix's later sub-prefixes side by side, a flat one's key ranges): 2,100 keys of a
    flat prefix are page requests of the stream, none of the pyarrow way (which listed it through
    its top level: 3 requests with a delimiter, then no page was handed on before the last)."""
    every = {f"paged_off/{i:05d}.png": b"%05d" % i for i in range(2100)}
    bucket.put_many(BUCKET, every)
    bucket.proxy.reset_counts()
    bucket.proxy.record()
    try:
        ds = sbloader.read_images(f"s3://{BUCKET}/paged_off/", decode=False, cache=False)
        order = list(bucket.proxy.order)
    finally:
        bucket.proxy.order = None
    arrived = [e[2] for e in order if e[:2] == ("list", "in")]
    assert len(arrived) >= 3 and set(arrived) == {"page"}, order
    running = [0]
    for e in order:
        if e[0] == "list":
            running.append(running[-1] + (1 if e[1] == "in" else -1))
    assert max(running) >= 2, order  # after the first page, key ranges side by side (was one after the other)
    assert ds._source.paths == [f"s3://{BUCKET}/{k}" for k in sorted(every)]  # every key once, in order
    assert bucket.proxy.object_gets == 0 and len(ds._source.partitions(0, 0, shuffle=False)) == 2100 // 64 + 1


def test_cache_off_reads_every_object_every_epoch(ray_session, images):
    root, uri = images
    ds = sbloader.read_images(uri, files_per_partition=6, cache=False)
    for _ in range(2):
        _server().proxy.reset_counts()
        assert len(_rows(ds)) == 24
        assert _server().proxy.object_gets == 24
        assert "cache_misses" not in ds.stats().operators[0].counters  # no cache: no hit ratio to show


def test_injected_503s_and_dropped_connections_are_survived_exactly_once(ray_session, images, tmp_path):
    root, uri = images
    local = _rows(sbloader.read_images(root, files_per_partition=4))
    ds = sbloader.read_images(uri, files_per_partition=4, cache_dir=str(tmp_path / "c"))
    proxy = _server().proxy
    proxy.reset_counts()
    done = proxy.faults_done
    proxy.inject("503", 3)
    proxy.inject("drop", 2)
    _same(local, _rows(ds), root, uri)  # every row once (_rows refuses a repeat)
    assert proxy.faults_done - done == 5 and not proxy.faults
    assert proxy.object_gets == 24  # each object's successful GET once
    assert ds.stats().operators[0].counters["retries"] == 5
    # 403 is not retried: under on_error="skip" the object is skipped and counted, the rest read once.
    skipping = sbloader.read_images(uri, files_per_partition=4, cache=False, on_error="skip")
    proxy.reset_counts()
    proxy.inject("403", 1)
    assert len(_rows(skipping)) == 23 and skipping.stats().skipped == 1
    assert proxy.object_gets == 23


def test_a_missing_object_is_named_and_skipped_under_on_error_skip(ray_session, images, tmp_path):
    root, uri = images
    client = _server().client()
    client.copy_object(Bucket=BUCKET, Key="gone/a.png", CopySource={"Bucket": BUCKET, "Key": "images/class_0/000.png"})
    client.copy_object(Bucket=BUCKET, Key="gone/b.png", CopySource={"Bucket": BUCKET, "Key": "images/class_1/001.png"})
    with pytest.raises(FileNotFoundError, match=f"s3://{BUCKET}/nothing-here"):
        sbloader.read_images(f"s3://{BUCKET}/nothing-here/")
    with pytest.raises(FileNotFoundError, match="s3://no-such-bucket-sb"):
        sbloader.read_images("s3://no-such-bucket-sb/x.png")
    raising = sbloader.read_images(f"s3://{BUCKET}/gone", cache=False)
    skipping = sbloader.read_images(f"s3://{BUCKET}/gone", cache=False, on_error="skip")
    client.delete_object(Bucket=BUCKET, Key="gone/a.png")  # deleted after the listing
    with pytest.raises(SourceReadError, match=f"s3://{BUCKET}/gone/a.png"):
        _rows(raising)
    rows = _rows(skipping)
    assert list(rows) == [f"s3://{BUCKET}/gone/b.png"]
    assert skipping.stats().skipped == 1


def test_a_changed_object_is_read_again(ray_session, images, tmp_path):
    client = _server().client()
    key = "changing/x.png"
    cache_dir = str(tmp_path / "cache")

    def put(value: int) -> None:
        import io
        buf = io.BytesIO()
        Image.fromarray(np.full((4, 6 + value, 3), value, dtype=np.uint8)).save(buf, format="PNG")
        client.put_object(Bucket=BUCKET, Key=key, Body=buf.getvalue())

    put(1)
    first = _rows(sbloader.read_images(f"s3://{BUCKET}/changing", cache_dir=cache_dir))
    put(2)
    again = sbloader.read_images(f"s3://{BUCKET}/changing", cache_dir=cache_dir)
    _server().proxy.reset_counts()
    second = _rows(again)
    assert _server().proxy.object_gets == 1
    assert first[f"s3://{BUCKET}/{key}"].max() == 1 and second[f"s3://{BUCKET}/{key}"].max() == 2


def test_a_full_cache_admits_nothing_new_and_never_waits(ray_session, images, tmp_path):
    root, uri = images
    ds = sbloader.read_images(uri, files_per_partition=6, cache_dir=str(tmp_path / "c"), cache_max_bytes=1500)
    _server().proxy.reset_counts()
    assert len(_rows(ds)) == 24
    first = _server().proxy.object_gets
    st = ds.stats().operators[0].counters
    assert first == 24 and st["not_admitted"] >= 1
    _server().proxy.reset_counts()
    assert len(_rows(ds)) == 24
    # What fitted stays (no thrashing); the rest is read from the store, never waiting for room.
    hits = ds.stats().operators[0].counters.get("cache_hits", 0)
    assert hits == 24 - st["not_admitted"] and _server().proxy.object_gets == st["not_admitted"]


def test_parquet_and_videos_over_s3_equal_local(ray_session, bucket, tmp_path):
    pq_dir = tmp_path / "pq"
    pq_dir.mkdir()
    write_image_parquet(str(pq_dir / "a.parquet"), 40, rows_per_group=16, min_size=(8, 8), max_size=(12, 12))
    write_image_parquet(str(pq_dir / "b.parquet"), 20, seed=1, rows_per_group=16, min_size=(8, 8), max_size=(12, 12))
    vid_dir = tmp_path / "vid"
    vid_dir.mkdir()
    write_video(str(vid_dir / "v0.mp4"), frames=12, width=32, height=24, seed=0)
    write_video(str(vid_dir / "v1.mp4"), frames=9, width=32, height=24, seed=1)
    _upload(bucket, str(pq_dir), "pq")
    _upload(bucket, str(vid_dir), "vid")

    def table(ds):
        return sorted((int(i), bytes(im)) for b in ds.iter_batches(16) for i, im in zip(b["id"], b["image"]))

    local = table(sbloader.read_parquet(str(pq_dir), rows_per_partition=10))
    proxy = _server().proxy
    for cache in (True, False):
        proxy.reset_counts()
        ds = sbloader.read_parquet(f"s3://{BUCKET}/pq", rows_per_partition=10, cache=cache,
                                   cache_dir=str(tmp_path / "c"))
        # each footer one ranged GET of the object's end, its size from the listing: no HEAD of a file
        # (the one HEAD asks whether "pq", without a trailing "/", is an object or a prefix)
        assert proxy.object_gets == 2 and proxy.counts[("HEAD", "object")] == 1
        proxy.reset_counts()
        assert ds.num_rows() == 60 and table(ds) == local
        if cache:  # each file one GET into the cache (fetched ahead or by its read), no HEAD
            assert proxy.object_gets == 2 and proxy.counts[("HEAD", "object")] == 0
        else:  # read in place by ranged GETs, the size listed: no HEAD, each range retried and counted as ours
            assert proxy.counts[("HEAD", "object")] == 0
            assert ds.stats().operators[0].counters["range_reads"] == proxy.object_gets > 0

    def frames(ds):
        return {(os.path.basename(str(p)), int(i)): f.copy()
                for b in ds.iter_batches(4) for p, i, f in zip(b["path"], b["frame_index"], b["frame"])}

    lv = frames(sbloader.read_videos(str(vid_dir), frames_per_partition=5))
    rds = sbloader.read_videos(f"s3://{BUCKET}/vid/", frames_per_partition=5, cache_dir=str(tmp_path / "c"))
    proxy.reset_counts()
    rv = frames(rds)
    # the probe at creation already fetched the videos into the cache: the reads take nothing more
    assert proxy.object_gets == 0 and proxy.counts[("HEAD", "object")] == 0
    assert sorted(lv) == sorted(rv) and all(np.array_equal(lv[k], rv[k]) for k in lv)
    assert all(str(p).startswith(f"s3://{BUCKET}/vid/") for p in next(rds.iter_batches(4))["path"])


def test_a_parquet_footer_larger_than_the_tail_read_takes_one_more_range_and_a_non_parquet_object_is_named(
        bucket, tmp_path, monkeypatch):
    """The footer is read from the object's end (its size listed); where it is longer than the first
    range, one more ranged GET reads the rest; an object that is no Parquet file is recorded as such."""
    from sbloader.sources import parquet
    from sbloader.sources.fetch import remote_files

    d = tmp_path / "pqt"
    d.mkdir()
    write_image_parquet(str(d / "a.parquet"), 40, rows_per_group=8, min_size=(8, 8), max_size=(12, 12))
    (d / "b.parquet").write_bytes(b"not a parquet file at all")
    _upload(bucket, str(d), "pqt")
    uris = [f"s3://{BUCKET}/pqt/a.parquet", f"s3://{BUCKET}/pqt/b.parquet"]
    versions = {u: (os.path.getsize(d / u.rsplit("/", 1)[1]), 0) for u in uris}
    remote = remote_files(versions, None, True, str(tmp_path / "c"), None)
    monkeypatch.setattr(parquet, "FOOTER_TAIL_BYTES", 64)  # far below this footer's size
    proxy = _server().proxy
    proxy.reset_counts()
    good, bad = parquet.read_footers(uris, None, remote)
    assert good.row_groups == parquet.read_footer(str(d / "a.parquet")).row_groups == (8,) * 5 and not good.error
    assert "is not a Parquet file" in bad.error and "b.parquet" in bad.error
    assert proxy.object_gets == 3 and proxy.counts[("HEAD", "object")] == 0  # 2 + 1 ranged GETs


def test_the_videos_one_call_probes_are_fetched_side_by_side(bucket, tmp_path):
    """A probe call's objects are fetched at once, not one round trip after the other (a task's
    4 videos at 20 ms spent 80 ms in round trips), each once, and every probe is its file's."""
    from sbloader.sources.fetch import DEFAULT_MAX_IN_FLIGHT, remote_files
    from sbloader.sources.files import list_inputs
    from sbloader.sources.video_probe import probe_video, probe_videos

    d = tmp_path / "vp"
    d.mkdir()
    for k in range(4):
        write_video(str(d / f"v{k}.mp4"), frames=6 + k, width=32, height=24, seed=k)
    _upload(bucket, str(d), "vp")
    uris, versions = list_inputs(f"s3://{BUCKET}/vp/", (".mp4",), "video")
    remote = remote_files(versions, None, True, str(tmp_path / "c"), None, DEFAULT_MAX_IN_FLIGHT)
    proxy = _server().proxy
    proxy.reset_counts()
    proxy.latency_s = 0.2
    try:
        metas = probe_videos(uris, None, remote)
    finally:
        proxy.latency_s = 0.0
    local = [probe_video(str(d / f"v{k}.mp4")).num_frames for k in range(4)]
    assert [m.num_frames for m in metas] == local == [6, 7, 8, 9]
    assert proxy.object_gets == 4 and proxy.peak_in_flight["all"] >= 2, proxy.peak_in_flight


def test_listing_a_few_thousand_keys_is_sorted_and_paginated(ray_session, bucket, monkeypatch):
    keys = [f"many/{i % 7}/{i:05d}.jpg" for i in range(2500)]
    bucket.put_many(BUCKET, {k: b"x" for k in keys})
    bucket.proxy.reset_counts()
    objs = list_uris([f"s3://{BUCKET}/many/"], (".jpg",), "image")
    assert [o.uri for o in objs] == sorted(f"s3://{BUCKET}/{k}" for k in keys)
    assert all(o.size == 1 for o in objs)
    assert bucket.proxy.counts[("GET", "list")] >= 3  # 1,000 keys a page
    assert LAST_LISTING.objects == 2500 and LAST_LISTING.seconds_per_1000 > 0
    monkeypatch.setattr(prefix_listing, "PARALLEL_LISTING_MIN_PREFIXES", 3)
    monkeypatch.setattr(prefix_listing, "_PREFIXES_PER_LISTING_TASK", 2)
    launched = []

    class _Counting:
        def remote(self, *args):
            launched.append(args[0])
            return task.remote(*args)

    task = prefix_listing._list_task
    monkeypatch.setattr(prefix_listing, "_list_task", _Counting())
    # 7 sub-prefixes: listed by 4 Ray tasks, the same objects in the same order
    assert list_uris([f"s3://{BUCKET}/many"], (".jpg",), "image") == objs
    assert [len(g) for g in launched] == [2, 2, 2, 1]

    class _Sink:  # page by page through obstore, as the fetch while listing takes them
        def __init__(self):
            self.seen = []

        def pages(self, uri, path, filesystem, after=None):
            return stream_pages(uri, path, filesystem, after)

        def __call__(self, page, more=True):
            self.seen.append(len(page))

    # Streamed: the first page has keys in sub-prefixes and a second page follows, so the top level
    # is listed; 7 >= 3 sub-prefixes: in parallel as above, after the first two pages were handed on.
    sink = _Sink()
    assert list_uris([f"s3://{BUCKET}/many/"], (".jpg",), "image", on_page=sink) == objs
    assert sink.seen == [1000, 1000] and [len(g) for g in launched] == [2, 2, 2, 1] * 2
    monkeypatch.setattr(prefix_listing, "PARALLEL_LISTING_MIN_PREFIXES", 64)  # 7 < 64: the stream goes on
    sink = _Sink()
    assert list_uris([f"s3://{BUCKET}/many/"], (".jpg",), "image", on_page=sink) == objs
    # 7 < 64: the stream goes on through its own sub-prefix (143 keys) while the one after it, of
    # which no key came yet (357), is listed side by side: the pages as they are answered
    assert sorted(sink.seen) == [143, 357, 1000, 1000] and len(launched) == 8
    globbed = list_uris([f"s3://{BUCKET}/many/3/*.jpg"], None, "image")
    assert [o.uri for o in globbed] == sorted(f"s3://{BUCKET}/{k}" for k in keys if k.startswith("many/3/"))


def test_a_nested_prefix_of_one_page_is_listed_with_one_request(ray_session, bucket):
    """Keys in sub-prefixes (class folders), fewer than a page: the listing is that page, one
    request; the top level is not listed to count the sub-prefixes (a round trip, 20-100 ms on a
    store far away, before the first GET: #47's first batch)."""
    keys = [f"nested/{i % 5}/{i:04d}.jpg" for i in range(300)]
    bucket.put_many(BUCKET, {k: b"x" for k in keys})
    bucket.proxy.reset_counts()
    got = []
    sink = type("Sink", (), {"pages": _stream_pages,
                             "__call__": lambda self, page, more=True: got.append(len(page))})()
    objs = list_uris([f"s3://{BUCKET}/nested/"], (".jpg",), "image", on_page=sink)
    assert [o.uri for o in objs] == sorted(f"s3://{BUCKET}/{k}" for k in keys) and got == [300]
    assert bucket.proxy.counts[("GET", "list")] == 1


def test_a_nested_prefix_of_pages_asks_for_its_top_level_alongside_the_second_page(ray_session, bucket):
    """Keys in sub-prefixes over three pages: the top level (to count the sub-prefixes: are they
    many enough to list in parallel?) is asked for while the second page is in flight, not after
    it was answered (a round trip, 20-100 ms, before the plan: #47's first batch), and the
    listing is the same."""
    keys = [f"nested2/{i % 5}/{i:05d}.jpg" for i in range(2100)]
    bucket.put_many(BUCKET, {k: b"x" for k in keys})
    bucket.proxy.reset_counts()
    bucket.proxy.latency_s = 0.05
    bucket.proxy.record()
    try:
        objs = list_uris([f"s3://{BUCKET}/nested2/"], (".jpg",), "image",
                         on_page=type("Sink", (), {"pages": _stream_pages,
                                                   "__call__": lambda self, page, more=True: None})())
        order = list(bucket.proxy.order)
    finally:
        bucket.proxy.latency_s, bucket.proxy.order = 0.0, None
    assert [o.uri for o in objs] == sorted(f"s3://{BUCKET}/{k}" for k in keys)
    arrived = [e[2] for e in order if e[:2] == ("list", "in")]
    assert arrived.count("top") == 1 and arrived.count("page") == 3, order
    answered = [i for i, e in enumerate(order) if e == ("list", "out")]
    top = next(i for i, e in enumerate(order) if e == ("list", "in", "top"))
    assert answered[0] < top < answered[1], order  # after the first page, before the second's answer


def _stream_pages(self, uri, path, filesystem, after=None):
    return stream_pages(uri, path, filesystem, after)


def test_the_sub_prefixes_the_stream_has_not_reached_are_listed_side_by_side(ray_session, bucket):
    """5 class folders of 1,000 keys: once the top level shows them (after the second page, which ends
    the second folder), the three folders of which no key came yet are each listed by a listing of
    their own, side by side (one round trip, not three more one after the other), and the listing is
    the same, sorted."""
    keys = [f"side/{c}/{i:05d}.jpg" for c in range(5) for i in range(1000)]
    bucket.put_many(BUCKET, {k: b"x" for k in keys})
    bucket.proxy.reset_counts()
    bucket.proxy.latency_s = 0.05
    bucket.proxy.record()
    seen = []
    try:
        objs = list_uris([f"s3://{BUCKET}/side/"], (".jpg",), "image",
                         on_page=type("Sink", (), {"pages": _stream_pages,
                                                   "__call__": lambda self, page, more=True: seen.append(len(page))})())
        order = list(bucket.proxy.order)
    finally:
        bucket.proxy.latency_s, bucket.proxy.order = 0.0, None
    assert [o.uri for o in objs] == sorted(f"s3://{BUCKET}/{k}" for k in keys)
    assert sorted(seen) == [1000] * 5, seen
    in_flight, most = 0, 0
    for e in order[order.index(("list", "in", "top")):]:
        if e[:2] == ("list", "in"):
            in_flight += 1
            most = max(most, in_flight)
        elif e == ("list", "out"):
            in_flight -= 1
    assert most >= 3, order  # the three folders' listings at once


def test_a_flat_folders_shards_are_listed_with_one_request_and_fetched_side_by_side(ray_session, bucket, tmp_path):
    """A brace pattern's folder holds no sub-prefix: its top level is the whole listing (one request,
    not a second recursive one), and its shards are fetched into the cache for their index all at
    once (each was a round trip after the other: 8 shards at 100 ms took 0.8 s to create, #47)."""
    pytest.importorskip("webdataset")
    from wds_shards import write_shards

    local = write_shards(str(tmp_path / "wds4"), shards=4, per_shard=3)
    _upload(bucket, str(tmp_path / "wds4"), "wds4")
    proxy = _server().proxy
    proxy.reset_counts()
    proxy.latency_s = 0.1
    try:
        ds = sbloader.read_webdataset(f"s3://{BUCKET}/wds4/train-{{000000..000003}}.tar", decode=False,
                                      cache_dir=str(tmp_path / "c"))
    finally:
        proxy.latency_s = 0.0
    assert proxy.counts[("GET", "list")] == 1 and proxy.object_gets == 4
    assert proxy.peak_in_flight["all"] == 4, proxy.peak_in_flight
    assert rows_by_key(ds) == rows_by_key(sbloader.read_webdataset(local, decode=False))


def test_two_processes_share_a_cache_directory_and_fetch_each_object_once(images, tmp_path):
    _, uri = images
    objs = list_uris([uri], None, "image")
    code = textwrap.dedent(f"""
        import sys
        from sbloader.sources.cache import CacheConfig
        from sbloader.sources.fetch import RemoteFiles
        versions = {{o: (s, m) for o, s, m in {[(o.uri, o.size, o.mtime_ns) for o in objs]!r}}}
        rf = RemoteFiles(None, CacheConfig(True, {str(tmp_path / 'shared')!r}), versions, 4)
        n = sum(len(b) for _, b in rf.read_many(sorted(versions)))
        print(n)
    """)
    _server().proxy.reset_counts()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert int(outs[0]) == int(outs[1]) == sum(o.size for o in objs)
    assert _server().proxy.object_gets == len(objs)  # the lock: one download per object


def test_webdataset_shards_by_brace_pattern_equal_local_with_one_request_per_range(ray_session, bucket, tmp_path):
    pytest.importorskip("webdataset")
    from wds_shards import write_shards

    local = write_shards(str(tmp_path / "wds"), shards=3, per_shard=7)
    data = open(local[1], "rb").read()
    (tmp_path / "wds" / "bad").mkdir()
    (tmp_path / "wds" / "bad" / "train-000001.tar").write_bytes(data[:int(len(data) * 0.6) + 100])
    _upload(bucket, str(tmp_path / "wds"), "wds")
    want = rows_by_key(sbloader.read_webdataset(local, decode=False, samples_per_partition=3))
    proxy = _server().proxy
    pattern = f"s3://{BUCKET}/wds/train-{{000000..000002}}.tar"
    for cache in (True, False):
        proxy.reset_counts()
        ds = sbloader.read_webdataset(pattern, decode=False, samples_per_partition=3, cache=cache,
                                      cache_dir=str(tmp_path / "c"))
        # Indexed once per process: with the cache, each shard fetched whole into it (one GET each).
        # The pattern is one listing of its folder (pyarrow asks once whether the folder is an
        # object): no request per shard before its GET.
        assert proxy.object_gets == (3 if cache else 0) and proxy.counts[("HEAD", "object")] <= 1
        proxy.reset_counts()
        assert rows_by_key(ds) == want
        assert proxy.counts[("HEAD", "object")] == 0
        st = ds.stats().operators[0].counters
        if cache:  # the reads take nothing from the store; each shard's first read counts the miss
            # (the shard came from the store for this dataset, when it was indexed), its other two hit
            assert proxy.object_gets == 0 and st["cache_hits"] == 6 and st["cache_misses"] == 3
        else:  # one ranged GET per partition (3 shards of 7 samples, 3 per partition)
            assert proxy.object_gets == 9 and st["range_reads"] == 9
            assert st["bytes_read"] == proxy.object_get_bytes
    tar_index._INDEXES.clear()
    proxy.reset_counts()
    again = sbloader.read_webdataset(pattern, decode=False, samples_per_partition=3, cache_dir=str(tmp_path / "c"))
    assert proxy.object_gets == 0 and again.num_rows() == 21  # the indexes were kept in the cache directory
    # A truncated shard in the bucket: the samples before the damage, as for a local one.
    files = [f"s3://{BUCKET}/wds/train-000000.tar", f"s3://{BUCKET}/wds/bad/train-000001.tar"]
    skip = sbloader.read_webdataset(files, decode=False, samples_per_partition=3, on_error="skip", cache=False)
    got = rows_by_key(skip)
    good = skip.source.files[1].keys
    assert 0 < len(good) < 7 and sorted(got) == sorted([f"s0_{i:03d}" for i in range(7)] + list(good))
    assert skip.stats().skipped == 1
    with pytest.raises(FileNotFoundError, match="1 of the 3 shards"):
        sbloader.read_webdataset(f"s3://{BUCKET}/wds/train-{{000001..000003}}.tar")
    with pytest.raises(SourceReadError, match="bad/train-000001.tar"):
        rows_by_key(sbloader.read_webdataset(files, decode=False, samples_per_partition=3, cache=False))


def test_resumed_mid_epoch_from_a_bucket_every_sample_once(ray_session, bucket, tmp_path):
    pytest.importorskip("webdataset")
    from harness import check_resume_everywhere
    from wds_shards import write_shards

    write_shards(str(tmp_path / "r"), shards=3, per_shard=8, images=False)
    _upload(bucket, str(tmp_path / "r"), "resume")
    ids = [s * 1000 + i for s in range(3) for i in range(8)]

    def make(rank, world_size, name):
        ds = sbloader.read_webdataset(f"s3://{BUCKET}/resume/train-{{000000..000002}}.tar", samples_per_partition=3,
                                      cache=False)
        return ds.to_dataloader(4, shuffle=True, seed=5, deterministic=True, rank=rank, world_size=world_size,
                                name=name)

    _server().proxy.inject("503", 2)
    check_resume_everywhere(make, ids, key="cls", resume_world_sizes=(2,), same_order=True, steps=[3],
                            states_in_one_run=True)


def test_a_native_epoch_from_a_bucket_starts_on_rays_workers_not_on_forked_ones(ray_session, bucket, tmp_path,
                                                                               monkeypatch):
    """The WebDataset's indexes are read here as the dataset is made: the object client's async runtime then
    runs in this process, and a worker forked from it would wait for its first request forever (issue #44's
    local start found it, split across ranks). A source of remote objects starts on Ray's workers."""
    pytest.importorskip("webdataset")
    from sbloader.loaders import local_start
    from sbloader.loaders.split_start import SPLIT_LOCAL_ENV
    from wds_shards import write_shards

    write_shards(str(tmp_path / "fk"), shards=2, per_shard=6, images=False)
    _upload(bucket, str(tmp_path / "fk"), "forked")
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "1")  # a local start forced wherever one may run
    monkeypatch.setenv(SPLIT_LOCAL_ENV, "2")
    ds = sbloader.read_webdataset(f"s3://{BUCKET}/forked/train-{{000000..000001}}.tar", samples_per_partition=3,
                                  cache=False)
    loader = ds.to_dataloader(4, shuffle=True, seed=5)
    assert sorted(int(c) for b in loader for c in b["cls"]) == sorted(s * 1000 + i for s in range(2) for i in range(6))
    assert loader.stats().local_partitions == 0
