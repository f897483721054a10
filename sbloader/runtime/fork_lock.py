"""One lock between this process's forks of local workers and its spawns of the embedded Ray's processes.

``subprocess.Popen`` waits until the child it spawned has called ``exec``: it reads a pipe
whose write end only that child holds, and the ``exec`` closes it. A process forked by
another thread in that moment (a local worker, :mod:`~sbloader.loaders.fork_safe`) holds a
copy of that write end too, so the ``Popen`` waits until *that* process exits. The embedded
Ray starts in the background while a loader's first batches are made on forked local workers:
its ``ray.init`` waited for the workers' exit, and a rank whose loop waited for Ray in the
meantime (its coordinator) never got it: the job hung (CI, ``tests/e2e/test_coordinator_loss.py``).

:data:`FORK_LOCK` is held while local workers are forked
(:class:`~sbloader.loaders.fork_safe.ForkGate`), and, inside :func:`spawns_apart_from_forks`
(the embedded Ray's start), by every ``Popen`` of this process while it spawns: a fork
waits a few milliseconds for a spawn, never the other way round for a worker's life.
"""
from __future__ import annotations

import contextlib
import subprocess
import threading
from typing import Any, Iterator

#: Held while local workers are forked, while a background thread pickles the dataset for the pool,
#: and by each subprocess spawn inside :func:`spawns_apart_from_forks`.
FORK_LOCK = threading.Lock()

SPAWN_WAIT_S = 30.0  # a spawn waits at most this long for a fork under way, then goes on (as before the lock)

_ORIGINAL_INIT = subprocess.Popen.__init__
_ACTIVE = {"count": 0}
_ACTIVE_LOCK = threading.Lock()


def _spawn_apart(self: Any, *args: Any, **kwargs: Any) -> None:
    got = FORK_LOCK.acquire(timeout=SPAWN_WAIT_S)
    try:
        _ORIGINAL_INIT(self, *args, **kwargs)
    finally:
        if got:
            FORK_LOCK.release()


@contextlib.contextmanager
def spawns_apart_from_forks() -> Iterator[None]:
    """While inside, every ``subprocess.Popen`` of this process spawns holding :data:`FORK_LOCK`
    (nested and concurrent uses count: the last one out restores ``Popen``)."""
    with _ACTIVE_LOCK:
        _ACTIVE["count"] += 1
        subprocess.Popen.__init__ = _spawn_apart  # type: ignore[method-assign]
    try:
        yield
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE["count"] -= 1
            if _ACTIVE["count"] == 0:
                subprocess.Popen.__init__ = _ORIGINAL_INIT  # type: ignore[method-assign]
