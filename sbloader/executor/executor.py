"""The streaming executor: one epoch of a pipeline, run by a scheduling loop on a
background thread (:mod:`~sbloader.executor.loop`), streamed to one consumer.

The consumer takes ready blocks (:meth:`StreamingExecutor.get_next`), reads them
(:meth:`~StreamingExecutor.fetch`: one ``ray.get``, or the consumer's shared-memory
slot when its task ran on this node, :mod:`~sbloader.executor.handoff`) and
releases them to the memory budget when done. Errors of the loop (a user
function's, a lost task's) are carried to the consumer's next ``get_next``.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

import ray

from sbloader.core.block import BlockMeta
from sbloader.core.errors import ExecutorShutdownError
from sbloader.core.plan import EpochPlan
from sbloader.core.stats import ExecutionStats
from sbloader.executor.failures import system_failure, unwrap
from sbloader.executor.handoff import SlotArena, SlotBlock, enabled as handoff_enabled
from sbloader.executor.loop import Scheduler
from sbloader.executor.options import ExecutionOptions, OutputBlock
from sbloader.executor.pace import ConsumerPace
from sbloader.executor.pools import PrestartedActor, kill_cached, prestart_pools
from sbloader.executor.stages import Stage
from sbloader.sources.base import Source

__all__ = ["ExecutionOptions", "OutputBlock", "PrestartedActor", "StreamingExecutor", "kill_cached",
           "prestart_pools"]


def _read(ref: ray.ObjectRef) -> Any:
    """A ready block's bytes (one ``ray.get``; a test replaces it to lose a block)."""
    return ray.get(ref)


class StreamingExecutor:
    """Runs one epoch of a pipeline, streaming blocks to one consumer.

    Args:
        source: the dataset's source.
        stages: physical stages (first is the read stage).
        plan: the epoch plan.
        options: budget, order and progress options.
        actor_cache: a dict the caller keeps: pool actors are left there at the end.
        estimates: an earlier execution's :meth:`estimates`.
        arena: the consumer's shared-memory slots: final-stage blocks made on its node
            are handed over there instead of through the object store. Read every
            block with :meth:`fetch`.
    """

    def __init__(self, source: Source, stages: list[Stage], plan: EpochPlan, options: ExecutionOptions,
                 actor_cache: Optional[dict[int, list]] = None,
                 estimates: Optional[list[Optional[float]]] = None,
                 arena: Optional[SlotArena] = None) -> None:
        self._source, self._stages, self._plan, self._opts = source, stages, plan, options
        usable = arena is not None and handoff_enabled() and arena.node_id not in options.exclude_nodes
        self._arena = arena if usable else None
        self._actor_cache = actor_cache
        self._estimates = estimates
        self._lock = threading.Condition()
        self._stop = False  # set once, by shutdown()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._done = False
        self._t0 = 0.0
        self._consumer = ConsumerPace(skip=2 + options.prefetch_blocks)
        self._loop: Optional[Scheduler] = None
        self._pending_stats = ExecutionStats()

    def start(self) -> "StreamingExecutor":
        """Plan the epoch, ship the source's shared object and start the loop thread."""
        self._t0 = time.perf_counter()
        self._loop = Scheduler(self._source, self._stages, self._plan, self._opts, self._consumer,
                               self._actor_cache, self._estimates, self._arena)
        self._thread = threading.Thread(target=self._run, name="sbloader-executor", daemon=True)
        self._thread.start()
        return self

    def get_next(self, timeout: Optional[float] = None) -> Optional[OutputBlock]:
        """The next ready block (its bytes now count as consumer-held), or None at the end.

        Raises:
            SbloaderError: the error of a failed task, with its operator and partition.
            TimeoutError: nothing became ready within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        t_wait = time.perf_counter()
        loop = self._loop
        with self._lock:
            self._consumer.asked(t_wait)
            while True:
                if self._error is not None:
                    raise self._error
                if self._stop:
                    raise ExecutorShutdownError("the execution was shut down; start a new iteration")
                item = loop.outputs.pop()
                if item is not None:
                    loop.budget.taken(item.meta.nbytes)
                    now = time.perf_counter()
                    if loop.stats.first_block_s is None:
                        loop.stats.first_block_s = now - self._t0
                    loop.stats.stall_s += now - t_wait
                    self._consumer.took(now, item.meta.num_rows)
                    self._lock.notify_all()
                    return item
                if self._done:
                    loop.stats.stall_s += time.perf_counter() - t_wait
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no block became ready within {timeout} s")
                self._lock.wait(timeout=0.5 if remaining is None else min(remaining, 0.5))

    def fetch(self, item: OutputBlock) -> Any:
        """The block of a ready item: one ``ray.get``, opened from the shared-memory slot
        when its task wrote it there (its arrays then view the slot, writable: it is
        theirs alone, and it is lent again once they are all gone). Arrays from the
        object store are read-only.

        A block lost after its call finished (its node, or the pool actor holding it, died before this
        read) is made again from its partition's provenance (:mod:`~sbloader.executor.remake`), at most
        :data:`~sbloader.executor.failures.MAX_RERUNS` times, and that block is returned.

        Raises:
            TaskLostError: the block was lost more than ``MAX_RERUNS`` times.
        """
        try:
            obj = _read(item.ref)
        except BaseException as e:
            self._loop.free_lease(item.lease)
            if not (isinstance(e, Exception) and system_failure(e)):
                raise
            return self._made_again(item, e)
        if isinstance(obj, SlotBlock):
            self._loop.stats.slot_blocks += 1
            return self._arena.open(obj)
        self._loop.free_lease(item.lease)
        return obj

    def _made_again(self, item: OutputBlock, error: Exception) -> Any:
        """The block of ``item``, lost with ``error`` before it was read, made again and read."""
        loop, meta = self._loop, item.meta
        part = loop.parts[meta.partition_id]
        while True:
            loop.reruns.record_lost_block(len(self._stages) - 1, meta.seq, part, error, self._stages[-1].name)
            try:
                return ray.get(loop.launcher.remake(part, meta.seq))
            except Exception as e:
                if not system_failure(e):
                    raise unwrap(e)
                error = e

    def release(self, nbytes: int) -> None:
        """The consumer is done with a block of ``nbytes``: it no longer counts."""
        with self._lock:
            self._loop.budget.release(nbytes)
            self._lock.notify_all()

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` the consumer still holds from an earlier execution as held from this one
        (a round of segments, :class:`~sbloader.executor.shard_rounds.ShardRounds`): this one makes
        only what the budget leaves beside them, and :meth:`release` frees them here."""
        if nbytes > 0:
            with self._lock:
                self._loop.budget.consumer += nbytes

    def release_block(self, meta: BlockMeta) -> None:
        """The consumer is done with the block of ``meta`` (:meth:`release` of its bytes)."""
        self.release(meta.nbytes)

    def shutdown(self) -> None:
        """Stop the loop, drop the running tasks and kill the pool actors (or keep them in
        the actor cache). Idempotent and thread-safe: the first call does the work (a
        loader's consumer and its fetch thread may both call it).

        Running tasks are not cancelled: they finish (at most one task per slot) and
        their outputs are freed with the dropped refs. ``ray.cancel`` racing with a
        task's completion aborts the driver in Ray 2.60 (``Check failed: it !=
        submissible_tasks_.end()`` in ``TaskManager::CompletePendingTask``, the race of
        ray-project/ray#54798); the CI saw it once when a loop broke out mid-epoch.
        """
        with self._lock:
            first, self._stop = not self._stop, True
            self._lock.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if not first or self._loop is None:
            return
        loop = self._loop
        with self._lock:  # (a loop thread that outlived the join finds _stop set and returns)
            if self._arena is not None:
                for meta_ref, run in loop.inflight.items():  # the small ref: the arena pins no block
                    self._arena.free_when_done(run.lease, meta_ref)
            for out in loop.outputs.drain():  # a later get_next raises, it never hands one out
                loop.free_lease(out.lease)
            loop.budget.output = 0
            loop.inflight.clear()
        loop.pools.shutdown()
        loop.bars.close()

    @property
    def epoch_seed(self) -> int:
        """The seed of the epoch this execution runs."""
        return self._plan.epoch_seed

    def pools_up(self) -> bool:
        """Every actor pool has at least one constructed actor (True without pools): the
        workers are up, what was start-up is over."""
        loop = self._loop
        if loop is None:
            return False
        return all(any(a.ready for a in actors) for actors in loop.pools.pools.values())

    def estimates(self) -> list[Optional[float]]:
        """The current output-size estimate of each stage (bytes per block)."""
        return list(self._loop.est) if self._loop is not None else list(self._estimates or [])

    def stats(self) -> ExecutionStats:
        """Statistics so far (final once the iteration ended; before that ``wall_s`` is the
        seconds the execution has run, so a running epoch shows its rate)."""
        if self._loop is None:
            return self._pending_stats
        if not self._done and self._t0:
            self._loop.stats.wall_s = time.perf_counter() - self._t0
        return self._loop.stats

    @property
    def held_bytes(self) -> float:
        """Bytes the pipeline holds or has promised in the object store now."""
        return self._loop.held()

    @property
    def consumer_pace(self) -> ConsumerPace:
        """The consumer's pace, which decides whether read tasks take several partitions
        (a loader with a fetch thread sets ``external`` and reports the loop's pace)."""
        return self._consumer

    def _demand(self) -> list:
        with self._lock:
            return self._loop.waiting_demand()

    def _run(self) -> None:
        loop = self._loop
        try:
            while True:
                with self._lock:
                    if self._stop:
                        return
                    loop.step()
                    if loop.finished():
                        self._done = True
                        loop.stats.wall_s = time.perf_counter() - self._t0
                        loop.stats.stuck_warnings = loop.watch.warnings
                        loop.bars.close()
                        self._lock.notify_all()
                        return
                    waiting = loop.waiting()
                if not waiting:
                    with self._lock:
                        self._lock.wait(timeout=0.05)
                    continue
                ready, _ = ray.wait(waiting, num_returns=1, timeout=0.05)
                if ready:
                    ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0)
                    found = loop.collect(ready)
                    with self._lock:
                        if self._stop:  # shut down meanwhile: shutdown() took over the runs and their slots
                            return
                        loop.apply(*found)
                        self._lock.notify_all()
                    loop.watch.progressed()
                else:
                    loop.watch.check(self._demand)
                    loop.stats.stuck_warnings = loop.watch.warnings
        except BaseException as e:  # carried to the consumer
            with self._lock:
                self._error = unwrap(e)
                self._lock.notify_all()
