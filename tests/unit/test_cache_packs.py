"""Packs: a read call's objects cached as one file with a hard link per entry (#47: creating a
file per object cost more CPU than its GET on the 2-core VM)."""
from __future__ import annotations

import os
import time

import pytest

from test_remote_io import _flaky_files, _wait_for_entries, handler_bytes

from sbloader.core.context import task_context
from sbloader.sources import ahead as ahead_mod
from sbloader.sources import inflight
from sbloader.sources.cache import PACK_MARK, DiskCache
from sbloader.sources.cache_ledger import scan
from sbloader.sources.cache_packs import member_count, read_entry


def _entries(rf, uris):
    return [rf._cached(u, take=False)[0] for u in uris]


def test_a_read_caches_its_objects_as_one_pack_and_reads_each_back(tmp_path, monkeypatch):
    monkeypatch.setattr(inflight, "_POOL", [])
    rf, handler = _flaky_files(tmp_path, 0, None, cache=True)
    uris = sorted(rf.versions)
    assert [b for _, b in rf.read_many(uris)] == [handler_bytes(u) for u in uris]
    paths = _entries(rf, uris)
    inodes = {os.stat(p).st_ino for p in paths}
    assert len(inodes) == 1 and os.stat(paths[0]).st_nlink == 5  # one file, five entries
    assert os.stat(paths[0]).st_mode & PACK_MARK and member_count(paths[0]) == 5
    assert [read_entry(p) for p in paths] == [handler_bytes(u) for u in uris]
    entries, reserved = scan(rf.cache.dir)
    assert len(entries) == 1 and sorted(entries[0][2]) == sorted(paths) and reserved == 0
    assert entries[0][1] == os.path.getsize(paths[0])  # the pack's bytes, counted once
    with task_context(1, 0, 1, "read", -1) as ctx:  # the next epoch: hits, no GET
        assert [b for _, b in rf.read_many(uris[::-1])] == [handler_bytes(u) for u in uris[::-1]]
    assert ctx.counters["cache_hits"] == 5 and "objects_read" not in ctx.counters
    assert sum(handler.opens.values()) == 5


def test_a_pack_is_evicted_whole_and_its_bytes_leave_the_ledger(tmp_path):
    c = DiskCache(str(tmp_path / "c"), max_bytes=10_000)
    items = [(c.path_for(f"s3://b/{i}", "v"), bytes([i]) * 2_000, 0) for i in range(3)]
    assert c.put_pack(items) == [True, True, True]
    assert c.used_bytes() == os.path.getsize(items[0][0]) > 6_000
    old = time.time() - 3_600
    for p, _, _ in items:
        os.utime(p, (old, old))
    big = c.path_for("s3://b/big", "v")
    assert c.put_at(big, bytes(5_000)) == big  # room only once the whole pack went
    assert not any(os.path.exists(p) for p, _, _ in items)
    assert c.used_bytes() == 5_000


def test_each_member_of_a_pack_fetched_ahead_counts_its_own_miss_and_get_once(tmp_path, monkeypatch):
    monkeypatch.setattr(inflight, "_POOL", [])
    rf, _ = _flaky_files(tmp_path, 0, None, cache=True)
    ahead = ["flaky://1.bin", "flaky://2.bin", "flaky://3.bin"]
    ahead_mod.take_background()
    rf.prefetch(ahead, count=True)  # as a read task does: one pack, its members marked
    _wait_for_entries(rf, ahead)
    time.sleep(0.05)  # the pack's done callbacks
    assert len({os.stat(p).st_ino for p in _entries(rf, ahead)}) == 1
    for uri in ahead:
        with task_context(0, 0, 1, "read", -1) as ctx:
            assert [b for _, b in rf.read_many([uri])] == [handler_bytes(uri)]
        assert ctx.counters["cache_misses"] == 1 and ctx.counters["objects_read"] == 1, ctx.counters
    with task_context(1, 0, 1, "read", -1) as ctx:
        assert [b for _, b in rf.read_many(ahead)] == [handler_bytes(u) for u in ahead]
    assert ctx.counters["cache_hits"] == 3 and "objects_read" not in ctx.counters
    assert not os.stat(_entries(rf, ahead)[0]).st_mode & 0o100  # every mark taken: the pack's too


def test_a_fetch_ahead_packs_each_partition_alone(tmp_path, monkeypatch):
    """The next partitions' objects are a pack each (the read's own size apart): a reader of the
    first waits for its own GETs, not for the next partition's too."""
    monkeypatch.setattr(inflight, "_POOL", [])
    rf, _ = _flaky_files(tmp_path, 0, None, cache=True)
    uris = sorted(rf.versions)
    assert [b for _, b in rf.read_many(uris[:2], ahead=uris[2:])] == [handler_bytes(u) for u in uris[:2]]
    _wait_for_entries(rf, uris[2:])
    ino = [os.stat(p).st_ino for p in _entries(rf, uris)]
    assert ino[0] == ino[1] and ino[2] == ino[3] and len(set(ino)) == 3  # own, the next two, the last one


def test_where_packs_cannot_be_made_each_object_is_an_entry_of_its_own(tmp_path, monkeypatch):
    """A filesystem without hard links (or sticky bits): the pack's temporary file goes, its bytes
    leave the ledger, and each object is written alone; any other error is raised, not retried per object."""
    from sbloader.sources import cache_packs

    def no_links(tmp, entries, linked):
        raise cache_packs.NoPacks("no hard link here")

    monkeypatch.setattr(cache_packs, "link_members", no_links)
    c = DiskCache(str(tmp_path / "c"))
    items = [(c.path_for(f"s3://b/{i}", "v"), bytes([i]) * 100, 0) for i in range(3)]
    assert c.put_pack(items) == [True, True, True]
    assert [read_entry(p) for p, _, _ in items] == [d for _, d, _ in items]
    assert len({os.stat(p).st_ino for p, _, _ in items}) == 3 and not os.stat(items[0][0]).st_mode & PACK_MARK
    assert c.used_bytes() == 300 and not [n for _, _, fs in os.walk(tmp_path) for n in fs if n.startswith(".tmp-")]

    def full(tmp, entries, linked):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_packs, "link_members", full)
    more = [(c.path_for(f"s3://b/x{i}", "v"), b"x" * 10, 0) for i in range(2)]
    with pytest.raises(OSError, match="No space"):
        c.put_pack(more)
    assert not any(os.path.exists(p) for p, _, _ in more) and c.used_bytes() == 300


def test_members_are_read_from_the_pack_held_open_and_a_pack_remade_meanwhile_is_read_anew(tmp_path, monkeypatch):
    """A pack is opened once per process, not once per member (#47: five system calls an object),
    at most ``open_packs.KEPT`` stay open, and a pack evicted while held open and written again
    under the same names is read afresh (a held inode's number is never another file's)."""
    from sbloader.sources import open_packs

    open_packs.forget_all()
    monkeypatch.setattr(open_packs, "KEPT", 8)
    c = DiskCache(str(tmp_path / "c"))
    packs = [[(c.path_for(f"s3://b/{k}-{i}", "v"), bytes([k, i]) * 700, 0) for i in range(6)] for k in range(12)]
    for items in packs:
        assert c.put_pack(items) == [True] * 6
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k))
    for items in packs:
        assert [read_entry(p) for p, _, _ in items] == [d for _, d, _ in items]
    assert len(opened) == len(packs)  # one open per pack
    assert len(open_packs._OPEN) == open_packs.KEPT
    before = len(os.listdir("/proc/self/fd"))
    first = packs[-1]
    for p, _, _ in first:  # evicted (every link), then the same entries written again with other bytes
        os.unlink(p)
    remade = [(p, b"new" + d, 0) for p, d, _ in first]
    assert c.put_pack(remade) == [True] * 6
    assert [read_entry(p) for p, _, _ in remade] == [d for _, d, _ in remade]
    open_packs.forget_all()
    assert len(os.listdir("/proc/self/fd")) <= before - open_packs.KEPT + 1


def test_a_pack_is_written_in_pieces_the_page_cache_keeps_small(tmp_path, monkeypatch):
    """One ``writev`` of a whole pack (megabytes) took 2 MiB page-cache folios, which cost ~10x
    the CPU of small pieces on the VM this is measured on; pieces of 256 KiB cost as much on
    another day, pieces of <= 128 KiB never did (#47)."""
    from sbloader.sources import cache_packs

    sizes = []
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: sizes.append(sum(len(b) for b in bufs)) or real(fd, bufs))
    c = DiskCache(str(tmp_path / "c"))
    items = [(c.path_for(f"s3://b/{i}", "v"), os.urandom(100_000 + i), 0) for i in range(40)]
    assert c.put_pack(items) == [True] * 40
    assert max(sizes) <= 128 << 10 and len(sizes) >= 32  # 4 MB in pieces
    assert [read_entry(p) for p, _, _ in items] == [d for _, d, _ in items]


def test_a_members_marks_are_taken_by_one_of_the_threads_reading_it_at_once(tmp_path):
    """Threads share the pack's descriptor, whose ``flock`` does not keep them apart: the pack's
    lock among threads does, so one reader counts the miss and the others hits."""
    import threading

    c = DiskCache(str(tmp_path / "c"))
    items = [(c.path_for(f"s3://b/{i}", "v"), bytes([i]) * 500, 0) for i in range(24)]
    assert c.put_pack(items, ahead=True, count=True) == [True] * 24
    for p, d, _ in items:
        got, start = [], threading.Barrier(8)

        def look() -> None:
            start.wait()
            got.append(c.check(p, len(d))[1])

        threads = [threading.Thread(target=look) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(got) == 8 and sum(1 for m in got if m) == 1, got
    assert not os.stat(items[0][0]).st_mode & 0o100  # the last member's mark took the pack's


def test_a_reads_members_of_one_pack_have_their_marks_taken_together_once(tmp_path, monkeypatch):
    """A read task looks at its partition's entries at once (``check_many``): the marks of a pack's
    members are taken under one lock with one ``pwrite`` of the footer's records (#47: four system
    calls a member before), each by one reader only, the others' left for their own readers."""
    import threading

    from sbloader.sources import cache_packs

    c = DiskCache(str(tmp_path / "c"))
    items = [(c.path_for(f"s3://b/{i}", "v"), bytes([i]) * 500, 0) for i in range(12)]
    assert c.put_pack(items, ahead=True, count=True) == [True] * 12
    writes: list = []
    real = os.pwrite
    monkeypatch.setattr(cache_packs.os, "pwrite", lambda fd, b, at: writes.append(at) or real(fd, b, at))
    first = [(p, len(d)) for p, d, _ in items[:8]]
    looks = c.check_many(first + [(c.path_for("s3://b/none", "v"), 1)])
    assert [p for p, _, _ in looks] == [p for p, _ in first] + [None]
    assert all(m & 0o100 and m & 0o010 for _, m, _ in looks[:8]) and len(writes) == 1
    assert [m for _, m, _ in c.check_many(first)] == [0] * 8  # taken: later reads are hits
    assert os.stat(items[0][0]).st_mode & 0o100  # four members keep theirs: so does the pack
    got, start = [], threading.Barrier(4)  # readers of the last four at once: one takes each mark

    def look() -> None:
        start.wait()
        got.append([m for _, m, _ in c.check_many([(p, len(d)) for p, d, _ in items[8:]])])

    threads = [threading.Thread(target=look) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 4 and [sum(1 for g in got if g[i]) for i in range(4)] == [1] * 4, got
    assert not os.stat(items[0][0]).st_mode & 0o100  # every member's taken: the pack's mark too
    assert [read_entry(p, st) for p, _, st in c.check_many([(p, len(d)) for p, d, _ in items])] == \
        [d for _, d, _ in items]


def test_a_member_is_found_by_its_records_own_digest_not_by_bytes_that_span_two_fields():
    """A member's record is found by ``bytes.find`` of its entry name (not a parse of every record
    each time a pack is opened, #47); a match not at a record's start is no match."""
    from sbloader.sources.cache_packs import _RECORD, _index

    names = [bytes([i]) * 32 for i in range(3)]
    raw = b"".join(_RECORD.pack(n, 100 * i, 10, 0, 0) for i, n in enumerate(names))
    for i, n in enumerate(names):
        assert _index(raw, "/c/ab/" + n.hex()) == i
    inside = raw[10:42]  # 32 bytes across a digest and the offset after it
    assert raw.find(inside) == 10 and _index(raw, "/c/ab/" + inside.hex()) == -1
    assert _index(raw, "/c/ab/" + (b"z" * 32).hex()) == -1


def test_the_packs_kept_open_are_bounded_by_their_bytes_too(tmp_path, monkeypatch):
    """Small packs are kept by the hundred (a shuffled epoch reads each object from another pack,
    #47), large ones only as many as :data:`open_packs.KEPT_BYTES` holds: an evicted pack's bytes
    stay on disk while it is kept."""
    from sbloader.sources import open_packs

    open_packs.forget_all()
    monkeypatch.setattr(open_packs, "KEPT", 100)
    monkeypatch.setattr(open_packs, "KEPT_BYTES", 20_000)
    c = DiskCache(str(tmp_path / "c"))
    packs = [[(c.path_for(f"s3://b/{k}-{i}", "v"), bytes([k, i]) * 1_000, 0) for i in range(3)] for k in range(6)]
    for items in packs:
        assert c.put_pack(items) == [True] * 3
        assert [read_entry(p) for p, _, _ in items] == [d for _, d, _ in items]
    size = os.path.getsize(packs[0][0][0])
    assert 6_000 < size < 7_000 and len(open_packs._OPEN) == 20_000 // size == 3
    assert open_packs._KEPT_BYTES[0] == 3 * size
    open_packs.forget_all()
    assert open_packs._KEPT_BYTES[0] == 0 and not open_packs._OPEN


def _entry_locked(rf, uri):
    """Whether ``uri``'s entry lock is held now (by a thread of this process, or another process)."""
    from sbloader.sources.cache import cache_here

    cache = cache_here(rf.cache)
    lock = cache.lock_at(cache.path_for(uri, rf._version(uri)[1]))
    if lock.try_enter():
        lock.__exit__(None, None, None)
        return False
    return True


def test_a_fetch_ahead_claims_every_entry_before_its_gets_and_lets_each_go_once_packed(tmp_path, monkeypatch):
    """The thread that starts a fetch ahead takes every entry's lock (and looks) itself and hands
    the pool only the GETs (in the fetch threads, the looks and locks cost 2-3x their CPU, #47):
    with 3 fetch threads and 5 slow objects, all 5 are claimed when ``prefetch`` returns (before,
    only those a thread had started). Each is one GET, and every lock goes once the pack is written."""
    monkeypatch.setattr(inflight, "_POOL", [])
    rf, handler = _flaky_files(tmp_path, 0, None, cache=True)
    handler.slow_s = 0.1
    uris = sorted(rf.versions)
    rf.prefetch(uris, count=True)
    assert all(_entry_locked(rf, u) for u in uris)
    _wait_for_entries(rf, uris)
    deadline = time.monotonic() + 10
    while any(_entry_locked(rf, u) for u in uris):
        assert time.monotonic() < deadline, "a fetched-ahead entry's lock was never let go"
        time.sleep(0.01)
    assert handler.opens == {u.split("://")[1]: 1 for u in uris}
    with task_context(0, 0, 1, "read", -1) as ctx:
        assert [b for _, b in rf.read_many(uris)] == [handler_bytes(u) for u in uris]
    assert ctx.counters["objects_read"] == 5 and ctx.counters["cache_misses"] == 5


def test_a_claimed_object_whose_get_fails_lets_its_entry_go(tmp_path, monkeypatch):
    monkeypatch.setattr(inflight, "_POOL", [])
    rf, handler = _flaky_files(tmp_path, 10, OSError("HTTP response code: 503 SlowDown"), cache=True)
    uris = sorted(rf.versions)[:2]
    rf.prefetch(uris, count=True)
    deadline = time.monotonic() + 10
    while any(_entry_locked(rf, u) for u in uris) or sum(handler.opens.values()) < 8:
        assert time.monotonic() < deadline, "a failed fetch ahead kept its entry's lock"
        time.sleep(0.01)
    assert _entries(rf, uris) == [None, None]  # nothing cached: the reads will ask again
