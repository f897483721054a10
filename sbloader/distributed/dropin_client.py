"""The drop-in DataLoader's iteration under torchrun: through the split coordinator.

Every rank iterates its sampler (indices only, so RNG state advances as under
torch); rank 0 sends the epoch's order to the coordinator, which cuts it into
equal per-rank batch counts (:mod:`sbloader.core.split`) and runs the pipeline. Each
rank pulls its batches as object refs, one request ahead (the prefetch), and
acknowledges what its training loop consumed.

An ``IterableDataset`` with ``split=True`` (:func:`iter_split_stream`) has no
order to send: the coordinator iterates it once for the job and equalises the
ranks' counts as the batches come (:func:`sbloader.core.split.stream_allowance`).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Iterator, Optional

import numpy as np
import ray

from sbloader.executor.executor import ExecutionOptions
from sbloader.sources.batches import PaddedBatch, ReadyBatchSource, ShardSource
from sbloader.distributed.specs import EpochSpec
from sbloader.distributed.naming import get_coordinator
from sbloader.core.errors import SbloaderError, UserFunctionError, reraise_as_torch
from sbloader.core.plan import make_epoch_plan
from sbloader.core.split import split_epoch
from sbloader.loaders.fetch_ahead import FetchAhead
from sbloader.core.stats import StallStats
from sbloader.core.wire import from_wire

if TYPE_CHECKING:
    from sbloader.loaders.dataloader import DataLoader

logger = logging.getLogger(__name__)


def _distributed(sampler: Any) -> bool:
    from torch.utils.data import DistributedSampler

    return isinstance(sampler, DistributedSampler)


def epoch_order(loader: "DataLoader", epoch: int, epoch_seed: int) -> np.ndarray:
    """The epoch's global sample order (dataset indices) before splitting."""
    sampler = loader.sampler
    if _distributed(sampler):
        import torch

        n = len(loader.dataset)
        if sampler.shuffle:
            g = torch.Generator()
            g.manual_seed(sampler.seed + sampler.epoch)
            order = torch.randperm(n, generator=g).numpy()
        else:
            order = np.arange(n)
        if sampler.drop_last:  # the cross-rank tail, as torch drops it
            order = order[: (n // sampler.num_replicas) * sampler.num_replicas]
        return order.astype(np.int64)
    return np.fromiter((int(i) for i in sampler), dtype=np.int64)


def _order_len(loader: "DataLoader") -> int:
    sampler = loader.sampler
    if _distributed(sampler):
        n = len(loader.dataset)
        return (n // sampler.num_replicas) * sampler.num_replicas if sampler.drop_last else n
    return len(sampler)


def split_len(loader: "DataLoader") -> int:
    """Batches each rank receives per epoch."""
    return split_epoch(_order_len(loader), loader.batch_size or 1, loader.world.world_size, loader.drop_last).per_rank


def _fingerprint(loader: "DataLoader") -> dict:
    from sbloader.loaders.dataloader import _safe_len

    return {"dataset": type(loader.dataset).__name__, "len": _safe_len(loader.dataset),
            "batch_size": loader.batch_size, "drop_last": loader.drop_last, "dataset_id": loader.dataset_id}


def _coordinator(loader: "DataLoader", stream: bool = False) -> Any:
    """The loader's coordinator: found, or created (then rank 0 has it start the worker pool;
    ``stream``: the pool of an ``IterableDataset``'s shards)."""
    if loader._coordinator is None:
        from sbloader.runtime.session import ensure_initialized

        ensure_initialized()
        w = loader.world
        loader._coordinator = get_coordinator(w.job_id, loader.name, w.world_size, _fingerprint(loader),
                                              w.restart_count, loader.stall_report_s)
        if w.rank == 0:  # not awaited: the pool starts while the ranks plan the epoch
            source = ShardSource.name if stream else ReadyBatchSource.name
            loader._coordinator.prewarm.remote(source, (loader._worker_op(),), _options(loader))
    return loader._coordinator


def _options(loader: "DataLoader") -> ExecutionOptions:
    """The execution options of the loader's epochs on the coordinator."""
    from sbloader.runtime.placement import exclusions_here

    prefetch = max(2, (loader.prefetch_factor or 2) * max(1, loader.num_workers))
    return ExecutionOptions(memory_budget=loader.memory_budget, deterministic=loader.in_order,
                            exclude_nodes=exclusions_here(loader.allow_trainer_node),
                            prefetch_blocks=prefetch, progress=False)


def _epoch_spec(loader: "DataLoader", run: Any) -> EpochSpec:
    """What rank 0 sends the coordinator: the run's batches as partitions, and the plan."""
    batches = [PaddedBatch(tuple(b), p) if p else b for b, p in zip(run.batches, run.pads)]
    fp = {"type": type(loader.dataset).__name__, "len": len(loader.dataset), "dataset_id": loader.dataset_id}
    source = ReadyBatchSource(batches, 1, fp, ids=run.ids)
    eplan = make_epoch_plan(run.ids, run.epoch, run.epoch_seed, shuffle=False)
    options = _options(loader)
    assignment = tuple(run.ranks) if loader.in_order else None
    return EpochSpec(run.epoch, run.epoch_seed, source, (loader._worker_op(),), eplan, options, run.per_rank,
                     assignment, tuple(tuple(map(tuple, r)) for r in run.batch_ranges),
                     tuple(tuple(r) for r in run.prior))


def _join_epoch(loader: "DataLoader", coord: Any, run: Any) -> Any:
    """Rank 0 starts the run's epoch on the coordinator; the others wait for it (None on timeout)."""
    if loader.world.rank == 0:
        return ray.get(coord.start_epoch.remote(_epoch_spec(loader, run)))
    return ray.get(coord.wait_epoch.remote(run.epoch, 300.0))


class _Pull:
    """(Fetch thread) Pulls this rank's batches from the coordinator, one request ahead.

    It keeps its own log of the batches it fetched: those are in this process
    (copied, or viewed), so after a coordinator death they are reported as taken
    and only the others are planned again.
    """

    def __init__(self, loader: "DataLoader", coord: Any, run: Any, per_rank: int, stalls: StallStats) -> None:
        self.loader, self.coord, self.run, self.per_rank, self.stalls = loader, coord, run, per_rank, stalls
        self.fetched: list[int] = []

    def _consumed(self) -> int:
        # copies free the block's bytes at once; zero-copy batches until the loop took them
        return len(self.fetched) if not self.loader.zero_copy else len(self.run.taken)

    def produce(self) -> Iterator[tuple]:
        loader, run, stalls = self.loader, self.run, self.stalls
        w = loader.world
        epoch = run.epoch
        pin = loader._pin()
        node = ray.get_runtime_context().get_node_id()
        ask = max(1, loader.prefetch_factor or 2)
        timeout = loader.timeout or None
        ready: deque = deque()  # (block ref, batch index) received, not yet fetched
        received = 0
        rebuilds = 0

        def request() -> Any:
            return self.coord.next_batches.remote(epoch, w.rank, ask, self._consumed(), node)

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
                    if not reply["refs"] and timeout is not None and time.monotonic() - last_batch > timeout:
                        raise RuntimeError(f"DataLoader timed out after {timeout} seconds")  # torch's words
                    continue
                ref, batch_index = ready.popleft()
                t0 = time.perf_counter()
                block = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:
                # The coordinator died, and with it the blocks it owned. Rebuild it from
                # what every rank holds; the rest is planned again.
                rebuilds += 1
                if rebuilds > 3:
                    raise SbloaderError(
                        f"rank {w.rank}: the split coordinator of loader {loader.name!r} died {rebuilds} times in "
                        f"epoch {epoch}. Restart the job and load the last checkpoint's loader state"
                    ) from e
                logger.warning("sbloader rank %d: coordinator lost (%s); rebuilding epoch %d from %d taken "
                               "batches", w.rank, type(e).__name__, epoch, len(self.fetched))
                loader._coordinator = None
                self.coord = _coordinator(loader)
                self.per_rank = ray.get(self.coord.rebuild.remote(epoch, w.rank, list(self.fetched),
                                                                  _epoch_spec(loader, run)))
                ready.clear()
                received = len(self.fetched)
                pending = request()
                continue
            last_batch = time.monotonic()
            batches = [from_wire(wire, pin=pin, copy=not loader.zero_copy) for wire in block["batch"]]
            del block
            stalls.fetch_s += time.perf_counter() - t0
            for batch in batches:
                self.fetched.append(batch_index)
                yield batch, batch_index
            batches = []


def local_cut(run: Any, k: int, world_size: int) -> list:
    """The consumed ledger after every rank's first ``k`` batches, from the plan alone.

    With ``in_order=True`` (the default) the plan fixes which batches each rank
    receives and in what order (``run.ranks``), the same plan on every rank, so
    every rank's first ``k`` batches are known here without asking the
    coordinator: a ``state_dict()`` costs no Ray call. Incremental like the
    coordinator's cut: the last cut's ranges merged with the batches since.
    Equal to :func:`sbloader.core.ledger.cut` over the coordinator's delivery logs.
    """
    from sbloader.core import ledger

    k0, ranges = run.cut_at if run.cut_at is not None and run.cut_at[0] <= k else (0, ledger.merge(run.prior))
    if k > k0:
        seen = [0] * world_size
        pieces = list(ranges)
        for b, r in enumerate(run.ranks):
            seen[r] += 1
            if k0 < seen[r] <= k:
                pieces.extend(tuple(x) for x in run.batch_ranges[b])
        ranges = ledger.merge(pieces)
        run.cut_at = (k, ranges)
    return list(ranges)


def cut(loader: "DataLoader", run: Any, timeout: float = 60.0) -> list:
    """The consumed ledger of the job after this rank's batches taken so far (every rank's first k).

    In order, computed here from the plan (:func:`local_cut`); otherwise (batches
    go to whichever rank asks first) the coordinator's delivery logs decide.
    """
    from sbloader.core import ledger

    if loader.in_order and not _no_ledger():
        return local_cut(run, len(run.taken), loader.world.world_size)
    consumed = ray.get(_coordinator(loader).cut.remote(run.epoch, len(run.taken), timeout))
    if consumed is None:  # every rank finished the epoch
        return [(0, len(run.order))]
    return ledger.merge(consumed)


def _no_ledger() -> bool:
    from sbloader.distributed.naming import ledger_enabled

    return not ledger_enabled()


def _next_from(fetch: FetchAhead, stalls: StallStats) -> Any:
    """The fetch thread's next item (StopIteration at its end); a user function's error
    is raised as torch's DataLoader raises it; the wait is added to ``stalls``."""
    try:
        return next(fetch)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, UserFunctionError):
            reraise_as_torch(e.cause)
        raise
    finally:
        stalls.wait_ready_s = fetch.wait_s


def iter_split(loader: "DataLoader") -> Iterator[Any]:
    """One epoch on this rank: pull batches from the coordinator, yield tensors."""
    t_start = time.perf_counter()
    w = loader.world
    from sbloader.loaders.dropin_state import start_run

    run = start_run(loader, w.world_size)  # every rank iterates its sampler, as under torch
    loader._run = run
    epoch = run.epoch
    coord = _coordinator(loader)
    try:
        per_rank = _join_epoch(loader, coord, run)
    except ray.exceptions.RayActorError:
        # The coordinator died after this rank had taken all of its previous epoch:
        # say so to the new one (ranks still in that epoch wait for every rank's
        # report to rebuild it), then start this epoch there.
        loader._coordinator = None
        coord = _coordinator(loader)
        last = loader._last_split_run
        if last is not None:
            coord.rebuild.remote(last.epoch, w.rank, list(last.taken), _epoch_spec(loader, last), wait=False)
        per_rank = _join_epoch(loader, coord, run)
    if w.rank != 0:
        if per_rank is None:
            raise SbloaderError(f"rank 0 did not start epoch {epoch} within 300 s; is rank 0 iterating this loader?")
    if per_rank != run.per_rank:
        raise SbloaderError(
            f"rank {w.rank} planned {run.per_rank} batches for epoch {epoch} but rank 0 planned {per_rank}: "
            "every rank must load the same state and use the same loader arguments"
        )
    stalls = StallStats()
    loader._last_stalls = stalls
    pulled = _Pull(loader, coord, run, per_rank, stalls)
    fetch = FetchAhead(pulled.produce(), depth=max(1, loader.prefetch_factor or 2))
    try:
        while len(run.taken) < pulled.per_rank:
            try:
                batch, batch_index = _next_from(fetch, stalls)
            except StopIteration:
                raise SbloaderError(f"rank {w.rank}: the fetch thread ended after {len(run.taken)} of "
                                    f"{pulled.per_rank} batches; this is a bug") from None
            stalls.batches += 1
            run.taken.append(batch_index)
            yield batch
        run.complete = True
        loader._last_split_run = run
    finally:
        stalls.wall_s = time.perf_counter() - t_start
        fetch.close()
        try:
            pulled.coord.finish.remote(epoch, w.rank, len(run.taken))
        except Exception:
            pass
        if loader.report_stalls:
            print(f"sbloader rank {w.rank} epoch {epoch}: {stalls}")


# ----- an IterableDataset split by the coordinator (the total is unknown) ---------------------


_KEEP_BLOCKS = 4  # fetched blocks a rank keeps while it takes their batches


def _stream_spec(loader: "DataLoader", epoch: int, epoch_seed: int) -> EpochSpec:
    """Rank 0's epoch of a stream: the dataset iterated once for the job, one shard per worker."""
    from sbloader.loaders.dataloader import _safe_len

    fp = {"type": type(loader.dataset).__name__, "len": _safe_len(loader.dataset), "dataset_id": loader.dataset_id}
    source = ShardSource(max(1, loader.num_workers), fp)
    ids = [p.id for p in source.partitions(epoch, epoch_seed)]
    eplan = make_epoch_plan(ids, epoch, epoch_seed, shuffle=False)
    return EpochSpec(epoch, epoch_seed, source, (loader._worker_op(),), eplan, _options(loader), None,
                     drop_last=loader.drop_last)


def stream_batch(item: Any, pin: bool, copy: bool, blocks: Optional[dict] = None) -> Any:
    """A :class:`~sbloader.distributed.coordinator.StreamBatch` as a batch of tensors: fetched, cut and joined here.

    ``blocks`` keeps the last few fetched blocks by ref: a block holds a whole
    worker shard's batches, fetched (deserialised) once rather than once per batch.
    """
    from sbloader.core.batch_slice import concat_rows, mark_padding, slice_rows

    blocks = {} if blocks is None else blocks

    def wire(ref: Any, pos: int) -> Any:
        if ref not in blocks:
            while len(blocks) >= _KEEP_BLOCKS:
                blocks.pop(next(iter(blocks)))
            blocks[ref] = ray.get(ref)["batch"]
        return blocks[ref][pos]

    if item.whole:
        ref, pos, _, _ = item.pieces[0]
        return from_wire(wire(ref, pos), pin=pin, copy=copy)
    parts = [slice_rows(from_wire(wire(ref, pos), copy=False), a, z) for ref, pos, a, z in item.pieces]
    batch = mark_padding(concat_rows(parts), item.rows, item.pad)
    if pin:
        from sbloader.core.wire import to_wire

        batch = from_wire(to_wire(batch), pin=True)
    return batch


def _pull_stream(loader: "DataLoader", coord: Any, epoch: int, stalls: StallStats) -> Iterator[Any]:
    """(Fetch thread) This rank's batches of a stream epoch, one request ahead, until told done."""
    w = loader.world
    pin = loader._pin()
    node = ray.get_runtime_context().get_node_id()
    ask = max(1, loader.prefetch_factor or 2)
    timeout = loader.timeout or None

    fetched = 0  # batches made (copies: their blocks are no longer needed)

    def request() -> Any:
        consumed = fetched if not loader.zero_copy else stalls.batches
        return coord.next_batches.remote(epoch, w.rank, ask, consumed, node)

    blocks: dict = {}  # the last blocks fetched, by ref
    pending = request()
    last_batch = time.monotonic()
    while pending is not None:
        reply = ray.get(pending)
        pending = None if reply["done"] else request()  # ask for the next ones first: the prefetch
        if not reply["batches"] and timeout is not None and time.monotonic() - last_batch > timeout:
            raise RuntimeError(f"DataLoader timed out after {timeout} seconds")  # torch's words
        for item in reply["batches"]:
            t0 = time.perf_counter()
            batch = stream_batch(item, pin, not loader.zero_copy, blocks)
            stalls.fetch_s += time.perf_counter() - t0
            last_batch = time.monotonic()
            fetched += 1
            yield batch
            batch = None


def iter_split_stream(loader: "DataLoader") -> Iterator[Any]:
    """One epoch of an ``IterableDataset`` split by the coordinator: this rank's share.

    The coordinator iterates the dataset once for the job (``num_workers`` shards,
    as torch's workers); every rank pulls whole batches while every other rank
    can still get as many, then one short last batch (or none with
    ``drop_last``), until the coordinator says it has all of its share.
    """
    t_start = time.perf_counter()
    w = loader.world
    epoch, epoch_seed = loader._next_epoch()
    coord = _coordinator(loader, stream=True)
    if w.rank == 0:
        ray.get(coord.start_epoch.remote(_stream_spec(loader, epoch, epoch_seed)))
    elif ray.get(coord.wait_epoch.remote(epoch, 300.0)) is None:
        raise SbloaderError(f"rank 0 did not start epoch {epoch} within 300 s; is rank 0 iterating this loader?")
    stalls = StallStats()
    loader._last_stalls = stalls
    fetch = FetchAhead(_pull_stream(loader, coord, epoch, stalls), depth=max(1, loader.prefetch_factor or 2))
    try:
        while True:
            try:
                batch = _next_from(fetch, stalls)
            except StopIteration:
                break
            stalls.batches += 1
            yield batch
    finally:
        stalls.wall_s = time.perf_counter() - t_start
        fetch.close()
        try:
            coord.finish.remote(epoch, w.rank, stalls.batches)
        except Exception:
            pass
        if loader.report_stalls:
            print(f"sbloader rank {w.rank} epoch {epoch}: {stalls}")
