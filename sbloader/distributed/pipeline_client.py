"""The rank side of a native pipeline's epoch split across ranks: block refs in, batches out.

Rank 0 starts the epoch on the job's coordinator (:func:`join`), which runs the
pipeline once for the job. Every rank cuts its batches from the cut plan all ranks
compute alike (:func:`~sbloader.core.cut.cut_plan`): it asks the coordinator for the
refs of the blocks its next batches need, fetches them (zero-copy on its node) and
keeps each while a later batch of its own takes rows from it (:func:`batches`).
A coordinator that died (its node, or its process) is replaced: every rank reports
how many of its batches it has cut, the new one runs the partitions still needed, and
each rank goes on from where it was (:class:`Link`, ``rebuild.py``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol

import ray

from sbloader.core.block import Batch
from sbloader.core.cut import CutPlan, assemble, checked_rows, last_use, places
from sbloader.core.errors import SbloaderError
from sbloader.core.plan import EpochPlan
from sbloader.distributed.block_fetch import fetch_bounded
from sbloader.distributed.specs import PartitionEpochSpec
from sbloader.executor.options import ExecutionOptions

logger = logging.getLogger(__name__)

_WAIT_S = 1.0  # one coordinator request waits at most this long for a block
_AHEAD = 2  # batches whose blocks a rank asks for ahead of the one it cuts
_MAX_REBUILDS = 3  # coordinators lost in one epoch before the rank gives up
_SLOW_WAIT_S = 60.0  # a rank waiting this long for a block says so (again each such wait)


class RankSplit(Protocol):
    """What a rank knows of its split epoch (``sbloader.loaders.pipeline_run.SplitRun``)."""

    pids: tuple
    rows: tuple
    plan: CutPlan
    rank: int
    taken: int

    @property
    def epoch(self) -> int: ...


def partition_spec(run: Any, source: Any, ops: tuple, options: ExecutionOptions, shuffle: bool) -> PartitionEpochSpec:
    """What rank 0 sends the coordinator to start the epoch of ``run`` (a :class:`RankSplit`)."""
    base = run.base
    plan = EpochPlan(base.epoch, base.epoch_seed, run.pids, shuffle)
    return PartitionEpochSpec(base.epoch, base.epoch_seed, source, tuple(ops), plan, options, run.plan.per_rank,
                              {run.pids[place]: i for place, i in last_use(run.plan).items()})


@dataclass
class Link:
    """A rank's way to its epoch's coordinator: the live handle, and how to replace a dead one.

    Attributes:
        coord: the coordinator now.
        reconnect: finds (or creates) the job's coordinator anew; None: a lost one is fatal.
        spec: the epoch's spec (rank 0's; the new coordinator plans the rebuild from it).
        rebuilds: coordinators lost and rebuilt in this epoch.
    """

    coord: Any
    reconnect: Optional[Callable[[], Any]] = None
    spec: Optional[PartitionEpochSpec] = None
    rebuilds: int = 0

    def rebuild(self, run: Any, cut: int, cause: BaseException) -> None:
        """The coordinator died: find its successor and report the ``cut`` batches this rank has
        made of epoch ``run.epoch``; returns once every rank reported and the epoch runs again.

        Raises:
            SbloaderError: no way to reconnect, too many losses in one epoch, or the other
                ranks did not report in time.
        """
        from sbloader.distributed.dropin_client import rebuild_epoch

        self.rebuilds += 1
        if self.reconnect is None or self.rebuilds > _MAX_REBUILDS:
            raise SbloaderError(
                f"rank {run.rank}: the split coordinator died ({type(cause).__name__}) {self.rebuilds} time(s) in "
                f"epoch {run.epoch}. Restart the job and load the last checkpoint's loader state"
            ) from cause
        logger.warning("sbloader rank %d: coordinator lost (%s); rebuilding epoch %d from batch %d",
                       run.rank, type(cause).__name__, run.epoch, cut)
        self.coord = self.reconnect()
        rebuild_epoch(self.coord, run.epoch, run.rank, list(range(cut)), self.spec if run.rank == 0 else None)


def join(coord: Any, run: Any, spec: Optional[PartitionEpochSpec]) -> None:
    """Rank 0 (``spec`` given) starts the epoch; the others wait for it. Every rank checks it
    planned the same number of batches as rank 0."""
    if spec is not None:
        per_rank = ray.get(coord.start_partition_epoch.remote(spec))
    else:
        per_rank = ray.get(coord.wait_epoch.remote(run.epoch, 300.0, run.rank))  # raises on timeout: what rank 0 does
        if per_rank is None:
            raise SbloaderError(f"rank 0 did not start epoch {run.epoch} within 300 s; is rank 0 iterating "
                                "this loader?")
    if per_rank != run.plan.per_rank:
        raise SbloaderError(
            f"rank {run.rank} planned {run.plan.per_rank} batches for epoch {run.epoch} but rank 0 planned "
            f"{per_rank}: every rank must load the same state and use the same loader arguments"
        )


def batches(link: Any, run: Any) -> Iterator[tuple[Batch, int]]:
    """(Fetch thread) This rank's batches as ``(batch, index among its batches)``, from the
    batch after the last one its loop took. ``link``: a :class:`Link` (or a coordinator, which
    is then not replaced when it dies)."""
    link = link if isinstance(link, Link) else Link(link)
    mine = run.plan.for_rank(run.rank)
    offset = {place: run.base.taken.get(pid, 0) for place, pid in enumerate(run.pids)}
    last_mine: dict[int, int] = {}
    for j, b in enumerate(mine):
        for p in places(b):
            last_mine[run.pids[p.key]] = j
    refs: dict[int, Any] = {}
    blocks: dict[int, Any] = {}

    def wanted(j: int) -> list[int]:
        out: list[int] = []
        for b in mine[j:j + 1 + _AHEAD]:
            for p in places(b):
                pid = run.pids[p.key]
                if pid not in out and pid not in refs and pid not in blocks:
                    out.append(pid)
        return out

    j = run.taken
    while j < len(mine):
        b = mine[j]
        want = wanted(j)
        now = [run.pids[p.key] for p in places(b)]
        try:
            waited = time.monotonic()
            while any(pid not in refs and pid not in blocks for pid in now):
                reply = _call(lambda: link.coord.block_refs.remote(run.epoch, run.rank, run.taken, want, _WAIT_S))
                refs.update(reply["refs"])
                want = [pid for pid in want if pid not in refs]
                missing = [pid for pid in now if pid not in refs and pid not in blocks]
                if missing and reply.get("done"):
                    raise SbloaderError(
                        f"rank {run.rank}: the coordinator ended epoch {run.epoch} while this rank still needs "
                        f"partition(s) {missing} for its batch {j}; every rank must iterate the same epoch. "
                        "Restart the job from the last checkpoint")
                if missing and time.monotonic() - waited > _SLOW_WAIT_S:
                    logger.warning("sbloader rank %d: waited %.0f s for partition(s) %s of epoch %d (batch %d)",
                                   run.rank, time.monotonic() - waited, missing, run.epoch, j)
                    waited = time.monotonic()
            for pid in now:
                if pid not in blocks:
                    blocks[pid] = _checked(_fetch(link, run, pid, refs.pop(pid), j), pid, run)
        except (ray.exceptions.RayActorError, ray.exceptions.OwnerDiedError) as e:
            # The coordinator died, and with it the blocks it owned that this rank had not
            # fetched (those fetched stay in this process): the epoch is rebuilt from batch j.
            link.rebuild(run, j, e)
            refs.clear()
            continue
        yield assemble(b, run.pids, run.epoch, blocks, offset), j
        for pid in [pid for pid, last in last_mine.items() if last == j]:
            blocks.pop(pid, None)
            refs.pop(pid, None)
        j += 1


def _fetch(link: Any, run: Any, pid: int, ref: Any, j: int) -> dict:
    """The block of partition ``pid`` by its ref, fetched with a bound and past it read through the
    coordinator that owns it (:func:`~sbloader.distributed.block_fetch.fetch_bounded`); one lost with its
    maker is made again (:func:`_remade`).

    Raises:
        SbloaderError: the coordinator cannot read it either.
    """
    try:
        return fetch_bounded(link.coord, ref, f"rank {run.rank}: partition {pid} of epoch {run.epoch} (batch {j})")
    except ray.exceptions.OwnerDiedError:
        raise  # the coordinator died (it owned the block): the epoch is rebuilt
    except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:
        return _remade(link, run, pid, ref, j, e)


def _remade(link: Any, run: Any, pid: int, ref: Any, j: int, lost: BaseException) -> dict:
    """The block of partition ``pid``, made again through every stage by the live coordinator: the one
    ``ref`` named was lost with the node, or the pool actor, that made it before this rank fetched it
    (a callable class's block: Ray answers the fetch with that actor's death). A coordinator that
    cannot be reached raises ``RayActorError`` (it died: the epoch is rebuilt). The new block is
    fetched with the same bound as any (before, this fetch had no time limit, and a rank of the
    suite's run waited on it for good)."""
    logger.info("sbloader rank %d: partition %d of epoch %d (batch %d) was lost with its maker (%s); making it "
                "again", run.rank, pid, run.epoch, j, type(lost).__name__)
    try:
        again = _call(lambda: link.coord.remake_block.remote(run.epoch, ref.hex()))
    except ray.exceptions.RayTaskError as e:
        raise SbloaderError(f"rank {run.rank}: partition {pid} of epoch {run.epoch} (batch {j}) was lost "
                            f"({type(lost).__name__}) and could not be made again. Restart the job from the last "
                            "checkpoint") from e
    return fetch_bounded(link.coord, again, f"rank {run.rank}: partition {pid} of epoch {run.epoch} (batch {j}), "
                                            "made again")


def _call(send: Any, patience_s: float = 30.0) -> Any:
    """``ray.get(send())``, sent again while the coordinator is only unreachable for a moment
    (a node of the cluster went away and Ray is reconnecting); a dead coordinator raises."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return ray.get(send())
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _checked(block: dict, pid: int, run: Any) -> dict:
    """The block, once its row count is the plan's (:func:`~sbloader.core.cut.checked_rows`), without the rows
    consumed ahead of its prefix."""
    place = run.pids.index(pid)
    return run.strip(place, checked_rows(block, pid, run.whole(place)))


def report_done(coord: Any, run: Any, spec: Optional[PartitionEpochSpec]) -> None:
    """Tell a coordinator that replaced a dead one that this rank had cut all of epoch ``run.epoch``
    (not waited for: the ranks still in that epoch rebuild it once every rank reported)."""
    coord.rebuild.remote(run.epoch, run.rank, list(range(run.plan.per_rank)), spec if run.rank == 0 else None,
                         120.0, False)


def finish(coord: Any, epoch: int, rank: int, taken: int) -> None:
    """Tell the coordinator this rank left the epoch after ``taken`` batches (waited for, at most
    5 s: a process that exits right after must not lose it, or the coordinator would take the
    rank for lost and keep the epoch for it)."""
    try:
        ray.get(coord.finish.remote(epoch, rank, taken), timeout=5)
    except Exception:  # the coordinator is gone or busy: nothing to tell
        pass


def stats(coord: Any, epoch: int) -> Any:
    """The job pipeline's :class:`~sbloader.core.stats.ExecutionStats` of ``epoch`` (None if it cannot tell)."""
    try:
        return ray.get(coord.execution_stats.remote(epoch), timeout=10)
    except Exception:  # the coordinator is gone or busy: statistics are not worth a failure
        return None
