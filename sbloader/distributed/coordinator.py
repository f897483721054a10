"""The split coordinator: one Ray actor per (job, loader) that feeds every rank.

It runs the epoch's streaming executor (:class:`~sbloader.distributed.epoch.Epoch`)
and hands ready batches to the ranks that ask for them, as object refs: the bytes
go from the producing node to the rank, never through the coordinator. Every rank
receives the plan's per-rank count, so DDP never hangs on an uneven split. It
logs, per rank, the ordered list of what it delivered and how much of it the rank
acknowledged as consumed: the consumed ledger ``state_dict()`` cuts. A coordinator
lost mid-epoch is rebuilt from what every rank reports it took (:meth:`SplitCoordinator.rebuild`).
It holds an epoch until every rank has ended it, and remembers the last few it
dropped, so a rank that arrives after its epoch ended on the others gets its share
and the end (:mod:`~sbloader.distributed.late_ranks`).

``SBLOADER_NO_LEDGER=1`` in the environment of the rank that creates the
coordinator switches the ledger off (an internal switch, for
measuring what the ledger costs, ``benchmarks/results/resume.md``): the coordinator
then keeps only counts, and ``state_dict()`` raises.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

import ray

from sbloader.core.errors import SbloaderError
from sbloader.distributed.epoch import Epoch
from sbloader.distributed.job_watch import DRIVER_CHECK_S, JobWatch, check_ranks_alive, process_info
from sbloader.distributed.late_ranks import JOIN_TIMEOUT_S, MAX_HELD_EPOCHS, EndedEpochs, overflow, unknown_epoch
from sbloader.distributed.partition_epoch import PartitionEpoch
from sbloader.distributed.rebuild import RebuildProtocol
from sbloader.distributed.specs import EpochSpec, PartitionEpochSpec
from sbloader.distributed.stream_epoch import StreamEpoch
from sbloader.executor.options import ExecutionOptions
from sbloader.executor.pools import kill_cached, prestart_pools

logger = logging.getLogger(__name__)

#: A coordinator no rank has called for this long retires itself (and its pool).
DEFAULT_IDLE_EXIT_S = 3600.0


@ray.remote(num_cpus=0, max_concurrency=64)
class SplitCoordinator(RebuildProtocol):
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
                 ledger: bool = True, idle_exit_s: float = DEFAULT_IDLE_EXIT_S,
                 job_token: Optional[str] = None) -> None:
        self._idle_exit_s = float(idle_exit_s)
        self._last_call = time.monotonic()
        self._job_token = job_token
        self._watch = JobWatch()  # the ranks' processes: the coordinator exits once all are gone
        self._world_size = world_size
        threading.Thread(target=self._reap_when_idle, daemon=True, name="sbloader-idle-exit").start()
        self._ledger = ledger
        self._fingerprint = fingerprint
        self._stall_report_s = stall_report_s
        self._epochs: dict[int, Epoch] = {}
        self._lock = threading.Lock()
        self._started = threading.Condition(self._lock)
        self._actor_cache: dict[int, list] = {}
        self._estimates: Optional[list] = None
        self._rebuilds: dict[int, dict] = {}  # epochs waiting for every rank's report
        self._rebuilt: set[int] = set()  # epochs rebuilt here (finished ones leave _epochs)
        self._finished_stats: dict[int, Any] = {}  # the last few finished epochs' ExecutionStats
        self._ended = EndedEpochs()  # epochs every rank ended: a late request gets the end (late_ranks.py)
        self._seeds: dict[int, int] = {}  # epoch -> the seed the first rank drew (an unseeded native loader)

    def hello(self, world_size: int, fingerprint: dict, token: Optional[str] = None, rank: Optional[int] = None,
              driver: Optional[str] = None, node: Optional[str] = None, loader: Optional[str] = None) -> dict:
        """Check that a rank's loader matches this coordinator's, and that the rank belongs to its job.

        Args:
            token: the job's token (:mod:`sbloader.runtime.job`); another job's is refused.
            rank, driver, node: the rank, its process's Ray job and node, recorded by a
                :class:`JobWatch` (a second live process claiming a rank is refused).
            loader: the id of the rank's loader, until its drop says ``shutdown(rank, loader)``.
        """
        self._last_call = time.monotonic()
        refused = {"ok": False, "world_size": self._world_size, "fingerprint": self._fingerprint}
        if self._job_token is not None and token is not None and token != self._job_token:
            return {**refused, "reason": "token"}
        if world_size != self._world_size or fingerprint != self._fingerprint:
            return refused
        if rank is not None and driver is not None:
            holder = self._watch.claim(rank, driver, node)
            if holder is not None:
                return {**refused, "reason": "rank", "holder": holder}
        if rank is not None and loader is not None:
            self._watch.opened(rank, loader)
        return {"ok": True}

    def prewarm(self, source_name: str, ops: tuple, options: ExecutionOptions, wait_s: float = 0.0) -> int:
        """Start the worker pool before the first epoch (rank 0 right after creating this; any rank may ask).

        The actors start and construct their callable class (import torch, unpickle
        the dataset) while the ranks plan their epoch; ``start_epoch``'s executor
        adopts them. Nothing is started once any epoch started or actors are cached.

        Returns:
            How many actors started ahead are still starting after waiting at most ``wait_s``
            (0: the pool is up, or an epoch took it).
        """
        self._last_call = time.monotonic()
        with self._lock:
            if not self._epochs and not any(self._actor_cache.values()):
                prestart_pools(source_name, ops, options, self._actor_cache)
            refs = [h.ready_ref for hs in self._actor_cache.values() for h in hs if hasattr(h, "ready_ref")]
        return len(refs) - len(ray.wait(refs, num_returns=len(refs), timeout=wait_s)[0]) if refs else 0

    def start_epoch(self, spec: EpochSpec, report: Optional[tuple] = None) -> int:
        """Rank 0 starts an epoch (idempotent); returns the per-rank batch count (-1: unknown).
        ``report``: rank 0's ``(delivered, positions)`` of a stream's local phase (:meth:`StreamEpoch.report`).

        An earlier epoch still being rebuilt (this coordinator replaced a dead one
        while other ranks were in that epoch) goes first: its pool must get the
        workers before this epoch's.
        """
        self._last_call = time.monotonic()
        with self._lock:
            self._await_rebuilds(spec.epoch)
            if spec.epoch not in self._epochs:
                kind = StreamEpoch if spec.per_rank is None else Epoch
                ep = kind(spec, self._world_size, self._actor_cache, self._estimates,
                          earlier=tuple(self._epochs.values()), ledger=self._ledger)
                self._epochs[spec.epoch] = ep
                ep.start()
                self._started.notify_all()
            if report is not None:
                self._epochs[spec.epoch].report(0, *report)
            return _count(self._epochs[spec.epoch].spec.per_rank)

    def agree_seed(self, epoch: int, seed: int) -> int:
        """The epoch seed of an unseeded native loader's epoch, the same for every rank: the first
        rank to ask proposes its draw (each rank's torch RNG may differ), the others get it."""
        self._last_call = time.monotonic()
        with self._lock:
            agreed = self._seeds.setdefault(int(epoch), int(seed))
            while len(self._seeds) > 16:
                self._seeds.pop(next(iter(self._seeds)))
            return agreed

    def start_partition_epoch(self, spec: PartitionEpochSpec) -> int:
        """Rank 0 starts an epoch of a native pipeline split across ranks (idempotent);
        returns the per-rank batch count. An earlier epoch being rebuilt goes first, as in
        :meth:`start_epoch`."""
        self._last_call = time.monotonic()
        with self._lock:
            self._await_rebuilds(spec.epoch)
            if spec.epoch not in self._epochs:
                ep = PartitionEpoch(spec, self._world_size, self._actor_cache, self._estimates,
                                     earlier=tuple(self._epochs.values()))
                self._epochs[spec.epoch] = ep
                ep.start()
                self._started.notify_all()
            return self._epochs[spec.epoch].spec.per_rank

    def _await_rebuilds(self, epoch: int, timeout: float = 120.0) -> None:
        """(Lock held) Wait until no epoch before ``epoch`` waits for the ranks' reports to be rebuilt.

        Raises:
            SbloaderError: some rank did not report within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while any(e < epoch for e in self._rebuilds):  # an entry leaves once rebuilt
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SbloaderError(
                    f"epoch {epoch} cannot start: the rebuild of an earlier epoch after the coordinator died "
                    f"still waits for ranks that did not report within {timeout:.0f} s "
                    f"({ {e: len(p['taken']) for e, p in self._rebuilds.items()} } rank(s) reported). "
                    "Restart the job from the last checkpoint"
                )
            self._started.wait(timeout=min(remaining, 1.0))

    def block_refs(self, epoch: int, rank: int, consumed: int, pids: list, wait_s: float = 1.0) -> dict:
        """(A native pipeline's epoch) Acknowledge ``consumed`` batches of ``rank``, then the refs
        of the ready blocks of partitions ``pids``, waiting at most ``wait_s`` for the first:
        ``{"refs": {partition id: ref}, "done": bool}`` (a block whose fetch by ref does not end:
        :meth:`read_block`)."""
        self._last_call = time.monotonic()
        ep = self._held(epoch, rank)
        if ep is None:  # it ended on every rank that asked for it
            return {"refs": {}, "done": True}
        if not isinstance(ep, PartitionEpoch):
            raise SbloaderError(f"rank {rank} asked for the blocks of epoch {epoch}, which rank 0 started for "
                                "another kind of loader; every rank must use the same loader")
        refs = ep.refs(rank, consumed, list(pids), wait_s, self._stall_report_s)
        if not refs:
            check_ranks_alive(self._watch, ep, rank)
        self._collect()
        return {"refs": refs, "done": ep.done(rank)}

    def wait_epoch(self, epoch: int, timeout: float, rank: Optional[int] = None,
                   report: Optional[tuple] = None) -> Optional[int]:
        """Wait until rank 0 started ``epoch``; its per-rank count (-1: unknown; also for an
        epoch that already ended here), or None on timeout. ``report``: as :meth:`start_epoch`'s, ``rank``'s.

        Raises:
            SbloaderError: on timeout when ``rank`` is given: who asked for what, and what rank 0 does.
        """
        self._last_call = time.monotonic()
        try:
            ep = self._held(epoch, rank, timeout)
        except SbloaderError:
            if rank is None:
                return None
            raise
        if report is not None and ep is not None:
            ep.report(rank, *report)
        return _count(ep.spec.per_rank if ep is not None else self._ended.per_rank(epoch))

    def _held(self, epoch: int, rank: Optional[int], timeout: float = JOIN_TIMEOUT_S) -> Optional[Epoch]:
        """The epoch, once rank 0 started it (waiting at most ``timeout``); None when it ended here.

        Raises:
            SbloaderError: rank 0 did not start it in time (:func:`~sbloader.distributed.late_ranks.unknown_epoch`).
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            while epoch not in self._epochs:
                if epoch in self._ended:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise unknown_epoch(epoch, rank, timeout, dict(self._epochs), self._ended)
                self._started.wait(timeout=min(remaining, 1.0))
            return self._epochs[epoch]

    def next_batches(self, epoch: int, rank: int, max_n: int, consumed: int,
                     node: Optional[str] = None, wait_s: float = 1.0) -> dict:
        """Acknowledge ``consumed`` batches, then take up to ``max_n`` more for ``rank``.

        Returns:
            ``{"refs": [...], "metas": [...], "done": bool}``; refs are object refs of
            blocks (bytes never pass through here). In an epoch of unknown length,
            ``{"batches": [StreamBatch, ...], "done": bool}`` instead.
        """
        self._last_call = time.monotonic()
        ep = self._held(epoch, rank)
        if ep is None:  # it ended on every rank that asked for it
            return self._ended.reply(epoch)
        ep.ack(rank, consumed)
        items = ep.take(rank, max_n, node, wait_s, self._stall_report_s)
        done = ep.done(rank)
        if not items and not done:
            check_ranks_alive(self._watch, ep, rank)
        self._collect()
        if isinstance(ep, StreamEpoch):
            return {"batches": items, "done": done}
        return {"refs": [i.ref for i in items], "metas": [i.meta for i in items],
                "index": [ep.spec.index_of(i.meta.seq) for i in items], "done": done}

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
                "state_dict() needs the consumed ledger, but this loader's coordinator was created with "
                "SBLOADER_NO_LEDGER=1 (a benchmark switch) and keeps no delivery logs; unset SBLOADER_NO_LEDGER "
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

    def execution_stats(self, epoch: int) -> Optional[Any]:
        """The :class:`~sbloader.core.stats.ExecutionStats` of an epoch running or recently finished here."""
        ep = self._epochs.get(epoch)
        if ep is not None and ep.executor is not None:
            return ep.executor.stats()
        return self._finished_stats.get(epoch)

    def process_info(self) -> dict:
        """The coordinator process's pid, resident memory (bytes) and, per epoch held here, the
        bytes of its delivery logs as compact JSON (``ledger_bytes``), for monitoring."""
        return process_info({e: ep.ledger_bytes() for e, ep in list(self._epochs.items())})

    def _reap_when_idle(self) -> None:
        """(Thread) Kill the pool and this actor once the job is over.

        Over: every rank's process is gone (:class:`JobWatch`), or no call for ``idle_exit_s``.
        """
        while True:
            idle = time.monotonic() - self._last_call
            if idle >= self._idle_exit_s:
                logger.warning("sbloader coordinator: no rank called for %.0f s; the job is taken to be over, "
                               "releasing the worker pool and exiting", self._idle_exit_s)
                break
            if self._watch.over(world_size=self._world_size) or self._watch.all_dropped(self._world_size, idle):
                logger.info("sbloader coordinator: every rank's process exited or dropped its loader; releasing pool")
                break
            time.sleep(min(DRIVER_CHECK_S, max(0.2, self._idle_exit_s - idle)))
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
            done = [e for e, ep in self._epochs.items() if ep.finished]
            late = overflow({e: ep for e, ep in self._epochs.items() if e not in done})
            for e, never in late:
                logger.warning("sbloader coordinator: epoch %d is dropped unfinished (%d epochs are held at most); "
                               "rank(s) %s never asked for it", e, MAX_HELD_EPOCHS, never)
            for e in done + [e for e, _ in late]:
                ep = self._epochs.pop(e)
                self._ended.add(e, ep.per_rank, isinstance(ep, StreamEpoch))  # a late rank gets the end
                if ep.executor is not None:
                    self._estimates = ep.executor.estimates()
                    self._finished_stats[e] = ep.executor.stats()
                    while len(self._finished_stats) > 4:
                        self._finished_stats.pop(next(iter(self._finished_stats)))
                ep.shutdown()

    def shutdown(self, rank: Optional[int] = None, loader: Optional[str] = None) -> None:
        """Stop every epoch and kill the cached worker actors; with ``rank`` and ``loader``: that rank's loader
        was dropped, and once every rank's were, this coordinator retires (:meth:`_reap_when_idle`)."""
        if loader is not None:
            return self._watch.dropped(rank, loader)
        with self._lock:
            for ep in self._epochs.values():
                ep.shutdown()
            self._epochs.clear()
            kill_cached(self._actor_cache)
            self._actor_cache.clear()


def _count(per_rank: Optional[int]) -> int:
    return -1 if per_rank is None else per_rank
