"""Slots of the same-node hand-off as a task sees them: the lease it was lent, and how it
writes its block there (:func:`store_here`) instead of returning it through Ray.

The task pickles its block (protocol 5), copies the out-of-band buffers (the
arrays' bytes) into its slot of the consumer's arena (a file in ``/dev/shm``), and
returns only a :class:`SlotBlock`: the pickle's in-band bytes and the buffers'
places, a few hundred bytes that Ray returns inline. The consumer's side, which
lends the slots and opens the blocks, is :mod:`sbloader.executor.handoff`.
"""
from __future__ import annotations

import mmap
import os
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

SHM_DIR = "/dev/shm"
_PREFIX = "sbloader-slots-"
_ALIGN = 64  # each buffer starts on a cache line: arrays stay aligned for any dtype
_ROUND = 1 << 20  # slot capacities are whole MiB
MAX_SLOTS = 32
_WORKER_MAPS_MAX = 2  # arenas a worker process keeps mapped

_WORKER_MAPS: "OrderedDict[str, mmap.mmap]" = OrderedDict()


@dataclass(frozen=True)
class SlotLease:
    """One slot of a consumer's arena, lent to the task that makes one output block.

    Attributes:
        path: the arena's file.
        offset: the slot's first byte in the file.
        capacity: the slot's bytes.
        node_id: the consumer's Ray node (a task elsewhere returns its block through Ray).
        slot: the slot's index.
        generation: the arena's generation (a re-sized arena starts a new one).
        token: this lease's number: a late or repeated free of an earlier lease of the
            same slot cannot free a later one.
    """

    path: str
    offset: int
    capacity: int
    node_id: str
    slot: int
    generation: int
    token: int = 0


@dataclass(frozen=True)
class SlotBlock:
    """An output block written into a slot: what the task returns through Ray instead.

    Attributes:
        lease: the slot.
        pickled: the block's pickle (protocol 5) without its out-of-band buffers.
        buffers: ``(offset in the slot, bytes)`` of each out-of-band buffer, in order.
    """

    lease: SlotLease
    pickled: bytes
    buffers: tuple


def enabled() -> bool:
    """Whether the shared-memory hand-off may be used (``SBLOADER_SLOT_HANDOFF`` is not ``0``)."""
    return os.environ.get("SBLOADER_SLOT_HANDOFF", "1").strip().lower() not in ("0", "false", "no", "off")


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def slot_capacity(block_bytes: float) -> int:
    """Bytes of a slot for blocks of about ``block_bytes``: a quarter more, whole MiB."""
    need = int(block_bytes * 1.25) + 64 * 1024
    return max(_ROUND, (need + _ROUND - 1) // _ROUND * _ROUND)


# ----- worker side -----------------------------------------------------------


def _worker_map(path: str) -> Optional[mmap.mmap]:
    """This process's mapping of an arena (kept for the next task), or None if it is gone."""
    m = _WORKER_MAPS.get(path)
    if m is not None:
        _WORKER_MAPS.move_to_end(path)
        return m
    for old in [p for p in _WORKER_MAPS if not os.path.exists(p)]:  # arenas their consumer closed
        _WORKER_MAPS.pop(old).close()
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        m = mmap.mmap(fd, os.fstat(fd).st_size)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    _WORKER_MAPS[path] = m
    while len(_WORKER_MAPS) > _WORKER_MAPS_MAX:
        _WORKER_MAPS.popitem(last=False)[1].close()
    return m


def store(obj: Any, lease: SlotLease) -> Any:
    """(In the task) Write ``obj`` into its slot: a :class:`SlotBlock`, or ``obj`` itself
    when it cannot go there (pickle cannot take it, a buffer is not contiguous, it
    outgrew the slot, the arena is gone). The caller checks the node."""
    bufs: list = []
    try:
        pickled = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
        raws = [b.raw() for b in bufs]
    except Exception:
        return obj
    if sum(_aligned(r.nbytes) for r in raws) > lease.capacity:
        return obj
    m = _worker_map(lease.path)
    if m is None or lease.offset + lease.capacity > len(m):
        return obj
    places = []
    pos = 0
    for r in raws:
        n = r.nbytes
        start = lease.offset + pos
        m[start:start + n] = r
        places.append((pos, n))
        pos += _aligned(n)
    return SlotBlock(lease, pickled, tuple(places))


def store_here(obj: Any, lease: Optional[SlotLease], node_id: str) -> Any:
    """(In the task) ``obj`` written into its lease's slot when the lease is for this node;
    else ``obj`` itself (Ray returns it through the object store)."""
    if lease is None or lease.node_id != node_id:
        return obj
    return store(obj, lease)
