"""The cache's byte budget is the node's: processes sharing a cache directory never hold
more than ``cache_max_bytes`` on disk together (counted on disk, not by the cache)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from sbloader.sources import cache as cache_mod
from sbloader.sources.cache import DiskCache
from sbloader.sources.cache_ledger import LEDGER_NAME, Ledger, reserved_bytes, tmp_name

BUDGET = 200_000

# One writer process: 150 objects of 2-20 KB, each under its entry's lock as a read task
# writes them; every entry may be evicted (PROTECT_S = 0). After each write it counts the
# directory itself and prints the largest count it saw. The directory is counted holding the
# ledger's lock: a listing is not a snapshot (a file renamed while it is listed can be seen
# twice), and under the lock no file is created, renamed or evicted.
_WRITER = r"""
import os, random, sys
from sbloader.sources import cache as cache_mod
from sbloader.sources.cache import DiskCache
from sbloader.sources.cache_ledger import Ledger
cache_mod.PROTECT_S = 0.0
ledger = Ledger(sys.argv[1])
root, budget, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
c = DiskCache(root, budget)
rng = random.Random(tag)
most, admitted = 0, 0
for i in range(150):
    uri = f"s3://b/{tag}/{i}"
    with c.lock(uri, "v"):
        admitted += c.put(uri, "v", bytes(rng.randrange(2_000, 20_000))) is not None
    with ledger.held():
        on_disk = 0
        for sub in os.scandir(root):
            if sub.is_dir():
                for e in os.scandir(sub.path):
                    if not e.name.endswith(".lock"):
                        try:
                            on_disk += e.stat().st_size
                        except OSError:
                            pass
    most = max(most, on_disk)
print(most, admitted)
"""


def _bytes_on_disk(root: str) -> int:
    """Every byte in the directory's entries and writes under way (lock files and the ledger aside)."""
    n = 0
    for sub in os.scandir(root):
        if not sub.is_dir():
            continue
        for e in os.scandir(sub.path):
            if not e.name.endswith(".lock"):
                try:
                    n += e.stat().st_size
                except OSError:
                    pass
    return n


def test_two_processes_on_one_cache_dir_never_hold_more_than_its_budget(tmp_path):
    root = str(tmp_path / "cache")
    os.makedirs(root)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, root, str(BUDGET), tag], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for tag in ("a", "b")]
    seen = [0]
    done = threading.Event()

    def watch() -> None:  # counted from outside while both write (a snapshot: under the ledger's lock)
        ledger = Ledger(root)
        while not done.is_set():
            with ledger.held():
                seen[0] = max(seen[0], _bytes_on_disk(root))
            time.sleep(0.001)  # let the writers have the lock

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        done.set()
        watcher.join()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    most = [int(o.split()[0]) for o, _ in outs]
    admitted = [int(o.split()[1]) for o, _ in outs]
    # Each process wrote ~1.6 MB: about 16 budgets between them, so evictions were needed all along.
    assert admitted == [150, 150]
    assert max(most) <= BUDGET and seen[0] <= BUDGET, (most, seen[0])
    final = _bytes_on_disk(root)
    assert BUDGET // 2 < final <= BUDGET  # the budget is used, not just respected
    with Ledger(root).held() as ledger:
        assert ledger.read() == final  # the ledger counts exactly what is on disk


def test_a_bounded_process_counts_what_an_unbounded_one_wrote(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "PROTECT_S", 3600.0)  # nothing may be evicted
    root = str(tmp_path)
    free = DiskCache(root, None)
    for i in range(10):
        assert free.put(f"s3://b/free/{i}", "v", bytes(10_000)) is not None
    bounded = DiskCache(root, 150_000)
    admitted = sum(bounded.put(f"s3://b/bounded/{i}", "v", bytes(10_000)) is not None for i in range(10))
    assert admitted == 5  # 100 KB were there already
    assert bounded.used_bytes() == 150_000


def test_a_recount_drops_dead_writers_and_entries_deleted_by_hand(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "PROTECT_S", 3600.0)
    root = str(tmp_path)
    c = DiskCache(root, 100_000)
    paths = [c.put(f"s3://b/{i}", "v", bytes(20_000)) for i in range(5)]
    assert all(paths) and c.put("s3://b/5", "v", bytes(20_000)) is None  # full
    # A writer that died mid-write left its temporary file; a user deleted two entries.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = os.path.join(os.path.dirname(paths[0]), f".tmp-{int(dead.stdout)}-1-20000")
    open(stale, "wb").close()
    os.unlink(paths[0])
    os.unlink(paths[1])
    assert c.put("s3://b/6", "v", bytes(40_000)) is not None  # the recount found the room
    assert not os.path.exists(stale)
    with Ledger(root).held() as ledger:
        assert ledger.read() == 100_000 == c.used_bytes()  # 3 entries of 20 KB and the new 40 KB


def test_a_write_under_way_is_named_with_its_bytes():
    assert reserved_bytes(tmp_name(1234)) == (os.getpid(), 1234)
    assert reserved_bytes("0123abcd") is None and reserved_bytes(LEDGER_NAME) is None


def test_a_replaced_entry_frees_its_old_bytes(tmp_path):
    c = DiskCache(str(tmp_path), 50_000)
    p = c.path_for("s3://b/x", "v")
    assert c.put_at(p, bytes(30_000)) == p
    assert c.put_at(p, bytes(40_000)) == p  # the old 30 KB are not counted twice
    with Ledger(str(tmp_path)).held() as ledger:
        assert ledger.read() == 40_000 == os.path.getsize(p)


def test_a_replaced_entry_that_no_longer_fits_is_not_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "PROTECT_S", 3600.0)
    c = DiskCache(str(tmp_path), 50_000)
    keep = c.put("s3://b/keep", "v", bytes(30_000))
    p = c.path_for("s3://b/x", "v")
    assert keep and c.put_at(p, bytes(20_000)) == p
    assert c.put_at(p, bytes(60_000)) is None  # the old 20 KB went; the new version is larger than the cache
    assert not os.path.exists(p)
    with Ledger(str(tmp_path)).held() as ledger:
        assert ledger.read() == 30_000 == c.used_bytes()
