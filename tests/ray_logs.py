"""The log files of a Ray's exited workers, deleted (issue #48: the suite is CPU-bound).

Ray's log monitor looks at every worker log of its folder ten times a second. A Ray that
lives for many tests starts hundreds of workers, each leaving three files: measured in an
embedded Ray with 100 and 200 actors made and killed, the monitor took 2.0% and 3.0% of a core
(325 and 621 files, growing with every worker), 0.5% and 0.7% once the exited workers' files
were gone. Used after each ``tests/ray`` test for the session's Ray (``tests/conftest.py``)
and every few seconds for a ``ray start`` test cluster (``tests/e2e/_cluster.py``).
"""
from __future__ import annotations

import os
import time


def drop_dead_workers_logs(logs_dir: str, min_age_s: float = 10.0) -> int:
    """Delete the worker logs in ``logs_dir`` (``worker-*.out``/``.err``, ``python-core-worker-*.log``)
    of processes that have exited (their pid gone from ``/proc``) and untouched for ``min_age_s``
    (their lines were forwarded long ago); how many. A live worker's files are never touched; a
    folder that is gone is nothing to do."""
    try:
        entries = list(os.scandir(logs_dir))
    except OSError:
        return 0
    now, dropped = time.time(), 0
    for entry in entries:
        name = entry.name
        if name.startswith("worker-") and name.endswith((".out", ".err")):
            pid = name.rsplit(".", 1)[0].rsplit("-", 1)[-1]
        elif name.startswith("python-core-worker-") and name.endswith(".log"):
            pid = name[:-4].rsplit("_", 1)[-1]
        else:
            continue
        if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue
        try:
            if now - entry.stat().st_mtime >= min_age_s:
                os.unlink(entry.path)
                dropped += 1
        except OSError:
            pass
    return dropped


def drop_this_rays_dead_workers_logs() -> int:
    """:func:`drop_dead_workers_logs` for the Ray this process started (``ray.init``); 0 when it
    started none (a Ray joined by address, or none at all)."""
    import ray

    try:
        logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    except AttributeError:  # no node of this process's own
        return 0
    return drop_dead_workers_logs(logs)
