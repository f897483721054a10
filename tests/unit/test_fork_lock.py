"""The embedded Ray's spawns and the local workers' forks stay apart (sbloader/runtime/fork_lock.py).

A ``Popen`` waits until its child has called ``exec``; a process forked by another thread in that
moment holds the pipe it waits on, and the ``Popen`` then waited for that process's whole life (a
torchrun job hung: its rank's ``ray.init`` waited for the local workers, its loop for Ray). That
moment lasts as long as the fork of the spawning process (milliseconds for a process with torch
loaded); here it lasts a second, so the worker's fork lands in it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

from sbloader.loaders.fork_safe import ForkGate
from sbloader.runtime.fork_lock import spawns_apart_from_forks

WORKER_LIFE_S = 8.0


def spawn_while_a_worker_forks(guarded: bool, monkeypatch) -> float:
    """Seconds a ``Popen`` took whose fork lasted 1 s, while a worker that lives :data:`WORKER_LIFE_S`
    is forked (behind a :class:`ForkGate`) 0.3 s into it."""
    took: list = []
    fork_exec = subprocess._fork_exec

    def slow_fork_exec(*args):
        pid = fork_exec(*args)
        time.sleep(1.0)  # the parent still holds the pipe's write end: a fork now copies it
        return pid

    monkeypatch.setattr(subprocess, "_fork_exec", slow_fork_exec)

    def spawn() -> None:
        t0 = time.monotonic()
        subprocess.Popen(["true"]).wait()
        took.append(time.monotonic() - t0)

    def run() -> None:
        spawner = threading.Thread(target=spawn)
        spawner.start()
        time.sleep(0.3)
        with ForkGate().forking():
            pid = os.fork()
            if pid == 0:  # the local worker
                time.sleep(WORKER_LIFE_S)
                os._exit(0)
        spawner.join()
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

    if guarded:
        with spawns_apart_from_forks():
            run()
    else:
        run()
    return took[0]


def test_a_spawn_never_waits_for_a_worker_forked_while_it_spawns(monkeypatch):
    assert spawn_while_a_worker_forks(True, monkeypatch) < WORKER_LIFE_S / 2


def test_without_the_lock_the_spawn_waits_for_the_worker_s_exit(monkeypatch):
    """What the lock prevents, shown: the test above would fail without it."""
    assert spawn_while_a_worker_forks(False, monkeypatch) >= WORKER_LIFE_S - 1


def test_popen_is_itself_again_once_the_last_start_left():
    original = subprocess.Popen.__init__
    with spawns_apart_from_forks():
        with spawns_apart_from_forks():
            assert subprocess.Popen.__init__ is not original
        assert subprocess.Popen.__init__ is not original
    assert subprocess.Popen.__init__ is original
