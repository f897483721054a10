"""Warm worker actors: a drop-in loader's workers outlive their epoch (``persistent_workers=False``).

torch forks its workers for each epoch in ~0.2 s; a Ray actor takes a second or more to
start (a process, importing torch, unpickling the dataset). So with the default
``persistent_workers=False`` a loader keeps its worker *processes* after an epoch ends,
and the next epoch rebuilds the worker in each of them (:meth:`MapActor.rebuild
<sbloader.executor.tasks.MapActor.rebuild>`) instead of starting new ones. torch's
semantics hold: the rebuild unpickles the dataset as the trainer pickled it at the
start of this iteration (a mutation made in a worker never reaches the next epoch),
runs ``worker_init_fn`` again, and seeds the worker from this epoch's base seed
(``base_seed + worker_id``). Warm actors are killed after ``SBLOADER_WARM_IDLE_S``
seconds without an epoch (60), when the loader is dropped, and at exit (with the
embedded Ray). ``SBLOADER_WARM_WORKERS=0`` turns this off (a new pool per epoch).
"""
from __future__ import annotations

import os
import threading
from typing import Any, Optional

import ray

from sbloader.executor.pools import PrestartedActor, kill_cached


def enabled() -> bool:
    """Whether warm workers are on (``SBLOADER_WARM_WORKERS`` is not ``0``)."""
    return os.environ.get("SBLOADER_WARM_WORKERS", "1") != "0"


def idle_s() -> float:
    """Seconds warm actors wait for the next epoch before they are killed."""
    return float(os.environ.get("SBLOADER_WARM_IDLE_S", "60"))


def take(carry: Any, op: Any, num_workers: int) -> dict:
    """The actor cache this epoch's pool starts from: the loader's warm actors, each rebuilding its
    worker from ``op`` (fresh dataset, ``worker_init_fn`` again), or empty (none, or another count)."""
    cancel(carry)
    cache = carry.warm_cache
    handles = [h.handle if isinstance(h, PrestartedActor) else h for hs in cache.values() for h in hs]
    if len(handles) != num_workers or not ray.is_initialized() or len(cache) != 1:
        kill_cached(cache)
        cache.clear()
        return cache
    key = next(iter(cache))
    cache[key] = [PrestartedActor(h, h.rebuild.remote(op), counted=True) for h in handles]
    return cache


def keep(carry: Any) -> None:
    """An epoch ended and left its actors in ``carry.warm_cache``: kill them after the idle time."""
    cancel(carry)
    if carry.dropped:
        kill_cached(carry.warm_cache)
        carry.held_cpus = 0.0
        return
    timer = threading.Timer(idle_s(), release, args=(carry,))
    timer.daemon = True
    carry.warm_timer = timer
    timer.start()


def cancel(carry: Any) -> None:
    """Stop the idle countdown (an epoch takes the actors)."""
    timer: Optional[threading.Timer] = getattr(carry, "warm_timer", None)
    if timer is not None:
        timer.cancel()
        carry.warm_timer = None


def release(carry: Any) -> None:
    """Kill the warm actors now (idle too long, or the loader is gone)."""
    cancel(carry)
    try:
        kill_cached(carry.warm_cache)
    except Exception:  # Ray is shutting down
        pass
    carry.held_cpus = 0.0
