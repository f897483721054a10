"""The actor pools of an execution: one per callable-class stage (``map_batches(Class)``).

A pool starts its minimum of actors and grows by one while inputs wait and no call
slot is free (and the memory budget allows more work), up to its limit: its
``concurrency`` maximum, or the room the other stages' reservations leave
(:mod:`~sbloader.executor.reservations`), so it never takes the resources the stages
that feed it need. It retires an actor only when nothing upstream will feed it again
and the actor has been idle for longer than building one took (the decisions:
:func:`~sbloader.executor.policy.pool_delta`). Each actor runs up to
:data:`ACTOR_SLOTS` calls (one running, one queued behind it). At the end of an
execution the actors are killed, or left in the caller's actor cache for the next
(``persistent_workers``); actors started ahead of an epoch (:func:`prestart_pools`)
are adopted from that cache while they may still be constructing.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import ray

from sbloader.core.errors import missing_module, workers_path_hint
from sbloader.core.stats import OperatorStats
from sbloader.executor.options import ExecutionOptions
from sbloader.executor.policy import PoolView, pool_delta
from sbloader.executor.reservations import idle_limit_s
from sbloader.executor.stages import Stage, build_stages
from sbloader.executor.tasks import MapActor

ACTOR_SLOTS = 2  # calls in flight per actor: one running, one queued behind it
_NODES: dict[str, str] = {}  # actor id -> its node, for actors kept in an actor cache across executions


def _actor_key(handle: Any) -> str:
    return handle._actor_id.hex()
IDLE_TIMEOUT_S = 5.0  # the least an actor sits idle before it may be retired


@dataclass(frozen=True)
class PrestartedActor:
    """A pool actor started before its epoch's executor (see :func:`prestart_pools`).

    Attributes:
        handle: the actor.
        ready_ref: resolves once its callable class is constructed.
        counted: an earlier execution launched it (and counted it in its stats); it was
            still starting when that execution ended.
    """

    handle: Any
    ready_ref: ray.ObjectRef
    counted: bool = False


@dataclass
class PoolActor:
    """An actor of a pool: its handle, its constructor's ref while it starts, its calls in flight."""

    handle: Any
    ready_ref: Optional[ray.ObjectRef]
    inflight: int = 0
    idle_since: float = field(default_factory=time.monotonic)
    launched: float = field(default_factory=time.monotonic)
    node: Optional[str] = None  # its node, once constructed

    @property
    def ready(self) -> bool:
        """Its callable class is constructed."""
        return self.ready_ref is None


def kill_cached(actor_cache: Optional[dict]) -> None:
    """Kill every actor kept in an actor cache (handles or :class:`PrestartedActor`) and empty it
    (nothing to kill once Ray is down: a loader collected at exit must not start Ray again)."""
    if not ray.is_initialized():
        for handles in (actor_cache or {}).values():
            handles.clear()
        return
    doomed = []
    for handles in (actor_cache or {}).values():
        doomed += [h.handle if isinstance(h, PrestartedActor) else h for h in handles]
        handles.clear()
    if doomed:  # on a thread of their own: Ray 2.60's kill_actor can wait for good (seen in a loop's epoch end)
        threading.Thread(target=_kill, args=(doomed,), name="sbloader-actor-kill", daemon=True).start()


def _kill(handles: list) -> None:
    for h in handles:
        try:
            ray.kill(h)
        except Exception:  # already dead, or Ray is shutting down
            pass


def new_pool_actor(stage: Stage, index: int, pool_size: int, opts: ExecutionOptions) -> Any:
    """Create one actor of an actor stage's pool (its constructor runs in the background)."""
    # No restart by Ray: a lost actor leaves its pool, which builds another where there is room
    # (ActorPools.lose), and its calls run again from provenance. A restart by Ray would wait for
    # CPUs beside that replacement, and Ray's reconstruction of the blocks it made would wait for
    # the restart (a rank then hung on its batch); without one, a lost block fails at once and is
    # made again (SplitCoordinator.remake).
    return MapActor.options(
        max_restarts=0,
        max_task_retries=opts.max_task_retries,
        **opts.placed(stage.ray_options),
    ).remote(stage.actor_op, index, pool_size, stage.ops[:-1])


def prestart_pools(source_name: str, ops: Sequence[Any], options: ExecutionOptions,
                   actor_cache: dict[int, list]) -> int:
    """Start the minimum number of actors of each actor pool of a pipeline ahead of its epoch.

    They go into ``actor_cache`` (as :class:`PrestartedActor`), where the epoch's executor
    adopts them: the actors' process start and the callable class's construction (for
    the drop-in loader: importing torch and unpickling the dataset, about a second each)
    overlap with whatever comes before the epoch starts. A pool that already has cached
    actors is left alone.

    Returns:
        The number of actors started.
    """
    from sbloader.runtime.session import cluster_cpus

    stages = build_stages(source_name, list(ops))
    started = 0
    for i, stage in enumerate(stages):
        if stage.kind != "actor" or actor_cache.get(i):
            continue
        lo, hi = stage.actor_op.pool_range()
        for index in range(lo):
            handle = new_pool_actor(stage, index, hi or int(cluster_cpus()), options)
            actor_cache.setdefault(i, []).append(PrestartedActor(handle, handle.ready.remote()))
            started += 1
    return started


def constructed_info(ref: ray.ObjectRef) -> Optional[tuple]:
    """An actor's ``ready()``: ``(node, pid, construction seconds)``, or None when the actor died
    or became unreachable for a reason of its own (a lost worker or node); its constructor's
    error is raised."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as e:  # ActorDiedError, ActorUnavailableError
        if getattr(e, "actor_init_failed", False):
            module = missing_module(e)
            if module:  # the dataset (or a stage's class) pickled by name from a module the worker cannot find
                raise ModuleNotFoundError(f"a pool actor of this loader cannot import module {module!r}. "
                                          f"{workers_path_hint()}", name=module) from e
            raise
        return None


class ActorPools:
    """Every actor pool of one execution.

    Args:
        stages: the execution's stages (the actor stages get a pool).
        bounds: per actor stage index, its pool's ``(min, limit)`` actors.
        options: the execution's options (placement, retries).
        stats: the execution's per-stage counters.
        actor_cache: actors kept from an earlier execution or started ahead, adopted
            here; at the end the pools' actors go back there (None: they are killed).
    """

    def __init__(self, stages: Sequence[Stage], bounds: dict[int, tuple[int, int]], options: ExecutionOptions,
                 stats: Sequence[OperatorStats], actor_cache: Optional[dict] = None) -> None:
        self._stages, self._bounds, self._opts, self._stats = stages, bounds, options, stats
        self._cache = actor_cache
        self.pools: dict[int, list[PoolActor]] = {i: [] for i in bounds}
        self.pending: dict[ray.ObjectRef, tuple[int, PoolActor]] = {}  # constructor ref -> actor
        self._built = {i: 0 for i in bounds}  # actors launched in this execution
        self._lost = {i: 0 for i in bounds}
        for i, (_, limit) in bounds.items():
            stats[i].pool_limit = limit
        for i, handles in (actor_cache or {}).items():
            if i not in self.pools:
                continue
            for h in handles:  # persistent workers kept from an earlier epoch, or started ahead
                if isinstance(h, PrestartedActor):  # may still be constructing
                    actor = PoolActor(h.handle, h.ready_ref)
                    self.pending[h.ready_ref] = (i, actor)
                    if not h.counted:
                        stats[i].actors_created += 1
                else:
                    actor = PoolActor(h, None, node=_NODES.get(_actor_key(h)))  # its node, if this process saw it
                self.pools[i].append(actor)
            handles.clear()

    def free_slots(self, i: int) -> int:
        """Calls the ready actors of pool ``i`` can take now."""
        return sum(max(0, ACTOR_SLOTS - a.inflight) for a in self.pools[i] if a.ready)

    def least_busy(self, i: int, prefer: Optional[int] = None) -> PoolActor:
        """The ready actor of pool ``i`` with the fewest calls in flight (one more is counted); the
        ``prefer``-th actor of the pool (its place, kept from execution to execution through the
        actor cache) when it is ready and has a free slot."""
        pool = self.pools[i]
        actor = pool[prefer % len(pool)] if prefer is not None and pool else None
        if actor is None or not actor.ready or actor.inflight >= ACTOR_SLOTS:
            actor = min((a for a in pool if a.ready), key=lambda a: a.inflight)
        actor.inflight += 1
        return actor

    def idle_limit_s(self, i: int) -> float:
        """How long an actor of pool ``i`` sits idle before it may be retired."""
        st = self._stats[i]
        mean = st.construction_s / st.actors_ready if st.actors_ready else None
        return idle_limit_s(mean, IDLE_TIMEOUT_S)

    def scale(self, queued: dict[int, int], budget_ok: dict[int, bool], upstream_active: dict[int, bool]) -> None:
        """Grow or shrink each pool by the policy (``queued``: inputs waiting per pool;
        ``upstream_active``: input that will feed it is still coming)."""
        now = time.monotonic()
        for i, actors in self.pools.items():
            lo, hi = self._bounds[i]
            ready = [a for a in actors if a.ready]
            limit_s = self.idle_limit_s(i)
            idle = [a for a in ready if a.inflight == 0 and now - a.idle_since > limit_s]
            view = PoolView(size=len(actors), pending=len(actors) - len(ready), min_size=lo, max_size=hi,
                            queued=queued.get(i, 0), free_slots=self.free_slots(i), idle_actors=len(idle),
                            upstream_active=upstream_active.get(i, False), constructed=self._built[i],
                            lost=self._lost[i], reads=self._stages[i].reads)
            delta = pool_delta(view, budget_ok.get(i, True))
            for _ in range(max(0, delta)):
                handle = new_pool_actor(self._stages[i], self._stats[i].actors_created, hi, self._opts)
                actor = PoolActor(handle, handle.ready.remote())
                actors.append(actor)
                self.pending[actor.ready_ref] = (i, actor)
                self._stats[i].actors_created += 1
                self._built[i] += 1
            if delta < 0:
                actors.remove(idle[0])
                self._stats[i].actors_retired += 1
                ray.kill(idle[0].handle)

    def constructed(self, ref: ray.ObjectRef, info: Optional[tuple]) -> None:
        """An actor's constructor returned (its ``ready`` ref came back with ``(node, pid,
        construction seconds)``), or the actor died before (``info`` None)."""
        i, actor = self.pending.pop(ref)
        st = self._stats[i]
        if info is None:
            self.pools[i].remove(actor)
            st.actors_lost += 1
            self._lost[i] += 1
            try:  # unreachable (its node lost) rather than dead: no restart beside its replacement
                ray.kill(actor.handle, no_restart=True)
            except Exception:
                pass
            return
        built_s = float(info[2]) if len(info) > 2 else 0.0
        st.actors_ready += 1
        st.construction_s += built_s
        st.resource_wait_s += max(0.0, time.monotonic() - actor.launched - built_s)
        actor.ready_ref = None
        actor.node = str(info[0]) if info else None
        if actor.node is not None:
            _NODES[_actor_key(actor.handle)] = actor.node
        actor.idle_since = time.monotonic()

    def lose_node(self, node: str) -> None:
        """A node left the cluster: its actors are lost (:meth:`lose`), busy or idle."""
        for actors in self.pools.values():
            for a in [a for a in actors if a.node == node]:
                self.lose(a)

    def lose(self, actor: PoolActor) -> Optional[str]:
        """An actor the system lost (its node died, its process was killed): out of its pool,
        killed for good (a restart would hold its resources beside the one the pool builds
        instead), counted as lost so the pool may build another. Returns its node (None: unknown).
        Idempotent: every call in flight on it fails alike."""
        for i, actors in self.pools.items():
            if actor in actors:
                actors.remove(actor)
                self._stats[i].actors_lost += 1
                self._lost[i] += 1
                if actor.ready_ref is not None:
                    self.pending.pop(actor.ready_ref, None)
                try:
                    ray.kill(actor.handle, no_restart=True)
                except Exception:  # already gone
                    pass
                break
        return actor.node

    def pending_per_stage(self) -> dict[int, int]:
        """Actors still starting, per pool."""
        out: dict[int, int] = {}
        for i, _ in self.pending.values():
            out[i] = out.get(i, 0) + 1
        return out

    def shutdown(self) -> None:
        """Kill every pool's actors, or leave them in the actor cache for the next execution."""
        for i, actors in self.pools.items():
            for a in actors:
                if self._cache is not None:  # kept for the next epoch, even if still starting
                    self._cache.setdefault(i, []).append(a.handle if a.ready else PrestartedActor(a.handle, a.ready_ref, True))
                    continue
                try:
                    ray.kill(a.handle)
                except Exception:
                    pass
            actors.clear()
        self.pending.clear()  # its handles too: a dropped actor cache then frees its actors at once, not at a GC
