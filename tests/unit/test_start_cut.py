"""The cut of Ray's start at exit (``sbloader/runtime/start_cut.py``), on plain functions and processes.

Where the cut raises (never inside an import, again after a callback swallowed it), that a start
asked after the cut never begins, and the sweep's process tools: the children that name this
process's Ray session, and a whole tree killed at once. The cut of a real start:
``tests/unit/test_exit.py``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import weakref

import pytest

from sbloader.runtime import reaper, start_cut


@pytest.fixture(autouse=True)
def fresh_cut(monkeypatch):
    """A process that has not begun to exit (the module's state is per process)."""
    monkeypatch.setattr(start_cut, "_STATE", {"asked": False, "raised": False, "swept": False})
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    if sys.gettrace() is not None:
        pytest.skip("a tracer runs (coverage, a debugger): the start is not cancellable under it")


def _step(log: list, name: str) -> None:
    log.append(name)


def test_a_start_runs_as_before_unless_cut():
    assert start_cut.cancellable(lambda: 42) == 42
    assert sys.gettrace() is None and not start_cut.asked()


def test_the_cut_raises_at_the_starts_next_call_and_nothing_after_it_runs():
    log: list = []

    def start() -> None:
        _step(log, "spawned")
        start_cut.cut()  # the exit, from the main thread while the start runs
        _step(log, "after the cut")
        _step(log, "never")

    with pytest.raises(start_cut.StartCancelled):
        start_cut.cancellable(start)
    assert log == ["spawned"]
    assert sys.gettrace() is None


def test_a_start_asked_after_the_cut_never_begins():
    start_cut.cut()
    called = []
    with pytest.raises(start_cut.StartCancelled, match="not begun"):
        start_cut.cancellable(lambda: called.append(1))
    assert called == [] and start_cut.asked()


def test_the_cut_waits_for_an_import_under_way_to_finish(tmp_path, monkeypatch):
    (tmp_path / "cut_mod_a.py").write_text(
        "import sys\nSTEPS = []\ndef step(n):\n    STEPS.append(n)\nfor n in range(3):\n    step(n)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    log: list = []

    def start() -> None:
        start_cut.cut()
        import cut_mod_a  # noqa: F401  (its body calls functions: none of those calls raises)
        _step(log, "after the import")

    with pytest.raises(start_cut.StartCancelled):
        start_cut.cancellable(start)
    mod = sys.modules.pop("cut_mod_a")
    assert mod.DONE and mod.STEPS == [0, 1, 2], "the module was left half made"
    assert log == []


def test_the_cut_never_raises_inside_the_standard_library_where_a_lock_may_be_held():
    """``logging`` takes its module lock and lets it go with a call (``_releaseLock``), often outside a
    ``finally`` (``Manager._clear_cache``): a cut raised at that call left the lock held, and the exiting
    process hung in its next log call (seen once: a Lightning job that raised while Ray started). The cut
    waits for the start's next call outside the standard library."""
    import logging
    import threading

    log: list = []

    def start() -> None:
        logging._acquireLock()  # as logging's own code does, then...
        start_cut.cut()  # ...the exit asks for the cut while the lock is held
        logging._releaseLock()
        _step(log, "outside the standard library")

    with pytest.raises(start_cut.StartCancelled):
        start_cut.cancellable(start)
    assert log == []
    got = []

    def other_thread_logs() -> None:
        free = logging._lock.acquire(timeout=5)
        if free:
            logging._lock.release()
        got.append(free)

    other = threading.Thread(target=other_thread_logs)
    other.start()
    other.join()
    if got != [True]:
        logging._releaseLock()  # this thread's: let the rest of the session log
    assert got == [True], "the logging module's lock was left held by the cut"


def test_a_cut_swallowed_by_a_callback_is_raised_again_and_not_printed(capsys):
    class Obj:
        pass

    log: list = []

    def start() -> None:
        obj = Obj()
        ref = weakref.ref(obj, lambda _: _step(log, "callback"))  # noqa: F841
        start_cut.cut()
        del obj  # the callback is the next call: Python swallows what it raises (unraisable)
        _step(log, "after the callback")
        _step(log, "never")

    with pytest.raises(start_cut.StartCancelled):
        start_cut.cancellable(start)
    assert log == []
    assert capsys.readouterr().err == ""


def test_the_sweep_finds_the_children_naming_this_process_s_ray_session_and_kills_their_trees():
    me = os.getpid()
    session = f"/tmp/ray/session_2026-01-01_00-00-00_123456_{me}"
    other = f"/tmp/ray/session_2026-01-01_00-00-00_123456_{me}1"  # another process's session (pid prefix)
    tree = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    ours = subprocess.Popen([sys.executable, "-c", tree, f"--session-dir={session}"])
    theirs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--session-dir={other}"])
    try:
        deadline = time.monotonic() + 20
        while len(reaper.children(ours.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = reaper.children(ours.pid)
        assert grandchild, "the test's process tree did not come up"
        found = start_cut.session_children()  # (a Ray this test process runs names its session too)
        assert ours.pid in found and theirs.pid not in found
        killed = reaper.kill_tree([ours.pid])
        assert sorted(killed) == sorted([ours.pid, *grandchild])
        assert ours.wait(5) == -9
        deadline = time.monotonic() + 5
        while reaper._stat(grandchild[0]) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reaper._stat(grandchild[0]) is None, "the grandchild outlived the kill"
        assert theirs.poll() is None, "a process of another session was killed"
    finally:
        for proc in (ours, theirs):
            proc.kill()
            proc.wait()
