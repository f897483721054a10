"""Whether the local worker an epoch waits on still makes progress.

A local worker (:mod:`~sbloader.loaders.native_start`) is a forked process. One that waits
forever, on a lock that its fork left held by a thread that does not exist in it (the
C library's exit-handler lock was one, :mod:`~sbloader.runtime.exit_lock`; another library's
may be next), would keep the epoch waiting forever: torch's iterator waits for a partition
without limit. So the epoch waits at most :func:`stall_s` seconds at a time; each time the
wait runs out, :class:`StallWatch` reads the CPU time of the worker it waits on
(``/proc/<pid>/stat``). A worker that used none over a whole wait is stalled: it is killed, and the
epoch goes on without the local workers, each start its own way (the pool or Ray's workers make what
was not received: :mod:`~sbloader.loaders.local_start`, :mod:`~sbloader.loaders.iterable_start`,
:mod:`~sbloader.loaders.stream_start`, :mod:`~sbloader.loaders.native_start`; a torchrun rank of the
drop-in forks new local workers once: :mod:`~sbloader.loaders.split_start`). A worker that
computes, however slowly, is waited for.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

STALL_ENV = "SBLOADER_LOCAL_STALL_S"  # seconds without CPU after which a local worker counts as stalled
DEFAULT_STALL_S = 15.0
MIN_CPU_S = 0.005  # less CPU than this over a whole wait: the worker did not run
STALLED = object()  # what :meth:`StallWatch.next_item` gives once the awaited worker stalled


def stall_s() -> float:
    """The wait after which a local worker that used no CPU is stalled (``SBLOADER_LOCAL_STALL_S``, 15 s)."""
    value = os.environ.get(STALL_ENV)
    return float(value) if value not in (None, "") else DEFAULT_STALL_S


def cpu_seconds(pid: int) -> Optional[float]:
    """The CPU seconds (user and system) process ``pid`` used so far (None: not readable here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15
    except (OSError, IndexError, ValueError):
        return None


class StallWatch:
    """Looks at the worker a torch multiprocessing iterator waits on, once per timed-out wait."""

    def __init__(self) -> None:
        self._seen: dict = {}  # worker pid -> its CPU seconds at the last look

    def awaited_pid(self, it: Any) -> Optional[int]:
        """The pid of the worker making the partition ``it`` waits for (None: none outstanding)."""
        info = getattr(it, "_task_info", {}).get(getattr(it, "_rcvd_idx", None))
        if not info or len(info) != 1:  # (worker,) while outstanding; (worker, data) once in
            return None
        return it._workers[info[0]].pid

    def stalled(self, it: Any) -> Optional[int]:
        """The pid of the awaited worker if it used no CPU since the last look at it (None: it ran, or this is
        the first look, or its CPU time is not readable here)."""
        pid = self.awaited_pid(it)
        cpu = cpu_seconds(pid) if pid is not None else None
        if cpu is None:
            return None
        last, self._seen[pid] = self._seen.get(pid), cpu
        return pid if last is not None and cpu - last < MIN_CPU_S else None

    def gives_up(self, it: Any, goes_on: str) -> bool:
        """Whether the epoch stops waiting for ``it``'s workers (:meth:`stalled`); if so, a warning says how it
        ``goes_on`` (e.g. "from partition 3 on the pool"), and the stalled worker is killed (:func:`kill`)."""
        pid = self.stalled(it)
        if pid is None:
            return False
        logger.warning("sbloader: local worker %d used no CPU for %.0f s; the epoch goes on %s (%s sets the wait)",
                       pid, stall_s(), goes_on, STALL_ENV)
        kill(it, pid)
        return True


    def next_item(self, it: Any, goes_on: Callable[[], str]) -> Any:
        """``next(it)`` of a torch iterator whose waits run out (``timeout=stall_s()``), waiting again while the
        awaited worker computes; :data:`STALLED` once it used no CPU over a whole wait (:meth:`gives_up`, told
        how the epoch ``goes_on()``). ``StopIteration`` and torch's other errors are raised as they come."""
        while True:
            try:
                return next(it)
            except RuntimeError as e:
                if not timed_out(e):
                    raise
                if self.gives_up(it, goes_on()):
                    return STALLED


def kill(it: Any, pid: int) -> None:
    """Kill ``it``'s stalled worker ``pid`` ahead of the iterator's shutdown, which would wait 5 s for it to
    exit (torch's ``MP_STATUS_CHECK_INTERVAL``) before terminating it. ``it``'s workers are first taken off
    torch's ``SIGCHLD`` watch, which would raise "worker exited unexpectedly" in the loop for this death; the
    other workers still get torch's shutdown (they exit by themselves)."""
    import signal

    from torch.utils.data import _utils

    if getattr(it, "_worker_pids_set", False):
        _utils.signal_handling._remove_worker_pids(id(it))
        it._worker_pids_set = False
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:  # gone already
        pass


def timed_out(error: BaseException) -> bool:
    """Whether ``error`` is torch's iterator's wait running out (``DataLoader timed out after N seconds``)."""
    return isinstance(error, RuntimeError) and str(error).startswith("DataLoader timed out after")
