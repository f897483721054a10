"""Loaders over native pipelines: ``ds.to_dataloader()`` and ``ds.to_torch_dataset()``.

Each iteration is one epoch: a fresh execution of the pipeline whose epoch seed is
drawn as torch draws its base seed (or fixed by ``seed``), so every iteration
reshuffles. Batches are dicts of tensors (writable; one copy of the bytes, into
pinned memory with ``pin_memory``) with ``.provenance``, made in a background
thread up to ``prefetch_blocks`` batches ahead of the training loop.
"""
from __future__ import annotations

import itertools
import math
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

from ._executor.executor import kill_cached
from .errors import SbloaderError
from ._fetch_ahead import FetchAhead
from .iterators import BlockFeed, ShuffleWindow, iter_batches, to_torch
from .stats import ExecutionStats, StallStats
from .wire import from_wire, to_wire

if TYPE_CHECKING:
    from ._pipeline_state import PipelineRun
    from .dataset import Dataset

_LOADER_COUNTER = itertools.count()


class PipelineLoader:
    """An iterable of torch batches over a :class:`~sbloader.Dataset`, one epoch per iteration.

    Args:
        dataset: the pipeline.
        batch_size: rows per batch.
        shuffle: reshuffle every epoch, as torch's ``shuffle=True`` does: sources of small
            items (files, list elements) draw each partition's members from the epoch
            seed, partitions run in a drawn order, rows are shuffled inside each, and a
            source whose partition is one unit of I/O (a Parquet row group, a video)
            has each batch drawn from several partitions at once (``shuffle_window``).
        shuffle_window: under ``shuffle``, how many partitions each batch draws from at
            once (default: the source's: 1 for ``read_images``, ``from_items``...,
            8 for ``read_parquet`` and ``read_videos``). The loop then holds that many
            output blocks (within the memory budget); 1 cuts each partition's batches
            on its own. See the user guide's "Shuffling".
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
        world_size: override the world size (default: ``WORLD_SIZE``); above 1 the
            job's split coordinator runs the pipeline once and every rank cuts its
            batches from a plan all ranks compute alike: the same number of batches
            on every rank, every row once (a few repeated rows marked
            ``batch["sbloader_padding"]`` only when fewer rows than ranks are left),
            and each batch drawn from the whole dataset under ``shuffle``.
        persistent_workers: keep the actor pools' actors (callable classes of
            ``map_batches``, e.g. a model) from one epoch to the next, as torch's
            ``persistent_workers`` keeps its worker processes: constructed once for
            the loader's life instead of once per epoch. They hold their CPUs/GPUs
            between epochs; they go when the loader is deleted.
        allow_trainer_node: on a cluster, let tasks and actors run on this
            process's node too (by default they avoid it when other nodes have CPUs).
        name: the loader's name in the job (default: its creation index in the
            process); split across ranks, the ranks find its coordinator by job id and name.
    """

    def __init__(self, dataset: "Dataset", batch_size: int = 256, *, shuffle: bool = False,
                 seed: Optional[int] = None, drop_last: bool = False, deterministic: bool = False,
                 memory_budget: Optional[int] = None, prefetch_blocks: int = 2, pin_memory: bool = False,
                 device: Any = None, zero_copy: bool = False, dtypes: Optional[Mapping[str, Any]] = None,
                 collate_fn: Optional[Callable] = None, generator: Any = None,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 persistent_workers: bool = False, allow_trainer_node: bool = False,
                 shuffle_window: Optional[int] = None, name: Optional[str] = None) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, found {batch_size}")
        self.dataset = dataset
        self.shuffle_window = dataset._window(shuffle_window)
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
        self.name = name if name is not None else f"pipeline{next(_LOADER_COUNTER)}"
        self._run: Any = None  # a PipelineRun (one consumer), or a SplitRun (split across ranks)
        self._resume: Optional[dict] = None
        self._coordinator: Any = None

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
                n = sum(sizes)
                if self.world.world_size > 1:
                    from .split import split_epoch

                    return split_epoch(n, self.batch_size, self.world.world_size, self.drop_last).per_rank
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
        """Execution statistics of the latest epoch (split across ranks: the job's pipeline,
        read from its coordinator at the end of the epoch)."""
        return self._stats

    def stall_stats(self) -> Optional[StallStats]:
        """The data-stall instrument of the latest epoch."""
        return self._stalls

    def state_dict(self) -> dict:
        """A small JSON-serialisable state: the partitions (and rows) the loop consumed.

        Split across ranks (world size above 1) it records every rank's first ``k``
        batches, ``k`` being this rank's count: take it at the same step on every
        rank (rank 0 may save it alone); it needs no process group and no call to
        the coordinator.
        """
        from ._pipeline_state import make_state

        run = self._run
        if run is not None and self.world.world_size > 1:
            run = run.snapshot()
        return make_state(self, run)

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
            epoch, seed = int(resume["epoch"]), int(resume["epoch_seed"])
            run = run_from_state(resume, self.dataset.plan(epoch=epoch, seed=None, shuffle=self.shuffle,
                                                           epoch_seed=seed).order)
        else:
            epoch = self._epoch
            plan = self.dataset.plan(epoch=epoch, shuffle=self.shuffle,
                                     epoch_seed=draw_epoch_seed(self.seed, epoch, self.generator))
            run = PipelineRun(epoch, plan.epoch_seed, order=plan.order)
        self._epoch, self._epoch_explicit = run.epoch + 1, False
        return run

    def _plan(self, run: "PipelineRun") -> Any:
        """The epoch plan of one consumer: the partitions not finished, in plan order."""
        from .plan import EpochPlan

        return EpochPlan(run.epoch, run.epoch_seed, tuple(pid for pid in run.order if pid not in run.done),
                         self.shuffle)

    def _split_coordinator(self) -> Any:
        """The job's coordinator of this loader (created by the first rank to ask)."""
        if self._coordinator is None:
            from ._pipeline_state import fingerprint
            from ._runtime import ensure_initialized
            from .coordinator import get_coordinator

            ensure_initialized()
            w = self.world
            self._coordinator = get_coordinator(w.job_id, self.name, w.world_size, fingerprint(self),
                                                w.restart_count)
        return self._coordinator

    def _coordinator_options(self, plan: Any) -> Any:
        """Execution options of the job's pipeline on the coordinator."""
        from ._executor.executor import ExecutionOptions
        from .placement import exclusions_here

        ahead = self._prefetch_blocks(plan) + self.world.world_size * (1 + self._window())
        return ExecutionOptions(memory_budget=self.memory_budget, deterministic=self.deterministic,
                                prefetch_blocks=ahead, progress=False,
                                exclude_nodes=exclusions_here(self.allow_trainer_node))

    def _prefetch_blocks(self, plan: Any) -> int:
        """``prefetch_blocks``, raised to two batches' worth when a batch spans several blocks."""
        source = self.dataset.source
        rows = source.num_rows()
        window = self._window()
        base = max(self.prefetch_blocks, window + 1) if window > 1 else self.prefetch_blocks
        try:
            parts = len(source.partitions(plan.epoch, plan.epoch_seed, shuffle=plan.shuffle))
        except Exception:  # a source that cannot list cheaply: blocks as given
            return base
        if not rows or not parts or self.batch_size is None:
            return base
        return max(base, 2 * math.ceil(self.batch_size / max(1.0, rows / parts)))

    def _window(self) -> int:
        """Partitions each batch draws from: ``shuffle_window`` under shuffle, else 1."""
        return self.shuffle_window if self.shuffle and self.batch_size is not None else 1

    def __iter__(self) -> Iterator[Any]:
        import torch

        run = self._start_run()
        pin = self.pin_memory and torch.accelerator.is_available()
        if self.pin_memory and not pin:
            warnings.warn("pin_memory=True but no accelerator is found; batches are not pinned", stacklevel=2)
        if self.world.world_size > 1:
            return self._iter_split(run, pin)
        return self._iter_local(run, pin)

    def _iter_local(self, run: "PipelineRun", pin: bool) -> Iterator[Any]:
        """One consumer: the epoch's pipeline in this process."""
        import torch

        self._run = run
        plan = self._plan(run)
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
        fetch = FetchAhead(self._produce(executor, run, pin), depth=max(1, self.prefetch_blocks))
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
                run.consume(parts)
                t_out = time.perf_counter()
                yield out
                pace.add(time.perf_counter() - t_out, self.batch_size)
            run.complete = True
            self._counted_rows = self._stats.operators[-1].rows
        finally:
            stalls.wall_s = time.perf_counter() - t_start
            fetch.close(wake=executor.shutdown)  # shutting down wakes a thread waiting for a block
            self._estimates = executor.estimates()

    def _iter_split(self, base: "PipelineRun", pin: bool) -> Iterator[Any]:
        """Split across ranks: the job's pipeline runs on its coordinator; this rank cuts its batches."""
        import torch

        from . import _partition_split

        run = _partition_split.plan_split(self, base)
        self._run = run
        t_start = time.perf_counter()
        stalls = StallStats()
        self._stalls = stalls
        self._stats = None

        def produce() -> Iterator[Any]:
            for batch, _ in _partition_split.iterate(self, run, stalls):
                t0 = time.perf_counter()
                out = self._to_output(batch, pin)
                stalls.fetch_s += time.perf_counter() - t0
                yield out

        fetch = FetchAhead(produce(), depth=max(1, self.prefetch_blocks))
        try:
            while run.taken < run.plan.per_rank:
                try:
                    out = next(fetch)
                except StopIteration:
                    raise SbloaderError(f"rank {self.world.rank}: the fetch thread ended after {run.taken} of "
                                        f"{run.plan.per_rank} batches; this is a bug") from None
                finally:
                    stalls.wait_ready_s = fetch.wait_s
                if self.device is not None:
                    for k, v in list(out.items()):
                        if isinstance(v, torch.Tensor):
                            out[k] = v.to(self.device, non_blocking=pin)
                stalls.batches += 1
                run.taken += 1
                yield out
            run.complete = True
        finally:
            stalls.wall_s = time.perf_counter() - t_start
            fetch.close()
            self._stats = self._coordinator_stats(base.epoch)

    def _coordinator_stats(self, epoch: int) -> Optional[ExecutionStats]:
        """The job pipeline's statistics of ``epoch`` from the coordinator (None if it cannot tell)."""
        import ray

        try:
            return ray.get(self._split_coordinator().execution_stats.remote(epoch), timeout=10)
        except Exception:  # the coordinator is gone or busy: statistics are not worth a failure
            return None

    def _to_output(self, batch: Any, pin: bool) -> Any:
        """A NumPy batch as the loop receives it: ``collate_fn``'s output, or writable (pinned) tensors."""
        if self.collate_fn is not None:
            return self.collate_fn(batch)
        out = to_torch(batch, self.dtypes, None, zero_copy=self.zero_copy or pin)
        if pin:
            prov, parts = batch.provenance, batch.parts
            out = from_wire(to_wire(out), pin=True)
            out.provenance, out.parts = prov, parts
        return out

    def _produce(self, executor: Any, run: "PipelineRun", pin: bool) -> Iterator[tuple]:
        """(Fetch thread) ``(tensors, parts, partition sizes seen)`` per batch; a last
        ``(None, (), sizes)`` for sizes seen after the last batch. ``run`` is only read
        here: the consumer records what it took."""
        from ._pipeline_state import skip_consumed

        seen: list = []
        window = self._window()
        feed = BlockFeed(executor, hold=None if window > 1 else 1)
        cut = ShuffleWindow(window, run.epoch_seed, run.batches, feed.release if window > 1 else None)
        batches = iter_batches(skip_consumed(iter(feed), run, seen), self.batch_size, self.drop_last, cut)
        try:
            for batch in batches:
                out = self._to_output(batch, pin)
                facts, seen[:] = list(seen), []
                yield out, getattr(batch, "parts", ()), facts
            if seen:
                yield None, (), list(seen)
        finally:
            batches.close()


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
