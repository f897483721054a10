"""An epoch in the split coordinator: its executor, and the batches it hands the ranks.

:class:`Epoch` runs the epoch's pipeline (a pump thread takes its ready blocks)
and hands the blocks to the ranks that ask, each rank up to the plan's per-rank
count, so DDP never hangs on an uneven split: in deterministic mode each rank's
own queue (the plan assigns every batch), otherwise a pool any rank takes from,
preferring blocks made on its node. Per rank it logs the ordered batches it
delivered and how many the rank acknowledged as consumed: the consumed ledger
(:meth:`Epoch.cut`). Its subclasses: an epoch of unknown length
(:mod:`~sbloader.distributed.stream_epoch`) and a native pipeline's epoch whose ranks
cut their own batches (:mod:`~sbloader.distributed.partition_epoch`).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from sbloader.core import ledger as _ledger
from sbloader.core.runs import RunLog
from sbloader.core.errors import ExecutorShutdownError, SbloaderError
from sbloader.core.split import pick_local
from sbloader.distributed.specs import EpochSpec
from sbloader.executor.options import OutputBlock
from sbloader.executor.executor import StreamingExecutor
from sbloader.executor.stages import build_stages

logger = logging.getLogger(__name__)


@dataclass
class RankLog:
    """What one rank received. ``delivered`` (the ledger; empty with the ledger off) keeps the
    batch indices as arithmetic runs, so it grows with the breaks in the rank's pattern, not
    with its batches; ``nbytes`` holds only the batches not yet acknowledged (a queue)."""

    delivered: RunLog = field(default_factory=RunLog)  # batch (plan) indices, in delivery order: the ledger
    nbytes: deque = field(default_factory=deque)  # bytes per delivered, unacknowledged batch
    acked: int = 0
    count: int = 0  # batches delivered
    last_seen: float = field(default_factory=time.monotonic)
    node: Optional[str] = None
    left: bool = False  # the rank left the epoch (finish)
    asked: bool = False  # the rank asked for batches of this epoch at least once


class Epoch:
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
        self._earlier: tuple[Epoch, ...] = tuple(earlier)
        self.executor: Optional[StreamingExecutor] = None  # built by the pump thread
        self._executor_lock = threading.Lock()
        self._executor_stopped = False
        self.cond = threading.Condition()
        self.pool: deque[OutputBlock] = deque()  # non-deterministic: any rank
        self.queues = [deque() for _ in range(world_size)]  # deterministic: per rank
        self.logs = [RankLog() for _ in range(world_size)]
        for r, batches in (taken or {}).items():  # a rebuilt coordinator: what each rank already took
            if ledger:
                self.logs[r].delivered = RunLog(batches)
            self.logs[r].count = self.logs[r].acked = len(batches)
            self.logs[r].asked = True
        self.produced_all = False
        self.error: Optional[BaseException] = None
        self.closed = False  # the executor was shut down on purpose before producing everything
        self._cut_lock = threading.Lock()
        self._cutter = _ledger.IncrementalCut(getattr(spec, "batch_ranges", ()), getattr(spec, "prior", ()))
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
        self._await_start()
        with self._executor_lock:
            if self._executor_stopped:
                return False
            spec = self.spec
            if getattr(spec, "executor_factory", None) is not None:  # a simulation's stand-in
                self.executor = spec.executor_factory(spec.source, spec.plan)
                self.executor.start()
                return True
            self.executor = self._new_executor(estimates)
        return True

    def _await_start(self) -> None:
        """(Pump) Wait for what the epoch's start needs besides the earlier epochs' actors (nothing here)."""

    def _new_executor(self, estimates: Optional[list]) -> Any:
        """(Pump, executor lock held) The started execution of the epoch's spec."""
        spec = self.spec
        return self.run_source(spec.source, spec.plan, estimates)

    def run_source(self, source: Any, plan: Any, estimates: Optional[list]) -> StreamingExecutor:
        """A started execution of ``source`` in ``plan``'s order through the epoch's operators, on its actors."""
        return StreamingExecutor(source, build_stages(source.name, list(self.spec.ops)), plan, self.spec.options,
                                 actor_cache=self._actor_cache, estimates=estimates).start()

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
        """(Pump, lock held) A ready block joins what the ranks take: its rank's queue
        (deterministic assignment) or the pool any rank takes from."""
        if self.spec.assignment is not None:
            self.queues[self.spec.assignment[item.meta.seq]].append(item)
        else:
            self.pool.append(item)

    def _end_of_production(self) -> None:
        """(Pump, lock held) The executor produced everything."""

    @property
    def per_rank(self) -> Optional[int]:
        """Batches each rank receives."""
        return self.spec.per_rank

    def _log(self, log: RankLog, batch_id: int, nbytes: int) -> None:
        if self.ledger:
            log.delivered.append(batch_id)
        log.nbytes.append(nbytes)
        log.count += 1

    def done(self, rank: int) -> bool:
        """Whether ``rank`` received every batch of the epoch."""
        pr = self.per_rank
        return pr is not None and self.logs[rank].count >= pr

    def take(self, rank: int, max_n: int, node: Optional[str], wait_s: float, stall_report_s: float) -> list:
        """Up to ``max_n`` ready batches for ``rank`` (within its count); waits at most ``wait_s``
        for one (an empty list: nothing yet)."""
        log = self.logs[rank]
        log.last_seen = time.monotonic()
        log.node = node
        log.asked = True
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
        for _ in range(log.acked, consumed):
            self.executor.release(log.nbytes.popleft())
        log.acked = max(log.acked, consumed)

    def cut(self, k: int) -> list:
        """The consumed ledger after every rank's first ``k`` batches (every log holds ``k``):
        incremental across calls (:class:`~sbloader.core.ledger.IncrementalCut`)."""
        with self._cut_lock:
            return self._cutter.after(k, [lg.delivered for lg in self.logs])

    def ledger_bytes(self) -> int:
        """Bytes of the per-rank delivery logs as compact JSON (what the ledger holds per rank)."""
        import json

        return len(json.dumps([[lg.delivered.runs(), list(lg.nbytes)] for lg in self.logs], separators=(",", ":")))

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
        """Every rank has ended the epoch: it left it, or it asked and acknowledged its whole
        share. A rank that never asked has not (a short epoch, even an empty one, may end on
        the others before a late rank arrives; it must still get its share and the end)."""
        pr = self.per_rank
        return all(lg.left or (lg.asked and pr is not None and lg.acked >= pr) for lg in self.logs)

    def shutdown(self) -> None:
        self.stop_executor()
