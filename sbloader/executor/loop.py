"""The scheduling loop of one execution: what its background thread does.

State: waiting inputs per stage (by plan position), calls in flight, actor pools
(:mod:`~sbloader.executor.pools`), ready outputs and bytes held (``outputs``, ``budget``).
Each step scales the pools, relaunches straggling reads (``stragglers``), and asks the pure
policy (:mod:`~sbloader.executor.policy`) which stage to feed next under the memory budget.
Finished calls are collected with ``ray.wait`` on their small metadata refs: block bytes
never pass through this process.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import sys
import time
from dataclasses import replace
from typing import Optional

import ray

from sbloader.core.block import BlockMeta
from sbloader.core.context import merge_counters
from sbloader.core.errors import ResourceError, SbloaderError
from sbloader.core.plan import EpochPlan
from sbloader.core.stats import ExecutionStats, OperatorStats
from sbloader.executor.budget import MemoryBudget, default_budget
from sbloader.executor.calls import Call, Running, Solo
from sbloader.executor.diagnostics import ProgressBars, StuckWatch, resource_demand
from sbloader.executor.failures import Rerun, shared_arg, sort_failures
from sbloader.executor.handoff import SlotArena
from sbloader.executor.slot_store import SlotLease
from sbloader.executor.launcher import Launcher
from sbloader.executor.options import ExecutionOptions, OutputBlock
from sbloader.executor.outputs import Outputs
from sbloader.executor.pace import ConsumerPace
from sbloader.executor.policy import StageView, blocks_ahead_cap, select_stage
from sbloader.executor.pools import ActorPools, constructed_info
from sbloader.executor.reruns import Reruns
from sbloader.executor.reservations import StageNeeds, pool_limit, shortfall
from sbloader.executor.sizing import Sizing
from sbloader.executor.stages import Stage, stage_concurrency
from sbloader.executor.stragglers import Stragglers
from sbloader.executor.tasks import EpochInfo
from sbloader.sources.base import Source

logger = logging.getLogger(__name__)

WAIT_ENV = "SBLOADER_WAIT_FOR_RESOURCES"  # 1: a cluster too small for the pipeline is waited for, not refused


class Scheduler:
    """The state and the steps of one execution's scheduling loop (the caller holds the lock).

    Args:
        source: the dataset's source.
        stages: physical stages (first is the read stage).
        plan: the epoch plan.
        options: budget, order, placement and progress.
        pace: the consumer's pace.
        actor_cache: pool actors kept from an earlier execution or started ahead; at the
            end they go back there.
        estimates: an earlier execution's output block sizes per stage.
        arena: the consumer's shared-memory slots (None: blocks go through the object store).
    """

    def __init__(self, source: Source, stages: list[Stage], plan: EpochPlan, options: ExecutionOptions,
                 pace: ConsumerPace, actor_cache: Optional[dict], estimates: Optional[list],
                 arena: Optional[SlotArena]) -> None:
        from sbloader.runtime.session import cluster_cpus

        self._stages, self._plan, self._opts, self._arena = stages, plan, options, arena
        self._counter = itertools.count()
        self.queues: list[list] = [[] for _ in stages]
        self.inflight: dict[ray.ObjectRef, Running] = {}
        self._stage_inflight = [0] * len(stages)
        self.stragglers = Stragglers()
        self.sizing = Sizing(len(stages), estimates, pace)
        self.est = self.sizing.block_bytes  # output bytes per block, per stage
        self.stats = ExecutionStats(operators=[OperatorStats(s.name) for s in stages])
        self.reruns = Reruns(plan.epoch, self.stats)
        self.outputs = Outputs(options.deterministic, dropped=self.drop_output)
        self.watch = StuckWatch(options.exclude_nodes)
        self._throttle_mark: dict[int, float] = {}
        cpus = cluster_cpus()
        budget = options.memory_budget
        if budget is None:
            budget = default_budget()
        self.budget = MemoryBudget(budget, len(stages))
        self.stats.memory_budget = self.budget.budget
        self._slots = [stage_concurrency(s, cpus) if s.kind != "actor" else 0 for s in stages]
        self.pools = ActorPools(stages, pool_bounds(stages, options.exclude_nodes), options, self.stats.operators,
                                actor_cache)
        self.parts = parts = {p.id: p for p in source.partitions(plan.epoch, plan.epoch_seed, shuffle=plan.shuffle)}
        missing = [pid for pid in plan.order if pid not in parts]
        if missing:
            raise SbloaderError(f"the epoch plan names partitions the source does not have: {missing[:5]}")
        self.launcher = Launcher(stages, options, EpochInfo(plan.epoch, plan.epoch_seed, plan.shuffle),
                                  shared_arg((source.reader(), source.shared())), self.pools)
        for seq, pid in enumerate(plan.order):
            heapq.heappush(self.queues[0], (seq, next(self._counter), parts[pid]))
        self.remaining = len(plan.order)
        self.bars = ProgressBars(stages, source.num_rows(), options.progress)

    def step(self) -> None:
        """Scale the pools, launch again the partitions of straggling read calls, launch work."""
        if self.reruns.watch_nodes(self.pools):  # a node joined: the task stages may keep more in flight
            from sbloader.runtime.session import cluster_cpus

            self._slots = [max(n, stage_concurrency(s, cluster_cpus())) if s.kind != "actor" else 0
                           for n, s in zip(self._slots, self._stages)]
        queued = {i: len(self.queues[i]) for i in self.pools.pools}
        ok = {i: self.held() + (self.est[i] or 0.0) <= self.budget.budget for i in queued}
        self.pools.scale(queued, ok, {i: self._upstream_active(i) for i in queued})
        calls = {id(r.call): r.call for r in self.inflight.values() if r.stage == 0 and len(r.call.items) > 1}
        self.stragglers.speculate(calls.values(), self.sizing.partition_s or 0.0, self.requeue)
        self.launch()

    def _upstream_active(self, i: int) -> bool:
        """Input that will reach stage ``i`` is still coming: partitions to read, or work queued
        or running in a stage before it."""
        return i > 0 and (self.remaining > 0 or any(self.queues[j] for j in range(1, i))
                          or any(self._stage_inflight[j] for j in range(i)))

    def waiting(self) -> list:
        """The refs the loop waits on: calls' metadata and actors' constructors."""
        return list(self.inflight) + list(self.pools.pending)

    def held(self) -> float:
        return self.budget.held(sum(r.input_bytes + r.est_bytes for r in self.inflight.values()))

    def drop_output(self, item: OutputBlock) -> None:
        self.budget.output -= item.meta.nbytes
        self.free_lease(item.lease)

    def requeue(self, seq: int, solo: Solo) -> None:
        heapq.heappush(self.queues[0], (seq, next(self._counter), solo))
        self.remaining += 1

    def waiting_demand(self) -> list[tuple[str, int, dict]]:
        """Per stage with work in flight: its name, the calls in flight, the resources one needs."""
        pending = self.pools.pending_per_stage()
        return [(s.name, n, resource_demand(s.ray_options)) for i, s in enumerate(self._stages)
                if (n := self._stage_inflight[i] + pending.get(i, 0))]

    def finished(self) -> bool:
        return (self.remaining == 0 and not any(self.queues)
                and all(self.stragglers.moot(r) for r in self.inflight.values()))

    def _stage_view(self, i: int) -> StageView:
        q = self.queues[i]
        if self._stages[i].kind == "actor":
            free = self.pools.free_slots(i)
        else:
            free = max(0, self._slots[i] - self._stage_inflight[i])
        first = i == 0 and self._opts.first_call_alone and not self.stats.operators[0].blocks
        est = None if first else self.est[i]  # None: one call at a time (ExecutionOptions.first_call_alone)
        if i == 0 and est is not None:  # the next call's output: one block per partition it reads
            est *= self._group_size()
        return StageView(i, len(q), q[0][0] if q else None, self._stage_inflight[i], free, est)

    def _group_size(self) -> int:
        """Partitions the source stage's next call reads (:meth:`Sizing.group`).

        One per call for a pool that reads (the drop-in's workers): an actor runs its
        calls one after another, so a call queued behind a straggling one would wait
        for it, and a relaunched straggler would block the actor it lands on. Actor
        calls cost Ray about half what tasks do (no lease), and grouping them showed
        no gain (see docs/architecture.md). One for a partition launched again.
        """
        q = self.queues[0]
        if self._stages[0].kind == "actor" or (q and isinstance(q[0][2], Solo)):
            return 1
        slots = self._slots[0]
        return self.sizing.group(len(q), slots, self._call_bytes(slots), self._blocks_ahead())

    def _call_bytes(self, slots: int) -> float:
        return Sizing.call_bytes(self.budget.budget, slots, self._opts.prefetch_blocks)

    def launch(self) -> None:
        now = time.perf_counter()
        while True:
            views = [self._stage_view(i) for i in range(len(self._stages))]
            consumer_ready = self.budget.freeing() or self.outputs.ready()
            decision = select_stage(views, self.budget.budget, self.held(), consumer_ready,
                                    source_blocked=self._blocks_ahead() >= self._ahead_cap())
            for i in range(len(self._stages)):
                if i in decision.throttled:
                    self._throttle_mark.setdefault(i, now)
                elif i in self._throttle_mark:
                    self.stats.operators[i].throttled_s += now - self._throttle_mark.pop(i)
            if decision.launch is None:
                return
            if decision.launch == 0:  # the source stage: a "read" task stage, or an actor pool that reads
                self._launch_read()
            else:
                self._launch_block(decision.launch)

    def _blocks_ahead(self) -> int:
        """Blocks not yet taken by the consumer: in flight, between stages, or ready."""
        return len(self.inflight) + sum(len(q) for q in self.queues[1:]) + self.outputs.waiting()

    def _ahead_cap(self) -> int:
        if self.pools.pools:
            # Not with an actor pool: a pool sized to the CPUs it may use (or left with only
            # those after a node died) would starve the reads it waits for once they are held
            # back; there the memory budget alone bounds it.
            return sys.maxsize
        # the source stage's slots count its calls' blocks (several partitions per task at the
        # partition time's target, Sizing.cap_group); later stages one block per task
        slots = sum(self._slots[1:])
        group = 1 if self._stages[0].kind == "actor" else self.sizing.cap_group(self._call_bytes(self._slots[0]))
        return blocks_ahead_cap(self._opts.prefetch_blocks, self._slots[0] * group + slots)

    def _lease(self, i: int) -> Optional[SlotLease]:
        """A shared-memory slot for a block stage ``i`` will make, if it hands blocks to the
        consumer, its block size is known and a slot is free."""
        if self._arena is None or i != len(self._stages) - 1 or not self.est[i]:
            return None
        return self._arena.lease(self.est[i], self.budget.budget)

    def free_lease(self, lease: Optional[SlotLease]) -> None:
        """The lease's task has finished and nothing will read its slot."""
        if lease is not None and self._arena is not None:
            self._arena.free(lease)

    def _launch_block(self, i: int) -> None:
        """One call of stage ``i`` (after the source) on the next block waiting for it."""
        seq, _, out = heapq.heappop(self.queues[i])
        self.budget.queued[i] -= out.meta.nbytes
        lease = self._lease(i)
        try:
            block_ref, meta_ref, actor = self.launcher.block(i, out.ref, out.meta, lease)
        except BaseException:  # nothing was launched: the slot was never written
            self.free_lease(lease)
            raise
        call = Call(1, actor, started=time.monotonic())
        self._stage_inflight[i] += 1
        self.inflight[meta_ref] = Running(i, seq, block_ref, out.meta.nbytes, self.est[i] or 0.0, call,
                                           out.meta.partition_id, lease, out)

    def _launch_read(self) -> None:
        """One call of the source stage: a task (or a pool actor's call) that reads the next few
        partitions of the plan, each returned as its own block and metadata."""
        q = self.queues[0]
        k = self._group_size()
        items = []
        while q and len(items) < k and not (items and isinstance(q[0][2], Solo)):
            seq, _, item = heapq.heappop(q)
            if isinstance(item, Solo):
                self.stragglers.queued_again.discard(item.part.id)
                self.stats.speculative_partitions += 1
                item = item.part
            items.append((seq, item))
        seqs, parts = tuple(seq for seq, _ in items), tuple(part for _, part in items)
        leases = tuple(self._lease(0) for _ in parts)
        arg = leases if any(lease is not None for lease in leases) else None
        try:
            refs, actor = self.launcher.read(parts, seqs, arg)
        except BaseException:  # nothing was launched: the slots were never written
            for lease in leases:
                self.free_lease(lease)
            raise
        call = Call(len(parts), actor, tuple(items), time.monotonic())
        self.remaining -= len(parts)
        self._stage_inflight[0] += 1
        for j, (seq, part) in enumerate(items):
            self.inflight[refs[2 * j + 1]] = Running(0, seq, refs[2 * j], 0, self.est[0] or 0.0, call, part.id,
                                                      leases[j])

    def collect(self, ready: list) -> tuple[list, list, list]:
        """(Outside the lock) The metadata of the finished calls among ``ready``:
        ``(actor refs, metadata refs, their metadata or None for a failed duplicate)``."""
        metas_refs = [r for r in ready if r in self.inflight]
        actors = [(r, constructed_info(r)) for r in ready if r in self.pools.pending]
        try:
            metas = ray.get(metas_refs) if metas_refs else []
        except Exception:
            metas = self._sort_failures(metas_refs)
        return actors, metas_refs, metas

    def apply(self, actors: list, metas_refs: list, metas: list) -> None:
        """(Under the lock) Record what :meth:`collect` found."""
        for r, info in actors:
            self.pools.constructed(r, info)
        for ref, meta in zip(metas_refs, metas):
            run = self.inflight.pop(ref)
            if isinstance(meta, Rerun):
                self._rerun(run, meta.error)
                continue
            if meta is None:  # a failed copy of a partition another copy still covers
                self.free_lease(run.lease)
                self._free_slot(run)
                self.stats.failed_copies += 1
                continue
            self._on_done(run, meta)

    def _sort_failures(self, refs: list) -> list:
        return sort_failures(refs, self.inflight, lambda run: self.stragglers.other_copy(run, self.inflight.values()),
                             [s.name for s in self._stages], self._plan.epoch)

    def _rerun(self, run: Running, error: BaseException) -> None:
        """The system lost this call (its actor or node): its partition, or its input block, is
        queued again; a lost pool actor leaves its pool, which regrows on the other nodes."""
        self.free_lease(run.lease)
        self._free_slot(run)
        node = self.pools.lose(run.call.actor) if run.call.actor is not None else None
        self.reruns.record(run, error, self._stages[run.stage].name, node)
        if run.stage == 0:
            part = next(p for seq, p in run.call.items if p.id == run.partition_id)
            heapq.heappush(self.queues[0], (run.seq, next(self._counter), part))
            self.remaining += 1
        else:
            heapq.heappush(self.queues[run.stage], (run.seq, next(self._counter), run.source))
            self.budget.queued[run.stage] += run.source.meta.nbytes

    def _free_slot(self, run: Running, task_s: float = 0.0) -> None:
        """One of the call's partitions came back: on its last, the call's slot is free (a
        task's time not spent running, Ray's scheduling queue, counts as waiting for resources)."""
        run.call.left -= 1
        run.call.task_s += task_s
        if run.call.left == 0:
            self._stage_inflight[run.stage] -= 1
            st = self.stats.operators[run.stage]
            st.tasks += 1
            if run.call.actor is None and run.call.started:
                st.resource_wait_s += max(0.0, time.monotonic() - run.call.started - run.call.task_s)
            if run.call.actor is not None:
                run.call.actor.inflight -= 1
                run.call.actor.idle_since = time.monotonic()

    def _on_done(self, run: Running, meta: BlockMeta) -> None:
        i = run.stage
        self._free_slot(run, meta.task_s)
        lease = run.lease
        if lease is not None and meta.node_id != lease.node_id:  # made elsewhere: the slot holds nothing
            self.free_lease(lease)
            lease = None
        last = i + 1 == len(self._stages)
        duplicate = (meta.partition_id in self.stragglers.done if i == 0 else False) or \
            (last and self.outputs.delivered(meta.partition_id))
        if duplicate:  # the other copy of a speculated partition won
            self.stats.duplicates_dropped += 1
            self.free_lease(lease)
            return
        if i == 0:
            self.remaining -= self.stragglers.came_back(meta.partition_id, self.queues[0])
        st = self.stats.operators[i]
        st.rows, st.blocks, st.bytes = st.rows + meta.num_rows, st.blocks + 1, st.bytes + meta.nbytes
        st.task_s += meta.task_s
        st.skipped += meta.skipped
        merge_counters(st.counters, meta.counters)
        if meta.counters:
            self.bars.show_bytes(i, st.counters)
        st.full_decodes += meta.full_decodes
        self.sizing.observe(i, meta, st.blocks, last)
        self.bars.update(i, meta.num_rows)
        out = OutputBlock(run.block_ref, meta, lease)
        if not last:
            heapq.heappush(self.queues[i + 1], (run.seq, next(self._counter), out))
            self.budget.queued[i + 1] += meta.nbytes
        else:
            if self.outputs.add(run.seq, out):
                self.budget.output += meta.nbytes
            else:
                self.free_lease(lease)
            self.budget.check(self.est, self._opts.prefetch_blocks)
        self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, int(self.held()))


def pool_bounds(stages: list[Stage], exclude_nodes: tuple) -> dict[int, tuple[int, int]]:
    """Each actor pool's ``(min, limit)``: the limit its maximum, or the room the other stages'
    reservations leave on the nodes the pipeline may use (:mod:`~sbloader.executor.reservations`).

    Raises:
        ResourceError: the nodes cannot hold one task of every task stage and one actor of
            every pool at once: some stage could never run. On a cluster whose autoscaler
            adds nodes on demand, :data:`WAIT_ENV` set to 1 makes it a warning: the
            pipeline waits for the nodes (the stuck watch warns while it does).
    """
    from sbloader.runtime.placement import usable_resources

    needs = []
    for s in stages:
        lo, hi = s.actor_op.pool_range() if s.kind == "actor" else (1, None)
        needs.append(StageNeeds(s.name, s.kind == "actor", resource_demand(s.ray_options), lo, hi))
    _, total = usable_resources(exclude_nodes)
    fatal = shortfall([replace(n, min_actors=1) for n in needs], total)
    if fatal:
        if os.environ.get(WAIT_ENV) == "1":
            logger.warning("sbloader: %s; waiting for nodes that have them (%s=1)", fatal, WAIT_ENV)
        else:
            raise ResourceError(f"{fatal}. On a cluster whose autoscaler adds such nodes on demand, set {WAIT_ENV}=1 "
                                "to wait for them instead")
    short = shortfall(needs, total)
    if short:  # every stage can run, but a pool cannot start its whole minimum
        logger.warning("sbloader: %s; the pools start the actors the room holds", short)
    return {i: (n.min_actors, pool_limit(needs, total, i)) for i, n in enumerate(needs) if n.actor}
