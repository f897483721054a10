"""torch's own ``DataLoader`` class, for the local workers, even where ``torch.utils.data.DataLoader`` was replaced.

The local start (:mod:`~sbloader.loaders.local_start`, :mod:`~sbloader.loaders.iterable_start`,
:mod:`~sbloader.loaders.native_start`) runs its worker processes through torch's own
``DataLoader``. A program that swaps ``torch.utils.data.DataLoader`` for ``sbloader.DataLoader``
(a test harness that patches torch's module, as ``scripts/conformance/torch_dataloader_suite.py``
does) would otherwise give the local start an sbloader loader, whose own local start takes
another, and so on: each level started a pool of actors ahead, without end. The class is
taken as torch defined it, or as it was when sbloader was imported.

What it returns is that class with one change: how a worker's end reaches the loop. torch registers its
workers' pids with its ``SIGCHLD`` handler, which a process has once any torch iterator was made on its main
thread, and the handler raises "DataLoader worker ... exited unexpectedly" inside the main thread wherever
it is when a registered worker ends badly. The local workers' iterator runs in the loader's fetch thread:
the handler's error would land in the training step (or the test) the main thread is running, not in the
loader's ``next``; and a pid torch keeps registered after its worker was reaped can name another process
that reuses it (CI's ``test_stateful_hang_shapes`` once read a worker's "exit code 1" there). So these
iterators keep their workers out of torch's registry; their data queue's wait, when it times out, checks
this iterator's own workers (``waitid`` without reaping: torch's own check then still sees them) and raises
torch's words for it (``DataLoader worker (pid N) is killed by signal: Segmentation fault``), which torch's
``_try_get_data`` raises its "exited unexpectedly" from: the error torch's loader gives in the main thread.
"""
from __future__ import annotations

import os
import queue
import signal
import time
from typing import Any, Optional

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


CHECK_S = 0.25  # how often a wait for the local workers' data looks at how they are

_CHECKING: dict = {}  # torch's class -> its subclass that reports how a worker ended off the main thread


def _checking(torch_cls: type) -> type:
    """``torch_cls`` whose multiprocessing iterator keeps its workers out of torch's ``SIGCHLD`` handler's
    registry and checks their ends itself, as the handler would, where it waits for their data
    (:class:`_ReportsWorkerEnds`)."""
    sub = _CHECKING.get(torch_cls)
    if sub is None:
        def _get_iterator(self: Any) -> Any:
            from torch.utils.data._utils import signal_handling

            it = torch_cls._get_iterator(self)
            data_queue = getattr(it, "_data_queue", None)
            if data_queue is None:  # no worker processes
                return it
            if getattr(it, "_worker_pids_set", False):  # out of torch's SIGCHLD handler's registry
                signal_handling._remove_worker_pids(id(it))
                it._worker_pids_set = False
            it._data_queue = _ReportsWorkerEnds(data_queue, it._workers)
            return it

        def check_worker_number_rationality(self: Any) -> None:
            """No warning: torch's too-many-workers warning was given at the sbloader loader's creation (a
            ``warnings.catch_warnings()`` around this one, off the main thread, would drop the filters other
            threads add meanwhile: it restores the whole list)."""

        sub = _CHECKING[torch_cls] = type(torch_cls.__name__, (torch_cls,), {
            "__module__": __name__, "__qualname__": torch_cls.__name__, "_get_iterator": _get_iterator,
            "check_worker_number_rationality": check_worker_number_rationality,
            "__doc__": "torch's DataLoader; a dead worker's error reaches the loop that reads it, in torch's words"})
    return sub


class _ReportsWorkerEnds:
    """torch's data queue, whose ``get`` that timed out raises torch's own error for one of ``workers`` that
    ended badly (``DataLoader worker (pid N) is killed by signal: ...``), as torch's ``SIGCHLD`` handler would;
    torch's ``_try_get_data`` then raises its "exited unexpectedly" from it."""

    def __init__(self, data_queue: Any, workers: list) -> None:
        self._queue, self._workers = data_queue, workers

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        """The next item, waiting at most ``timeout`` seconds (torch's wait, 5 s at a time), the workers' ends
        looked at every :data:`CHECK_S` meanwhile: a worker that died is reported within that, not at the
        end of torch's wait."""
        if not block:
            return self._queue.get(False)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = CHECK_S if deadline is None else max(0.0, min(CHECK_S, deadline - time.monotonic()))
            try:
                return self._queue.get(timeout=wait)
            except queue.Empty:
                for w in self._workers:
                    message = worker_end(w)
                    if message is not None:
                        raise RuntimeError(message) from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


_SHM_HINT = ("It is possible that dataloader's workers are out of shared memory. Please try to raise your shared "
             "memory limit.")


def worker_end(w: Any) -> Optional[str]:
    """torch's words for how worker process ``w`` ended, if it ended badly (None: running, or exited 0). The
    process is not reaped (``waitid`` with ``WNOWAIT``); one reaped already is read from its ``exitcode``."""
    code = getattr(getattr(w, "_popen", None), "returncode", None)
    if code is None:
        try:
            info = os.waitid(os.P_PID, w.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except (OSError, TypeError):  # not our child (ChildProcessError), or not started
            return None
        if info is None:
            return None
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    if code > 0:
        return (f"DataLoader worker (pid {w.pid}) exited unexpectedly with exit code {code}. Details are lost due "
                "to multiprocessing. Rerunning with num_workers=0 may give better error trace.")
    if code < 0:
        message = f"DataLoader worker (pid {w.pid}) is killed by signal: {signal.strsignal(-code)}. "
        return message + _SHM_HINT if -code == signal.SIGBUS else message
    return None
