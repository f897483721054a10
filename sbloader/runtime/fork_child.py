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
"""
from __future__ import annotations

import os
import sys

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


def install() -> None:
    """Register :func:`forget_ray` to run in every child this process forks (idempotent)."""
    if _INSTALLED["done"] or not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(after_in_child=forget_ray)
    _INSTALLED["done"] = True
