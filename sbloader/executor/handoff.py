"""Same-node hand-off of output blocks through a shared-memory arena, past the object store.

A block a task returns through Ray costs the worker a put into the plasma store,
the raylet its bookkeeping and the consumer a plasma get; the slots skip all
three (the gain, side by side: ``benchmarks/results/handoff.md``).

When the consumer's node may run tasks, the executor lends each final-stage
partition a *slot* of a :class:`SlotArena`, a file in ``/dev/shm`` the consumer
owns. The task pickles its block (protocol 5), copies the out-of-band buffers (the
arrays' bytes) into the slot, and returns only the pickle's in-band bytes and the
buffers' places: a :class:`SlotBlock` of a few hundred bytes that Ray returns
inline. The consumer unpickles over views of the slot. They are writable: the slot
is the block's alone until every view is gone, so a batch becomes a writable tensor
without the copy a read-only object-store buffer needs (torch's DataLoader likewise
hands over its workers' shared-memory tensors). On the image workload that copy was
a third of the trainer's CPU per image.

A slot is lent to one partition at launch and comes back:

- once every array viewing it is gone: every view's ``base`` leads to one NumPy
  array per opened block, whose finalizer frees the slot (a training loop that
  keeps zero-copy tensors keeps its slot; the next blocks then go through the
  object store);
- at once when the task returned its block through Ray instead (it ran on another
  node, the block outgrew the slot, pickle could not take it);
- once its task has finished, when its output will never be read (a dropped
  duplicate, a failed task, an execution shut down with tasks in flight).

Slots are reused last-in first-out, so their pages stay warm in every process that
maps them. No free slot (or no ``/dev/shm``): the block goes through the object
store, as it would without an arena. ``SBLOADER_SLOT_HANDOFF=0`` turns the arena off.
"""
from __future__ import annotations

import logging
import mmap
import os
import pickle
import threading
import uuid
import weakref
from collections import deque
from typing import Any, Callable, Optional

import numpy as np

from sbloader.executor.slot_store import (MAX_SLOTS, SHM_DIR, SlotBlock, SlotLease, _PREFIX, enabled,
                                          slot_capacity, store, store_here)

logger = logging.getLogger("sbloader")

__all__ = ["MAX_SLOTS", "SHM_DIR", "SlotArena", "SlotBlock", "SlotLease", "consumer_arena", "enabled",
           "slot_capacity", "store", "store_here", "sweep_stale"]

# ----- consumer side ---------------------------------------------------------


def _ray_done(refs: list) -> list:
    import ray

    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    return ready


def _pid_namespace() -> str:
    """This process's PID namespace (a number; ``0`` where unknown): arenas carry it, so a
    container that shares ``/dev/shm`` but not PIDs never sweeps another's."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
        return "".join(c for c in link if c.isdigit()) or "0"
    except OSError:
        return "0"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str = SHM_DIR) -> int:
    """Remove arenas whose consumer process no longer runs (it was killed before it
    could remove its own): the number removed."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    mine = f"{_PREFIX}{_pid_namespace()}-"
    for name in names:
        if not name.startswith(mine):
            continue
        try:
            pid = int(name[len(mine):].split("-", 1)[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except OSError:
                pass
    return removed


_ARENAS: dict = {}  # node id -> this process's arena (one: the node Ray runs on now)
_ARENAS_LOCK = threading.Lock()


def consumer_arena() -> Optional["SlotArena"]:
    """This process's arena (Ray is initialised), or None when the hand-off is turned off
    or this machine has no ``/dev/shm``.

    One per process: every dataset and loader in it shares its slots, as they share
    Ray's object store, so a trainer that iterates a training and a validation set
    keeps the pages of one working set, not one per dataset.
    """
    if not enabled() or not os.path.isdir(SHM_DIR):
        return None
    import ray

    node = ray.get_runtime_context().get_node_id()
    with _ARENAS_LOCK:
        arena = _ARENAS.get(node)
        if arena is None:  # a first one, or Ray was restarted (another node id)
            for old in _ARENAS.values():
                old.close()
            _ARENAS.clear()
            arena = _ARENAS[node] = SlotArena(node)
        return arena


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class SlotArena:
    """The consumer's shared-memory slots for output blocks made on its node.

    Thread-safe: the executor leases and frees slots from its loop thread, the
    consumer opens blocks in its fetch thread, and a block's finalizer frees its
    slot from whichever thread drops the last view (it only appends to a deque).

    Args:
        node_id: the consumer's Ray node.
        directory: where the arena's file lives (a tmpfs).
        max_slots: most slots at once.
        done: ``refs -> the refs whose tasks finished`` (``ray.wait`` with no wait).
    """

    def __init__(self, node_id: str, directory: str = SHM_DIR, max_slots: int = MAX_SLOTS,
                 done: Optional[Callable[[list], list]] = None) -> None:
        self.node_id = node_id
        self._dir = directory
        self._max_slots = max_slots
        self._done = done or _ray_done
        self._lock = threading.Lock()
        self._freed: deque = deque()  # (generation, slot, token) from finalizers; drained under the lock
        self._generation = 0
        self._path: Optional[str] = None
        self._view: Optional[memoryview] = None
        self._capacity = 0
        self._slots = 0  # slots the file holds
        self._made = 0  # slots handed out at least once (their space reserved)
        self._free: list[int] = []  # a stack: the last freed is the next lent (warm pages)
        self._out: dict[int, int] = {}  # slots lent or viewed -> their lease's token
        self._tokens = 0
        self._waiting: list[tuple[SlotLease, Any]] = []  # slots freed once their task finished
        self._disabled: Optional[str] = None
        self._finalizer: Optional[weakref.finalize] = None

    def __reduce__(self) -> tuple:
        # a copy in another process (a pickled loader) starts empty: slots are this process's
        return (SlotArena, (self.node_id, self._dir, self._max_slots))

    @property
    def in_use(self) -> int:
        """Slots lent to tasks or viewed by the consumer now."""
        with self._lock:
            self._drain()
            return len(self._out)

    @property
    def touched(self) -> int:
        """Slots of the current file lent at least once: their pages are reserved (memory).
        Slots are reused last-freed first, so this is also the most lent or viewed at once."""
        return self._made

    @property
    def disabled(self) -> Optional[str]:
        """Why the arena lends no slots (closed, no ``/dev/shm``, no room there), or None."""
        return self._disabled

    def lease(self, block_bytes: float, max_bytes: float) -> Optional[SlotLease]:
        """A slot for a block of about ``block_bytes``, or None (no slot free, or none fits).

        Args:
            block_bytes: the expected size of the block.
            max_bytes: most bytes the slots lent or viewed may hold with this one (the
                execution's memory budget).
        """
        with self._lock:
            if self._disabled:
                return None
            self._drain()
            need = slot_capacity(block_bytes)
            if self._path is None or (need > self._capacity and not self._out):
                if max_bytes // need < 2:  # the budget holds fewer than two such blocks
                    return None
                self._create(need, self._max_slots)  # sparse: only the slots lent take memory
                if self._disabled:
                    return None
            elif need > self._capacity:
                return None  # blocks outgrew the slots; re-sized once every slot is back
            if (len(self._out) + 1) * self._capacity > max_bytes:
                return None
            if self._free:
                slot = self._free.pop()
            elif self._made < self._slots:
                slot = self._made
                if not self._reserve(slot):
                    return None
                self._made += 1
            else:
                return None
            self._tokens += 1
            self._out[slot] = self._tokens
            return SlotLease(self._path, slot * self._capacity, self._capacity, self.node_id, slot,
                             self._generation, self._tokens)

    def free(self, lease: Optional[SlotLease]) -> None:
        """The slot's task has finished and nothing will read what it holds."""
        if lease is not None:
            self._freed.append((lease.generation, lease.slot, lease.token))

    def free_when_done(self, lease: Optional[SlotLease], ref: Any) -> None:
        """The slot's output will never be read, but its task (``ref``, any of its return
        refs; a small one, so the arena pins no block) may still write it."""
        if lease is not None:
            with self._lock:
                self._waiting.append((lease, ref))

    def open(self, block: SlotBlock) -> Any:
        """The block, its arrays writable views of the slot; the slot is free once they are all gone.

        Raises:
            SbloaderError: the block names another arena or an older generation of this one.
        """
        lease = block.lease
        with self._lock:
            view = self._view
            if view is None or lease.path != self._path or lease.generation != self._generation:
                from sbloader.core.errors import SbloaderError

                raise SbloaderError(
                    f"a block names shared-memory slot {lease.slot} of {lease.path} (generation "
                    f"{lease.generation}), which this process's arena does not hold (any more): the arena "
                    "was closed or re-sized, or the block was read in another process than the one whose "
                    "executor launched its task. Read blocks through that executor's fetch(), in its process"
                )
            base = np.frombuffer(view, dtype=np.uint8, count=lease.capacity, offset=lease.offset)
        try:
            obj = pickle.loads(block.pickled, buffers=[base[o:o + n] for o, n in block.buffers])
        except BaseException:
            self._freed.append((lease.generation, lease.slot, lease.token))
            raise
        weakref.finalize(base, self._freed.append, (lease.generation, lease.slot, lease.token))
        return obj

    def close(self) -> None:
        """Remove the arena's file. Blocks still viewed stay readable until dropped."""
        with self._lock:
            self._retire()
            self._disabled = self._disabled or "closed"

    # ----- under the lock -------------------------------------------------

    def _drain(self) -> None:
        if self._waiting:
            done = set(self._done([ref for _, ref in self._waiting]))
            keep = []
            for lease, ref in self._waiting:
                if ref in done:
                    self._freed.append((lease.generation, lease.slot, lease.token))
                else:
                    keep.append((lease, ref))
            self._waiting = keep
        while self._freed:
            gen, slot, token = self._freed.popleft()
            if gen == self._generation and self._out.get(slot) == token:
                del self._out[slot]
                self._free.append(slot)

    def _create(self, capacity: int, slots: int) -> None:
        self._retire()
        if not os.path.isdir(self._dir):
            self._disabled = f"{self._dir} does not exist"
            return
        sweep_stale(self._dir)
        path = os.path.join(self._dir, f"{_PREFIX}{_pid_namespace()}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            self._disabled = f"cannot create an arena in {self._dir}: {e}"
            return
        try:
            os.ftruncate(fd, capacity * slots)
            mm = mmap.mmap(fd, capacity * slots)
        except OSError as e:
            _unlink(path)
            self._disabled = f"cannot map {capacity * slots} bytes in {self._dir}: {e}"
            return
        finally:
            os.close(fd)
        self._generation += 1
        self._path, self._capacity, self._slots, self._made = path, capacity, slots, 0
        self._view = memoryview(mm)
        self._free, self._out = [], {}
        self._finalizer = weakref.finalize(self, _unlink, path)

    def _reserve(self, slot: int) -> bool:
        """Reserve a slot's pages in the tmpfs, so a full ``/dev/shm`` shows here, not as a
        SIGBUS in the task that writes it."""
        try:
            fd = os.open(self._path, os.O_RDWR)
            try:
                os.posix_fallocate(fd, slot * self._capacity, self._capacity)
            finally:
                os.close(fd)
            return True
        except (OSError, AttributeError) as e:  # AttributeError: a platform without posix_fallocate
            self._slots = self._made  # the slots reserved so far stay in use; no more
            if not self._made:
                self._disabled = f"no room for a {self._capacity}-byte slot in {self._dir}: {e}"
            logger.warning("sbloader: no room for another %d-byte shared-memory slot in %s (%s); the %d "
                           "reserved are used, other blocks go through Ray's object store", self._capacity,
                           self._dir, e, self._made)
            return False

    def _retire(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # unlinks the file
            self._finalizer = None
        self._path, self._view = None, None
        self._free, self._out, self._waiting = [], {}, []
