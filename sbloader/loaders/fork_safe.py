"""Local worker processes forked while other threads import: the modules they need, whole.

A module that another thread of this process is importing at the moment of a ``fork``
stays locked in the child for good (its lock's owner does not exist there): a local
worker importing it waits forever. The trainer's process has such threads while a
loader starts (the background Ray start, the pool's start ahead), so the local starts
(:mod:`~sbloader.loaders.local_start`, :mod:`~sbloader.loaders.native_start`) import
what their workers will import before they fork them: the import then waits for that
thread instead, and the child finds the module whole.
"""
from __future__ import annotations

import importlib

#: What a forked local worker imports: imported here before the fork (:func:`import_for_children`).
CHILD_MODULES = ("torch.utils.data._utils.worker", "sbloader.core.batch_slice", "sbloader.core.context",
                 "sbloader.sources.batches", "sbloader.loaders.worker")


def import_for_children(extra: tuple = ()) -> None:
    """Import, in this process, every module the local workers will import, before they are forked.

    A module another thread is importing at the moment of a fork stays locked in the child for good
    (its lock's owner does not exist there): a local worker importing it waited forever (seen with
    the background start's imports). Imported here first, the import waits for that thread instead,
    and the child finds the module whole.
    """
    for name in CHILD_MODULES + tuple(extra):
        importlib.import_module(name)
