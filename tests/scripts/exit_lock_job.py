"""Forks made while another thread keeps the C library's exit-handler lock busy (``tests/unit/test_exit_lock.py``).

Usage: ``exit_lock_job.py HAMMER_SO MODE N [UNTIL]``: N children are forked, one at a time, each while a
thread runs ``exit_lock_hammer.c``'s loop, each making a C++ static (torch's thread pool: ``torch.set_num_threads(1)``,
as a torch worker's first call) after, in MODE ``free``, :func:`sbloader.runtime.exit_lock.free_in_child`; in MODE
``ray``, nothing but ``import ray`` first (sbloader's at-fork hook asks then); in MODE ``off``, nothing.
A child not done within 3 s is killed. With UNTIL (an end: ``hung``, ``freed``), forks go on past N until one
child ended so (at most :data:`MAX_FORKS`; the hammer holds the lock at most forks, not all: on a loaded machine a
few forks in a row may find it free). Prints one JSON line: how each child ended.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time

import torch

from sbloader.runtime import exit_lock

CHILD_S = 3.0
MAX_FORKS = 40


def child(mode: str) -> int:
    if mode == "free":
        exit_lock.free_in_child()
    torch.set_num_threads(1)  # a C++ static made for the first time in this process
    asked = exit_lock._DONE["pid"] == os.getpid()  # by this call, or by sbloader's at-fork hook (mode ray)
    return {"free": 10, "freed": 11, "left": 12}[exit_lock._DONE["result"]] if asked else 13


class Hammer:
    """``exit_lock_hammer.c``'s loop on a thread while inside (the lock busy for a fork made inside)."""

    def __init__(self, path: str) -> None:
        self.lib, self.stop, self.rounds = ctypes.CDLL(path), ctypes.c_int(0), ctypes.c_int(0)

    def __enter__(self) -> "Hammer":
        self.stop.value = self.rounds.value = 0
        self.thread = threading.Thread(target=self.lib.hammer, args=(ctypes.byref(self.stop),
                                                                     ctypes.byref(self.rounds)), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 5.0
        while self.rounds.value < 2 and time.monotonic() < deadline:  # in its loop (a loaded machine starts it late)
            time.sleep(0.0005)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.value = 1
        self.thread.join()


def main(hammer_so: str, mode: str, n: int, until: str = "") -> None:
    if mode == "ray":
        import ray  # noqa: F401 - a process with Ray loaded: every child it forks asks (sbloader.runtime.fork_child)
    hammer = Hammer(hammer_so)
    ends: dict = {}
    k = 0
    while k < n or (until and until not in ends and k < MAX_FORKS):
        k += 1
        with hammer:  # only around the fork: the machine's CPUs stay free for the suite's other tests
            pid = os.fork()
            if pid == 0:
                os._exit(child(mode))
        deadline = time.monotonic() + CHILD_S
        end = "hung"
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                end = {10: "free", 11: "freed", 12: "left", 13: "off"}.get(os.waitstatus_to_exitcode(status), "died")
                break
            time.sleep(0.005)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        ends[end] = ends.get(end, 0) + 1
    print(json.dumps(ends), flush=True)
    os._exit(0)  # nothing of the hammer's is left to run at exit


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
