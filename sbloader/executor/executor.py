"""The streaming executor: one non-blocking scheduling loop on a background thread.

State: a queue of waiting inputs per stage (ordered by plan position), the tasks in
flight, actor pools, the ready outputs and the bytes the consumer holds. Each step
collects finished tasks (``ray.wait`` with a short timeout; metadata only), asks
the pure policy which stage to feed next under the memory budget, and launches.
Block bytes never pass through this process: only refs and small metadata do.
Final-stage blocks made on the consumer's node may skip the object store through
the consumer's shared-memory slots (:mod:`.handoff`), which this executor lends.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import logging
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import ray

from sbloader.core.block import BlockMeta
from sbloader.core.errors import ExecutorShutdownError, MemoryBudgetError, SbloaderError, TaskLostError
from sbloader.runtime.placement import usable_resources
from sbloader.core.plan import EpochPlan
from sbloader.sources.base import Partition, Source
from sbloader.core.stats import ExecutionStats, OperatorStats
from sbloader.executor.policy import (MAX_CALL_BYTES, PoolView, StageView, blocks_ahead_cap, min_budget_bytes, partitions_per_task, pool_delta,
                     select_stage)
from sbloader.executor.stages import Stage, build_stages, stage_concurrency
from sbloader.executor.handoff import SlotArena, SlotBlock, SlotLease, enabled as handoff_enabled
from sbloader.executor.tasks import EpochInfo, MapActor, Packed, block_stage_task, pack, read_stage_task

logger = logging.getLogger(__name__)

_ACTOR_SLOTS = 2  # calls in flight per actor: one running, one queued behind it
_IDLE_TIMEOUT_S = 5.0
# Ray frees released objects asynchronously (the embedded Ray batches frees every
# 20 ms, later on a loaded machine); a released block still counts against the
# budget for this long.
_FREE_LAG_S = 0.25
# No task finished and no actor started for this long while work is in flight: say
# which resources the waiting work needs and what the cluster has free (a pool of
# another loader's persistent workers holding every CPU looks like a silent hang).
_STUCK_WARN_S = 20.0
# A read call of several partitions returns their blocks together, so one slow
# partition would hold back the others of its call. A call running this many
# times longer than expected (and at least _SPECULATE_MIN_S) has its partitions
# launched again, one per call; whichever copy of a partition finishes first is
# delivered, the other dropped (the straggler then delays only itself).
_SPECULATE_FACTOR = 4.0
_SPECULATE_MIN_S = 1.0


@dataclass(frozen=True)
class ExecutionOptions:
    """How one execution runs.

    Attributes:
        memory_budget: bytes the pipeline may hold in the object store, including
            blocks the consumer has taken but not released. None: a quarter of the
            cluster's object store.
        deterministic: deliver blocks in plan order whatever the timing.
        prefetch_blocks: ready output blocks to keep ahead of the consumer.
        progress: tqdm bars per operator (None: only on a TTY).
        max_task_retries: Ray retries of a task lost to a dead worker or node.
        exclude_nodes: node ids tasks and actors must avoid (the trainer's nodes,
            see :mod:`sbloader.runtime.placement`).
    """

    memory_budget: Optional[int] = None
    deterministic: bool = False
    prefetch_blocks: int = 2
    progress: Optional[bool] = None
    max_task_retries: int = 3
    exclude_nodes: tuple = ()

    def __post_init__(self) -> None:
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"memory_budget must be a positive number of bytes, found {self.memory_budget}")
        if self.prefetch_blocks < 1:
            raise ValueError(f"prefetch_blocks must be >= 1, found {self.prefetch_blocks}")


@dataclass(frozen=True)
class OutputBlock:
    """A ready block: its object ref and metadata (bytes stay in the object store, or in
    the consumer's shared-memory slot ``lease``: read it with :meth:`StreamingExecutor.fetch`)."""

    ref: ray.ObjectRef
    meta: BlockMeta
    lease: Optional[SlotLease] = None


@dataclass(frozen=True)
class PrestartedActor:
    """A pool actor started before its epoch's executor (see :func:`prestart_pools`).

    Attributes:
        handle: the actor.
        ready_ref: resolves once its callable class is constructed.
    """

    handle: Any
    ready_ref: ray.ObjectRef


def kill_cached(actor_cache: Optional[dict]) -> None:
    """Kill every actor kept in an actor cache (handles or :class:`PrestartedActor`) and empty it."""
    for handles in (actor_cache or {}).values():
        for h in handles:
            try:
                ray.kill(h.handle if isinstance(h, PrestartedActor) else h)
            except Exception:  # already dead, or Ray is shutting down
                pass
        handles.clear()


def _placed(options: dict, opts: "ExecutionOptions") -> dict:
    """Ray options with the placement policy's scheduling strategy, if any."""
    if not opts.exclude_nodes:
        return options
    from sbloader.runtime.placement import scheduling_strategy

    return {**options, "scheduling_strategy": scheduling_strategy(opts.exclude_nodes)}


def _new_pool_actor(stage: Stage, index: int, pool_size: int, opts: "ExecutionOptions") -> Any:
    """Create one actor of an actor stage's pool (its constructor runs in the background)."""
    return MapActor.options(
        max_restarts=opts.max_task_retries,
        max_task_retries=opts.max_task_retries,
        **_placed(stage.ray_options, opts),
    ).remote(stage.ops[0], index, pool_size)


def prestart_pools(source_name: str, ops: Sequence[Any], options: "ExecutionOptions",
                   actor_cache: dict[int, list]) -> int:
    """Start the minimum number of actors of each actor pool of a pipeline ahead of its epoch.

    They go into ``actor_cache`` (as :class:`PrestartedActor`), where the epoch's
    :class:`StreamingExecutor` adopts them: the actors' process start and the
    callable class's construction (for the drop-in loader: importing torch and
    unpickling the dataset, about a second each) overlap with whatever comes
    before the epoch starts. A pool that already has cached actors is left alone.

    Returns:
        The number of actors started.
    """
    from sbloader.runtime.session import cluster_cpus

    stages = build_stages(source_name, list(ops))
    cpus = cluster_cpus()
    started = 0
    for i, stage in enumerate(stages):
        if stage.kind != "actor" or actor_cache.get(i):
            continue
        lo, hi = stage.ops[0].pool_bounds(cpus)
        for index in range(lo):
            handle = _new_pool_actor(stage, index, hi, options)
            actor_cache.setdefault(i, []).append(PrestartedActor(handle, handle.ready.remote()))
            started += 1
    return started


@dataclass
class _Actor:
    handle: Any
    ready_ref: Optional[ray.ObjectRef]
    inflight: int = 0
    idle_since: float = field(default_factory=time.monotonic)


def _toward(prev: Optional[float], x: float, weight: float) -> float:
    """A running estimate moved ``weight`` of the way to ``x`` (``x`` itself when there is none)."""
    return x if prev is None else prev + weight * (x - prev)


class ConsumerPace:
    """Seconds the consumer spends per row between taking rows and asking for more (a
    moving average): the training loop's own time, its waits for data left out.

    The executor measures it at :meth:`StreamingExecutor.get_next` (after the first
    ``skip`` blocks) unless a loader reports it itself (``external``): a loader whose
    fetch thread takes blocks ahead of the loop must report the loop's pace, since
    the thread asks again at once while its queue has room.

    Args:
        skip: blocks taken before the executor's own measurement starts.
        alpha: weight of the newest interval in the average.
    """

    def __init__(self, skip: int = 4, alpha: float = 0.25) -> None:
        self._skip, self._alpha = skip, alpha
        self.external = False
        self._taken = 0
        self._last: Optional[float] = None
        self._last_rows = 0
        self.row_s: Optional[float] = None

    def asked(self, t: float) -> None:
        """(Executor) the consumer asks for a block at ``t`` (``time.perf_counter()``)."""
        if self.external or self._last is None or self._taken <= self._skip:
            return
        self.add(t - self._last, self._last_rows)

    def took(self, t: float, rows: int) -> None:
        """(Executor) the consumer got a block of ``rows`` rows at ``t``."""
        self._taken += 1
        self._last, self._last_rows = t, rows

    def add(self, seconds: float, rows: int) -> None:
        """The consumer spent ``seconds`` on ``rows`` rows."""
        if rows <= 0:
            return
        self.row_s = _toward(self.row_s, seconds / rows, self._alpha)


@dataclass
class _Call:
    """One Ray task or actor call; a read call may cover several partitions."""

    left: int  # its partitions whose metadata has not come back yet
    actor: Optional[_Actor] = None
    items: tuple = ()  # a read call: its (seq, Partition) pairs
    started: float = 0.0  # time.monotonic() at launch
    speculated: bool = False


@dataclass(frozen=True)
class _Solo:
    """A partition launched again on its own (its first call straggles)."""

    part: Partition


@dataclass
class _Running:
    stage: int
    seq: int
    block_ref: ray.ObjectRef
    input_bytes: int
    est_bytes: float
    call: _Call
    partition_id: int = -1  # the partition it reads (source stage) or maps
    lease: Optional[SlotLease] = None  # a final-stage block's shared-memory slot


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
        self._source = source
        usable = arena is not None and handoff_enabled() and arena.node_id not in options.exclude_nodes
        self._arena = arena if usable else None
        self._actor_cache = actor_cache
        self._stages = stages
        self._plan = plan
        self._opts = options
        self._info = EpochInfo(plan.epoch, plan.epoch_seed, plan.shuffle)
        self._lock = threading.Condition()
        self._stop = False  # set once, by shutdown()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._counter = itertools.count()
        self._queues: list[list] = [[] for _ in stages]
        self._queued_bytes = [0] * len(stages)
        self._inflight: dict[ray.ObjectRef, _Running] = {}
        self._stage_inflight = [0] * len(stages)
        # Output-size estimates per stage; a later epoch of the same pipeline starts
        # from the last one's, so its first tasks need not run one at a time.
        self._est: list[Optional[float]] = (
            list(estimates) if estimates is not None and len(estimates) == len(stages) else [None] * len(stages)
        )
        # Seconds one partition takes in the source stage, measured afresh every epoch
        # (so an epoch's first tasks read one partition each: a quick first batch).
        self._est_partition_s: Optional[float] = None
        self._read_done: set[int] = set()  # partitions whose source-stage block came back
        self._solo_queued: set[int] = set()  # partitions queued again (see _speculate)
        self._consumer = ConsumerPace(skip=2 + options.prefetch_blocks)
        self._est_out_rows: Optional[float] = None  # rows per output block
        self._pools: dict[int, list[_Actor]] = {i: [] for i, s in enumerate(stages) if s.kind == "actor"}
        self._stats = ExecutionStats(operators=[OperatorStats(s.name) for s in stages])
        self._pending_actors: dict[ray.ObjectRef, tuple[int, _Actor]] = {}
        for i, handles in (actor_cache or {}).items():
            if i in self._pools:  # persistent workers kept from an earlier epoch, or started ahead
                for h in handles:
                    if isinstance(h, PrestartedActor):  # may still be constructing
                        actor = _Actor(h.handle, h.ready_ref)
                        self._pending_actors[h.ready_ref] = (i, actor)
                        self._stats.operators[i].actors_created += 1
                    else:
                        actor = _Actor(h, None)
                    self._pools[i].append(actor)
                handles.clear()
        self._outputs: deque[OutputBlock] = deque()
        self._ordered: dict[int, OutputBlock] = {}
        self._next_seq = 0
        self._delivered_partitions: set[int] = set()
        self._output_bytes = 0
        self._consumer_bytes = 0
        self._releasing: deque[tuple[float, int]] = deque()
        self._remaining = 0
        self._done = False
        self._budget_checked = False
        self._t0 = 0.0
        self._bars: list[Any] = []
        self._throttle_mark: dict[int, float] = {}
        self._last_progress = time.monotonic()
        self._last_stuck_warning = 0.0

    # ----- consumer side -------------------------------------------------

    def start(self) -> "StreamingExecutor":
        """Plan the epoch, ship the source's shared object and start the loop thread."""
        from sbloader.runtime.session import cluster_cpus

        self._t0 = time.perf_counter()
        cpus = cluster_cpus()
        budget = self._opts.memory_budget
        if budget is None:
            store = ray.cluster_resources().get("object_store_memory", 2 * 2**30)
            budget = int(store * 0.25)
        self._budget = int(budget)
        self._stats.memory_budget = self._budget
        self._slots = [stage_concurrency(s, cpus) if s.kind != "actor" else 0 for s in self._stages]
        self._pool_bounds = {i: self._stages[i].ops[0].pool_bounds(cpus) for i in self._pools}
        parts = {p.id: p for p in self._source.partitions(self._plan.epoch, self._plan.epoch_seed,
                                                          shuffle=self._plan.shuffle)}
        missing = [pid for pid in self._plan.order if pid not in parts]
        if missing:
            raise SbloaderError(f"the epoch plan names partitions the source does not have: {missing[:5]}")
        self._shared_ref = _shared_arg((self._source.reader(), self._source.shared()))
        self._ops_arg = [pack(s.ops) if s.kind != "actor" else None for s in self._stages]
        for seq, pid in enumerate(self._plan.order):
            heapq.heappush(self._queues[0], (seq, next(self._counter), parts[pid]))
        self._remaining = len(self._plan.order)
        self._make_bars()
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
        with self._lock:
            self._consumer.asked(t_wait)
            while True:
                if self._error is not None:
                    raise self._error
                if self._stop:
                    raise ExecutorShutdownError("the execution was shut down; start a new iteration")
                item = self._pop_output()
                if item is not None:
                    self._output_bytes -= item.meta.nbytes
                    self._consumer_bytes += item.meta.nbytes
                    if self._stats.first_block_s is None:
                        self._stats.first_block_s = time.perf_counter() - self._t0
                    now = time.perf_counter()
                    self._stats.stall_s += now - t_wait
                    self._consumer.took(now, item.meta.num_rows)
                    self._lock.notify_all()
                    return item
                if self._done:
                    self._stats.stall_s += time.perf_counter() - t_wait
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no block became ready within {timeout} s")
                self._lock.wait(timeout=0.5 if remaining is None else min(remaining, 0.5))

    def fetch(self, item: OutputBlock) -> Any:
        """The block of a ready item: one ``ray.get``, opened from the shared-memory slot
        when its task wrote it there (its arrays then view the slot, writable: it is
        theirs alone, and it is lent again once they are all gone). Arrays from the
        object store are read-only."""
        try:
            obj = ray.get(item.ref)
        except BaseException:
            self._free_lease(item.lease)
            raise
        if isinstance(obj, SlotBlock):
            self._stats.slot_blocks += 1
            return self._arena.open(obj)
        self._free_lease(item.lease)
        return obj

    def release(self, nbytes: int) -> None:
        """The consumer is done with a block of ``nbytes``: it no longer counts."""
        with self._lock:
            self._consumer_bytes = max(0, self._consumer_bytes - nbytes)
            self._releasing.append((time.monotonic(), nbytes))
            self._lock.notify_all()

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
        if not first:
            return
        with self._lock:  # (a loop thread that outlived the join finds _stop set and returns)
            if self._arena is not None:
                for meta_ref, run in self._inflight.items():  # the small ref: the arena pins no block
                    self._arena.free_when_done(run.lease, meta_ref)
                for out in list(self._outputs) + list(self._ordered.values()):
                    self._arena.free(out.lease)
            # Ready blocks are dropped: a later get_next raises, it never hands one out.
            self._outputs.clear()
            self._ordered.clear()
            self._output_bytes = 0
            self._inflight.clear()
        for i, actors in self._pools.items():
            for a in actors:
                if self._actor_cache is not None:  # kept for the next epoch, even if still starting
                    kept = a.handle if a.ready_ref is None else PrestartedActor(a.handle, a.ready_ref)
                    self._actor_cache.setdefault(i, []).append(kept)
                    continue
                try:
                    ray.kill(a.handle)
                except Exception:
                    pass
            actors.clear()
        self._close_bars()

    @property
    def epoch_seed(self) -> int:
        """The seed of the epoch this execution runs."""
        return self._plan.epoch_seed

    def estimates(self) -> list[Optional[float]]:
        """The current output-size estimate of each stage (bytes per block)."""
        return list(self._est)

    def stats(self) -> ExecutionStats:
        """Statistics so far (final once the iteration ended)."""
        return self._stats

    @property
    def held_bytes(self) -> float:
        """Bytes the pipeline holds or has promised in the object store now."""
        return self._held()

    # ----- loop side ------------------------------------------------------

    def _pop_output(self) -> Optional[OutputBlock]:
        if not self._opts.deterministic:
            return self._outputs.popleft() if self._outputs else None
        while self._next_seq in self._ordered:
            item = self._ordered.pop(self._next_seq)
            self._next_seq += 1
            if item.meta.num_rows > 0:
                return item
            self._output_bytes -= item.meta.nbytes
            self._free_lease(item.lease)
        return None

    def _consumer_ready(self) -> bool:
        """Memory will be freed without a new task: a block awaits the consumer, or frees are pending."""
        self._held()  # expires old releases
        if self._releasing:
            return True
        if self._opts.deterministic:
            return self._next_seq in self._ordered
        return bool(self._outputs)

    def _held(self) -> float:
        running = sum(r.input_bytes + r.est_bytes for r in self._inflight.values())
        horizon = time.monotonic() - _FREE_LAG_S
        while self._releasing and self._releasing[0][0] < horizon:
            self._releasing.popleft()
        freeing = sum(n for _, n in self._releasing)
        return sum(self._queued_bytes) + self._output_bytes + self._consumer_bytes + running + freeing

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stop:
                        return
                    self._scale_pools()
                    self._speculate()
                    self._launch()
                    if self._finished():
                        self._done = True
                        self._stats.wall_s = time.perf_counter() - self._t0
                        self._close_bars()
                        self._lock.notify_all()
                        return
                    waiting = list(self._inflight) + list(self._pending_actors)
                if not waiting:
                    with self._lock:
                        self._lock.wait(timeout=0.05)
                    continue
                ready, _ = ray.wait(waiting, num_returns=1, timeout=0.05)
                if ready:
                    ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0)
                    self._complete(ready)
                    self._last_progress = time.monotonic()
                else:
                    self._maybe_warn_stuck()
        except BaseException as e:  # carried to the consumer
            with self._lock:
                self._error = _unwrap(e)
                self._lock.notify_all()

    def _maybe_warn_stuck(self) -> None:
        now = time.monotonic()
        if now - self._last_progress < _STUCK_WARN_S or now - self._last_stuck_warning < 3 * _STUCK_WARN_S:
            return
        self._last_stuck_warning = now
        available, total = usable_resources(self._opts.exclude_nodes)
        msg = stuck_message(self._waiting_demand(), available, total, now - self._last_progress,
                            excluded=len(self._opts.exclude_nodes))
        if msg:
            self._stats.stuck_warnings += 1
            logger.warning(msg)

    def _waiting_demand(self) -> list[tuple[str, int, dict]]:
        """Per stage with work in flight: its name, the calls in flight, the resources one needs."""
        with self._lock:
            pending = collections.Counter(i for i, _ in self._pending_actors.values())
            out = []
            for i, stage in enumerate(self._stages):
                n = self._stage_inflight[i] + pending.get(i, 0)
                if n:
                    out.append((stage.name, n, resource_demand(stage.ray_options)))
            return out

    def _finished(self) -> bool:
        return (
            self._remaining == 0
            and not any(self._queues)
            and all(self._moot(r) for r in self._inflight.values())
        )

    def _moot(self, run: _Running) -> bool:
        """A source-stage copy of a partition whose other copy already came back."""
        return run.stage == 0 and run.partition_id in self._read_done

    def _speculate(self) -> None:
        """Launch again, one per task, the partitions of read tasks that straggle."""
        now = time.monotonic()
        per = self._est_partition_s or 0.0  # the current estimate: it follows the machine's load
        calls = {id(r.call): r.call for r in self._inflight.values() if r.stage == 0 and len(r.call.items) > 1}
        for call in calls.values():
            limit = max(_SPECULATE_MIN_S, _SPECULATE_FACTOR * per * len(call.items))
            if call.speculated or now - call.started < limit:
                continue
            call.speculated = True
            for seq, part in call.items:
                if part.id not in self._read_done:
                    heapq.heappush(self._queues[0], (seq, next(self._counter), _Solo(part)))
                    self._solo_queued.add(part.id)
                    self._remaining += 1

    def _drop_solo(self, partition_id: int) -> None:
        """A partition came back: its second copy, if still queued, is not launched."""
        if partition_id not in self._solo_queued:
            return
        self._solo_queued.discard(partition_id)
        q = self._queues[0]
        keep = [e for e in q if not (isinstance(e[2], _Solo) and e[2].part.id == partition_id)]
        if len(keep) < len(q):
            self._remaining -= len(q) - len(keep)
            q[:] = keep
            heapq.heapify(q)

    def _stage_view(self, i: int) -> StageView:
        q = self._queues[i]
        if self._stages[i].kind == "actor":
            free = sum(max(0, _ACTOR_SLOTS - a.inflight) for a in self._pools[i] if a.ready_ref is None)
        else:
            free = max(0, self._slots[i] - self._stage_inflight[i])
        est = self._est[i]
        if i == 0 and est is not None:  # the next call's output: one block per partition it reads
            est *= self._group_size()
        return StageView(i, len(q), q[0][0] if q else None, self._stage_inflight[i], free, est)

    def _group_size(self) -> int:
        """Partitions the source stage's next call reads (see :func:`partitions_per_task`).

        One per call for a pool that reads (the drop-in's workers): an actor runs its
        calls one after another, so a call queued behind a straggling one would wait
        for it, and a relaunched straggler would block the actor it lands on. Actor
        calls cost Ray about half what tasks do (no lease), and grouping them showed
        no gain (see docs/architecture.md). One for a partition launched again.
        """
        q = self._queues[0]
        if self._stages[0].kind == "actor" or (q and isinstance(q[0][2], _Solo)):
            return 1
        slots = self._slots[0]
        if self._consumer.row_s is None or self._est_out_rows is None:  # pace unknown: small tasks
            return 1
        return partitions_per_task(self._est_partition_s, len(q), slots, self._est[0], self._call_bytes(slots),
                                   blocks_ahead=self._blocks_ahead(),
                                   consumer_block_s=self._consumer.row_s * self._est_out_rows,
                                   workers=max(1, slots - 1))

    @property
    def consumer_pace(self) -> ConsumerPace:
        """The consumer's pace, which decides whether read tasks take several partitions
        (a loader with a fetch thread sets ``external`` and reports the loop's pace)."""
        return self._consumer

    def _cap_group(self) -> int:
        """The group size the partition time and block size allow, whatever the queue
        and the consumer: what the blocks-ahead cap allows per source slot. It does
        not grow with the dataset or with the blocks already ahead (no ratchet)."""
        if self._stages[0].kind == "actor":
            return 1
        slots = self._slots[0]
        return partitions_per_task(self._est_partition_s, sys.maxsize, 1, self._est[0], self._call_bytes(slots))

    def _call_bytes(self, slots: int) -> float:
        """Most output bytes of one read task: its share of the budget when every slot
        runs one and has one finished behind it, and at most MAX_CALL_BYTES."""
        return min(self._budget / (2 * slots + self._opts.prefetch_blocks), MAX_CALL_BYTES)

    def _launch(self) -> None:
        now = time.perf_counter()
        while True:
            views = [self._stage_view(i) for i in range(len(self._stages))]
            decision = select_stage(views, self._budget, self._held(), self._consumer_ready(),
                                    source_blocked=self._blocks_ahead() >= self._ahead_cap())
            for i in range(len(self._stages)):
                if i in decision.throttled:
                    self._throttle_mark.setdefault(i, now)
                elif i in self._throttle_mark:
                    self._stats.operators[i].throttled_s += now - self._throttle_mark.pop(i)
            if decision.launch is None:
                return
            self._launch_one(decision.launch)

    def _blocks_ahead(self) -> int:
        """Blocks not yet taken by the consumer: in flight, between stages, or ready."""
        ready = len(self._ordered) if self._opts.deterministic else len(self._outputs)
        return len(self._inflight) + sum(len(q) for q in self._queues[1:]) + ready

    def _ahead_cap(self) -> int:
        if self._pools:
            # Not with an actor pool: a pool sized to the CPUs it may use (or left
            # with only those after a node died) would starve the reads it waits for
            # once they are held back; there the memory budget alone bounds it.
            return sys.maxsize
        # the source stage's slots count its calls' blocks (several partitions per task
        # at the partition time's target, see _cap_group); later stages one block per task
        slots = sum(self._slots[i] for i in range(1, len(self._stages)) if i not in self._pools)
        slots += sum(self._pool_bounds[i][1] * _ACTOR_SLOTS for i in self._pools if i > 0)
        return blocks_ahead_cap(self._opts.prefetch_blocks, self._slots[0] * self._cap_group() + slots)

    def _lease(self, i: int) -> Optional[SlotLease]:
        """A shared-memory slot for a block stage ``i`` will make, if it hands blocks to
        the consumer, its block size is known and a slot is free."""
        if self._arena is None or i != len(self._stages) - 1 or not self._est[i]:
            return None
        return self._arena.lease(self._est[i], self._budget)

    def _free_lease(self, lease: Optional[SlotLease]) -> None:
        """The lease's task has finished and nothing will read its slot."""
        if lease is not None and self._arena is not None:
            self._arena.free(lease)

    def _launch_one(self, i: int) -> None:
        stage = self._stages[i]
        if i == 0:  # the source stage: a "read" task stage, or an actor pool that reads
            self._launch_read(i)
            return
        seq, _, out = heapq.heappop(self._queues[i])
        est = self._est[i] or 0.0
        self._queued_bytes[i] -= out.meta.nbytes
        lease = self._lease(i)
        try:
            if stage.kind == "task":
                block_ref, meta_ref = block_stage_task.options(
                    max_retries=self._opts.max_task_retries, **self._placed(stage.ray_options)
                ).remote(out.ref, out.meta, self._ops_arg[i], self._info, lease)
                call = _Call(1)
            else:
                actor = min((a for a in self._pools[i] if a.ready_ref is None), key=lambda a: a.inflight)
                actor.inflight += 1
                block_ref, meta_ref = actor.handle.process.remote(out.ref, out.meta, self._info, lease)
                call = _Call(1, actor)
        except BaseException:  # nothing was launched: the slot was never written
            self._free_lease(lease)
            raise
        self._stage_inflight[i] += 1
        self._inflight[meta_ref] = _Running(i, seq, block_ref, out.meta.nbytes, est, call, out.meta.partition_id,
                                            lease)

    def _launch_read(self, i: int) -> None:
        """One call of the source stage: a task (or a pool actor's call) that reads the
        next few partitions of the plan, each returned as its own block and metadata."""
        stage = self._stages[i]
        q = self._queues[i]
        k = self._group_size()
        items = []
        while q and len(items) < k and not (items and isinstance(q[0][2], _Solo)):
            seq, _, item = heapq.heappop(q)
            if isinstance(item, _Solo):
                self._solo_queued.discard(item.part.id)
                self._stats.speculative_partitions += 1
                item = item.part
            items.append((seq, item))
        seqs = tuple(seq for seq, _ in items)
        parts = tuple(part for _, part in items)
        leases = tuple(self._lease(i) for _ in parts)
        arg = leases if any(lease is not None for lease in leases) else None
        try:
            if stage.kind == "read":
                refs = read_stage_task.options(
                    num_returns=2 * len(parts), max_retries=self._opts.max_task_retries,
                    **self._placed(stage.ray_options)
                ).remote(self._shared_ref, parts, self._ops_arg[i], self._info, seqs, stage.name, arg)
                actor = None
            else:  # an actor pool that reads its partitions itself
                actor = min((a for a in self._pools[i] if a.ready_ref is None), key=lambda a: a.inflight)
                actor.inflight += 1
                refs = actor.handle.read_process.options(num_returns=2 * len(parts)).remote(
                    self._shared_ref, parts, self._info, seqs, stage.name, arg
                )
        except BaseException:  # nothing was launched: the slots were never written
            for lease in leases:
                self._free_lease(lease)
            raise
        call = _Call(len(parts), actor, tuple(items), time.monotonic())
        self._remaining -= len(parts)
        self._stage_inflight[i] += 1
        est = self._est[i] or 0.0
        for j, (seq, part) in enumerate(items):
            self._inflight[refs[2 * j + 1]] = _Running(i, seq, refs[2 * j], 0, est, call, part.id, leases[j])

    def _placed(self, options: dict) -> dict:
        """Ray options with the placement policy's scheduling strategy, if any."""
        return _placed(options, self._opts)

    def _scale_pools(self) -> None:
        now = time.monotonic()
        for i, actors in self._pools.items():
            lo, hi = self._pool_bounds[i]
            ready = [a for a in actors if a.ready_ref is None]
            view = PoolView(
                size=len(actors),
                pending=len(actors) - len(ready),
                min_size=lo,
                max_size=hi,
                queued=len(self._queues[i]),
                free_slots=sum(max(0, _ACTOR_SLOTS - a.inflight) for a in ready),
                idle_actors=sum(1 for a in ready if a.inflight == 0 and now - a.idle_since > _IDLE_TIMEOUT_S),
            )
            budget_ok = self._held() + (self._est[i] or 0.0) <= self._budget
            delta = pool_delta(view, budget_ok)
            stage = self._stages[i]
            for _ in range(max(0, delta)):
                index = self._stats.operators[i].actors_created
                handle = _new_pool_actor(stage, index, hi, self._opts)
                actor = _Actor(handle, handle.ready.remote())
                actors.append(actor)
                self._pending_actors[actor.ready_ref] = (i, actor)
                self._stats.operators[i].actors_created += 1
            if delta < 0:
                idle = [a for a in ready if a.inflight == 0 and now - a.idle_since > _IDLE_TIMEOUT_S]
                victim = idle[0]
                actors.remove(victim)
                ray.kill(victim.handle)

    def _complete(self, ready: list) -> None:
        metas_refs = [r for r in ready if r in self._inflight]
        actor_refs = [r for r in ready if r in self._pending_actors]
        if actor_refs:
            ray.get(actor_refs)  # raises the constructor's error, if any
        try:
            metas = ray.get(metas_refs) if metas_refs else []
        except Exception:
            metas = self._sort_failures(metas_refs)
        with self._lock:
            if self._stop:  # shut down meanwhile: shutdown() took over the runs and their slots
                return
            for r in actor_refs:
                i, actor = self._pending_actors.pop(r)
                self._stats.operators[i].actors_ready += 1
                actor.ready_ref = None
                actor.idle_since = time.monotonic()
            for ref, meta in zip(metas_refs, metas):
                run = self._inflight.pop(ref)
                if meta is None:  # a failed copy of a partition another copy still covers
                    self._free_lease(run.lease)
                    self._free_slot(run)
                    self._stats.failed_copies += 1
                    continue
                self._on_done(run, meta)
            self._lock.notify_all()

    def _sort_failures(self, refs: list) -> list:
        """After a failed batch ``ray.get``: each ref's metadata, or None for a failed
        copy of a partition that another copy delivered or may still deliver (a
        speculated partition). Any other failure is raised."""
        metas = []
        for r in refs:
            try:
                metas.append(ray.get(r))
            except Exception as e:
                run = self._inflight[r]
                # The failed task's block ref holds the same error; fetch it so Ray does
                # not also print it as an "unhandled error" when the ref is dropped.
                try:
                    ray.get(run.block_ref, timeout=0)
                except Exception:
                    pass
                if not self._other_copy(run):
                    raise self._lost(run, e) if _unwrap(e) is e else e
                metas.append(None)
        return metas

    def _lost(self, run: _Running, e: BaseException) -> BaseException:
        """A task's failure outside the user's functions, as a :class:`TaskLostError`
        naming the call's partitions (Ray's own error names none)."""
        parts = [part for _, part in run.call.items]
        ids = tuple(p.id for p in parts) or (run.partition_id,)
        labels = tuple(p.label for p in parts)
        first = (str(e).strip().splitlines() or [""])[0]
        cause = f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__
        err = TaskLostError(self._stages[run.stage].name, self._plan.epoch, ids, labels, cause)
        err.__cause__ = e
        return err

    def _other_copy(self, run: _Running) -> bool:
        """Another copy of this source-stage partition came back, is queued or runs."""
        if run.stage != 0:
            return False
        pid = run.partition_id
        if pid in self._read_done or pid in self._solo_queued:
            return True
        return any(o is not run and o.stage == 0 and o.partition_id == pid for o in self._inflight.values())

    def _free_slot(self, run: _Running) -> None:
        """One of the call's partitions came back: on its last, the call's slot is free."""
        run.call.left -= 1
        if run.call.left == 0:
            self._stage_inflight[run.stage] -= 1
            self._stats.operators[run.stage].tasks += 1
            if run.call.actor is not None:
                run.call.actor.inflight -= 1
                run.call.actor.idle_since = time.monotonic()

    def _on_done(self, run: _Running, meta: BlockMeta) -> None:
        i = run.stage
        st = self._stats.operators[i]
        self._free_slot(run)
        lease = run.lease
        if lease is not None and meta.node_id != lease.node_id:  # made elsewhere: the slot holds nothing
            self._free_lease(lease)
            lease = None
        if i == 0:
            if meta.partition_id in self._read_done:  # the other copy of a speculated partition won
                self._stats.duplicates_dropped += 1
                self._free_lease(lease)
                return
            self._read_done.add(meta.partition_id)
            self._drop_solo(meta.partition_id)
        st.rows += meta.num_rows
        st.blocks += 1
        st.bytes += meta.nbytes
        st.task_s += meta.task_s
        st.skipped += meta.skipped
        n = st.blocks
        self._est[i] = _toward(self._est[i], meta.nbytes, 1 / n)
        if i == 0:
            self._est_partition_s = _toward(self._est_partition_s, meta.task_s, 1 / n)
        if self._bars:
            self._bars[i].update(meta.num_rows)
        out = OutputBlock(run.block_ref, meta, lease)
        if i + 1 < len(self._stages):
            heapq.heappush(self._queues[i + 1], (run.seq, next(self._counter), out))
            self._queued_bytes[i + 1] += meta.nbytes
        else:
            if meta.partition_id in self._delivered_partitions:
                self._stats.duplicates_dropped += 1
                self._free_lease(lease)
                return
            self._delivered_partitions.add(meta.partition_id)
            self._est_out_rows = _toward(self._est_out_rows, meta.num_rows, 0.25)
            self._output_bytes += meta.nbytes
            if self._opts.deterministic:
                self._ordered[run.seq] = out
            elif meta.num_rows > 0:
                self._outputs.append(out)
            else:
                self._output_bytes -= meta.nbytes
                self._free_lease(lease)
            self._check_budget()
        held = int(self._held())
        if held > self._stats.peak_held_bytes:
            self._stats.peak_held_bytes = held

    def _check_budget(self) -> None:
        if self._budget_checked or any(e is None for e in self._est):
            return
        self._budget_checked = True
        need = min_budget_bytes([e or 0.0 for e in self._est], self._est[-1] or 0.0, self._opts.prefetch_blocks)
        if need > self._budget:
            raise MemoryBudgetError(
                f"memory_budget={self._budget} bytes cannot hold one block per stage "
                f"({[int(e or 0) for e in self._est]} bytes) plus prefetch_blocks={self._opts.prefetch_blocks} "
                f"output blocks of ~{int(self._est[-1] or 0)} bytes: need at least {need} bytes. "
                f"Raise memory_budget, lower the prefetch, or use smaller partitions."
            )

    def _make_bars(self) -> None:
        show = self._opts.progress if self._opts.progress is not None else sys.stderr.isatty()
        if not show:
            return
        from tqdm.auto import tqdm

        # the first stage counts its output rows: the source's count is its total
        # unless a fused filter/flat_map changes the number of rows
        keeps_rows = not any(op.kind in ("filter", "flat_map") for op in self._stages[0].ops)
        total = self._source.num_rows() if keeps_rows else None
        self._bars = [
            tqdm(total=total if i == 0 else None, desc=s.name[:30], unit="row", position=i, leave=False)
            for i, s in enumerate(self._stages)
        ]

    def _close_bars(self) -> None:
        for b in self._bars:
            b.close()
        self._bars = []


_INLINE_ARG_BYTES = 64 * 1024


def _shared_arg(payload: Any) -> Any:
    """The read tasks' shared argument: by value when small, else one object in the store.

    By value matters for placement: a task whose argument lives in the trainer
    node's object store can be leased there by Ray's locality-aware scheduling
    despite a node-label constraint.
    """
    packed = pack(payload)  # pickled once here, not once per task
    if isinstance(packed, Packed):
        return packed if len(packed.data) <= _INLINE_ARG_BYTES else ray.put(payload)
    import ray.cloudpickle as cloudpickle

    try:  # it holds Ray handles: by value through Ray's serialisation when small
        if len(cloudpickle.dumps(payload)) <= _INLINE_ARG_BYTES:
            return payload
    except Exception:  # not picklable by value here: let Ray's own serialisation say why
        pass
    return ray.put(payload)


def resource_demand(ray_options: dict) -> dict:
    """The Ray resources one task or actor of a stage asks for (CPU 1 unless set)."""
    need = {"CPU": float(ray_options.get("num_cpus", 1) or 0)}
    if ray_options.get("num_gpus"):
        need["GPU"] = float(ray_options["num_gpus"])
    need.update({k: float(v) for k, v in (ray_options.get("resources") or {}).items()})
    return {k: v for k, v in need.items() if v > 0}


def stuck_message(demand: list, available: dict, total: dict, silent_s: float, excluded: int = 0) -> Optional[str]:
    """The warning for a pipeline that made no progress for ``silent_s`` seconds, or None.

    Only when some waiting stage needs a resource the nodes it may use do not have
    free (``available``/``total`` count those nodes; ``excluded`` nodes, the
    trainer's, are left out): slow tasks that hold the CPUs they asked for are not
    reported.
    """
    short = []
    for name, n, need in demand:
        lacking = {k: v for k, v in need.items() if available.get(k, 0.0) + 1e-9 < v}
        if lacking:
            want = ", ".join(f"{k}={v:g}" for k, v in need.items())
            have = ", ".join(f"{k} {available.get(k, 0.0):g} of {total.get(k, 0.0):g}" for k in lacking)
            short.append(f"{name} ({n} call(s) waiting, each needs {want}; free: {have})")
    if not short:
        return None
    where = (f" on the nodes it may use ({excluded} trainer node(s) left out; allow_trainer_node=True "
             "lets tasks run there too)") if excluded else ""
    return (
        f"sbloader: no task finished for {silent_s:.0f} s and the pipeline waits for resources{where}: "
        + "; ".join(short)
        + ". Something else holds them: another loader's persistent workers (delete that loader or use "
        "persistent_workers=False), actors of another job, or a pool larger than the cluster. Lower "
        "num_workers / worker_num_cpus / concurrency, or give Ray more CPUs (sbloader.init(num_cpus=...))."
    )


def _unwrap(e: BaseException) -> BaseException:
    """The sbloader error inside a Ray task error, else the error itself."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, SbloaderError):
        return cause
    return e
