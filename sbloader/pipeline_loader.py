"""Loaders over native pipelines: ``ds.to_dataloader()`` and ``ds.to_torch_dataset()``.

Each iteration is one epoch: a fresh execution of the pipeline whose epoch seed is
drawn as torch draws its base seed (or fixed by ``seed``), so every iteration
reshuffles. Batches are dicts of tensors (writable; one copy of the bytes, into
pinned memory with ``pin_memory``) with ``.provenance``, made in a background
thread up to ``prefetch_blocks`` batches ahead of the training loop.
"""
from __future__ import annotations

import math
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

from ._executor.executor import kill_cached
from .errors import SbloaderError, StateDictError
from ._fetch_ahead import FetchAhead
from .block import PADDING_KEY
from .iterators import iter_batches, iter_blocks, to_torch
from .stats import ExecutionStats, StallStats
from .wire import from_wire, to_wire

if TYPE_CHECKING:
    from ._pipeline_state import PipelineRun
    from .dataset import Dataset


class PipelineLoader:
    """An iterable of torch batches over a :class:`~sbloader.Dataset`, one epoch per iteration.

    Args:
        dataset: the pipeline.
        batch_size: rows per batch.
        shuffle: shuffle partitions and rows within them every epoch.
        seed: fix the epoch seed to ``f(seed, epoch)``; None draws it like torch.
        drop_last: drop a final short batch.
        deterministic: fixed delivery order for a given epoch seed.
        memory_budget: bytes the pipeline may hold in the object store.
        prefetch_blocks: ready blocks kept ahead of the consumer, and batches the
            fetch thread makes ahead of the training loop.
        pin_memory: copy batches into page-locked memory (with an accelerator).
        device: move batches to this device.
        zero_copy: wrap the buffers without copying (read-only over Ray's object store).
            Batches made on the trainer's node are writable views of the process's
            shared-memory slots either way (``sbloader/_executor/handoff.py``).
        dtypes: torch dtype per column.
        collate_fn: applied to each NumPy batch instead of the tensor conversion.
        generator: torch generator the epoch seed is drawn from.
        rank: override the rank (default: torchrun's ``RANK``).
        world_size: override the world size (default: ``WORLD_SIZE``); above 1 each
            rank gets every ``world_size``-th partition of the epoch's plan and the
            same number of batches (the longer ranks' extra rows are not delivered).
        persistent_workers: keep the actor pools' actors (callable classes of
            ``map_batches``, e.g. a model) from one epoch to the next, as torch's
            ``persistent_workers`` keeps its worker processes: constructed once for
            the loader's life instead of once per epoch. They hold their CPUs/GPUs
            between epochs; they go when the loader is deleted.
        allow_trainer_node: on a cluster, let tasks and actors run on this
            process's node too (by default they avoid it when other nodes have CPUs).
    """

    def __init__(self, dataset: "Dataset", batch_size: int = 256, *, shuffle: bool = False,
                 seed: Optional[int] = None, drop_last: bool = False, deterministic: bool = False,
                 memory_budget: Optional[int] = None, prefetch_blocks: int = 2, pin_memory: bool = False,
                 device: Any = None, zero_copy: bool = False, dtypes: Optional[Mapping[str, Any]] = None,
                 collate_fn: Optional[Callable] = None, generator: Any = None,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 persistent_workers: bool = False, allow_trainer_node: bool = False) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, found {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.deterministic = deterministic
        self.memory_budget = memory_budget
        self.prefetch_blocks = prefetch_blocks
        self.pin_memory = pin_memory
        self.device = device
        self.zero_copy = zero_copy
        self.dtypes = dtypes
        self.collate_fn = collate_fn
        self.generator = generator
        self.persistent_workers = persistent_workers
        self.allow_trainer_node = allow_trainer_node
        self._actor_cache: Optional[dict] = {} if persistent_workers else None
        # The stages' output block sizes measured by the last epoch: the next starts
        # every slot at once instead of one task per stage until a block is measured.
        self._estimates: Optional[list] = None
        self._epoch = 0
        self._epoch_explicit = False
        self._stats: Optional[ExecutionStats] = None
        self._stalls: Optional[StallStats] = None
        self._counted_rows: Optional[int] = None
        from .world import World

        self.world = World.detect(rank=rank, world_size=world_size)
        self._run: Any = None
        self._resume: Optional[dict] = None

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, found {epoch}")
        self._epoch, self._epoch_explicit = epoch, True

    def __del__(self) -> None:
        kill_cached(getattr(self, "_actor_cache", None))

    def __len__(self) -> int:
        # One rule, with or without torchrun: without filter/flat_map, operators are
        # taken to keep one output row per input row (a rank that runs short raises).
        if not self.dataset.num_rows_changing():
            sizes = [p.num_rows for p in self.dataset.source.partitions(self._epoch, 0)]
            if all(n is not None for n in sizes):
                if self.world.world_size > 1:
                    return self._quota(sizes)
                n = sum(sizes)
                return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)
        n = self.dataset.num_rows()
        if n is None:
            n = self._counted_rows  # counted by the last complete epoch
        if n is None:
            raise TypeError(
                f"{self.dataset!r} has no length known before running (map_batches, filter or "
                "flat_map may change the row count); iterate one epoch first to count it"
            )
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def stats(self) -> Optional[ExecutionStats]:
        """Execution statistics of the latest epoch."""
        return self._stats

    def stall_stats(self) -> Optional[StallStats]:
        """The data-stall instrument of the latest epoch."""
        return self._stalls

    def state_dict(self) -> dict:
        """A small JSON-serialisable state: the partitions (and rows) the loop consumed.

        Under torchrun (world size above 1) every rank must call it at the same step:
        the ranks' ledgers are gathered with ``torch.distributed.all_gather_object``.

        Raises:
            StateDictError: under torchrun without an initialised process group.
        """
        from ._pipeline_state import make_state, merge_runs

        if self.world.world_size > 1:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise StateDictError(
                    "state_dict() of a native pipeline under torchrun gathers every rank's ledger through "
                    "torch.distributed: call it on every rank after init_process_group (or use the drop-in "
                    "sbloader.DataLoader, whose coordinator needs no process group)"
                )
            runs: list = [None] * self.world.world_size
            dist.all_gather_object(runs, self._run)
            return make_state(self, merge_runs(runs))
        return make_state(self, self._run)

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Resume from :meth:`state_dict`: the next iteration delivers only what was not consumed."""
        from ._pipeline_state import validate

        state = validate(self, state_dict, strict)
        self._resume = dict(state)
        self._run = None
        self._epoch, self._epoch_explicit = int(state["epoch"]), True

    def _start_run(self) -> "PipelineRun":
        from ._pipeline_state import PipelineRun, run_from_state
        from .dataset import draw_epoch_seed

        resume, self._resume = self._resume, None
        if resume is not None and resume.get("epoch_seed") is not None:
            run = run_from_state(resume)
        else:
            epoch = self._epoch
            run = PipelineRun(epoch, draw_epoch_seed(self.seed, epoch, self.generator))
        self._epoch, self._epoch_explicit = run.epoch + 1, False
        return run

    def _plan(self, run: "PipelineRun") -> tuple[Any, Optional[int]]:
        """This rank's epoch plan (unfinished partitions) and its batch quota under torchrun."""
        from .plan import EpochPlan, make_epoch_plan

        parts = self.dataset.source.partitions(run.epoch, run.epoch_seed)
        full = make_epoch_plan([p.id for p in parts], run.epoch, run.epoch_seed, self.shuffle)
        order = [pid for pid in full.order if pid not in run.done]
        w = self.world
        if w.world_size == 1:
            return EpochPlan(run.epoch, run.epoch_seed, tuple(order), full.shuffle_rows), None
        rows = {p.id: p.num_rows for p in parts}
        if any(rows[pid] is None for pid in order) or self.dataset.num_rows_changing():
            raise SbloaderError(
                "under torchrun a native pipeline is split by partition and needs every rank's row count "
                "up front: its source must know partition sizes and its operators must keep one output row "
                "per input row (no filter/flat_map); or set world_size=1 / use sbloader.DataLoader"
            )
        mine = order[w.rank::w.world_size]
        return EpochPlan(run.epoch, run.epoch_seed, tuple(mine), full.shuffle_rows), self._quota(
            [rows[pid] for pid in order])

    def _quota(self, sizes: list) -> int:
        """Batches per rank, the same whatever the epoch's order.

        Each rank holds every ``world_size``-th partition of the order. Without
        ``drop_last`` the quota covers the largest share any rank can get (the
        ``ceil(P / world_size)`` largest partitions): no row is left out, and a rank
        whose share is smaller fills its last batches with repeated rows, marked
        ``batch["sbloader_padding"]``. With ``drop_last`` it is what the smallest
        share fills, and the rest of the longer shares is dropped.
        """
        w = self.world.world_size
        ordered = sorted(sizes)
        if self.drop_last:
            return sum(ordered[: len(sizes) // w]) // self.batch_size
        return math.ceil(sum(ordered[len(sizes) - math.ceil(len(sizes) / w):]) / self.batch_size)

    def _prefetch_blocks(self, plan: Any) -> int:
        """``prefetch_blocks``, raised to two batches' worth when a batch spans several blocks."""
        source = self.dataset.source
        rows = source.num_rows()
        try:
            parts = len(source.partitions(plan.epoch, plan.epoch_seed))
        except Exception:  # a source that cannot list cheaply: blocks as given
            return self.prefetch_blocks
        if not rows or not parts or self.batch_size is None:
            return self.prefetch_blocks
        return max(self.prefetch_blocks, 2 * math.ceil(self.batch_size / max(1.0, rows / parts)))

    def __iter__(self) -> Iterator[Any]:
        import torch

        run = self._start_run()
        self._run = run
        plan, quota = self._plan(run)
        pin = self.pin_memory and torch.accelerator.is_available()
        if self.pin_memory and not pin:
            warnings.warn("pin_memory=True but no accelerator is found; batches are not pinned", stacklevel=2)
        t_start = time.perf_counter()
        executor = self.dataset.execute(plan=plan, deterministic=self.deterministic,
                                        memory_budget=self.memory_budget,
                                        prefetch_blocks=self._prefetch_blocks(plan), progress=False,
                                        allow_trainer_node=self.allow_trainer_node,
                                        actor_cache=self._actor_cache, estimates=self._estimates,
                                        arena=self.dataset._slot_arena())
        self._stats = executor.stats()
        stalls = StallStats()
        self._stalls = stalls
        # A background thread takes ready blocks, cuts the batches and makes the
        # writable (or pinned) tensors, ``prefetch_blocks`` batches ahead, as the
        # drop-in DataLoader does: the training loop only takes them (and moves them
        # to the device), so a GPU step does not wait for the copy.
        fetch = FetchAhead(self._produce(executor, run, quota, pin), depth=max(1, self.prefetch_blocks))
        # The loop's own time per batch (its waits left out) tells the executor whether
        # the pipeline is the bottleneck: the fetch thread cannot see it.
        pace = executor.consumer_pace
        pace.external = True
        try:
            while True:
                try:
                    out, parts, seen = next(fetch)
                except StopIteration:
                    break
                finally:
                    stalls.wait_ready_s = fetch.wait_s
                for pid, rows in seen:  # partition sizes the fetch thread saw, recorded here
                    run.see(pid, rows)
                if out is None:
                    continue
                if self.device is not None:
                    for k, v in list(out.items()):
                        if isinstance(v, torch.Tensor):
                            out[k] = v.to(self.device, non_blocking=pin)
                stalls.batches += 1
                run.consume(parts)  # padding batches have no parts: never consumed
                t_out = time.perf_counter()
                yield out
                pace.add(time.perf_counter() - t_out, self.batch_size)
            run.complete = True
            if quota is None:
                self._counted_rows = self._stats.operators[-1].rows
        finally:
            stalls.wall_s = time.perf_counter() - t_start
            fetch.close(wake=executor.shutdown)  # shutting down wakes a thread waiting for a block
            self._estimates = executor.estimates()

    def _produce(self, executor: Any, run: "PipelineRun", quota: Optional[int], pin: bool) -> Iterator[tuple]:
        """(Fetch thread) ``(tensors, parts, partition sizes seen)`` per batch, ``quota``
        batches under torchrun; a last ``(None, (), sizes)`` for sizes seen after the last
        batch. ``run`` is only read here: the consumer records what it took."""
        from ._pipeline_state import skip_consumed

        seen: list = []
        batches = iter_batches(skip_consumed(iter_blocks(executor), run, seen), self.batch_size, self.drop_last)
        yielded = 0
        last = None
        try:
            while quota is None or yielded < quota:
                try:
                    batch = next(batches)
                    if quota is not None:  # the rows a short share repeats, kept apart from the
                        last = _snapshot(batch)  # tensors the loop may change in place (slot views)
                except StopIteration:
                    if quota is None:
                        break
                    if last is None:
                        raise SbloaderError(
                            f"rank {self.world.rank} received no rows but owes {quota} batches: under torchrun a "
                            "native pipeline needs at least one partition per rank"
                        ) from None
                    batch = _padding_batch(last, self.batch_size)  # a shorter share: marked repeats
                if self.collate_fn is not None:
                    out = self.collate_fn(batch)
                else:
                    out = to_torch(batch, self.dtypes, None, zero_copy=self.zero_copy or pin)
                    if pin:
                        prov, parts = batch.provenance, batch.parts
                        out = from_wire(to_wire(out), pin=True)
                        out.provenance, out.parts = prov, parts
                yielded += 1
                facts, seen[:] = list(seen), []
                yield out, getattr(batch, "parts", ()), facts
            if seen:
                yield None, (), list(seen)
        finally:
            batches.close()




def _snapshot(batch: Any) -> dict:
    """A batch's columns copied: the tensors made from a batch may view its buffers."""
    import numpy as np

    return {k: np.array(v, copy=True) if isinstance(v, np.ndarray) else v for k, v in batch.items()}


def _padding_batch(last: Any, batch_size: int) -> Any:
    """A batch of rows repeated from ``last``, every row marked as padding."""
    import numpy as np

    from .block import Batch

    n = len(next(iter(last.values())))
    take = np.arange(batch_size) % max(1, n)
    out = Batch({k: v[take] for k, v in last.items()})
    out[PADDING_KEY] = np.ones(batch_size, dtype=bool)
    return out


def _torch_iterable_base() -> type:
    from torch.utils.data import IterableDataset

    return IterableDataset


class TorchIterableDataset(_torch_iterable_base()):  # type: ignore[misc]
    """A ``torch.utils.data.IterableDataset`` of ready batches from a pipeline.

    Use it with ``torch.utils.data.DataLoader(it, batch_size=None)``: batching and
    preprocessing already happen on the cluster. With torch workers > 1 every
    worker would run the whole pipeline, so that raises an error.
    """

    def __init__(self, loader: PipelineLoader) -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[Any]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise RuntimeError(
                f"to_torch_dataset() is already parallel on the cluster; torch's DataLoader has "
                f"num_workers={info.num_workers}, which would load every batch {info.num_workers} times. "
                "Use num_workers=0 and batch_size=None."
            )
        return iter(self._loader)

    def __len__(self) -> int:
        return len(self._loader)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration."""
        self._loader.set_epoch(epoch)
