"""torch's own ``DataLoader`` class, for the local workers, even where ``torch.utils.data.DataLoader`` was replaced.

The local start (:mod:`~sbloader.loaders.local_start`, :mod:`~sbloader.loaders.iterable_start`,
:mod:`~sbloader.loaders.native_start`) runs its worker processes through torch's own
``DataLoader``. A program that swaps ``torch.utils.data.DataLoader`` for ``sbloader.DataLoader``
(a test harness that patches torch's module, as ``scripts/conformance/torch_dataloader_suite.py``
does) would otherwise give the local start an sbloader loader, whose own local start takes
another, and so on: each level started a pool of actors ahead, without end. The class is
taken as torch defined it, or as it was when sbloader was imported.

What it returns is that class with one addition: torch learns how a worker process ended (killed by
a signal, exited with a code) from its ``SIGCHLD`` handler, which it can install from the main
thread only; the local workers' iterator runs in the loader's fetch thread, so without the handler
a segfaulted worker read only "DataLoader worker (pid(s) ...) exited unexpectedly", without torch's
"is killed by signal: Segmentation fault" cause. There, the data queue's wait asks torch's own check
(``_error_if_any_worker_fails``, which the handler calls) when it times out, before torch's reaping
of the dead workers: the same error, with the same cause, as torch's loader in the main thread.
"""
from __future__ import annotations

import queue
from typing import Any

import torch.utils.data.dataloader as _torch_dataloader

_AT_IMPORT = _torch_dataloader.DataLoader  # torch's class as it was when sbloader was imported
_TORCH_MODULE = "torch.utils.data.dataloader"


def torch_loader() -> type:
    """torch's ``DataLoader`` class: ``torch.utils.data.dataloader.DataLoader`` when that is torch's own,
    else the one that was there when sbloader was imported.

    Raises:
        RuntimeError: neither is torch's (replaced before sbloader was imported): import sbloader first.
    """
    for cls in (_torch_dataloader.DataLoader, _AT_IMPORT):
        if getattr(cls, "__module__", None) == _TORCH_MODULE:
            return _checking(cls)
    raise RuntimeError("torch.utils.data.DataLoader was replaced before sbloader was imported, and sbloader's "
                       "local workers need torch's own DataLoader: import sbloader before replacing it")


_CHECKING: dict = {}  # torch's class -> its subclass that reports how a worker ended off the main thread


def _checking(torch_cls: type) -> type:
    """``torch_cls`` whose multiprocessing iterator, where torch's ``SIGCHLD`` handler is not installed
    (every torch iterator of this process was made off the main thread), checks its workers' ends as the
    handler would (:class:`_ReportsWorkerEnds`)."""
    sub = _CHECKING.get(torch_cls)
    if sub is None:
        def _get_iterator(self: Any) -> Any:
            from torch.utils.data._utils import signal_handling

            it = torch_cls._get_iterator(self)
            data_queue = getattr(it, "_data_queue", None)
            if data_queue is not None and not signal_handling._SIGCHLD_handler_set:
                it._data_queue = _ReportsWorkerEnds(data_queue)
            return it

        def check_worker_number_rationality(self: Any) -> None:
            """No warning: torch's too-many-workers warning was given at the sbloader loader's creation (a
            ``warnings.catch_warnings()`` around this one, off the main thread, would drop the filters other
            threads add meanwhile: it restores the whole list)."""

        sub = _CHECKING[torch_cls] = type(torch_cls.__name__, (torch_cls,), {
            "__module__": __name__, "__qualname__": torch_cls.__name__, "_get_iterator": _get_iterator,
            "check_worker_number_rationality": check_worker_number_rationality,
            "__doc__": "torch's DataLoader; off the main thread, a dead worker's error names its signal, as torch's"})
    return sub


class _ReportsWorkerEnds:
    """torch's data queue, whose ``get`` that timed out raises torch's own error for a worker that died
    (``DataLoader worker (pid N) is killed by signal: ...``), as torch's ``SIGCHLD`` handler raises it
    inside the main thread's wait; torch's ``_try_get_data`` then raises its "exited unexpectedly" from it."""

    def __init__(self, data_queue: Any) -> None:
        self._queue = data_queue

    def get(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._queue.get(*args, **kwargs)
        except queue.Empty:
            from torch.utils.data._utils import signal_handling

            signal_handling._error_if_any_worker_fails()  # waitid(WNOWAIT): torch's reaping still sees them
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)
