"""The split coordinator: one Ray actor per (job, loader) that feeds every rank.

It runs the epoch's streaming executor and hands ready batches to the ranks that
ask for them, as object refs: the bytes go from the producing node to the rank,
never through the coordinator. Every rank receives the plan's per-rank count, so
DDP never hangs on an uneven split (an epoch of unknown length, an
``IterableDataset``, is equalised as it goes: :func:`sbloader.split.stream_allowance`).
In deterministic mode the plan fixes which
rank gets which batch; otherwise a rank gets whatever is ready, preferring
batches produced on its own node. The coordinator logs, per rank, the ordered
list of what it delivered and how much of it the rank acknowledged as consumed.

That log is the consumed ledger ``state_dict()`` cuts. ``SBLOADER_NO_LEDGER=1`` in
the environment of the rank that creates the coordinator switches it off (an
internal switch, for ``benchmarks/bench_resume.py`` to measure what the ledger
costs): the coordinator then keeps only counts, and ``state_dict()`` raises.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import ray

from ._executor.executor import ExecutionOptions, OutputBlock, StreamingExecutor, kill_cached, prestart_pools
from ._executor.stages import build_stages
from . import ledger as _ledger
from .errors import ExecutorShutdownError, SbloaderError
from .plan import EpochPlan
from .split import pick_local, stream_allowance, stream_tail

logger = logging.getLogger(__name__)

NAMESPACE = "sbloader"
NO_LEDGER_ENV = "SBLOADER_NO_LEDGER"
IDLE_EXIT_ENV = "SBLOADER_COORDINATOR_IDLE_EXIT_S"
#: A coordinator no rank has called for this long retires itself (and its pool).
DEFAULT_IDLE_EXIT_S = 3600.0


def idle_exit_s() -> float:
    """Seconds without a call after which a coordinator exits (``SBLOADER_COORDINATOR_IDLE_EXIT_S``)."""
    raw = os.environ.get(IDLE_EXIT_ENV)
    if raw is None:
        return DEFAULT_IDLE_EXIT_S
    try:
        value = float(raw)
    except ValueError:
        raise SbloaderError(f"{IDLE_EXIT_ENV} must be a number of seconds, found {raw!r}") from None
    if value <= 0:
        raise SbloaderError(f"{IDLE_EXIT_ENV} must be positive, found {raw!r}")
    return value


def ledger_enabled() -> bool:
    """False when ``SBLOADER_NO_LEDGER=1`` (benchmarks only): coordinators keep counts, no ledger."""
    return os.environ.get(NO_LEDGER_ENV, "") != "1"


@dataclass(frozen=True)
class EpochSpec:
    """What rank 0 sends to start an epoch.

    Attributes:
        epoch: the epoch number.
        epoch_seed: the epoch seed.
        source: the epoch's source (batches as partitions).
        ops: the operators (the loader's worker pool).
        plan: the epoch plan (partition order).
        options: executor options.
        per_rank: batches each rank receives; None when the total is unknown (an
            ``IterableDataset``'s stream, equalised as it is produced).
        assignment: rank of each partition, by plan position (deterministic mode),
            or None to hand out whatever is ready.
        batch_ranges: per batch (partition) id, the sample positions of its real rows.
        prior: positions consumed before this run of the epoch (a resumed epoch).
        batch_index: the epoch's batch index of each plan position, when the plan
            holds only some of the epoch's batches (a rebuilt coordinator); empty
            means the identity.
        drop_last: (unknown total) drop the batches left after the equal whole
            batches instead of spreading their rows as short last batches.
    """

    epoch: int
    epoch_seed: int
    source: Any
    ops: tuple
    plan: EpochPlan
    options: ExecutionOptions
    per_rank: Optional[int]
    assignment: Optional[tuple[int, ...]] = None
    batch_ranges: tuple = ()
    prior: tuple = ()
    batch_index: tuple = ()
    drop_last: bool = False

    def index_of(self, seq: int) -> int:
        """The epoch's batch index of the partition at plan position ``seq``."""
        return self.batch_index[seq] if self.batch_index else seq


@dataclass
class _RankLog:
    """What one rank received. With the ledger off, ``delivered`` stays empty and
    ``nbytes`` holds only the batches not yet acknowledged (a queue)."""

    delivered: list = field(default_factory=list)  # batch (plan) indices, in delivery order: the ledger
    nbytes: Any = field(default_factory=list)  # bytes per delivered batch (ledger off: per unacked batch)
    acked: int = 0
    count: int = 0  # batches delivered
    last_seen: float = field(default_factory=time.monotonic)
    node: Optional[str] = None
    left: bool = False  # the rank left the epoch (finish)


@dataclass(frozen=True)
class StreamBatch:
    """(Unknown total) one batch a rank receives, as pieces of produced batches.

    Attributes:
        pieces: ``(block ref, batch position in the block, row start, row stop)``;
            one whole batch, or the pieces of a short last batch.
        rows: rows of the batch, padding included.
        pad: the last ``pad`` rows repeat earlier rows (marked as padding).
        whole: a produced batch as is (no cutting on the rank).
    """

    pieces: tuple
    rows: int
    pad: int = 0
    whole: bool = True


@dataclass(frozen=True)
class _Produced:
    """(Unknown total) a produced batch: batch ``pos`` of block ``ref``."""

    ref: Any
    pos: int
    rows: int
    nbytes: int
    node: str
    id: int  # production order: the batch's id in the delivery logs


class _Epoch:
    """One epoch in the coordinator.

    Its executor is built only once every earlier epoch still alive here has
    produced everything (or was left by every rank) and handed its worker actors
    back to the cache: rank 0 may start epoch ``e + 1`` while other ranks still
    consume epoch ``e``, and a second pool next to the first would wait forever
    for CPUs on a cluster the first pool fills.
    """

    def __init__(self, spec: EpochSpec, world_size: int, actor_cache: dict,
                 estimates: Optional[list] = None, earlier: tuple = (), taken: Optional[dict] = None,
                 ledger: bool = True) -> None:
        self.spec = spec
        self.ledger = ledger
        self.world_size = world_size
        self._actor_cache = actor_cache
        self._estimates = estimates
        self._earlier: tuple[_Epoch, ...] = tuple(earlier)
        self.executor: Optional[StreamingExecutor] = None  # built by the pump thread
        self._executor_lock = threading.Lock()
        self._executor_stopped = False
        self.cond = threading.Condition()
        self.pool: deque[OutputBlock] = deque()  # non-deterministic: any rank
        self.queues = [deque() for _ in range(world_size)]  # deterministic: per rank
        self.logs = [_RankLog() if ledger else _RankLog(nbytes=deque()) for _ in range(world_size)]
        for r, batches in (taken or {}).items():  # a rebuilt coordinator: what each rank already took
            if ledger:
                self.logs[r].delivered = list(batches)
                self.logs[r].nbytes = [0] * len(batches)
            self.logs[r].count = self.logs[r].acked = len(batches)
        self.produced_all = False
        self.stream = spec.per_rank is None  # the total is unknown: equalise as it goes
        self.produced = 0  # (stream) batches produced so far
        self.tail: Optional[list] = None  # (stream) per rank its short last batch, once production ended
        self.error: Optional[BaseException] = None
        self.closed = False  # the executor was shut down on purpose before producing everything
        self._cut_lock = threading.Lock()
        self._cut_at: tuple[int, list] = (0, _ledger.merge(getattr(spec, "prior", ())))  # (k, ranges) of the last cut
        self.pump = threading.Thread(target=self._pump, daemon=True, name=f"sbloader-pump-{spec.epoch}")

    def start(self) -> None:
        self.pump.start()

    def _build_executor(self) -> bool:
        """Wait for the earlier epochs to release the worker actors, then start this epoch's executor."""
        estimates = self._estimates
        for prev in self._earlier:
            with prev.cond:
                while not (prev.produced_all or prev.finished or prev.error is not None or self._executor_stopped):
                    prev.cond.wait(timeout=0.2)
            prev.stop_executor()  # its actors go back to the cache; its ready batches stay served
            if prev.executor is not None:
                estimates = prev.executor.estimates()
        self._earlier = ()
        with self._executor_lock:
            if self._executor_stopped:
                return False
            spec = self.spec
            self.executor = StreamingExecutor(
                spec.source, build_stages(spec.source.name, list(spec.ops)), spec.plan, spec.options,
                actor_cache=self._actor_cache, estimates=estimates,
            )
            self.executor.start()
        return True

    def stop_executor(self) -> None:
        """Stop the executor (idempotent, thread-safe): its cached actors return to the cache once."""
        with self._executor_lock:
            self._executor_stopped = True
            if self.executor is not None:
                self.executor.shutdown()

    def _pump(self) -> None:
        try:
            if not self._build_executor():
                return
            while True:
                item = self.executor.get_next()
                with self.cond:
                    if item is None:
                        self._end_of_production()
                        self.produced_all = True
                        self.cond.notify_all()
                        return
                    self._deliver(item)
                    self.cond.notify_all()
        except ExecutorShutdownError:
            # closed on purpose (every rank finished or left the epoch, or the job's
            # coordinator shut down): a request still in flight gets an empty reply,
            # not an error nobody reads (Ray would log it as unhandled)
            with self.cond:
                self.closed = True
                self.cond.notify_all()
        except BaseException as e:  # carried to every rank's next request
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _deliver(self, item: OutputBlock) -> None:
        """(Pump, lock held) A ready block joins what the ranks take."""
        if self.stream:
            self._add_batches(item)
        elif self.spec.assignment is not None:
            self.queues[self.spec.assignment[item.meta.seq]].append(item)
        else:
            self.pool.append(item)

    def _end_of_production(self) -> None:
        """(Pump, lock held) The executor produced everything."""
        if self.stream:
            self._plan_tail()

    # ----- an epoch of unknown length (stream) -------------------------------------------------

    def _add_batches(self, item: OutputBlock) -> None:
        """(Pump, lock held) A produced block's batches join the pool, its bytes shared among them."""
        meta = item.meta
        rows = meta.batch_rows or (1,) * meta.num_rows
        n = len(rows)
        if n == 0:  # a shard that yielded nothing: no rank will acknowledge its bytes
            self.executor.release(meta.nbytes)
        for pos, r in enumerate(rows):
            share = meta.nbytes // n + (meta.nbytes % n if pos == 0 else 0)
            self.pool.append(_Produced(item.ref, pos, int(r), share, meta.node_id, self.produced))
            self.produced += 1

    def _plan_tail(self) -> None:
        """(Pump, lock held) Production ended: set the left-over batches aside as the tail.

        Every rank's quota is ``produced // world_size`` whole batches; the rest
        (the shortest undelivered batches, so the whole batches stay full) is
        dropped with ``drop_last`` or cut into one short last batch per rank.
        """
        ws = self.world_size
        quota = self.produced // ws
        left = self.produced - quota * ws
        if left == 0:
            self.tail = [None] * ws
            return
        by_rows = sorted(range(len(self.pool)), key=lambda i: (self.pool[i].rows, i))[:left]
        spare = [self.pool[i] for i in sorted(by_rows)]
        keep = set(by_rows)
        self.pool = deque(b for i, b in enumerate(self.pool) if i not in keep)
        for b in spare:  # out of the budget: nothing more is produced
            self.executor.release(b.nbytes)
        if self.spec.drop_last:
            self.tail = [None] * ws
            return
        plan = stream_tail([b.rows for b in spare], ws)
        self.tail = [StreamBatch(tuple((spare[i].ref, spare[i].pos, a, z) for i, a, z in pieces),
                                 sum(z - a for _, a, z in pieces), pad, whole=False)
                     for pieces, pad in zip(plan.pieces, plan.pad)]

    @property
    def per_rank(self) -> Optional[int]:
        """Batches each rank receives: None while a stream's total is unknown."""
        if not self.stream:
            return self.spec.per_rank
        if self.tail is None:
            return None
        return self.produced // self.world_size + (1 if self.tail[0] is not None else 0)

    def take_stream(self, rank: int, max_n: int, node: Optional[str], wait_s: float,
                    stall_report_s: float) -> list:
        """(Unknown total) up to ``max_n`` batches for ``rank`` as :class:`StreamBatch`; waits at
        most ``wait_s`` for one (an empty list: nothing yet; see :meth:`done`)."""
        log = self.logs[rank]
        log.last_seen = time.monotonic()
        log.node = node
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                if not self._open():
                    return []
                whole = self.produced // self.world_size if self.produced_all else None
                if whole is not None and log.count >= whole:  # its whole batches: the short last one
                    last = self.tail[rank]
                    if last is None or log.count > whole:
                        return []
                    self._log(log, -1, 0)
                    return [last]
                allow = stream_allowance(self.produced, [lg.count for lg in self.logs], rank, self.produced_all)
                if allow > 0:
                    break
                if not self._wait(deadline, rank, stall_report_s):
                    return []
            out = []
            while self.pool and len(out) < min(max_n, allow):
                idx = pick_local([b.node for b in self.pool], node)
                b = self.pool[idx]
                del self.pool[idx]
                out.append(StreamBatch(((b.ref, b.pos, 0, b.rows),), b.rows))
                self._log(log, b.id, b.nbytes)
            return out

    def _log(self, log: _RankLog, batch_id: int, nbytes: int) -> None:
        if self.ledger:
            log.delivered.append(batch_id)
        log.nbytes.append(nbytes)
        log.count += 1

    def done(self, rank: int) -> bool:
        """Whether ``rank`` received every batch of the epoch."""
        pr = self.per_rank
        return pr is not None and self.logs[rank].count >= pr

    def take(self, rank: int, max_n: int, node: Optional[str], wait_s: float, stall_report_s: float) -> list:
        if self.stream:
            return self.take_stream(rank, max_n, node, wait_s, stall_report_s)
        log = self.logs[rank]
        log.last_seen = time.monotonic()
        log.node = node
        quota = self.spec.per_rank - log.count
        if quota <= 0:
            return []
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                if not self._open():
                    return []
                q = self.queues[rank] if self.spec.assignment is not None else self.pool
                if q:
                    break
                if self.produced_all:
                    raise SbloaderError(
                        f"epoch {self.spec.epoch}: rank {rank} is owed {quota} more batches but the "
                        "pipeline produced everything; this is a bug in the split plan"
                    )
                if not self._wait(deadline, rank, stall_report_s):
                    return []
            out = []
            while q and len(out) < min(max_n, quota):
                if self.spec.assignment is None:
                    idx = pick_local([o.meta.node_id for o in q], node)
                    item = q[idx]
                    del q[idx]
                else:
                    item = q.popleft()
                out.append(item)
                self._log(log, self.spec.index_of(item.meta.seq), item.meta.nbytes)  # the epoch's batch index
            return out

    def ack(self, rank: int, consumed: int) -> None:
        """Rank ``rank`` has consumed its first ``consumed`` batches: release their bytes."""
        log = self.logs[rank]
        consumed = min(consumed, log.count)
        for i in range(log.acked, consumed):
            self.executor.release(log.nbytes[i] if self.ledger else log.nbytes.popleft())
        log.acked = max(log.acked, consumed)

    def cut(self, k: int) -> list:
        """The consumed ledger after every rank's first ``k`` batches (every log holds ``k``).

        Incremental: the logs only grow, so the cut at ``k`` is the last cut's ranges
        merged with the batches between the two ``k``; the same ``k`` again (every
        rank's ``state_dict()`` at one checkpoint) costs a copy. A ``k`` below the
        last is computed from scratch. Equal to :func:`sbloader.ledger.cut`.
        """
        with self._cut_lock:
            k0, ranges = self._cut_at
            if k < k0:
                return _ledger.cut([lg.delivered[:k] for lg in self.logs], k, self.spec.batch_ranges,
                                   self.spec.prior)
            if k > k0:
                pieces = list(ranges)
                for lg in self.logs:
                    for b in lg.delivered[k0:k]:
                        pieces.extend(self.spec.batch_ranges[b])
                ranges = _ledger.merge(pieces)
                self._cut_at = (k, ranges)
            return list(ranges)

    def _open(self) -> bool:
        """(``cond`` held) Raise the pipeline's error, if any; False once the epoch was closed."""
        if self.error is not None:
            raise self.error
        return not self.closed

    def _wait(self, deadline: float, rank: int, stall_report_s: float) -> bool:
        """(``cond`` held) Wait for the pump until ``deadline``; False once it has passed
        (after reporting the ranks that stopped asking)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self._check_stuck(rank, stall_report_s)
            return False
        self.cond.wait(timeout=remaining)
        return True

    def _check_stuck(self, rank: int, stall_report_s: float) -> None:
        now = time.monotonic()
        silent = [r for r, lg in enumerate(self.logs)
                  if r != rank and now - lg.last_seen > stall_report_s and not self.done(r)]
        if silent:
            logger.warning(
                "sbloader epoch %d: rank(s) %s stopped asking for batches %.0f s ago while rank %d waits; "
                "their undelivered batches hold the memory budget",
                self.spec.epoch, silent, stall_report_s, rank,
            )

    def silent_ranks(self, stall_report_s: float) -> list[int]:
        now = time.monotonic()
        return [r for r, lg in enumerate(self.logs)
                if now - lg.last_seen > stall_report_s and not self.done(r)]

    @property
    def finished(self) -> bool:
        pr = self.per_rank
        return all(lg.left or (pr is not None and lg.acked >= pr) for lg in self.logs)

    def shutdown(self) -> None:
        self.stop_executor()


@dataclass(frozen=True)
class PartitionEpochSpec:
    """What rank 0 sends to start an epoch of a native pipeline split across ranks.

    The ranks cut their batches themselves from the partitions' blocks, by a plan
    every rank computes alike (:func:`sbloader.cut.cut_plan`); the coordinator runs
    the pipeline once for the job, hands each rank the block refs it asks for, and
    releases a block once every rank is past the last batch that takes its rows.

    Attributes:
        epoch: the epoch number.
        epoch_seed: the epoch seed.
        source: the dataset's source.
        ops: the dataset's operators.
        plan: the partitions still to run, in plan order.
        options: executor options.
        per_rank: batches each rank receives.
        last_use: per partition id, the cut index of the last batch taking its rows.
    """

    epoch: int
    epoch_seed: int
    source: Any
    ops: tuple
    plan: EpochPlan
    options: ExecutionOptions
    per_rank: int
    last_use: dict


class _PartitionEpoch(_Epoch):
    """An epoch of a native pipeline whose ranks cut their own batches (:class:`PartitionEpochSpec`)."""

    def __init__(self, spec: PartitionEpochSpec, world_size: int, actor_cache: dict,
                 estimates: Optional[list] = None, earlier: tuple = ()) -> None:
        super().__init__(spec, world_size, actor_cache, estimates, earlier, ledger=False)  # type: ignore[arg-type]
        self.stream = False
        self.ready: dict[int, OutputBlock] = {}  # partition id -> block not yet released
        self.released: set[int] = set()
        self.consumed = [0] * world_size

    def _deliver(self, item: OutputBlock) -> None:
        pid = item.meta.partition_id
        if pid in self.released or pid in self.ready:  # nobody will take it (or a duplicate)
            self.executor.release(item.meta.nbytes)
            return
        self.ready[pid] = item
        self._release_passed()

    def _end_of_production(self) -> None:
        pass

    def refs(self, rank: int, consumed: int, pids: list, wait_s: float, stall_report_s: float) -> dict:
        """Ack ``consumed`` batches of ``rank``, then the refs of the ready blocks of the
        partitions ``pids``, waiting at most ``wait_s`` for the first of them."""
        log = self.logs[rank]
        log.last_seen = time.monotonic()
        self.ack(rank, consumed)
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                if not self._open():
                    return {}
                if not pids or pids[0] in self.ready:
                    break
                if self.produced_all or pids[0] in self.released:
                    raise SbloaderError(
                        f"epoch {self.spec.epoch}: rank {rank} asks for the block of partition {pids[0]}, which the "
                        "pipeline did not produce or already released; this is a bug in the cut plan"
                    )
                if not self._wait(deadline, rank, stall_report_s):
                    return {}
            return {p: self.ready[p].ref for p in pids if p in self.ready}

    def ack(self, rank: int, consumed: int) -> None:
        with self.cond:
            self.consumed[rank] = max(self.consumed[rank], int(consumed))
            self.logs[rank].count = self.logs[rank].acked = self.consumed[rank]
            self._release_passed()

    def _release_passed(self) -> None:
        """(``cond`` held) Release the blocks no rank will take rows from again."""
        from .cut import progress

        passed = progress(self.consumed)
        for pid in [p for p in self.ready if self.spec.last_use.get(p, -1) < passed]:
            item = self.ready.pop(pid)
            self.released.add(pid)
            if self.executor is not None:
                self.executor.release(item.meta.nbytes)

    def done(self, rank: int) -> bool:
        return self.consumed[rank] >= self.spec.per_rank

    @property
    def finished(self) -> bool:
        return all(lg.left or self.consumed[r] >= self.spec.per_rank for r, lg in enumerate(self.logs))


@ray.remote(num_cpus=0, max_concurrency=64)
class SplitCoordinator:
    """The per-(job, loader) actor. Coordination only: it takes no CPU (``num_cpus=0``).

    Args:
        world_size: ranks of the job.
        fingerprint: describes the loader; a rank with another fingerprint is refused.
        stall_report_s: seconds of silence after which a rank is reported by number.
        ledger: keep the per-rank delivery logs that ``cut`` reads (the consumed
            ledger); False keeps counts only and ``cut`` raises (benchmarks only).
        idle_exit_s: after this long without a call from any rank the job is taken
            to be over: the coordinator kills its worker pool and itself. It is a
            detached actor (a rank's death must not take the others' data with it),
            so on a cluster that outlives the job nothing else would free them. A
            job that comes back later (a long evaluation between epochs) gets a new
            one, as after a coordinator death.
    """

    def __init__(self, world_size: int, fingerprint: dict, stall_report_s: float = 60.0,
                 ledger: bool = True, idle_exit_s: float = DEFAULT_IDLE_EXIT_S) -> None:
        self._idle_exit_s = float(idle_exit_s)
        self._last_call = time.monotonic()
        threading.Thread(target=self._reap_when_idle, daemon=True, name="sbloader-idle-exit").start()
        self._world_size = world_size
        self._ledger = ledger
        self._fingerprint = fingerprint
        self._stall_report_s = stall_report_s
        self._epochs: dict[int, _Epoch] = {}
        self._lock = threading.Lock()
        self._started = threading.Condition(self._lock)
        self._actor_cache: dict[int, list] = {}
        self._estimates: Optional[list] = None
        self._rebuilds: dict[int, dict] = {}  # epochs waiting for every rank's report
        self._rebuilt: set[int] = set()  # epochs rebuilt here (finished ones leave _epochs)
        self._finished_stats: dict[int, Any] = {}  # the last few finished epochs' ExecutionStats

    def hello(self, world_size: int, fingerprint: dict) -> dict:
        """Check that a rank's loader matches this coordinator's."""
        self._last_call = time.monotonic()
        if world_size != self._world_size or fingerprint != self._fingerprint:
            return {"ok": False, "world_size": self._world_size, "fingerprint": self._fingerprint}
        return {"ok": True}

    def prewarm(self, source_name: str, ops: tuple, options: ExecutionOptions) -> int:
        """Start the worker pool before the first epoch (rank 0, right after creating this).

        The actors start and construct their callable class (import torch, unpickle
        the dataset) while the ranks plan their epoch; ``start_epoch``'s executor
        adopts them. A no-op once any epoch started or actors are cached.

        Returns:
            The number of actors started.
        """
        self._last_call = time.monotonic()
        with self._lock:
            if self._epochs or any(self._actor_cache.values()):
                return 0
            return prestart_pools(source_name, ops, options, self._actor_cache)

    def start_epoch(self, spec: EpochSpec) -> int:
        """Rank 0 starts an epoch (idempotent); returns the per-rank batch count (-1: unknown).

        An earlier epoch still being rebuilt (this coordinator replaced a dead one
        while other ranks were in that epoch) goes first: its pool must get the
        workers before this epoch's.
        """
        self._last_call = time.monotonic()
        deadline = time.monotonic() + 120.0
        with self._lock:
            while any(e < spec.epoch for e in self._rebuilds):  # an entry leaves once rebuilt
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SbloaderError(
                        f"epoch {spec.epoch} cannot start: the rebuild of an earlier epoch after the coordinator "
                        f"died still waits for ranks that did not report within 120 s "
                        f"({ {e: sorted(p['taken']) for e, p in self._rebuilds.items()} }). "
                        "Restart the job from the last checkpoint"
                    )
                self._started.wait(timeout=min(remaining, 1.0))
            if spec.epoch not in self._epochs:
                ep = _Epoch(spec, self._world_size, self._actor_cache, self._estimates,
                            earlier=tuple(self._epochs.values()), ledger=self._ledger)
                self._epochs[spec.epoch] = ep
                ep.start()
                self._started.notify_all()
            return _count(self._epochs[spec.epoch].spec.per_rank)

    def start_partition_epoch(self, spec: PartitionEpochSpec) -> int:
        """Rank 0 starts an epoch of a native pipeline split across ranks (idempotent);
        returns the per-rank batch count."""
        self._last_call = time.monotonic()
        with self._lock:
            if spec.epoch not in self._epochs:
                ep = _PartitionEpoch(spec, self._world_size, self._actor_cache, self._estimates,
                                     earlier=tuple(self._epochs.values()))
                self._epochs[spec.epoch] = ep
                ep.start()
                self._started.notify_all()
            return self._epochs[spec.epoch].spec.per_rank

    def block_refs(self, epoch: int, rank: int, consumed: int, pids: list, wait_s: float = 1.0) -> dict:
        """(A native pipeline's epoch) Acknowledge ``consumed`` batches of ``rank``, then the refs
        of the ready blocks of partitions ``pids``, waiting at most ``wait_s`` for the first:
        ``{"refs": {partition id: ref}, "done": bool}``."""
        self._last_call = time.monotonic()
        ep = self._epochs.get(epoch)
        if not isinstance(ep, _PartitionEpoch):
            raise SbloaderError(f"epoch {epoch} was not started by rank 0 (known: {sorted(self._epochs)})")
        refs = ep.refs(rank, consumed, list(pids), wait_s, self._stall_report_s)
        self._collect()
        return {"refs": refs, "done": ep.done(rank)}

    def wait_epoch(self, epoch: int, timeout: float) -> Optional[int]:
        """Wait until rank 0 started ``epoch``; its per-rank count (-1: unknown), or None on timeout."""
        self._last_call = time.monotonic()
        deadline = time.monotonic() + timeout
        with self._lock:
            while epoch not in self._epochs:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._started.wait(timeout=remaining)
            return _count(self._epochs[epoch].spec.per_rank)

    def next_batches(self, epoch: int, rank: int, max_n: int, consumed: int,
                     node: Optional[str] = None, wait_s: float = 1.0) -> dict:
        """Acknowledge ``consumed`` batches, then take up to ``max_n`` more for ``rank``.

        Returns:
            ``{"refs": [...], "metas": [...], "done": bool}``; refs are object refs of
            blocks (bytes never pass through here). In an epoch of unknown length,
            ``{"batches": [StreamBatch, ...], "done": bool}`` instead.
        """
        self._last_call = time.monotonic()
        ep = self._epochs.get(epoch)
        if ep is None:
            raise SbloaderError(f"epoch {epoch} was not started by rank 0 (known: {sorted(self._epochs)})")
        ep.ack(rank, consumed)
        items = ep.take(rank, max_n, node, wait_s, self._stall_report_s)
        done = ep.done(rank)
        self._collect()
        if ep.stream:
            return {"batches": items, "done": done}
        return {"refs": [i.ref for i in items], "metas": [i.meta for i in items],
                "index": [ep.spec.index_of(i.meta.seq) for i in items], "done": done}

    def rebuild(self, epoch: int, rank: int, taken: list, spec: EpochSpec, timeout: float = 120.0,
                wait: bool = True) -> Optional[int]:
        """Rebuild an epoch after the previous coordinator died, from the ranks' own logs.

        Every rank reports the batches its training loop took (their bytes reached
        it; the rest died with the old coordinator, which owned them) and the
        epoch's full spec (every rank plans the same). Once all ranks reported, the
        batches nobody took are planned again, each rank owed exactly what it
        still lacks of its count, and the ranks continue.

        A rank that had already finished the epoch when the coordinator died
        notices only at its next epoch; it reports with ``wait=False`` (all its
        batches taken) so the ranks still in the epoch can go on.

        Returns:
            The per-rank batch count of the epoch (None with ``wait=False``).

        Raises:
            SbloaderError: not every rank reported within ``timeout`` seconds.
        """
        self._last_call = time.monotonic()
        deadline = time.monotonic() + timeout
        with self._lock:
            if epoch in self._rebuilt:  # a late report: the epoch was rebuilt (and maybe finished)
                ep = self._epochs.get(epoch)
                return ep.spec.per_rank if ep is not None and wait else None
            pend = self._rebuilds.setdefault(epoch, {"taken": {}, "spec": None})
            pend["taken"][rank] = list(taken)
            if rank == 0:
                # Rank 0 started the epoch: the batch indices every rank reports are
                # positions in *its* plan. Another rank's sampler may have drawn
                # another order (an unseeded shuffle), so only rank 0's spec counts.
                pend["spec"] = spec
            self._started.notify_all()
            if not wait:
                if epoch not in self._epochs and len(pend["taken"]) == self._world_size:
                    self._start_rebuilt(epoch, pend["spec"], pend["taken"])
                return None
            while epoch not in self._epochs:
                if len(pend["taken"]) == self._world_size:
                    self._start_rebuilt(epoch, pend["spec"], pend["taken"])
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(self._world_size)) - set(pend["taken"]))
                    raise SbloaderError(
                        f"rebuilding epoch {epoch} after the coordinator died: rank(s) {missing} did not report "
                        f"within {timeout:.0f} s (finished or dead?); restart the job from the last checkpoint"
                    )
                self._started.wait(timeout=remaining)
            return self._epochs[epoch].spec.per_rank

    def _start_rebuilt(self, epoch: int, spec: EpochSpec, taken: dict) -> None:
        """Start the part of ``spec`` that no rank took (called with the lock held)."""
        self._rebuilds.pop(epoch, None)
        self._rebuilt.add(epoch)
        done = {b for batches in taken.values() for b in batches}
        keep = [i for i in range(len(spec.plan.order)) if i not in done]
        plan = EpochPlan(spec.plan.epoch, spec.plan.epoch_seed, tuple(spec.plan.order[i] for i in keep),
                         spec.plan.shuffle)
        assignment = tuple(spec.assignment[i] for i in keep) if spec.assignment is not None else None
        rebuilt = replace(spec, source=spec.source.subset(keep), plan=plan, assignment=assignment,
                          batch_index=tuple(keep))
        ep = _Epoch(rebuilt, self._world_size, self._actor_cache, self._estimates,
                    earlier=tuple(self._epochs.values()), taken=taken, ledger=self._ledger)
        self._epochs[epoch] = ep
        ep.start()
        self._started.notify_all()

    def finish(self, epoch: int, rank: int, consumed: int) -> None:
        """A rank left the epoch having consumed ``consumed`` batches."""
        self._last_call = time.monotonic()
        ep = self._epochs.get(epoch)
        if ep is not None:
            ep.ack(rank, consumed)
            ep.logs[rank].left = True
            self._collect()

    def delivery_log(self, epoch: int) -> list[dict]:
        """Per rank: the ordered partition ids delivered (empty with the ledger off), their count
        and the count acknowledged."""
        ep = self._epochs.get(epoch)
        if ep is None:
            return []
        return [{"delivered": list(lg.delivered), "count": lg.count, "acked": lg.acked} for lg in ep.logs]

    def cut(self, epoch: int, k: int, timeout: float = 60.0) -> Optional[list]:
        """The consumed ledger after every rank's first ``k`` batches of ``epoch``.

        Waits (bounded) until every rank has received its ``k``-th batch.

        Returns:
            Merged position ranges, or None when the epoch is already over on every rank.

        Raises:
            SbloaderError: after ``timeout`` seconds, naming the ranks still short; or at
                once when this coordinator keeps no ledger.
        """
        self._last_call = time.monotonic()
        if not self._ledger:
            raise SbloaderError(
                f"state_dict() needs the consumed ledger, but this loader's coordinator was created with "
                f"{NO_LEDGER_ENV}=1 (a benchmark switch) and keeps no delivery logs; unset {NO_LEDGER_ENV} "
                "in the job's environment to checkpoint"
            )
        deadline = time.monotonic() + timeout
        while True:
            ep = self._epochs.get(epoch)
            if ep is None:
                return None
            short = [r for r, lg in enumerate(ep.logs) if len(lg.delivered) < k]
            if not short:
                return [list(r) for r in ep.cut(k)]
            if time.monotonic() > deadline:
                raise SbloaderError(
                    f"state_dict() at batch {k} of epoch {epoch} waited {timeout:.0f} s for rank(s) {short} "
                    f"to receive their batch {k}; those ranks are stuck or stopped iterating"
                )
            time.sleep(0.01)

    def silent_ranks(self, epoch: int) -> list[int]:
        """Ranks that stopped asking for longer than the report timeout."""
        ep = self._epochs.get(epoch)
        return ep.silent_ranks(self._stall_report_s) if ep is not None else []

    def epoch_stats(self, epoch: int) -> Optional[dict]:
        """The execution statistics of an epoch (as a dict)."""
        st = self.execution_stats(epoch)
        return st.to_dict() if st is not None else None

    def execution_stats(self, epoch: int) -> Optional[Any]:
        """The :class:`~sbloader.stats.ExecutionStats` of an epoch running or recently finished here."""
        ep = self._epochs.get(epoch)
        if ep is not None and ep.executor is not None:
            return ep.executor.stats()
        return self._finished_stats.get(epoch)

    def process_info(self) -> dict:
        """The coordinator process's pid and resident memory (bytes), for monitoring."""
        import os

        rss = 0
        try:
            with open(f"/proc/{os.getpid()}/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
        return {"pid": os.getpid(), "rss": rss}

    def _reap_when_idle(self) -> None:
        """(Thread) Kill the pool and this actor once no rank has called for ``idle_exit_s``."""
        while True:
            idle = time.monotonic() - self._last_call
            if idle >= self._idle_exit_s:
                break
            time.sleep(min(30.0, max(0.2, self._idle_exit_s - idle)))
        logger.warning("sbloader coordinator: no rank called for %.0f s; the job is taken to be over, "
                       "releasing the worker pool and exiting", self._idle_exit_s)
        try:
            self.shutdown()
        finally:
            ray.kill(ray.get_runtime_context().current_actor)

    def _collect(self) -> None:
        """Shut down epochs every rank has finished (actors stay cached for the next).

        An epoch every rank left early (a step limit) is dropped too, though its
        pipeline had not produced everything: nobody will take its ready batches,
        and keeping it would hold them in the object store for the rest of the job.
        """
        with self._lock:
            for e in [e for e, ep in self._epochs.items() if ep.finished]:
                ep = self._epochs.pop(e)
                if ep.executor is not None:
                    self._estimates = ep.executor.estimates()
                    self._finished_stats[e] = ep.executor.stats()
                    while len(self._finished_stats) > 4:
                        self._finished_stats.pop(next(iter(self._finished_stats)))
                ep.shutdown()

    def shutdown(self) -> None:
        """Stop every epoch and kill the cached worker actors."""
        with self._lock:
            for ep in self._epochs.values():
                ep.shutdown()
            self._epochs.clear()
            kill_cached(self._actor_cache)
            self._actor_cache.clear()


def _count(per_rank: Optional[int]) -> int:
    return -1 if per_rank is None else per_rank


def coordinator_name(job_id: str, loader_name: str, restart_count: int = 0) -> str:
    """The Ray actor name of a loader's coordinator in a job."""
    return f"sbloader-coordinator:{job_id}:{restart_count}:{loader_name}"


def get_coordinator(job_id: str, loader_name: str, world_size: int, fingerprint: dict,
                    restart_count: int = 0, stall_report_s: float = 60.0) -> Any:
    """The job's coordinator for a loader: created by the first rank to ask, found by the rest."""
    name = coordinator_name(job_id, loader_name, restart_count)
    handle = SplitCoordinator.options(
        name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
    ).remote(world_size, fingerprint, stall_report_s, ledger_enabled(), idle_exit_s())
    reply = ray.get(handle.hello.remote(world_size, fingerprint))
    if not reply["ok"]:
        raise SbloaderError(
            f"coordinator {name!r} already exists for another loader: found world_size="
            f"{reply['world_size']} and {reply['fingerprint']}, expected world_size={world_size} and "
            f"{fingerprint}. Give the loader a distinct name= or a fresh job id."
        )
    if restart_count > 0:
        _retire(coordinator_name(job_id, loader_name, restart_count - 1))
    return handle


def _retire(name: str) -> None:
    """Kill the coordinator of the job's previous (elastic) restart and its worker pool.

    Coordinators are detached, so they outlive the rank that created them; after
    torchrun restarts the workers, the previous restart's coordinator serves
    nobody (the new job resumes from a checkpoint) but would keep its pool's CPUs.
    """
    try:
        old = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:  # none, or already retired by another rank
        return
    try:
        ray.get(old.shutdown.remote(), timeout=10)
    except Exception:  # dead or stuck: the kill below is enough (its pool actors die with it)
        pass
    try:
        ray.kill(old)
    except Exception:
        pass
