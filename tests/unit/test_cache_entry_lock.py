"""An entry's lock (held while its object is downloaded) excludes every other thread and
process wanting that entry, and nobody wanting another; it creates no file per entry."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from sbloader.sources import cache_locks
from sbloader.sources.cache import LOCKS_NAME, DiskCache

# Another process takes the entry's lock, prints the seconds it waited, and lets go.
_TAKER = r"""
import sys, time
from sbloader.sources.cache import DiskCache
c = DiskCache(sys.argv[1])
print("taking", flush=True)
t0 = time.monotonic()
with c.lock_at(c.path_for(sys.argv[2], "v")):
    print(round(time.monotonic() - t0, 3), flush=True)
"""


def _waits(c: DiskCache, uri: str) -> threading.Event:
    """A thread taking ``uri``'s lock; the event is set once it holds it."""
    got = threading.Event()

    def take() -> None:
        with c.lock_at(c.path_for(uri, "v")):
            got.set()

    threading.Thread(target=take, daemon=True).start()
    return got


def _check_exclusion(root: str) -> None:
    c = DiskCache(root)
    with c.lock_at(c.path_for("s3://b/a", "v")):
        same, other = _waits(c, "s3://b/a"), _waits(c, "s3://b/b")
        assert other.wait(10), "another entry's lock waited for this one"
        assert not same.wait(0.3), "a second thread took an entry's lock while it was held"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        child = subprocess.Popen([sys.executable, "-c", _TAKER, root, "s3://b/a"], stdout=subprocess.PIPE,
                                 text=True, env=env)
        assert child.stdout.readline().strip() == "taking"
        time.sleep(0.6)
        assert child.poll() is None, "another process took an entry's lock while it was held"
    assert same.wait(10)
    waited = float(child.communicate(timeout=60)[0])
    assert waited >= 0.5  # it waited for this process to let go


def test_an_entry_lock_excludes_threads_and_processes_for_that_entry_only(tmp_path):
    _check_exclusion(str(tmp_path))
    names = [e for _, _, files in os.walk(tmp_path) for e in files]
    assert names == [LOCKS_NAME]  # one lock file for the directory, none per entry


def test_without_ofd_locks_an_entry_lock_falls_back_to_a_lock_file_per_entry(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_locks, "_OFD_OK", [False])
    c = DiskCache(str(tmp_path))
    p = c.path_for("s3://b/a", "v")
    with c.lock_at(p):
        assert os.path.exists(p + ".lock")
        assert not _waits(c, "s3://b/a").wait(0.3)
        assert _waits(c, "s3://b/b").wait(10)


def test_a_process_takes_its_entries_locks_on_one_descriptor_and_a_forked_child_on_its_own(tmp_path, monkeypatch):
    """Opening and closing the lock file for each entry were two system calls an object (#47):
    the file is opened once per process. Locks of one open description do not exclude each other,
    so a thread trying an entry another thread holds is refused by the process itself, and a
    forked child (which inherits the description) opens its own and is refused by the kernel."""
    c = DiskCache(str(tmp_path))
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k))
    for i in range(20):
        with c.lock_at(c.path_for(f"s3://b/{i}", "v")):
            pass
    assert [p for p in opened if p.endswith(LOCKS_NAME)] == [os.path.join(str(tmp_path), LOCKS_NAME)]
    monkeypatch.setattr(os, "open", real_open)
    held = c.lock_at(c.path_for("s3://b/a", "v"))
    with held:
        other = []
        t = threading.Thread(target=lambda: other.append(c.lock_at(c.path_for("s3://b/a", "v")).try_enter()))
        t.start()
        t.join(10)
        assert other == [False], "a second thread took an entry's lock while the first held it"
        for let_go in (True, False):  # a child's copy lets go of nothing: the next child is refused too
            pid = os.fork()
            if pid == 0:
                ok = not c.lock_at(c.path_for("s3://b/a", "v")).try_enter()
                if let_go:
                    held.__exit__(None, None, None)
                os._exit(0 if ok else 1)
            assert os.waitpid(pid, 0)[1] == 0, "a forked child took the lock its parent held"
    again = c.lock_at(c.path_for("s3://b/a", "v"))
    assert again.try_enter()
    again.__exit__(None, None, None)
