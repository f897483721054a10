"""The drop-in ``DataLoader``: torch's signature, loading on a Ray cluster.

Change ``from torch.utils.data import DataLoader`` to ``from sbloader import DataLoader``. The
sampler still runs in the trainer (indices only); every ``dataset[i]`` and ``collate_fn`` call runs
in a pool of ``num_workers`` remote actors; the trainer receives ready, collated batches and copies
each tensor's bytes once (into pinned memory with ``pin_memory=True``). Each iteration is an epoch
object (:mod:`~sbloader.loaders.dropin_epoch`) built from a snapshot of the loader's arguments.
"""
from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Any, Callable, Generic, Optional, TypeVar

from sbloader.core.plan import loader_epoch_seed
from sbloader.core.split import split_epoch as split_positions
from sbloader.core.stats import ExecutionStats, StallStats
from sbloader.loaders import closer, dropin_args, dropin_checkpoint, dropin_state
from sbloader.loaders import torch_loader  # noqa: F401  (torch's DataLoader class as it is at sbloader's import)
from sbloader.loaders.dropin_args import check_torch_args, decide_split, is_iterable_dataset
from sbloader.loaders.dropin_settings import DropinCarry, DropinSettings, resolve, safe_len, warn_excess_workers
from sbloader.loaders.epoch import EpochIterator
from sbloader.loaders.iterable_resume import IterableRun, run_from_state
from sbloader.runtime.world import World

_LOADER_COUNTER = itertools.count()
T_co = TypeVar("T_co", covariant=True)


class DataLoader(Generic[T_co]):
    """Drop-in replacement for ``torch.utils.data.DataLoader`` that loads on Ray.

    The positional and keyword arguments are torch's, with the same defaults, checks
    and semantics; the keyword-only arguments after ``in_order`` are sbloader's.

    Args:
        dataset: a map-style dataset (``__getitem__``/``__len__``) or an
            ``IterableDataset``.
        batch_size: samples per batch (None disables auto-batching).
        shuffle: reshuffle every iteration (map-style only).
        sampler: yields dataset indices; exclusive with ``shuffle``.
        batch_sampler: yields lists of indices; exclusive with batch_size,
            shuffle, sampler and drop_last.
        num_workers: remote loader actors; 0 loads in this process, like torch.
        collate_fn: merges samples into a batch; runs in the remote workers.
        pin_memory: copy batches into page-locked memory (only with an accelerator).
        drop_last: drop the last incomplete batch.
        timeout: seconds to wait for a batch before raising (0: forever).
        worker_init_fn: called with the worker id once in each remote worker.
        multiprocessing_context: checked as torch checks it; a valid one has no effect (workers are Ray actors).
        generator: RNG for the sampler and the epoch seed.
        prefetch_factor: batches in flight per worker (default 2 when workers > 0).
        persistent_workers: keep the worker actors alive between epochs.
        pin_memory_device: accepted for compatibility (deprecated in torch).
        in_order: deliver batches in sampler order (deterministic); False
            delivers them as they are ready.
        seed: fixes the epoch seed to ``f(seed, epoch)`` instead of drawing it.
        split: split each epoch across ranks (world size above 1) through the job's
            split coordinator, equal batch counts on every rank. Default: True for a
            map-style dataset with no sampler, torch's Random or SequentialSampler, or a
            DistributedSampler of the job's world (one of another world is its own split);
            anything else must say. ``True`` with an ``IterableDataset``: the coordinator
            iterates it once for the job and splits its batches (``len()`` raises
            ``TypeError``); ``False``: every rank iterates what its dataset or sampler
            yields, as under torch (``docs/torchrun.md``).
        memory_budget: bytes the pipeline may hold in the object store.
        batches_per_partition: batches per unit of work (and of replay).
        worker_num_cpus: CPUs per worker actor.
        worker_resources: extra Ray resources per worker actor.
        device: copy batches to this device (e.g. ``"cuda"``) on a side stream.
        zero_copy: wrap the buffers without copying (read-only over Ray's object store;
            batches made on the trainer's node are writable shared-memory views either way).
        dataset_id: a name for the dataset, checked on ``load_state_dict``.
        report_stalls: print the stall instrument at the end of each epoch.
        name: the loader's name in the job (default: its creation index in the
            process); ranks find the loader's coordinator by job id and name.
        rank: override the rank (default: torchrun's ``RANK``).
        world_size: override the world size (default: ``WORLD_SIZE``).
        job_id: the job's id, the same on every rank and unique per job (default: taken from the
            launcher, see docs/launchers.md; needed only where the launcher gives nothing).
        stall_report_s: seconds after which a rank that stopped asking is reported.
        allow_trainer_node: let workers run on the trainer's node even when other
            nodes have CPUs (by default they avoid it; see :mod:`sbloader.runtime.placement`).
        start_timeout: seconds the workers may take to start (placed, constructed,
            ``worker_init_fn`` run) before ``WorkerStartError``; ``timeout`` counts only after.
        snapshot_every_n_steps: torchdata ``StatefulDataLoader``'s; accepted and not needed: the
            state is computed at any step (map-style: from the plan; iterable: each batch
            carries its shard's snapshot), so every step is a snapshot.
        local_start: while the worker pool is not up (Ray starting, the first epoch), a map-style
            epoch starts on ``num_workers`` worker processes forked here, as torch's, and the pool
            takes over once its actors are up (:mod:`~sbloader.loaders.local_start`). False: every
            batch comes from the pool (a trainer node whose CPUs are kept for the trainer);
            ``SBLOADER_LOCAL_START=0`` turns it off process-wide.

    What is the same as torch's and what differs: ``docs/user_guide.md``.
    """

    def __new__(cls, dataset: Any = None, *args: Any, **kwargs: Any) -> "DataLoader":
        # a dataset may name its own subclass: sbloader.mix(...)'s (sbloader/loaders/mix_dropin.py)
        # (looked up on the dataset's class: a dataset's own __getattr__ never answers it)
        own = getattr(type(dataset), "dropin_loader_class", None) if cls is DataLoader else None
        return super().__new__(own() if own is not None else cls)

    def __init__(
        self,
        dataset: Any,
        batch_size: Optional[int] = 1,
        shuffle: Optional[bool] = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Optional[Callable] = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Optional[Callable[[int], None]] = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: Optional[int] = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: Optional[int] = None,
        split: Optional[bool] = None,
        memory_budget: Optional[int] = None,
        batches_per_partition: int = 1,
        worker_num_cpus: float = 1.0,
        worker_resources: Optional[dict] = None,
        device: Any = None,
        zero_copy: bool = False,
        dataset_id: Optional[str] = None,
        report_stalls: bool = False,
        name: Optional[str] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        job_id: Optional[str] = None,
        stall_report_s: float = 60.0,
        allow_trainer_node: bool = False,
        start_timeout: Optional[float] = 300.0,
        snapshot_every_n_steps: Optional[int] = 1,
        local_start: bool = True,
    ) -> None:
        import torch
        from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler
        from torch.utils.data._utils.collate import default_collate, default_convert

        self._iterable = is_iterable_dataset(dataset)
        b = check_torch_args(iterable=self._iterable, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                             batch_sampler=batch_sampler, num_workers=num_workers, drop_last=drop_last,
                             timeout=timeout, prefetch_factor=prefetch_factor,
                             persistent_workers=persistent_workers, batches_per_partition=batches_per_partition,
                             shuffle_target=dataset)
        dropin_args.check_multiprocessing_context(multiprocessing_context, num_workers)
        dataset = dropin_args.datapipe_with_shuffle(dataset, shuffle)
        warn_excess_workers(num_workers, worker_num_cpus)
        self.world = World.detect(rank=rank, world_size=world_size, job_id=job_id)
        self.split = decide_split(split, self.world, dataset, self._iterable, sampler, batch_sampler)
        if self.split and self._iterable and b.batch_size is None:
            raise ValueError(
                "split=True with an IterableDataset needs batch_size (auto-batching): the coordinator equalises "
                "the ranks by cutting the last rows into short batches; pass batch_size= or split=False"
            )
        # With ``seed`` and no generator, the order of our own RandomSampler is f(seed, epoch) too.
        self._seeded_sampler = (not self._iterable and sampler is None and b.shuffle and seed is not None
                                and generator is None)
        own_batch_sampler = False
        if not self._iterable and sampler is None:
            sampler = RandomSampler(dataset, generator=generator) if b.shuffle else SequentialSampler(dataset)
        if b.batch_size is not None and batch_sampler is None and not self._iterable:
            batch_sampler = BatchSampler(sampler, b.batch_size, b.drop_last)
            own_batch_sampler = True
        self.dataset = dataset
        self.batch_size = b.batch_size
        self.drop_last = b.drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.num_workers = num_workers
        self.collate_fn = collate_fn or (default_collate if self._auto_collation else default_convert)
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.generator = generator
        self.prefetch_factor = b.prefetch_factor
        self.persistent_workers = persistent_workers
        self.in_order = in_order
        self.seed = seed
        self.memory_budget = memory_budget
        self.batches_per_partition = batches_per_partition
        self.worker_num_cpus = worker_num_cpus
        self.worker_resources = worker_resources
        self.device = device
        self.zero_copy = zero_copy
        self.dataset_id = dataset_id
        self.report_stalls = report_stalls
        self.name = name if name is not None else f"loader{next(_LOADER_COUNTER)}"
        self.stall_report_s = stall_report_s
        self.allow_trainer_node, self.start_timeout = allow_trainer_node, start_timeout
        if snapshot_every_n_steps is not None and snapshot_every_n_steps < 0:
            raise ValueError(f"snapshot_every_n_steps must be >= 0 or None, found {snapshot_every_n_steps}")
        self.snapshot_every_n_steps = snapshot_every_n_steps  # every step is one here (see the docstring)
        self._torch = torch
        self._epoch = 0
        self._user_batch_sampler = batch_sampler is not None and not own_batch_sampler  # not replayable
        self._run: Optional[dropin_state.EpochRun] = None  # the current epoch's (positions, batches, taken)
        self._unreplayable: Optional[str] = None  # why the current epoch cannot be checkpointed (its keys)
        self._stalls: Optional[StallStats] = None
        self._iterator: Optional[weakref.ref] = None
        self._resume: Optional[dict] = None  # a loaded state, applied by the next iteration
        self._base_seed: Optional[int] = None
        self._carry = DropinCarry()
        self._split_epochs = 0  # split epochs begun: only the first may start locally (alike on every rank)
        self._len_reported: Optional[int] = None  # an IterableDataset's len(), once the user asked (torch's check)
        self.local_start = local_start
        if num_workers > 0:  # Ray starts (or is joined) now, in the background: the first batch never waits
            from sbloader.runtime import background

            background.start()
        self._initialized = True

    def __setattr__(self, attr: str, val: Any) -> None:
        if attr in dropin_args.GUARDED_ATTRIBUTES and self.__dict__.get("_initialized", False):
            # torch's guard: the sampler, batching and plan were derived from these
            raise ValueError(f"{attr} attribute should not be set after {type(self).__name__} is initialized")
        super().__setattr__(attr, val)

    def __del__(self) -> None:
        carry = getattr(self, "_carry", None)
        if carry is not None:  # its actors go on the closer thread: the GC may run this anywhere
            carry.dropped = True
            try:
                closer.call_later(carry.drop)
            except Exception:  # the interpreter is tearing down (module globals gone): Ray went before
                pass

    # ----- torch-compatible surface -------------------------------------------

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None or (self._iterable and self.batch_size is not None)

    @property
    def _index_sampler(self) -> Any:
        return self.batch_sampler if self._auto_collation and not self._iterable else self.sampler

    @property
    def _stateful(self) -> bool:
        """Whether this loader can checkpoint: an IterableDataset (one rank's), or a map-style dataset
        batched by its own BatchSampler (or unbatched, ``batch_size=None``)."""
        if self._iterable:
            return not self.split
        return not self._user_batch_sampler  # batch_size=None: batches of one index

    def __len__(self) -> int:
        if self.split and self._iterable:  # the coordinator splits a stream whose total it learns at the end
            raise TypeError(f"object of type '{type(self).__name__}' has no len(): it splits an IterableDataset "
                            "across ranks, and the per-rank count is known only once the dataset is exhausted")
        if self.split:
            positions = dropin_state.order_length(self.sampler, len(self.dataset))
            return split_positions(positions, self.batch_size or 1, self.world.world_size, self.drop_last).per_rank
        if self._iterable:
            length = self._len_reported = len(self.dataset)
            if self.batch_size is not None:
                length = length // self.batch_size if self.drop_last else -(-length // self.batch_size)
            return length
        return len(self._index_sampler)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration (its seed is ``f(seed, epoch)`` when ``seed`` is set)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, found {epoch}")
        if self._resume is not None and self._resume.get("epoch") != epoch:
            # the epoch after a state taken at the last batch of its own (an empty remainder) is the
            # expected continuation: only another epoch drops a loaded state worth a warning
            # and a state drawn by state_dict() before iterating was never loaded: it goes quietly
            if not (self._resume.get("empty_remainder") and epoch == self._resume.get("epoch", -2) + 1) \
                    and not getattr(self, "_resume_drawn", False):
                warnings.warn(
                    f"set_epoch({epoch}) after load_state_dict of epoch {self._resume.get('epoch')}: the loaded "
                    "state is dropped and epoch starts fresh", stacklevel=2)
            self._resume = None
        self._epoch = epoch

    def state_dict(self) -> dict:
        """A small state of what the training loop consumed so far (torch.save-able; JSON-serialisable
        when a Stateful dataset's or sampler's own state is).

        Map-style: taken after the loop received its k-th batch of the epoch, it records the
        first k batches of every rank (prefetched batches are never in it); rank 0 can save it
        alone, every rank of the resumed job loads it (any world size). Under torchrun with
        ``in_order=True`` the cut is computed here; with ``in_order=False`` the coordinator's
        delivery logs decide (one bounded actor call). An ``IterableDataset``: each worker
        shard's snapshot (its own ``state_dict()``s, or the samples it produced). A dataset or
        sampler with ``state_dict``/``load_state_dict`` has its state in it (see
        :mod:`~sbloader.loaders.dropin_checkpoint`).
        """
        return dropin_checkpoint.loader_state(self)

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Resume from a :meth:`state_dict`: the next iteration replays exactly what was not consumed.

        Args:
            state_dict: a state from :meth:`state_dict` (possibly of another world size or ``num_workers``).
            strict: check that the dataset, batch size and sampler match; False loads anyway.

        Raises:
            StateDictError: the state does not match this loader ("found X, expected Y").
        """
        dropin_checkpoint.load_loader_state(self, state_dict, strict)

    def stats(self) -> Optional[ExecutionStats]:
        """Execution statistics of the latest epoch's pool (None before any, with num_workers=0, or for an
        epoch the local worker processes made alone)."""
        return self._carry.stats

    def stall_stats(self) -> Optional[StallStats]:
        """The data-stall instrument of the latest epoch."""
        return self._stalls

    # ----- iteration ----------------------------------------------------------

    def __iter__(self) -> EpochIterator:
        previous = self._iterator() if self._iterator is not None else None
        if previous is not None:  # a new epoch while the last one's iterator lives on: end that one
            previous.close()
        from sbloader.loaders import dropin_iter

        s = self._settings()
        if self.split:
            it = dropin_iter.split_start_epoch(self, s)
        else:
            it = dropin_iter.start_epoch(s, self._carry, *self._begin())
            if self._iterable and self._len_reported is not None:
                it.after_batch = dropin_args.length_check(self.dataset, self._len_reported, self.num_workers)
        self._stalls, self._iterator = it.stalls, weakref.ref(it)
        return it

    def _begin(self) -> tuple:
        """The next epoch of a loader that is not split, and this loader's bookkeeping of it: ``(run,
        sampler, epoch, epoch_seed)``. ``run``: the epoch's plan and the loop's record (an ``EpochRun``, or
        an ``IterableRun`` of the shards' snapshots; None where no state is kept); ``sampler``: what a run
        without a plan iterates (the index sampler, or the keys it drew)."""
        sampler, self._unreplayable = self._index_sampler, None
        if self._iterable:  # where a loaded state left its shards, or fresh
            resume, self._resume = self._resume, None
            if resume is None:
                run = IterableRun(*self._next_epoch())
            else:
                run = run_from_state(resume["iterable"], self._next_epoch)
                self._epoch = run.epoch + 1
        else:
            try:
                run = self._start_run(1) if self._stateful else None
            except dropin_state.KeysNotIndices as keys:  # batch_size=None, a sampler of lists (say): run them as drawn
                run, sampler, self._unreplayable = None, keys.keys, str(keys)
        self._run = run
        epoch, epoch_seed = (run.epoch, run.epoch_seed) if run is not None else self._next_epoch()
        return run, sampler, epoch, epoch_seed

    def _settings(self) -> DropinSettings:
        """The arguments this epoch runs with, as they are now."""
        return resolve(self, self._auto_collation)

    def _next_epoch(self) -> tuple[int, int]:
        """The next epoch and its seed (drawn as torch draws its base seed, or ``f(seed, epoch)``)."""
        epoch = self._epoch
        seed, self._base_seed = loader_epoch_seed(self.seed, epoch, self.generator, self._base_seed,
                                                  self.persistent_workers and self.num_workers > 0)
        if self._seeded_sampler:
            self.sampler.generator = self._torch.Generator().manual_seed(seed)
        self._epoch = epoch + 1
        return epoch, seed

    def _start_run(self, world_size: int) -> dropin_state.EpochRun:
        """Begin the next epoch: fresh, or the one a loaded state left unfinished."""
        resume, self._resume = self._resume, None
        run = dropin_state.start_run(self.sampler, len(self.dataset), resume, self._next_epoch,
                                     self.batch_size or 1, world_size, self.drop_last, whole=self.split)
        self._epoch = run.epoch + 1
        return run

    def _coordinator(self, stream: bool = False) -> Any:
        """The loader's coordinator: found, or created (then rank 0 has it start the worker pool)."""
        if self._carry.coordinator is None:
            fp = {"dataset": type(self.dataset).__name__, "len": safe_len(self.dataset),
                  "batch_size": self.batch_size, "drop_last": self.drop_last, "dataset_id": self.dataset_id}
            from sbloader.loaders.dropin_epoch import find_coordinator

            self._carry.coordinator = find_coordinator(self.world, self.name, fp, self.stall_report_s,
                                                       self._settings(), stream, self._carry)
            self._carry.lease_interval_s = min(1.0, self.stall_report_s / 4)
        return self._carry.coordinator

    def _reconnect(self) -> Any:
        """A new coordinator after the old one died."""
        self._carry.coordinator = None
        return self._coordinator()
