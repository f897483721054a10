"""The requests in flight of a whole node: a budget shared by every process on it (the Ray
workers reading, the ranks, the driver's fetch while listing), on top of each process's own
(:mod:`sbloader.sources.inflight`).

The node's budget is ``limit`` slot files in a directory every process of the node sees
(``<tmp>/sbloader-node-slots-<uid>-<limit>``); a request holds one slot, an exclusive
``flock`` on its file, while it runs. The OS lets go of a dead process's locks, so a
process killed mid-request leaks nothing. Taking a free slot costs one non-blocking
``flock`` (a few when others are taken); with none free, a request waits on one slot held
by another process (or, when this process holds them all, for one of its own to end).
``$SBLOADER_NODE_MAX_IN_FLIGHT`` sets the limit (default :data:`DEFAULT_NODE_MAX_IN_FLIGHT`;
``0``: no node budget). Processes that set different limits each keep their own set.
"""
from __future__ import annotations

import fcntl
import os
import random
import tempfile
import threading
from typing import Optional

#: Requests every process of a node keeps in flight together, at most, by default.
DEFAULT_NODE_MAX_IN_FLIGHT = 256

#: Environment variable setting the node's budget of requests in flight (``0``: none).
NODE_MAX_IN_FLIGHT_ENV = "SBLOADER_NODE_MAX_IN_FLIGHT"


class NodeSlots:
    """``limit`` slots shared by the processes of a node through ``flock`` on files in ``root``.

    Args:
        limit: requests in flight on the node, at most.
        root: the directory of the slot files (created if missing).
    """

    def __init__(self, limit: int, root: str) -> None:
        self.limit, self.root = int(limit), root
        os.makedirs(root, exist_ok=True)
        self._cond = threading.Condition()
        self._fds: dict[int, int] = {}
        self._held: set[int] = set()  # slots this process holds, tries or waits on
        self._waiting = 0  # threads waiting for one of this process's own slots

    def _fd(self, i: int) -> int:
        fd = self._fds.get(i)
        if fd is None:
            fd = self._fds[i] = os.open(os.path.join(self.root, f"slot-{i:05d}"), os.O_RDWR | os.O_CREAT, 0o666)
        return fd

    def try_take(self) -> Optional[int]:
        """A free slot, now held (its number), or None when the node's are all taken. The
        ``flock`` runs outside this process's lock (the slot is marked first, so no other
        thread of the process tries it meanwhile): threads contend only for a set update."""
        start = random.randrange(self.limit)
        for j in range(self.limit):
            i = (start + j) % self.limit
            with self._cond:
                if i in self._held:
                    continue
                self._held.add(i)
                fd = self._fd(i)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return i
            except BlockingIOError:
                self._drop(i)
        return None

    def take(self) -> int:
        """A slot, waiting for one when the node's are all taken; give it back with :meth:`give`."""
        while True:
            i = self.try_take()
            if i is not None:
                return i
            with self._cond:
                others = [k for k in range(self.limit) if k not in self._held]
                if not others:  # this process holds them all: wait for one of its own
                    self._waiting += 1
                    self._cond.wait()
                    self._waiting -= 1
                    continue
                k = random.choice(others)
                self._held.add(k)  # no other thread of this process takes it meanwhile
                fd = self._fd(k)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # until its holder lets go (or dies)
            except BaseException:
                self._drop(k)
                raise
            return k

    def give(self, i: int) -> None:
        """Hand back slot ``i`` (unlocked before it is unmarked: no thread of this process
        can take it while it is still locked)."""
        fcntl.flock(self._fds[i], fcntl.LOCK_UN)
        self._drop(i)

    def _drop(self, i: int) -> None:
        with self._cond:
            self._held.discard(i)
            if self._waiting:
                self._cond.notify()

    def _forget(self) -> None:
        """In a forked child: the parent's descriptors share its locks; close them, hold nothing."""
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds, self._held, self._cond, self._waiting = {}, set(), threading.Condition(), 0


_NODE: list = []
_NODE_LOCK = threading.Lock()


def node_limit() -> int:
    """``$SBLOADER_NODE_MAX_IN_FLIGHT`` (default :data:`DEFAULT_NODE_MAX_IN_FLIGHT`; 0: none).

    Raises:
        ValueError: it is not a non-negative integer.
    """
    raw = os.environ.get(NODE_MAX_IN_FLIGHT_ENV, "")
    if not raw:
        return DEFAULT_NODE_MAX_IN_FLIGHT
    if not raw.isdigit():
        raise ValueError(f"{NODE_MAX_IN_FLIGHT_ENV} must be a non-negative integer (requests every process of "
                         f"a node keeps in flight together; 0: no node budget), found {raw!r}")
    return int(raw)


def node_slots() -> Optional[NodeSlots]:
    """This process's handle on the node's budget (None when it is 0)."""
    if _NODE:  # (each request asks: no lock once it is made)
        return _NODE[0]
    with _NODE_LOCK:
        if not _NODE:
            limit = node_limit()
            root = os.path.join(tempfile.gettempdir(), f"sbloader-node-slots-{os.getuid()}-{limit}")
            _NODE.append(NodeSlots(limit, root) if limit else None)
        return _NODE[0]


def _after_fork() -> None:
    if _NODE and _NODE[0] is not None:
        _NODE[0]._forget()


os.register_at_fork(after_in_child=_after_fork)
