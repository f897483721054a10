"""A process forked from a Ray driver lets go of Ray: its inherited Ray objects die quietly.

A forked child (a torch ``DataLoader`` worker, a local worker of sbloader's local start)
inherits the driver's Ray objects: ``ObjectRef``\\ s and actor handles in its memory, and
Ray's core worker beneath them, without the threads that run it. When the child's garbage
collector frees one of them (torch's pickling of a batch calls ``gc.collect()``), the
object's finaliser calls into that core worker: it waited for good on a lock whose owner
is a thread of the parent (the child hung, and the trainer with it, in the suite's
``test_iterable_dataset_shards_by_worker_info``), or it used the connections the child
shares with the parent. Ray cannot be used from such a child anyway.

:func:`install` registers an ``os.register_at_fork`` hook (once, at ``import sbloader``):
in every child forked from a process connected to Ray, the worker's ``core_worker`` and
``gcs_client`` are dropped, so Ray's finalisers skip them (``ActorHandle.__del__`` checks
for the core worker, ``ObjectRef``'s swallows the error) and a call into Ray fails at once
instead of hanging. The parent is untouched.

The same hook first sets the C library's exit-handler lock free in the child where the fork left
it held (:mod:`~sbloader.runtime.exit_lock`), in every child of a process that loaded Ray: Ray's
start and its C++ threads take that lock, and a torch worker forked then waited forever at its
first C++ static, whether the loader was sbloader's or the user's own torch ``DataLoader``.
"""
from __future__ import annotations

import os
import sys

from sbloader.runtime.loaded_modules import loaded

_INSTALLED = {"done": False}
_DROPPED = ("core_worker", "gcs_client")


def forget_ray() -> bool:
    """In a forked child: drop the inherited core worker and GCS client. True when there were some."""
    worker = getattr(sys.modules.get("ray._private.worker"), "global_worker", None)  # Ray not imported: None
    if worker is None:
        return False
    dropped = False
    for name in _DROPPED:
        if name in getattr(worker, "__dict__", {}):
            del worker.__dict__[name]
            dropped = True
    return dropped


def _after_fork_in_child() -> None:
    """In every child: where this process loaded Ray (whose start and C++ threads make C++ statics, for
    seconds, under the C library's exit-handler lock), that lock set free if the fork left it held
    (:mod:`~sbloader.runtime.exit_lock`: a torch ``DataLoader``'s worker forked then, sbloader's or the
    user's own, waited forever at its first C++ static); then :func:`forget_ray`."""
    lock = loaded("sbloader.runtime.exit_lock")  # imported before ``import ray`` (session); never imported here
    if lock is not None and "ray" in sys.modules:  # also while ``ray`` is being imported: its C++ loads then
        lock.free_in_child()
    forget_ray()


def install() -> None:
    """Register :func:`forget_ray` (and the exit-handler lock's check) to run in every child this process
    forks (idempotent)."""
    if _INSTALLED["done"] or not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(after_in_child=_after_fork_in_child)
    _INSTALLED["done"] = True
