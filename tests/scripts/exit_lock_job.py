"""Forks made while another thread keeps the C library's exit-handler lock busy (``tests/unit/test_exit_lock.py``).

Usage: ``exit_lock_job.py HAMMER_SO MODE N``: a thread runs ``exit_lock_hammer.c``'s loop; N children are
forked, one at a time, each making a C++ static (torch's thread pool: ``torch.set_num_threads(1)``, as a
torch worker's first call) after, in MODE ``free``, :func:`sbloader.runtime.exit_lock.free_in_child`, or in
MODE ``off``, nothing. A child not done within 3 s is killed. Prints one JSON line: how each child ended.
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


def child(mode: str) -> int:
    result = exit_lock.free_in_child() if mode == "free" else "off"
    torch.set_num_threads(1)  # a C++ static made for the first time in this process
    return {"free": 10, "freed": 11, "left": 12, "off": 13}[result]


def main(hammer_so: str, mode: str, n: int) -> None:
    stop = ctypes.c_int(0)
    hammer = ctypes.CDLL(hammer_so)
    thread = threading.Thread(target=hammer.hammer, args=(ctypes.byref(stop),), daemon=True)
    thread.start()
    time.sleep(0.05)
    ends: dict = {}
    for _ in range(n):
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
    stop.value = 1
    thread.join()
    print(json.dumps(ends), flush=True)
    os._exit(0)  # the hammer's handlers are gone; nothing else to run at exit


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
