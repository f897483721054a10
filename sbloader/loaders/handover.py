"""The handover of a locally started epoch to the pool: the pool's actors started ahead, and the switch.

A local start (:mod:`~sbloader.loaders.local_start` for map-style datasets,
:mod:`~sbloader.loaders.iterable_start` for an ``IterableDataset``) makes an epoch's first
batches on local worker processes while, in the background, Ray comes up and the pool's
actors are started ahead (:func:`prestart`: the loader's warm actors rebuilt, or new ones);
:class:`Handover` says when they are all constructed, and the epoch's iterator
(:func:`phased_iterator`) is woken and closed in whichever phase it is in. The close and the
background start agree under :data:`PRESTART_LOCK`: actors started for an epoch that ended
first (shorter than Ray's start) stay warm for the next one, never lost in between.
"""
from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Callable, Iterator, Optional

from sbloader.core.stats import StallStats
from sbloader.loaders.epoch import Delivery, EpochIterator
from sbloader.loaders.fork_safe import FORK_LOCK


class Handover:
    """The local sampler of partitions: hands out partitions until the pool's actors are up, then stops.

    Args:
        total: the epoch's partitions.
        actors: the pool's actors started ahead (:class:`~sbloader.executor.pools.PrestartedActor`), filled
            in by the background start once Ray is up.
    """

    def __init__(self, total: int, at: Optional[int] = None) -> None:
        self.total, self.at = total, at  # at: hand over exactly there, waiting for the pool (tests)
        self.stopped_at: Optional[int] = None  # the first partition the pool makes (None: the local phase ran all)
        self.handed = 0  # partitions handed out to the local workers so far (the first ``handed``)
        self.missed: list = []  # of those, the ones a stalled local phase never delivered: the pool makes them first
        self.cache: dict = {}
        self._refs: list = []
        self._lock = threading.Lock()
        self.closed = False
        self.gave_up = False  # the pool could not be started: the local workers make the whole epoch

    def prestarted(self, cache: dict) -> None:
        """The pool's actors are starting (their constructors' refs say when they are up)."""
        with self._lock:
            self.cache = cache
            self._refs = [h.ready_ref for hs in cache.values() for h in hs if hasattr(h, "ready_ref")]

    def ready(self) -> bool:
        """Whether every actor of the pool is constructed (never blocks)."""
        with self._lock:
            refs = list(self._refs)
        if not self.cache:
            return False
        if not refs:
            return True
        import ray

        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(done) == len(refs)

    def __iter__(self) -> Iterator[int]:
        for p in range(self.total):
            if self.at is not None:
                if p == self.at:
                    while not self.ready() and not self.closed and not self.gave_up:
                        time.sleep(0.01)
                    if not self.gave_up:
                        self.stopped_at = p
                        return
            elif p > 0 and self.ready():  # at least one local partition: the local workers are already forked
                self.stopped_at = p
                return
            self.handed = p + 1
            yield p

    def stalled(self, received: set) -> None:
        """The local phase ends on a stalled worker, having delivered the partitions ``received``: the pool makes
        the ones handed out but not received (:attr:`missed`), then those never handed out."""
        self.missed = sorted(set(range(self.handed)) - received)
        if self.stopped_at is None:
            self.stopped_at = self.handed


PRESTART_LOCK = threading.Lock()


def begin(s: Any, carry: Any, epoch_seed: int, total: int, at: Optional[int]) -> Handover:
    """A local start's handover for its ``total`` partitions (``at``: forced there, tests): the loader counted
    as holding its pool's CPUs now (a loader built meanwhile leaves them), and the pool's actors started
    ahead in the background (:func:`prestart`)."""
    carry.stats = None  # an earlier epoch's are not this one's (the pool's, if it takes over, replace them)
    handover = Handover(total, at)
    carry.starts += 1
    hold(s, carry)
    start_prestart(s, carry, epoch_seed, handover)
    return handover



def start_prestart(s: Any, carry: Any, epoch_seed: int, handover: Handover) -> None:
    """Run :func:`prestart` for this epoch (``carry.starts``) in the background (the exit waits for it)."""
    from sbloader.runtime.background import spawn

    spawn(prestart, (s, carry, epoch_seed, handover, carry.starts), "sbloader-pool-prestart")


def prestart(s: Any, carry: Any, epoch_seed: int, handover: Handover, start: int) -> None:
    """In the background: Ray up (started at the loader's construction), then the pool's actors
    started ahead (the loader's warm ones rebuilt, or new ones) for the handover. An epoch that
    ended first (shorter than Ray's start) leaves them warm for the next epoch; a newer epoch's
    start (``carry.starts`` past ``start``) takes over instead."""
    try:
        from sbloader.runtime import background
        from sbloader.runtime.session import ensure_initialized

        ensure_initialized()  # first: the modules below import ``ray``, which a process whose files run out
        # must not import (runtime.open_files.check refuses to start Ray there, before its import)
        from sbloader.loaders import warm_workers
        from sbloader.loaders.dropin_epoch import pool_options
        from sbloader.executor.pools import prestart_pools
        from sbloader.sources.batches import ReadyBatchSource, ShardSource

        if background.exiting() or carry.dropped or carry.starts != start or (
                handover.closed and not warm_workers.enabled()):
            return _release_hold(carry)  # nobody would take the actors
        try:
            with FORK_LOCK:  # no local worker forked while the dataset is pickled here
                op = s.worker_op(epoch_seed)
        except Exception as exc:  # the dataset (or collate_fn, worker_init_fn) cannot travel to the pool
            warnings.warn(f"sbloader: the epoch stays on local worker processes: the dataset, collate_fn or "
                          f"worker_init_fn cannot be pickled for the cluster's workers ({exc!r}); make them "
                          "picklable to load on the cluster", RuntimeWarning, stacklevel=1)
            handover.gave_up = True
            return _release_hold(carry)
        if not s.persistent_workers and warm_workers.enabled():
            # an epoch dropped a moment ago (a resume right after ``del it``) hands its actors over when the
            # closer has closed it: wait for that here, outside the locks its close takes, not start new ones
            warm_workers.available(carry, s.warm_key(), s.num_workers)
        with PRESTART_LOCK, FORK_LOCK:  # the epoch's close (``closed``) sees the actors, or none at all
            if background.exiting() or carry.dropped or carry.starts != start:
                if carry.dropped and not background.exiting():  # dropped while it waited above: what it
                    warm_workers.hand_to_process(carry)  # took back to the idle pool, not lost with the loader
                return
            if s.persistent_workers:
                cache = carry.actor_cache
            elif warm_workers.enabled():
                cache = warm_workers.take(carry, op, s.num_workers, s.warm_key(), settle=False)  # under the locks
            else:
                cache = {}
            hold(s, carry)
            prestart_pools((ShardSource if s.iterable else ReadyBatchSource).name, (op,), pool_options(s), cache)
            handover.prestarted(cache)
            if handover.closed:  # the epoch ended before Ray was up: its actors wait for the next one
                keep_prestarted(s, carry, handover)
    except Exception as exc:  # the local phase goes on alone; the pool's own start raises it if it recurs
        import logging

        handover.gave_up = True
        logging.getLogger(__name__).debug("sbloader: pool prestart failed: %r", exc)


def _release_hold(carry: Any) -> None:
    """No actor will be started for this epoch: the loader holds no CPUs unless it keeps actors."""
    if not any(carry.warm_cache.values()) and not carry.actor_cache:
        carry.held_cpus = 0.0


def hold(s: Any, carry: Any) -> None:
    """The pool's CPUs count as held by this loader (other loaders' worker shares leave them)."""
    from sbloader.loaders.dropin_settings import _CARRIES

    carry.held_cpus = s.num_workers * s.worker_num_cpus
    _CARRIES.add(carry)


def workers_up(phase: dict) -> bool:
    """Whether a local phase's workers are up (``timeout`` counts, ``start_timeout`` is over): every worker ran
    its init (``phase["inits"]``: ``worker_init_fn`` included, as a pool actor's start), or a batch came."""
    inits = phase.get("inits")
    return bool(phase.get("up")) or (inits is not None and all(inits))


def pool_batches(handover: Handover, phase: dict, open_pool: Callable[[], Any]) -> Iterator[Delivery]:
    """The pool's batches after the handover: ``open_pool()`` starts it (on the actors started ahead) and puts
    it in ``phase["pool"]``, where the epoch's close finds it. An epoch closed while its pool opened (a
    ``persistent_workers`` pool waits for every actor) found no pool to shut down: it is shut down and closed
    here, or its rounds would run on, their actors' CPUs held and counted by nobody once the loader is gone."""
    with PRESTART_LOCK:
        if handover.closed:  # closed before the pool opened: its actors started ahead were kept warm
            return
        phase["opening"] = True
    try:
        pool = open_pool()
    except BaseException:
        with PRESTART_LOCK:
            phase.pop("opening", None)
        raise
    with PRESTART_LOCK:
        gone = handover.closed
        if not gone:
            phase["pool"] = pool
    if gone:  # the close found no pool: closed here, once
        pool.executor.shutdown()
        pool.closed()
        return
    yield from pool.produce


def phased_iterator(s: Any, carry: Any, run: Any, epoch: int, stalls: StallStats, handover: Handover, phase: dict,
                    produce: Iterator[Delivery]) -> EpochIterator:
    """The epoch's iterator over ``produce`` (its local phase, then the pool it opens with :func:`pool_batches`,
    if any): woken and closed in the phase it is in; a pool that never ran leaves the actors started ahead warm."""
    from sbloader.loaders.failed_batch import translate

    def wake() -> None:
        handover.closed = True
        if "pool" in phase:
            phase["pool"].executor.shutdown()

    def closed() -> None:
        with PRESTART_LOCK:  # the pool opened (closed here), opening (closed where it opens) or never: one of them
            handover.closed = True
            pool = phase.get("pool")
            if pool is None and not phase.get("opening"):  # its actors started ahead (now or later) stay warm
                keep_prestarted(s, carry, handover)
        if pool is not None:
            pool.closed()
        s.reporter(f"epoch {epoch}", stalls)()

    return EpochIterator(produce, run, ahead=s.ahead, stalls=stalls, to_device=s.to_device, translate=translate,
                         timeout=s.timeout or None, wake=wake, on_close=closed,
                         started=lambda: workers_up(phase), start_timeout=s.start_timeout)


def keep_prestarted(s: Any, carry: Any, handover: Handover) -> None:
    """The epoch ended before the handover: the actors started for it wait for the next epoch."""
    from sbloader.runtime.loaded_modules import loaded

    warm_workers = loaded("sbloader.loaders.warm_workers")  # no import: this may run at exit
    if s.persistent_workers or not handover.cache or warm_workers is None:
        return
    carry.held_cpus = s.num_workers * s.worker_num_cpus
    warm_workers.keep(carry)
