"""Whether a coordinator's job still runs: the ranks' processes, seen through their Ray jobs.

Coordinators are detached actors (one rank's death must not take the others' data
with it), so on a cluster that outlives the job nothing else would remove them.
Every rank says which Ray job its process is (a driver of its own under torchrun;
the trainer's driver under Ray Train); once all of them are dead in the GCS, the
job has ended or crashed and its coordinator releases its pool and exits.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

import ray

#: How often the ranks' processes are checked, and how long all must be gone.
DRIVER_CHECK_S = 1.0
DRIVERS_GONE_GRACE_S = 2.0
#: How long a coordinator waits for a rank that never said hello once the others are gone.
LATE_RANK_GRACE_S = 300.0
DROPPED_GRACE_S = 2.0  # a coordinator whose every rank dropped its loader retires after no call for this long


def job_alive(job_hex: str) -> bool:
    """Whether the Ray job ``job_hex`` still runs; unknown (no answer) counts as running."""
    try:
        infos = ray._private.worker.global_worker.gcs_client.get_all_job_info(timeout=5)
    except Exception:
        return True
    for job_id, info in infos.items():
        if (job_id.hex() if hasattr(job_id, "hex") else str(job_id)) == job_hex:
            return not info.is_dead
    return True


class JobWatch:
    """The ranks that said hello to a coordinator and the Ray job of each one's process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[int, str] = {}
        self._nodes: dict[int, str] = {}
        self._gone_since: Optional[float] = None
        self._gone: list[int] = []
        self._checked = 0.0
        self._loaders: dict[int, set] = {}  # rank -> its live loaders' ids (told by hello and the loaders' drop)

    def claim(self, rank: int, driver: str, node: Optional[str] = None) -> Optional[str]:
        """Record ``rank`` as served to ``driver`` (on ``node``); returns another live holder of the
        rank (refuse), else None."""
        with self._lock:
            holder = self._holders.get(rank)
            if holder is not None and holder != driver and job_alive(holder):
                return holder
            self._holders[rank] = driver
            if node is not None:
                self._nodes[rank] = node
            return None

    def opened(self, rank: int, loader: str) -> None:
        """Rank ``rank``'s loader ``loader`` uses the coordinator."""
        with self._lock:
            self._loaders.setdefault(rank, set()).add(loader)

    def dropped(self, rank: int, loader: str) -> None:
        """Rank ``rank``'s loader ``loader`` was dropped (garbage collected): it will not ask again."""
        with self._lock:
            self._loaders.get(rank, set()).discard(loader)

    def all_dropped(self, world_size: int, idle: float) -> bool:
        """Whether every rank of ``world_size`` used the coordinator through a loader, has dropped every
        such loader, and nobody called for ``idle`` >= :data:`DROPPED_GRACE_S` seconds (a loader built per
        epoch under torchrun gets a new name, so a new coordinator: nobody asks this one again, and its
        pool's CPUs go back)."""
        with self._lock:
            return len(self._loaders) >= world_size and not any(self._loaders.values()) and idle >= DROPPED_GRACE_S

    def node_of(self, rank: int) -> Optional[str]:
        """The node ``rank``'s process said hello from (None: not told)."""
        return self._nodes.get(rank)

    def gone(self, now: Optional[float] = None, alive: Any = None) -> list[int]:
        """The ranks whose process is gone (its Ray job dead: it exited, or its node was lost);
        asked of the GCS at most once per :data:`DRIVER_CHECK_S`."""
        now = time.monotonic() if now is None else now
        if now - self._checked >= DRIVER_CHECK_S:
            self._checked = now
            with self._lock:
                holders = dict(self._holders)
            alive = alive or job_alive
            self._gone = sorted(r for r, d in holders.items() if not alive(d))
        return list(self._gone)

    def over(self, now: Optional[float] = None, world_size: Optional[int] = None,
             alive: Any = None) -> bool:
        """True once every recorded process has been gone for :data:`DRIVERS_GONE_GRACE_S` (checked
        by polling); for :data:`LATE_RANK_GRACE_S` while some rank of the ``world_size`` never said
        hello (it may be late: the coordinator must outlive the rank that created it)."""
        now = time.monotonic() if now is None else now
        job_alive = alive or globals()["job_alive"]
        with self._lock:
            drivers = set(self._holders.values())
            grace = DRIVERS_GONE_GRACE_S if world_size is None or len(self._holders) >= world_size \
                else LATE_RANK_GRACE_S
        if not drivers or any(job_alive(d) for d in drivers):
            self._gone_since = None
            return False
        if self._gone_since is None:
            self._gone_since = now
        with self._lock:
            unchanged = set(self._holders.values()) == drivers
        return unchanged and now - self._gone_since >= grace


def check_ranks_alive(watch: JobWatch, ep: Any, asking: int) -> None:
    """Fail the epoch for rank ``asking`` when another rank's process is gone before the end of
    its share (``ep``: the coordinator's epoch, with per-rank ``logs`` and ``done``).

    Losing the node that runs a rank is the trainer's failure, not the loader's: the
    other ranks would wait for its batches, or DDP for its gradients, until a timeout.
    They fail within seconds instead, naming the rank and its node; torchrun's restart
    resumes from the last checkpoint.

    Raises:
        SbloaderError: naming the gone rank(s) and their node(s).
    """
    from sbloader.core.errors import SbloaderError

    gone = [r for r in watch.gone() if r != asking and r < len(ep.logs) and not ep.logs[r].left and not ep.done(r)]
    if gone:
        where = ", ".join(f"rank {r} on node {watch.node_of(r) or '?'}" for r in gone)
        raise SbloaderError(
            f"epoch {ep.spec.epoch}: the process of {where} is gone before the end of its share (its node was "
            "lost, or it crashed): the training job has lost a rank, which the loader cannot replace. Restart "
            "the job (torchrun's --max-restarts); it resumes exactly once from the last checkpoint's loader state"
        )


def process_info(ledgers: dict) -> dict:
    """This process's pid and resident memory (bytes), with ``ledgers`` (per epoch, its delivery logs' bytes)."""
    import os

    rss = 0
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    return {"pid": os.getpid(), "rss": rss, "ledger_bytes": ledgers}
