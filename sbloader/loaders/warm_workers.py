"""Warm worker actors: a drop-in loader's workers outlive their epoch, and their loader.

torch forks its workers for each epoch in ~0.2 s; a Ray actor takes a second or more to
start (a process, importing torch, unpickling the dataset). So with the default
``persistent_workers=False`` a loader keeps its worker *processes* after an epoch ends,
and the next epoch rebuilds the worker in each of them (:meth:`MapActor.rebuild
<sbloader.executor.tasks.MapActor.rebuild>`) instead of starting new ones. torch's
semantics hold: the rebuild unpickles the dataset as the trainer pickled it at the
start of this iteration (a mutation made in a worker never reaches the next epoch),
runs ``worker_init_fn`` again, and seeds the worker from this epoch's base seed
(``base_seed + worker_id``). ``SBLOADER_WARM_WORKERS=0`` turns this off (a new pool
per epoch).

Warm per process, not per loader: when a loader is dropped, its idle warm actors go
to this process's idle pool, keyed by what they were started with (the count, CPUs
and resources per actor, the placement); a new loader with the same key takes them
(a script that builds its loader inside the epoch loop starts no new processes).
A ``persistent_workers=True`` loader's actors are its own for its life (rebuilt never), but
when it is dropped they wait in the same idle pool, and a new ``persistent_workers`` loader
of the same key takes them at its first epoch, rebuilt there as above
(:func:`adopt_persistent`: a resume builds a second loader right after the first).
Idle actors, a loader's or the process's, are killed after ``SBLOADER_WARM_IDLE_S``
seconds without an epoch (60), and at exit (with the embedded Ray); the process's idle actors
go at once when a new pool needs their CPUs, here or at the coordinator of a split loader
of this process (:func:`give_way`), and whenever the cluster has CPU work that waits for free CPUs
(a pool started where :func:`give_way` was not asked or read a free-CPU figure that lagged, another
process's, a user's own Ray tasks: :func:`watch`). A live loader's warm actors between its epochs
go only for the latter (torch's loader holds no worker between epochs: a pipeline run between two
epochs must not wait for the idle time); a new loader's workers share the CPUs they hold. They are this
process's actors in this job's Ray: never shared with another process or job.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional, Tuple

import ray

from sbloader.executor.pools import PrestartedActor, kill_cached


def enabled() -> bool:
    """Whether warm workers are on (``SBLOADER_WARM_WORKERS`` is not ``0``)."""
    return os.environ.get("SBLOADER_WARM_WORKERS", "1") != "0"


def idle_s() -> float:
    """Seconds warm actors wait for the next epoch before they are killed."""
    return float(os.environ.get("SBLOADER_WARM_IDLE_S", "60"))


WATCH_S = 0.5  # how often the idle actors look for CPU work that waits for them
WATCH_READINGS = 2  # readings in a row that must show waiting work (not a task queued for a moment)
DRAIN_S = 2.0  # at most this long a new pool waits for a dropped epoch's close to hand its actors over
_IDLE_LOCK = threading.Lock()
_IDLE: dict = {}  # key -> (actor cache, its idle timer): the warm actors of dropped loaders


def park(key: Any, cache: dict) -> None:
    """Idle actors (an actor cache) wait in the process's idle pool under ``key`` for the next user of
    the same key, and are killed after the idle time; killed at once when that key is taken already."""
    cache = {k: list(v) for k, v in cache.items() if v}
    if not cache:
        return
    with _IDLE_LOCK:
        if key in _IDLE or not ray.is_initialized():
            kill_cached(cache)
            return
        timer = threading.Timer(idle_s(), _expire, args=(key,))
        timer.daemon = True
        _IDLE[key] = (cache, timer)
        timer.start()
    watch()


def unpark(key: Any) -> dict:
    """The process's idle actors under ``key`` (taken out of the idle pool), or an empty cache."""
    with _IDLE_LOCK:
        entry = _IDLE.pop(key, None)
    if entry is None:
        return {}
    entry[1].cancel()
    return entry[0]


def _adopt(carry: Any, settle: bool = True) -> None:
    """An empty loader takes the process's idle actors of its key, if any: a dropped loader's, or
    those of a live loader between epochs (a loop that builds its loader each epoch holds the last
    one until the new one is built; that one, if it iterates again, starts its own). ``settle``:
    first let the closer finish the epochs dropped a moment ago (never under a lock an epoch's close
    takes: :mod:`~sbloader.loaders.handover`'s prestart passes False)."""
    key = getattr(carry, "warm_key", None)
    if key is None or any(carry.warm_cache.values()):
        return
    if _adopt_from(carry, key) or not settle:
        return
    from sbloader.loaders import closer

    # an epoch dropped a moment ago (an iterator that raised, or was let go) hands its actors over
    # when the closer thread closes it: wait for that close (briefly) rather than start a new pool
    closer.drain(DRAIN_S)
    _adopt_from(carry, key)


def _adopt_from(carry: Any, key: Tuple) -> bool:
    """:func:`_adopt`'s look: the idle pool's actors of ``key``, or another loader's; whether found."""
    from sbloader.loaders.dropin_settings import _CARRIES

    carry.warm_cache.update(unpark(key))
    if any(carry.warm_cache.values()):
        return True
    with _IDLE_LOCK:
        for other in list(_CARRIES):
            if other is carry or getattr(other, "warm_key", None) != key:
                continue
            if other.dropped and not other.pools_running and any(other.actor_cache.values()):
                _move(other.actor_cache, carry.warm_cache)  # a dropped persistent loader's, not yet handed over
                other.held_cpus = 0.0
                return True
            if other.dropped or other.warm_timer is None or not any(other.warm_cache.values()):
                continue  # another key, or in an epoch (its idle countdown runs only between epochs)
            cancel(other)
            _move(other.warm_cache, carry.warm_cache)
            other.held_cpus = 0.0
            return True
    return False


def _move(source: dict, target: dict) -> None:
    """The actors of one cache go to another (``source`` is left empty)."""
    for k, handles in source.items():
        target.setdefault(k, []).extend(handles)
    source.clear()


def available(carry: Any, key: Tuple, num_workers: int) -> bool:
    """Whether ``num_workers`` warm actors wait for this loader (its own, or the process's idle ones)."""
    carry.warm_key = key
    _adopt(carry)
    return sum(len(hs) for hs in carry.warm_cache.values()) == num_workers


def take(carry: Any, op: Any, num_workers: int, key: Optional[Tuple] = None, settle: bool = True) -> dict:
    """The actor cache this epoch's pool starts from: the loader's warm actors (or the process's idle
    ones of the same ``key``), each rebuilding its worker from ``op`` (fresh dataset, ``worker_init_fn``
    again), or empty (none, or another count). ``settle``: as :func:`_adopt`'s."""
    with _IDLE_LOCK:  # from here the watcher leaves the loader's warm actors alone (:func:`_release_live`)
        cancel(carry)
    if key is not None:
        carry.warm_key = key
    _adopt(carry, settle)
    cache = carry.warm_cache
    handles = [h.handle if isinstance(h, PrestartedActor) else h for hs in cache.values() for h in hs]
    if len(handles) != num_workers or not ray.is_initialized() or len(cache) != 1:
        kill_cached(cache)
        cache.clear()
        make_room(carry.warm_key)
        return cache
    key = next(iter(cache))
    cache[key] = [PrestartedActor(h, h.rebuild.remote(op), counted=True) for h in handles]
    return cache


def adopt_persistent(carry: Any, op: Any, num_workers: int, key: Tuple) -> None:
    """A ``persistent_workers`` loader's first epoch: its actors become the process's idle ones of ``key``
    (a dropped loader's, each rebuilding its worker from ``op``) when there are; else it starts its own.
    Its actors wait in the idle pool under ``key`` once the loader is dropped."""
    if not enabled() or any(carry.actor_cache.values()):
        return
    carry.actor_cache.update(take(carry, op, num_workers, key))
    carry.warm_cache = {}


def keep(carry: Any) -> None:
    """An epoch ended and left its actors in ``carry.warm_cache``: kill them after the idle time."""
    from sbloader.loaders.dropin_settings import _CARRIES

    _CARRIES.add(carry)
    cancel(carry)
    if carry.dropped:  # the loader went while its epoch ran: the actors wait for another loader
        hand_to_process(carry)
        return
    timer = threading.Timer(idle_s(), release, args=(carry,))
    timer.daemon = True
    carry.warm_timer = timer
    timer.start()
    watch()


def cancel(carry: Any) -> None:
    """Stop the idle countdown (an epoch takes the actors)."""
    timer: Optional[threading.Timer] = getattr(carry, "warm_timer", None)
    if timer is not None:
        timer.cancel()
        carry.warm_timer = None


def release(carry: Any) -> None:
    """Kill the warm actors now (idle too long)."""
    cancel(carry)
    try:
        kill_cached(carry.warm_cache)
    except Exception:  # Ray is shutting down
        pass
    carry.held_cpus = 0.0


def hand_to_process(carry: Any) -> None:
    """The loader is gone: its idle actors (warm, or its persistent workers once no epoch runs on them)
    wait in the process's idle pool for a loader of the same key (killed after the idle time); without a
    key, or when one is waiting there already, killed."""
    cancel(carry)
    key = getattr(carry, "warm_key", None)
    cache: dict = {}
    with _IDLE_LOCK:
        _move(carry.warm_cache, cache)
        if not getattr(carry, "pools_running", 0):  # else its epoch hands them over when it closes
            _move(carry.actor_cache, cache)
    cache = {k: v for k, v in cache.items() if v}
    carry.held_cpus = 0.0  # a running epoch's pool counts its own (``pool_cpus``) until it closes
    if key is None:
        kill_cached(cache)
    else:
        park(key, cache)


def pipeline_key(source_name: str, ops: Any, allow_trainer_node: bool) -> Optional[Tuple]:
    """The key under which a native pipeline's callable-class actors wait between pipelines: its
    operators as pickled (class, constructor arguments, resources, the functions fused before it)
    and the placement. None when it has no callable-class stage (nothing to keep)."""
    if not any(op.is_actor for op in ops):
        return None
    import hashlib

    import ray.cloudpickle as cloudpickle

    try:
        digest = hashlib.sha256(cloudpickle.dumps((source_name, list(ops)))).hexdigest()
    except Exception:  # an operator that does not pickle alike twice: no reuse
        return None
    return ("pipeline", digest, bool(allow_trainer_node))


def make_room(key: Any) -> None:
    """New actors of ``key`` are about to start: the process's idle actors of other keys (dropped loaders'
    and pipelines', waiting for a user that may never come) are killed now when the cluster has fewer
    free CPUs than the new ones ask for, instead of holding them until their idle timeout."""
    give_way(float(key[0]) * float(key[1]) if isinstance(key, tuple) and len(key) == 4 else 0.0, keep=key)


def give_way(needed: float, keep: Any = None) -> None:
    """A pool that asks for ``needed`` CPUs is about to start (here, or at the split coordinator of a loader
    of this process): the process's idle actors (but those of ``keep``) are killed now when the cluster has
    fewer free CPUs than that; else the pool would wait for them until their idle timeout."""
    with _IDLE_LOCK:
        others = [k for k in _IDLE if k != keep]
    if not others or needed <= 0:
        return
    from sbloader.runtime import cluster_state

    try:
        free = cluster_state.available_resources().get("CPU", 0.0)
    except Exception:  # the cluster did not answer: keep them (their idle timeout still runs)
        return
    if free >= needed:
        return
    for k in others:
        with _IDLE_LOCK:
            entry = _IDLE.pop(k, None)
        if entry is not None:
            entry[1].cancel()
            kill_cached(entry[0])


def idle_actors() -> int:
    """How many actors wait in the process's idle pool now (each holds its CPUs until taken or killed)."""
    with _IDLE_LOCK:
        return sum(len(handles) for cache, _ in _IDLE.values() for handles in cache.values())


def release_idle() -> None:
    """Kill every actor waiting in the process's idle pool now (a test's job ends with the test)."""
    with _IDLE_LOCK:
        entries = list(_IDLE.values())
        _IDLE.clear()
    for cache, timer in entries:
        timer.cancel()
        _kill_quietly(cache)


def _expire(key: Tuple) -> None:
    with _IDLE_LOCK:
        entry = _IDLE.pop(key, None)
    if entry is not None:
        _kill_quietly(entry[0])


_WATCHER: list = []  # the watcher thread, while one runs


def watch() -> None:
    """Idle actors wait in this process's idle pool: a thread reads the cluster's waiting CPU work every
    :data:`WATCH_S` until none are left, and when :data:`WATCH_READINGS` readings in a row show work
    that waits for free CPUs, the idle actors are killed (:func:`give_way` decides when a pool starts,
    from a free-CPU figure that lags; this sees what waits, whoever asked)."""
    with _IDLE_LOCK:
        if _WATCHER:
            return
        thread = threading.Thread(target=_watch, name="sbloader-idle-watch", daemon=True)
        _WATCHER.append(thread)
    thread.start()


def _live_between_epochs() -> list:
    """The live loaders whose warm actors wait for their next epoch (each holds their CPUs)."""
    from sbloader.loaders.dropin_settings import _CARRIES

    return [c for c in list(_CARRIES) if not c.dropped and c.warm_timer is not None and any(c.warm_cache.values())]


def _watch() -> None:
    from sbloader.runtime import cluster_state

    seen = 0
    while True:
        time.sleep(WATCH_S)
        with _IDLE_LOCK:
            if not (_IDLE or _live_between_epochs()) or not ray.is_initialized():
                _WATCHER.clear()
                return
        try:
            waiting = cluster_state.cpus_waiting()
        except Exception:  # the GCS did not answer, or Ray is shutting down: read again next time
            continue
        seen = seen + 1 if waiting > 0 else 0
        if seen < WATCH_READINGS:
            continue
        seen = 0
        release_idle()
        _release_live()


def _release_live() -> None:
    """Kill the warm actors of the live loaders between epochs (their next epochs start new ones: better
    than work that waits for the idle time). Taken under the lock :func:`take` takes them under."""
    victims: dict = {}
    with _IDLE_LOCK:
        for carry in _live_between_epochs():
            cancel(carry)
            for k, handles in carry.warm_cache.items():
                victims.setdefault(k, []).extend(handles)
            carry.warm_cache.clear()
            carry.held_cpus = 0.0
    _kill_quietly(victims)


def _kill_quietly(cache: dict) -> None:
    try:
        kill_cached(cache)
    except Exception:  # Ray is shutting down
        pass
