"""Loaders over native pipelines: ``ds.to_dataloader()`` and ``ds.to_torch_dataset()``.

Each iteration is one epoch (:mod:`~sbloader.loaders.pipeline_epoch`): a fresh
execution of the pipeline whose epoch seed is drawn as torch draws its base seed
(or fixed by ``seed``), so every iteration reshuffles. Batches are dicts of tensors
(writable; one copy of the bytes, into pinned memory with ``pin_memory``) with
``.provenance``, made in a background thread up to ``prefetch_blocks`` batches
ahead of the training loop.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import uuid
import warnings
import weakref
from typing import Any, Callable, Iterator, Mapping, Optional

from sbloader.core.errors import StateDictError
from sbloader.core.ops import rows_changing
from sbloader.core.plan import draw_epoch_seed
from sbloader.core.split import split_epoch
from sbloader.core.stats import ExecutionStats, StallStats
from sbloader.executor.pools import kill_cached
from sbloader.loaders import closer, epoch_ahead, pipeline_state
from sbloader.core.window import WindowSpec
from sbloader.loaders import native_split_start, native_start, shuffle_window
from sbloader.loaders.batching import window_of
from sbloader.loaders.epoch import EpochIterator
from sbloader.loaders.pipeline_epoch import (Carry, Pipeline, PipelineSettings, epoch_plan, local_epoch,
                                             narrowed_note, sizes_of, split_epoch as run_split_epoch)
from sbloader.loaders.pipeline_run import PipelineRun, plan_split
from sbloader.loaders.tensors import TensorOptions
from sbloader.runtime.world import World
from sbloader.runtime import background

_LOADER_COUNTER = itertools.count()


class PipelineLoader:
    """An iterable of torch batches over a :class:`~sbloader.Dataset`, one epoch per iteration.

    Args:
        dataset: the pipeline (a :class:`~sbloader.Dataset`: a source and its operators).
        batch_size: rows per batch.
        shuffle: reshuffle every epoch, as torch's ``shuffle=True`` does: sources of small
            items (files, list elements) draw each partition's members from the epoch
            seed, partitions run in a drawn order, rows are shuffled inside each, and a
            source whose partition is one unit of I/O (a Parquet row group, a video)
            has each batch drawn from several partitions at once (``shuffle_window``).
        shuffle_window: under ``shuffle``, what the partitions a batch draws from at once
            may hold: a size (``"512 MiB"``), rows (``"50000 rows"``), or an int, a count
            of partitions as before (1 cuts each partition's batches on its own, the
            least memory). Default: the source's: 1 for ``read_images``,
            ``from_items``... (their partitions are already uniform samples); for
            ``read_parquet``, ``read_videos`` and ``read_webdataset`` half the memory
            budget (``sbloader.core.window.DEFAULT_SHARE``), so data whose output fits
            mixes exactly like torch's shuffle; the window's blocks count in the
            budget. See the user guide's "Shuffling".
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
            shared-memory slots either way (``sbloader/executor/handoff.py``).
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
            the loader's life. They hold their CPUs/GPUs between epochs; they go when
            the loader is deleted. Without it the actors still stay warm in this
            process for ``SBLOADER_WARM_IDLE_S`` (60 s) between epochs and pipelines:
            the next epoch, or a new pipeline with the same classes, constructor
            arguments and resources, runs in them (``SBLOADER_WARM_WORKERS=0``: built
            once per epoch, as torch's non-persistent workers).
        allow_trainer_node: on a cluster, let tasks and actors run on this
            process's node too (by default they avoid it when other nodes have CPUs).
        name: the loader's name in the job (default: its creation index in the
            process); split across ranks, the ranks find its coordinator by job id and name.
        job_id: the job's id, the same on every rank and unique per job (default: taken from
            the launcher, see docs/launchers.md; needed only where the launcher gives nothing).
        local_start: in a process whose Ray is not up yet, start the epoch on local worker
            processes forked here (the plan's first partitions, made as Ray's tasks make them)
            while Ray starts in the background from the loader's construction; Ray's workers
            take the rest (``sbloader/loaders/native_start.py``). Function stages only; False
            (or ``SBLOADER_LOCAL_START=0``) waits for Ray, for a node whose CPUs are the trainer's.
    """

    def __init__(self, dataset: Pipeline, batch_size: int = 256, *, shuffle: bool = False,
                 seed: Optional[int] = None, drop_last: bool = False, deterministic: bool = False,
                 memory_budget: Optional[int] = None, prefetch_blocks: int = 2, pin_memory: bool = False,
                 device: Any = None, zero_copy: bool = False, dtypes: Optional[Mapping[str, Any]] = None,
                 collate_fn: Optional[Callable] = None, generator: Any = None,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 persistent_workers: bool = False, allow_trainer_node: bool = False,
                 shuffle_window: Any = None, name: Optional[str] = None,
                 job_id: Optional[str] = None, local_start: bool = True) -> None:
        if batch_size is None or batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, found {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.shuffle_window = window_of(dataset.source, shuffle_window)  # a WindowSpec
        self.seed = seed
        self.generator = generator
        self.persistent_workers = persistent_workers
        self.world = World.detect(rank=rank, world_size=world_size, job_id=job_id)
        self.name = name if name is not None else f"pipeline{next(_LOADER_COUNTER)}"
        pin = pin_memory and _accelerator()
        if pin_memory and not pin:
            warnings.warn("pin_memory=True but no accelerator is found; batches are not pinned", stacklevel=2)
        self.settings = PipelineSettings(
            batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, deterministic=deterministic,
            memory_budget=memory_budget, prefetch_blocks=prefetch_blocks,
            window=self.shuffle_window if shuffle else WindowSpec(partitions=1), allow_trainer_node=allow_trainer_node,
            tensors=TensorOptions(pin=pin, zero_copy=zero_copy, dtypes=dtypes, collate_fn=collate_fn),
            device=device, local_start=local_start)
        self._carry = Carry(actor_cache={} if persistent_workers else None)
        self._epoch = 0
        # The current epoch's run and stall instrument; its iterator only weakly: a loop that
        # breaks off drops the iterator, which then stops its pipeline (as torch's does).
        self._run: Any = None
        self._stalls: Optional[StallStats] = None
        self._iterator: Optional[weakref.ref] = None
        self._resume: Optional[dict] = None
        self._coordinator: Any = None
        self._coordinator_lock = threading.Lock()
        self._ahead: Optional[epoch_ahead.Ahead] = None  # the next epoch, begun ahead (start_ahead)
        self._split_epochs = 0  # split epochs begun: only the first may start locally (alike on every rank)
        if local_start and self.world.world_size == 1:  # Ray starts (or is joined) now, in the background
            background.start()

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, found {epoch}")
        self._drop_ahead()
        self._epoch = epoch

    def __del__(self) -> None:
        carry = getattr(self, "_carry", None)
        if carry is not None and carry.actor_cache:  # killed on the closer thread: the GC may run this anywhere
            try:
                closer.call_later(lambda cache=carry.actor_cache: kill_cached(cache))
            except Exception:  # the interpreter is tearing down (module globals gone): Ray went before
                pass
        coordinator = getattr(self, "_coordinator", None)
        if coordinator is not None:  # it retires once every rank's loader is gone
            try:
                closer.call_later(lambda rank=self.world.rank, me=self._id: coordinator.shutdown.remote(rank, me))
            except Exception:  # the interpreter is tearing down: the coordinator sees the ranks' processes gone
                pass

    def __len__(self) -> int:
        # One rule, with or without torchrun: without filter/flat_map, operators are
        # taken to keep one output row per input row (a rank that runs short raises).
        n = None
        if not rows_changing(self.dataset.ops):
            sizes = list(sizes_of(self.dataset.source, self._epoch, 0, False).values())
            n = None if any(s is None for s in sizes) else sum(sizes)
        if n is not None and self.world.world_size > 1:
            return split_epoch(n, self.batch_size, self.world.world_size, self.settings.drop_last).per_rank
        n = n if n is not None else self._carry.counted_rows  # counted by the last complete epoch
        if n is None:
            raise TypeError(
                f"{self.dataset!r} has no length known before running (filter or flat_map may change the row "
                "count); iterate one epoch first to count it"
            )
        return n // self.batch_size if self.settings.drop_last else math.ceil(n / self.batch_size)

    def stats(self) -> Optional[ExecutionStats]:
        """Execution statistics of the latest epoch (split across ranks: the job's pipeline,
        read from its coordinator at the end of the epoch)."""
        return self._carry.stats

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
        if self._run is None and self._resume is not None:
            return dict(self._resume)  # loaded, not iterated yet: the same state again
        run = self._run.progress() if self._run is not None else None
        return pipeline_state.make_state(self._fingerprint(), self._epoch, run)

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Resume from :meth:`state_dict`: the next iteration delivers only what was not consumed."""
        state = pipeline_state.FORMAT.check(state_dict, self._fingerprint(), strict)
        self._drop_ahead()
        self._resume = dict(state)
        self._run = None
        self._epoch = int(state["epoch"])

    def as_mixture_source(self) -> None:
        """Run as a mixture's source: cut batches in one process as a split epoch does (a budget
        window in rows, from the plan, not in bytes of the blocks as they come), so that
        :meth:`credit_rows` can tell the rows of a state taken here partway through a batch; and
        start each epoch with one read call until its first block is out, so every source's first
        call runs before another's second (the mixture's first batch needs a block of each)."""
        self.settings = dataclasses.replace(self.settings, plan_cut=True, first_call_alone=True)

    def credit_rows(self, state_dict: dict, rows: int, world_size: int, strict: bool = True) -> dict:
        """``state_dict`` (taken on ``world_size`` ranks between two batches) with the first ``rows`` rows
        of every rank's next batch counted as consumed, as a state that resumes on any world size.

        A mixture resumed on another world size asks it of each source its ranks were partway
        through (:mod:`~sbloader.loaders.mix_loader`): the batches are cut from the plan every rank
        computes, so which rows those were is arithmetic. Needs partition sizes known up front (as a
        split epoch does) and, for a state between epochs, the loader's ``seed``.
        """
        state = pipeline_state.FORMAT.check(state_dict, self._fingerprint(), strict)
        if rows <= 0:
            return dict(state)
        source, epoch = self.dataset.source, int(state["epoch"])
        if state.get("epoch_seed") is not None:
            plan = epoch_plan(source, epoch, int(state["epoch_seed"]), self.shuffle)
            base = pipeline_state.run_from_state(state, plan.order)
        elif self.seed is not None:
            plan = epoch_plan(source, epoch, draw_epoch_seed(self.seed, epoch, self.generator), self.shuffle)
            base = PipelineRun(plan.epoch, plan.epoch_seed, order=plan.order)
        else:
            raise StateDictError(
                "credit_rows: found a state between epochs of an unseeded loader, expected a seeded one: the "
                "next epoch's order is drawn at random; pass seed= to the loader")
        spec = self.settings.window
        budget = shuffle_window.default_budget(self.settings.memory_budget) if spec.partitions is None else 0
        window = shuffle_window.split_window(spec, base, source, budget)
        sizes = sizes_of(source, base.epoch, base.epoch_seed, self.shuffle)
        run = plan_split(base, sizes, rows_changing(self.dataset.ops), self.batch_size, world_size, 0,
                         self.settings.drop_last, window)
        return pipeline_state.make_state(self._fingerprint(), epoch, run.progress(0, rows))

    def _fingerprint(self) -> dict:
        return pipeline_state.fingerprint(self.dataset, self.batch_size, self.shuffle)

    def _start_run(self) -> PipelineRun:
        """The epoch this iteration runs: the one a loaded state left unfinished, or the next."""
        resume, self._resume = self._resume, None
        source = self.dataset.source
        if resume is not None and resume.get("epoch_seed") is not None:
            plan = epoch_plan(source, int(resume["epoch"]), int(resume["epoch_seed"]), self.shuffle)
            run = pipeline_state.run_from_state(resume, plan.order)
        else:
            plan = epoch_plan(source, self._epoch, draw_epoch_seed(self.seed, self._epoch, self.generator),
                              self.shuffle)
            run = PipelineRun(plan.epoch, plan.epoch_seed, order=plan.order)
        self._epoch = run.epoch + 1
        return run

    def _split_coordinator(self) -> Any:
        """The job's coordinator of this loader (created by the first rank to ask; one lookup at a time:
        the loop's thread waits for the one a background start began)."""
        with self._coordinator_lock:
            return self._find_coordinator()

    def _find_coordinator(self) -> Any:
        if self._coordinator is None:
            from sbloader.distributed.naming import get_coordinator
            from sbloader.runtime.session import ensure_initialized

            from sbloader.loaders import warm_workers
            from sbloader.runtime.job import identify

            w = self.world
            job = identify(w)
            ensure_initialized()
            self._id = uuid.uuid4().hex  # this loader, recorded by the coordinator until its drop
            self._coordinator = get_coordinator(job, self.name, w.world_size, self._fingerprint(),
                                                w.restart_count, rank=w.rank, loader=self._id)
            warm_workers.give_way(1.0)  # the coordinator runs the pipeline: idle actors here give way
        return self._coordinator

    def _job_seed(self, base: PipelineRun, coordinator: Any) -> PipelineRun:
        """A fresh unseeded epoch with the seed every rank uses (the first rank's draw): the ranks
        cut their batches from one plan, and each rank's torch RNG may draw another seed."""
        if self.seed is not None or base.done or base.taken or base.ahead or base.batches:
            return base  # seeded, or resumed from a state every rank loaded alike
        import ray

        seed = ray.get(coordinator.agree_seed.remote(base.epoch, base.epoch_seed))
        if seed == base.epoch_seed:
            return base
        plan = epoch_plan(self.dataset.source, base.epoch, seed, self.shuffle)
        return PipelineRun(plan.epoch, plan.epoch_seed, order=plan.order)

    def _reconnect(self) -> Any:
        """The job's coordinator anew, after the one this loader had died."""
        with self._coordinator_lock:
            self._coordinator = None
            return self._find_coordinator()

    def __iter__(self) -> EpochIterator:
        previous = self._iterator() if self._iterator is not None else None
        if previous is not None:  # a new epoch while the last one's iterator lives on: end that one
            previous.close()
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # its own carry, the loader's from now on (what this epoch left in it too)
            it = ahead.take()
            ahead.carry.last_split, ahead.carry.counted_rows = self._carry.last_split, self._carry.counted_rows
            self._carry = ahead.carry
        else:
            it = self._opener(self._start_run(), self._carry)()
        self._run, self._stalls, self._iterator = it.run, it.stalls, weakref.ref(it)
        return it

    def start_ahead(self) -> bool:
        """Begin the next epoch now, while the loop reads this one's last batches: its pipeline starts
        (and, split across ranks, its coordinator is found) meanwhile, and the next ``iter()`` takes it
        over (``sbloader/loaders/epoch_ahead.py``; a mixture asks it of a source with two batches
        left). ``state_dict()`` stays this epoch's until then; loading a state or setting the epoch
        drops it. Only between two plain epochs of function stages, and in one process once Ray is up
        (an epoch on local workers forks them: never from this thread). Returns whether it began."""
        if (self._ahead is not None or self._run is None or self._resume is not None
                or self._carry.actor_cache is not None or not epoch_ahead.functions_only(self.dataset)
                or (self.world.world_size == 1 and not background.ready())):  # no local start begun ahead
            return False
        epoch, splits = self._epoch, self._split_epochs

        def undo() -> None:
            self._epoch, self._split_epochs = epoch, splits

        carry = dataclasses.replace(self._carry)  # stats() stays this epoch's until the next iter()
        self._ahead = epoch_ahead.Ahead(self._opener(self._start_run(), carry), undo, carry)
        return True

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.drop()

    def _opener(self, base: PipelineRun, carry: Carry) -> Callable[[], EpochIterator]:
        """What opens the epoch of ``base`` (decided here, alike on every rank; it may be called on another
        thread: :meth:`start_ahead`)."""
        if self.world.world_size == 1:
            return lambda: local_epoch(self.dataset, self.settings, base, carry)
        if self._first_split() and native_split_start.enabled(
                self.dataset, self.settings, base, self.seed is not None, self._carry.actor_cache is not None):
            budget = native_start.budget_before_ray(self.settings.memory_budget)  # the embedded Ray's, or given
            run = self._split(base, budget)
            return lambda: native_split_start.split_start_epoch(
                self, run, native_split_start.local_count(run.plan.per_rank), lambda rest: self._split(rest, budget))

        def joined() -> EpochIterator:
            coordinator = self._split_coordinator()  # joins the job's Ray: the default budget reads it
            budget = shuffle_window.default_budget(self.settings.memory_budget)
            run = self._split(self._job_seed(base, coordinator), budget)
            return run_split_epoch(self.dataset, self.settings, run, coordinator, carry, self._reconnect)

        return joined

    def _first_split(self) -> bool:
        """Whether this is the loader's first split epoch (counted here, never read from the background
        coordinator lookup, whose timing differs between ranks: every rank must decide alike)."""
        self._split_epochs += 1
        return self._split_epochs == 1

    def _split(self, base: PipelineRun, budget: int) -> Any:
        """The job's cut of ``base`` (what the epoch has left), the same on every rank."""
        sizes = sizes_of(self.dataset.source, base.epoch, base.epoch_seed, self.shuffle)
        window = shuffle_window.split_window(self.settings.window, base, self.dataset.source, budget)
        run = plan_split(base, sizes, rows_changing(self.dataset.ops), self.batch_size, self.world.world_size,
                         self.world.rank, self.settings.drop_last, window)
        if run.plan.narrowed:
            shuffle_window.warn_once(self.dataset, narrowed_note(self.settings.window, run.plan.widest,
                                                                 len(base.order)))
        return run


def _accelerator() -> bool:
    import torch

    return torch.accelerator.is_available()
