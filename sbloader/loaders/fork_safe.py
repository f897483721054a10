"""Local worker processes forked while other threads import: the modules they need, whole.

A module that another thread of this process is importing at the moment of a ``fork``
stays locked in the child for good (its lock's owner does not exist there): a local
worker importing it waits forever. The trainer's process has such threads while a
loader starts (the background Ray start, the pool's start ahead), so the local starts
(:mod:`~sbloader.loaders.local_start`, :mod:`~sbloader.loaders.native_start`) import
what their workers will import before they fork them: the import then waits for that
thread instead, and the child finds the module whole.

A module the worker needs that this process did not import first (a user's dataset importing a
module lazily in ``__getitem__`` while the background start imports it too) is dropped in the
child, half made as it is, with its lock, and imported anew there (:func:`forget_foreign_imports`,
after every fork made inside :meth:`ForkGate.forking`).

Locks below Python are the same: a lock a thread holds at the fork (torch's, the C library's)
stays held in the child. A worker forked while the pool's start ahead pickled the dataset (its
tensors) waited forever in ``torch.set_num_threads(1)`` (CI, ``test_nested_tensors_go_through_the_workers``).
:data:`~sbloader.runtime.fork_lock.FORK_LOCK` keeps this process's own forks of local workers apart from
its background pickling of the dataset (:class:`ForkGate`) and from the embedded Ray's spawns of its processes
(:mod:`~sbloader.runtime.fork_lock`). The C library's exit-handler lock, taken by every thread that makes a
C++ static (Ray's start and Ray's own threads do, for seconds), cannot be kept apart so: each local worker
sets it free if the fork left it held (:mod:`~sbloader.runtime.exit_lock`), before anything else it runs.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from typing import Any, Iterator

from sbloader.runtime import exit_lock
from sbloader.runtime.fork_lock import FORK_LOCK

#: What a forked local worker imports: imported here before the fork (:func:`import_for_children`).
#: ``numpy.random`` too: torch's worker loop seeds it, and numpy 2 imports it only on first use; half made
#: in a child (the background Ray start importing it at the fork), it cannot be made anew there (its C
#: parts: "cannot import name 'MT19937'"), and every local worker died at its start.
CHILD_MODULES = ("torch.utils.data._utils.worker", "sbloader.core.batch_slice", "sbloader.core.context",
                 "sbloader.sources.batches", "sbloader.loaders.worker", "numpy.random")


_forking = False  # True while ForkGate.forking runs: what a child forked then inherits


def forget_foreign_imports() -> list[str]:
    """(In a child just forked) Import anew, when next asked for, each module another thread of the parent
    was importing at the fork: its lock's owner does not exist here, so an import of it would wait for
    good, and the module itself is half made. Its half-made module and its lock are dropped; the
    modules it had imported whole stay. Returns the names dropped."""
    bootstrap = sys.modules.get("_frozen_importlib")
    locks = getattr(bootstrap, "_module_locks", None)
    if not isinstance(locks, dict):
        return []
    me = threading.get_ident()
    dropped = []
    for name, ref in list(locks.items()):
        lock = ref()
        if lock is None:
            continue
        owner = getattr(lock, "owner", None)
        inner = getattr(lock, "lock", None)
        if (owner is not None and owner != me) or (inner is not None and inner.locked()):
            locks.pop(name, None)
            sys.modules.pop(name, None)
            dropped.append(name)
    return dropped


def _after_fork_in_child() -> None:
    if _forking:
        exit_lock.free_in_child()
        forget_foreign_imports()
        _free_torch_seed_lock()


def _free_torch_seed_lock() -> None:
    """(In a child just forked) A fresh ``torch.cuda._initialization_lock`` if another thread of the
    parent held it at the fork (inside ``torch.manual_seed``): the child's own seeding would wait
    for good."""
    cuda = sys.modules.get("torch.cuda")
    lock = getattr(cuda, "_initialization_lock", None)
    if lock is not None and lock.locked():
        cuda._initialization_lock = threading.Lock()


def seed_here(seed: int) -> None:
    """Seed this process's global RNGs (:func:`~sbloader.core.context.seed_globals`), never while
    local workers are being forked: ``torch.manual_seed`` takes torch's locks, and a worker forked
    while another thread held one waited forever in its own seeding (a mixture's ``IterableDataset``
    source seeding in the loop's thread while another source forked its local workers)."""
    from sbloader.core.context import seed_globals

    with FORK_LOCK:
        seed_globals(seed)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def import_for_children(extra: tuple = ()) -> None:
    """Import, in this process, every module the local workers will import, before they are forked.

    A module another thread is importing at the moment of a fork stays locked in the child for good
    (its lock's owner does not exist there): a local worker importing it waited forever (seen with
    the background start's imports). Imported here first, the import waits for that thread instead,
    and the child finds the module whole.
    """
    for name in CHILD_MODULES + tuple(extra):
        importlib.import_module(name)


class ForkGate:
    """Holds :data:`FORK_LOCK` from just before torch's iterator forks the local workers until it first
    asks the sampler for an index (by then every worker is forked): the sampler may then wait for the
    pool (a forced handover), whose start takes the lock, without a deadlock.

    Wrap the workers' sampler with :meth:`wrap` and create their iterator inside :meth:`forking`.
    """

    def __init__(self) -> None:
        self._held = False

    def wrap(self, sampler: Any) -> "_Gated":
        """``sampler``, opening the gate at its first use."""
        return _Gated(sampler, self)

    def open(self) -> None:
        """Let background pickling go on (idempotent)."""
        if self._held:
            self._held = False
            FORK_LOCK.release()

    @contextlib.contextmanager
    def forking(self, extra: tuple = ()) -> Iterator[None]:
        """Fork the local workers inside this: the modules they import imported first, no background
        pickling of the dataset under way until the sampler is first asked."""
        global _forking
        import_for_children(extra)
        FORK_LOCK.acquire()
        self._held = True
        _forking = True
        try:
            yield
        finally:
            _forking = False
            self.open()


class _Gated:
    """A sampler that opens its :class:`ForkGate` when its iteration begins."""

    def __init__(self, sampler: Any, gate: ForkGate) -> None:
        self.sampler, self.gate = sampler, gate

    def __iter__(self) -> Iterator[Any]:
        self.gate.open()
        yield from self.sampler
