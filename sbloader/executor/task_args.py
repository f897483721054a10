"""Task arguments pickled once by the driver (:class:`Packed`), and a large one put in the object
store once and unpickled once per worker process (:class:`SharedRef`).

A read task's source travels with every task: the reader (for a bucket, every object's listed
size and version) and the shared plan of the epoch (every partition's objects, for the fetch
ahead). For 100,000 keys that is 4.6 MB pickled and ~40 ms to unpickle; put in the object
store as it is, every task unpickled it again (#47). A :class:`SharedRef` names it by its
digest, so a worker process that has it takes it from its own memory.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import ray

#: Arguments a worker process keeps unpickled, at most, and their pickled bytes together (the
#: newest is kept whatever its size). A shuffled epoch's read tasks share a new argument (its
#: plan of fetches ahead), so an epoch's is of no use to the next: a few are kept, not a run's.
UNPACKED_MAX = 64
UNPACKED_MAX_BYTES = 32 * 2 ** 20

_UNPACKED: "OrderedDict[bytes, tuple[Any, int]]" = OrderedDict()  # digest -> (argument, its pickled bytes)
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Packed:
    """An argument pickled once by the driver and shipped as bytes.

    Ray would otherwise cloudpickle the operators (user functions, by value when
    defined in ``__main__``) again for every task, at a cost in the trainer's CPU
    per task; bytes cost a copy. The worker unpickles a digest once and reuses it.

    Attributes:
        digest: a hash of ``data``.
        data: the pickled argument.
    """

    digest: bytes
    data: bytes


class _HoldsRayHandle(Exception):
    pass


def _main_by_value(cloudpickle: Any) -> None:
    """In a process started by multiprocessing's spawn (Lightning's ``ddp_spawn``,
    ``torch.multiprocessing.spawn``) the script runs as ``__mp_main__``: its classes
    must travel by value, as ``__main__``'s do, since Ray's workers cannot import it."""
    import sys

    mp_main = sys.modules.get("__mp_main__")
    if mp_main is not None and not getattr(mp_main, "_sbloader_by_value", False):
        try:
            cloudpickle.register_pickle_by_value(mp_main)
            mp_main._sbloader_by_value = True
        except (ValueError, TypeError):
            pass


def pack(obj: Any) -> Any:
    """``obj`` as a :class:`Packed`, or ``obj`` itself when it holds Ray object refs or
    actor handles (those must go through Ray's own serialisation, which tracks them)."""
    import hashlib
    import io

    import ray.cloudpickle as cloudpickle
    from ray.actor import ActorHandle

    class _Pickler(cloudpickle.CloudPickler):
        def reducer_override(self, o: Any) -> Any:
            if isinstance(o, (ray.ObjectRef, ActorHandle)):
                raise _HoldsRayHandle()
            return super().reducer_override(o)

    _main_by_value(cloudpickle)
    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=5).dump(obj)
    except _HoldsRayHandle:
        return obj
    except Exception:  # not picklable here: let Ray's own serialisation say why, per task
        return obj
    data = buf.getvalue()
    return Packed(hashlib.blake2b(data, digest_size=16).digest(), data)


@dataclass(frozen=True)
class SharedRef:
    """A :class:`Packed` argument too large to travel with each task, in the object store once.

    Nested in a task's arguments, the ref is not fetched by Ray before the task runs: a worker
    process that unpickled this digest before takes it from its own memory (:func:`unpack`), only
    the others fetch it. (Nor does it draw the task to the node holding it, as a ref among the
    task's own arguments would, by Ray's locality-aware scheduling.)

    Attributes:
        digest: the packed argument's digest.
        ref: the :class:`Packed` in the object store.
    """

    digest: bytes
    ref: Any


def share(packed: Packed) -> SharedRef:
    """``packed`` put in the object store, as a :class:`SharedRef` (the caller keeps it while tasks run)."""
    return SharedRef(packed.digest, ray.put(packed))


def unpack(obj: Any) -> Any:
    """The argument a :class:`Packed` or :class:`SharedRef` holds (unpickled once per worker
    process, kept while :data:`UNPACKED_MAX` and :data:`UNPACKED_MAX_BYTES` allow); else ``obj``."""
    if isinstance(obj, SharedRef):
        hit = _kept(obj.digest)
        if hit is not None:
            return hit
        obj = ray.get(obj.ref)
    if not isinstance(obj, Packed):
        return obj
    hit = _kept(obj.digest)
    if hit is None:
        import ray.cloudpickle as cloudpickle

        hit = cloudpickle.loads(obj.data)
        with _LOCK:
            _UNPACKED[obj.digest] = (hit, len(obj.data))
            while len(_UNPACKED) > 1 and (len(_UNPACKED) > UNPACKED_MAX
                                          or sum(n for _, n in _UNPACKED.values()) > UNPACKED_MAX_BYTES):
                _UNPACKED.popitem(last=False)
    return hit


def _kept(digest: bytes) -> Any:
    with _LOCK:
        hit = _UNPACKED.get(digest)
        if hit is None:
            return None
        _UNPACKED.move_to_end(digest)
        return hit[0]
