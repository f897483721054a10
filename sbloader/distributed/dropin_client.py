"""The rank side of the drop-in DataLoader's epochs split by the coordinator.

Every rank iterates its sampler (indices only, so the RNG state advances as under
torch); rank 0 sends the epoch's batches to the coordinator (:func:`epoch_spec`,
:func:`join`), which runs the worker pool and hands each rank its share, equal
counts on every rank. :class:`Pull` takes this rank's batches as object refs, one
request ahead (the prefetch), acknowledging what was consumed, and rebuilds a lost
coordinator from what the ranks hold. An ``IterableDataset`` split by the
coordinator has no order to send: :func:`pull_stream` takes the batches the
coordinator equalises as they come.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable, Iterator, Optional

import ray

from sbloader.core.batch_slice import concat_rows, mark_padding, slice_rows
from sbloader.core.errors import SbloaderError
from sbloader.core.lease import LEASE_INTERVAL_S, RateMeter, lease_size
from sbloader.core.plan import make_epoch_plan
from sbloader.core.wire import from_wire, to_wire
from sbloader.distributed.block_fetch import fetch_bounded
from sbloader.distributed.specs import EpochSpec
from sbloader.executor.options import ExecutionOptions
from sbloader.sources.batches import PaddedBatch, ReadyBatchSource, ShardSource

logger = logging.getLogger(__name__)

_KEEP_BLOCKS = 4  # fetched blocks a rank keeps while it takes their batches
_MAX_REBUILDS = 3
_MAX_REMAKES = 3  # times one batch lost with its node is made again


def epoch_spec(run: Any, fingerprint: dict, worker_op: Any, options: ExecutionOptions, in_order: bool) -> EpochSpec:
    """What rank 0 sends the coordinator to start the epoch of ``run`` (an
    :class:`~sbloader.loaders.dropin_state.EpochRun`): its batches as partitions, and the plan."""
    batches = [PaddedBatch(tuple(b), p) if p else b for b, p in zip(run.batches, run.pads)]
    source = ReadyBatchSource(batches, 1, fingerprint, ids=run.ids)
    plan = make_epoch_plan(run.ids, run.epoch, run.epoch_seed, shuffle=False)
    return EpochSpec(run.epoch, run.epoch_seed, source, (worker_op,), plan, options, run.per_rank,
                     tuple(run.ranks) if in_order else None,
                     tuple(tuple(map(tuple, r)) for r in run.batch_ranges), tuple(tuple(r) for r in run.prior))


def stream_spec(epoch: int, epoch_seed: int, shards: int, fingerprint: dict, worker_op: Any,
                options: ExecutionOptions, drop_last: bool, segment: Optional[int] = None,
                reports: bool = False) -> EpochSpec:
    """Rank 0's epoch of a stream: the dataset iterated once for the job, one shard per worker, in
    segments of ``segment`` batches round after round (None: each shard whole); ``reports``: the
    ranks started it on local workers (production waits for their reports, then resumes each shard
    from its reported snapshot: only segments resume a shard)."""
    if reports and segment is None:
        raise ValueError("stream_spec(reports=True) needs a segment: a stream started on the ranks' local workers "
                         "resumes each shard from their reports, which only a segmented epoch does")
    source = ShardSource(shards, fingerprint)
    plan = make_epoch_plan([p.id for p in source.partitions(epoch, epoch_seed)], epoch, epoch_seed, shuffle=False)
    return EpochSpec(epoch, epoch_seed, source, (worker_op,), plan, options, None, drop_last=drop_last,
                     segment=segment, reports=reports)


def join(coord: Any, rank: int, epoch: int, spec: Callable[[], EpochSpec], report: Optional[tuple] = None) -> int:
    """Rank 0 starts the epoch (``spec()`` built only there); the others wait for it. ``report``: this
    rank's ``(delivered, positions)`` after a stream's local phase (``StreamEpoch.report``).

    Returns:
        The per-rank batch count (-1: unknown until the stream ends).

    Raises:
        SbloaderError: rank 0 did not start the epoch within 300 s.
    """
    if rank == 0:
        return ray.get(coord.start_epoch.remote(spec(), report))
    per_rank = ray.get(coord.wait_epoch.remote(epoch, 300.0, rank, report))  # raises on timeout, saying what rank 0 does
    if per_rank is None:
        raise SbloaderError(f"rank 0 did not start epoch {epoch} within 300 s; is rank 0 iterating this loader?")
    return per_rank


class Pull:
    """(Fetch thread) This rank's batches from the coordinator, one request ahead.

    It keeps its own log of the batches it fetched: those are in this process
    (copied, or viewed), so after a coordinator death they are reported as taken
    and only the others are planned again.

    Args:
        coord: the coordinator.
        rank: this rank.
        epoch: the epoch.
        per_rank: batches this rank receives.
        ask: batches asked for per request (the prefetch).
        pin, copy: how wire batches become tensors.
        consumed: the batches the training loop consumed so far (acknowledged, so the
            coordinator releases their bytes).
        reconnect: a new coordinator after the old one died.
        spec: the epoch's spec, for the rebuild.
        timeout: seconds without a batch before torch's timeout error (None: wait).
    """

    def __init__(self, coord: Any, rank: int, epoch: int, per_rank: int, ask: int, pin: bool, copy: bool,
                 consumed: Callable[[], int], reconnect: Callable[[], Any], spec: Callable[[], EpochSpec],
                 timeout: Optional[float] = None, lease_interval_s: float = LEASE_INTERVAL_S) -> None:
        self.coord, self.rank, self.epoch, self.per_rank, self.ask = coord, rank, epoch, per_rank, ask
        self.lease_interval_s = lease_interval_s  # a rank must call well within the silent-rank report time
        self.pin, self.copy, self.timeout = pin, copy, timeout
        self._consumed, self._reconnect, self._spec = consumed, reconnect, spec
        self.fetched: list[int] = []
        self.fetch_s = 0.0
        self.rebuilds = 0  # coordinators lost and rebuilt in this epoch
        self.remade = 0  # batches lost with their node and made again

    def _acked(self) -> int:
        # copies free the block's bytes at once; zero-copy batches only once the loop took them
        return len(self.fetched) if self.copy else self._consumed()

    def _fetch(self, ref: Any, batch_index: int) -> Any:
        """A batch's block; one lost with the node that made it (the coordinator lives: it
        owns the block) is made again from its provenance (``SplitCoordinator.remake``)."""
        def remake() -> Any:
            self.remade += 1
            return ray.get(self.coord.remake.remote(self.epoch, batch_index))

        return fetch_block(ref, remake, f"rank {self.rank}: batch {batch_index} of epoch {self.epoch}", self.coord)

    def batches(self) -> Iterator[tuple[Any, int]]:
        """``(tensors, batch index of the epoch)`` until this rank has its count."""
        node = ray.get_runtime_context().get_node_id()
        ready: deque = deque()  # (block ref, batch index) received, not yet fetched
        received = 0

        meter = RateMeter()

        def request() -> Any:
            # a lease lasting about LEASE_INTERVAL_S at this rank's pace: the coordinator's
            # cost per request is fixed, so fewer requests per batch (core/lease.py)
            # with a short silent-rank report time (below 4 s) a rank calls for every prefetch, unleased
            n = lease_size(meter.rate, self.ask) if self.lease_interval_s >= LEASE_INTERVAL_S else self.ask
            return self.coord.next_batches.remote(self.epoch, self.rank, n, self._acked(), node)

        pending = request()
        last_batch = time.monotonic()
        while len(self.fetched) < self.per_rank:
            try:
                if not ready:
                    reply = ray.get(pending)
                    index = reply.get("index") or [m.seq for m in reply["metas"]]
                    ready.extend(zip(reply["refs"], index))
                    received += len(reply["refs"])
                    # ask for the next ones before using these: the prefetch
                    pending = request() if received < self.per_rank else None
                    if not reply["refs"] and self.timeout is not None and time.monotonic() - last_batch > self.timeout:
                        raise RuntimeError(f"DataLoader timed out after {self.timeout} seconds")  # torch's words
                    continue
                ref, batch_index = ready.popleft()
                t0 = time.perf_counter()
                block = self._fetch(ref, batch_index)
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:
                # The coordinator died, and with it the blocks it owned. Rebuild it from
                # what every rank holds; the rest is planned again.
                self.rebuilds += 1
                if self.rebuilds > _MAX_REBUILDS:
                    raise SbloaderError(
                        f"rank {self.rank}: the split coordinator died {self.rebuilds} times in epoch {self.epoch}. "
                        "Restart the job and load the last checkpoint's loader state"
                    ) from e
                logger.warning("sbloader rank %d: coordinator lost (%s); rebuilding epoch %d from %d taken "
                               "batches", self.rank, type(e).__name__, self.epoch, len(self.fetched))
                self.coord = self._reconnect()
                self.per_rank = rebuild_epoch(self.coord, self.epoch, self.rank, self.fetched,
                                              self._spec() if self.rank == 0 else None)
                ready.clear()
                received = len(self.fetched)
                pending = request()
                continue
            last_batch = time.monotonic()
            batches = [from_wire(wire, pin=self.pin, copy=self.copy) for wire in block["batch"]]
            del block
            self.fetch_s += time.perf_counter() - t0
            for batch in batches:
                self.fetched.append(batch_index)
                meter.took(time.monotonic())
                yield batch, batch_index
            batches = []


def fetch_block(ref: Any, remake: Callable[[], Any], what: str, coord: Any = None) -> Any:
    """``ray.get(ref)`` of a block the coordinator owns; a block lost with the node that made it is
    made again by ``remake()`` (a new ref), at most ``_MAX_REMAKES`` times.

    Lost shows as ``ObjectLostError``, or as the ``ActorDiedError`` of the pool actor that made it
    (Ray's reconstruction runs the actor's task again, and that actor died with its node). A
    coordinator that died shows as ``OwnerDiedError`` (it owned the block), raised for the caller
    to rebuild it, as is the ``RayActorError`` of a ``remake()`` the dead coordinator cannot answer.
    With ``coord`` (the owner), a fetch lasting past :data:`~sbloader.distributed.block_fetch.FETCH_S` is
    read through it instead (:func:`~sbloader.distributed.block_fetch.fetch_bounded`).

    Raises:
        SbloaderError: the block was lost ``_MAX_REMAKES + 1`` times (``what``: the batch, for the message),
            or its fetch did not end and the coordinator could not read it either.
    """
    for attempt in range(_MAX_REMAKES + 1):
        try:
            if coord is None:
                return ray.get(ref)
            return fetch_bounded(coord, ref, what)
        except ray.exceptions.OwnerDiedError:  # the coordinator died: rebuild (the caller)
            raise
        except (ray.exceptions.ObjectLostError, ray.exceptions.RayActorError) as e:
            if attempt == _MAX_REMAKES:
                raise SbloaderError(f"{what} was lost {attempt + 1} times with the nodes that made it") from e
            # the coordinator names the lost node once for the job; stats() counts the re-runs
            logger.info("sbloader %s was lost with the node that made it (%s); making it again from its "
                        "provenance", what, type(e).__name__)
            ref = remake()
    raise AssertionError("unreachable")


def rebuild_epoch(coord: Any, epoch: int, rank: int, taken: list, spec: Optional[EpochSpec], timeout: float = 120.0,
                  poll_s: float = 0.2) -> int:
    """Report what this rank took to a coordinator that replaced a dead one, and wait until
    every rank reported and the epoch was rebuilt.

    Only rank 0's spec counts (the batch indices are positions in its plan), so the
    other ranks send none: at 256 ranks the specs alone were megabytes to unpickle.
    The report returns at once; the wait is a poll of ``wait_epoch`` in short slices.
    A report that waited inside the coordinator would hold one of its threads (64)
    until the last rank reported: with more ranks than threads the last reports
    could never run.

    Returns:
        The epoch's per-rank batch count.

    Raises:
        SbloaderError: the epoch was not rebuilt within ``timeout`` seconds.
    """
    ray.get(coord.rebuild.remote(epoch, rank, list(taken), spec, timeout, False))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        per_rank = ray.get(coord.wait_epoch.remote(epoch, poll_s))
        if per_rank is not None:
            return per_rank
    raise SbloaderError(
        f"rank {rank}: rebuilding epoch {epoch} after the coordinator died waited {timeout:.0f} s for every "
        "rank to report what it took; some rank finished, stopped or died. Restart the job from the last checkpoint"
    )


def coordinator_cut(coord: Any, epoch: int, k: int, order_len: int, timeout: float = 60.0) -> list:
    """The consumed ledger after every rank's first ``k`` batches, from the coordinator's logs
    (``in_order=False``: batches go to whichever rank asks first)."""
    from sbloader.core import ledger

    consumed = ray.get(coord.cut.remote(epoch, k, timeout))
    if consumed is None:  # every rank finished the epoch
        return [(0, order_len)]
    return ledger.merge(consumed)


def stream_batch(item: Any, pin: bool, copy: bool, blocks: Optional[dict] = None,
                 fetch: Callable[[Any], Any] = ray.get) -> Any:
    """A :class:`~sbloader.distributed.specs.StreamBatch` as a batch of tensors: fetched, cut and joined here.

    ``blocks`` keeps the last few fetched blocks by ref: a block holds a whole
    worker shard's batches, fetched (deserialised) once rather than once per batch.
    ``fetch``: a block ref's block (:func:`pull_stream` makes a lost one again).
    """
    blocks = {} if blocks is None else blocks

    def wire(ref: Any, pos: int) -> Any:
        if ref not in blocks:
            while len(blocks) >= _KEEP_BLOCKS:
                blocks.pop(next(iter(blocks)))
            blocks[ref] = fetch(ref)["batch"]
        return blocks[ref][pos]

    if item.whole:
        ref, pos, _, _ = item.pieces[0]
        return from_wire(wire(ref, pos), pin=pin, copy=copy)
    parts = [slice_rows(from_wire(wire(ref, pos), copy=False), a, z) for ref, pos, a, z in item.pieces]
    batch = mark_padding(concat_rows(parts), item.rows, item.pad)
    if pin:
        batch = from_wire(to_wire(batch), pin=True)
    return batch


def pull_stream(coord: Any, rank: int, epoch: int, ask: int, pin: bool, copy: bool,
                consumed: Callable[[], int], timeout: Optional[float] = None, start: int = 0) -> Iterator[Any]:
    """(Fetch thread) This rank's batches of a stream epoch, one request ahead, until the
    coordinator says this rank has its share (``start``: the batches it delivered before, locally).
    A block lost with the node that made it before this rank fetched it is made again from its
    worker shard by the coordinator (``SplitCoordinator.remake_block``; once for all ranks), as a
    map-style batch is."""
    node = ray.get_runtime_context().get_node_id()
    fetched = start  # batches made (copies: their blocks are no longer needed)

    def fetch(ref: Any) -> Any:
        lost = [ref]

        def remake() -> Any:
            lost[0] = ray.get(coord.remake_block.remote(epoch, lost[0].hex()))
            return lost[0]

        return fetch_block(ref, remake, f"rank {rank}: a block of epoch {epoch}", coord)

    def request() -> Any:
        return coord.next_batches.remote(epoch, rank, ask, fetched if copy else consumed(), node)

    blocks: dict = {}  # the last blocks fetched, by ref
    pending = request()
    last_batch = time.monotonic()
    while pending is not None:
        reply = ray.get(pending)
        pending = None if reply["done"] else request()  # ask for the next ones first: the prefetch
        if not reply["batches"] and timeout is not None and time.monotonic() - last_batch > timeout:
            raise RuntimeError(f"DataLoader timed out after {timeout} seconds")  # torch's words
        for item in reply["batches"]:
            batch = stream_batch(item, pin, copy, blocks, fetch)
            last_batch = time.monotonic()
            fetched += 1
            yield batch
            batch = None


def finish(coord: Any, epoch: int, rank: int, consumed: int) -> None:
    """Tell the coordinator this rank left the epoch after ``consumed`` batches (waited for, at most
    5 s: a process that exits right after must not lose it, or the coordinator would take the
    rank for lost and keep the epoch for it)."""
    try:
        ray.get(coord.finish.remote(epoch, rank, consumed), timeout=5)
    except Exception:  # the coordinator is gone or busy: nothing to tell
        pass
