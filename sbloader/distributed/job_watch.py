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
from typing import Optional

import ray

#: How often the ranks' processes are checked, and how long all must be gone.
DRIVER_CHECK_S = 1.0
DRIVERS_GONE_GRACE_S = 2.0


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
        self._gone_since: Optional[float] = None

    def claim(self, rank: int, driver: str) -> Optional[str]:
        """Record ``rank`` as served to ``driver``; returns another live holder of the rank (refuse), else None."""
        with self._lock:
            holder = self._holders.get(rank)
            if holder is not None and holder != driver and job_alive(holder):
                return holder
            self._holders[rank] = driver
            return None

    def over(self, now: Optional[float] = None) -> bool:
        """True once every recorded process has been gone for :data:`DRIVERS_GONE_GRACE_S` (checked by polling)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            drivers = set(self._holders.values())
        if not drivers or any(job_alive(d) for d in drivers):
            self._gone_since = None
            return False
        if self._gone_since is None:
            self._gone_since = now
        with self._lock:
            unchanged = set(self._holders.values()) == drivers
        return unchanged and now - self._gone_since >= DRIVERS_GONE_GRACE_S
