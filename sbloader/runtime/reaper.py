"""A watcher that removes the embedded Ray's processes when the process that owns it dies.

Ray binds its node processes (GCS, raylet, ...) to their parent with a
parent-death signal, but the raylet's own children (the dashboard and runtime-env
agents) outlive a SIGKILLed owner by about a minute: they first try to report the
raylet's death to the GCS, which is already gone. The reaper is a small
standard-library process started next to the embedded Ray. It keeps a list of the
Ray processes (the node processes and their descendants, each with its start time
so a reused pid is never hit) and reads a pipe whose other end only the owner
holds: the pipe reaches end-of-file when the owner exits in any way, including
SIGKILL, and the reaper then kills what is left of that list.

This file runs as a script (``python reaper.py PID...``) and imports nothing from
sbloader, so the watcher starts in tens of milliseconds.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

SCAN_S = 1.0  # how often the list of Ray processes is refreshed while the owner lives


def _stat(pid: int) -> Optional[tuple[int, int]]:
    """(parent pid, start time) of a live process, None when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if rest[0] in ("Z", "X"):
        return None
    return int(rest[1]), int(rest[19])


def _tree(roots: dict[int, int]) -> dict[int, int]:
    """The live processes among ``roots`` (pid -> start time) and all their descendants."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                parents.setdefault(st[0], []).append(int(entry))
                starts[int(entry)] = st[1]
    out = {pid: start for pid, start in roots.items() if starts.get(pid) == start}
    todo = list(out)
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in out:
                out[child] = starts[child]
                todo.append(child)
    return out


def children(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[0] == pid:
                out.append(int(entry))
    return out


def kill_tree(root_pids: list[int]) -> list[int]:
    """Kill ``root_pids`` and all their descendants (SIGKILL), none able to start another meanwhile:
    each is stopped (SIGSTOP) as it is found, until a scan finds no new one. Returns the pids killed."""
    roots = {pid: st[1] for pid in root_pids if (st := _stat(pid)) is not None}
    found: dict[int, int] = {}
    while True:
        new = {pid: start for pid, start in _tree({**roots, **found}).items() if pid not in found}
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        found.update(new)
    for pid, start in found.items():
        st = _stat(pid)
        if st is not None and st[1] == start:
            _signal(pid, signal.SIGKILL)
    return sorted(found)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:  # gone already
        pass


def watch(root_pids: list[int]) -> None:
    """Script entry: follow ``root_pids``' process trees until stdin closes, then kill them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    roots = {pid: st[1] for pid in root_pids if (st := _stat(pid)) is not None}
    known: dict[int, int] = dict(roots)
    closed = threading.Event()

    def wait_for_eof() -> None:
        while sys.stdin.buffer.read(1):
            pass
        closed.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    while not closed.wait(SCAN_S):
        known.update(_tree(roots))
    time.sleep(0.5)  # a normal exit stops Ray by itself; leave it a moment
    for pid, start in known.items():
        st = _stat(pid)
        if st is not None and st[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def start(root_pids: list[int]) -> Optional[subprocess.Popen]:
    """Start a reaper for the Ray processes ``root_pids`` (Linux only; None elsewhere).

    The returned process's stdin is the pipe: the caller keeps the object alive
    (and so the pipe's write end open) for as long as its Ray runs.
    """
    if not sys.platform.startswith("linux") or not root_pids:
        return None
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *map(str, root_pids)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


if __name__ == "__main__":
    watch([int(a) for a in sys.argv[1:]])
