"""The drop-in ``DataLoader``: torch's signature, loading on a Ray cluster.

Change ``from torch.utils.data import DataLoader`` to ``from sbloader import
DataLoader``. The sampler still runs in the trainer (indices only); every
``dataset[i]`` and ``collate_fn`` call runs in a pool of ``num_workers`` remote
actors; the trainer receives ready, collated batches and only copies each
tensor's bytes once (into pinned memory with ``pin_memory=True``).
"""
from __future__ import annotations

import itertools
import math
import time
import warnings
from typing import Any, Callable, Iterator, Optional

from sbloader.executor.executor import ExecutionOptions, StreamingExecutor, kill_cached
from sbloader.executor.stages import build_stages
from sbloader.loaders.worker import LoaderWorker
from sbloader.sources.batches import ReadyBatchSource, ShardSource
from sbloader.runtime.session import ensure_initialized
from sbloader.core.plan import draw_epoch_seed
from sbloader.core.ops import Op
from sbloader.core.plan import epoch_seed_from, make_epoch_plan
from sbloader.core.errors import StateDictError, UserFunctionError, reraise_as_torch
from sbloader.loaders.fetch_ahead import FetchAhead
from sbloader.core.stats import ExecutionStats, StallStats
from sbloader.core.wire import from_wire, tensors, to_device


_LOADER_COUNTER = itertools.count()


def _decide_split(split: Optional[bool], world: Any, dataset: Any, iterable: bool, sampler: Any,
                  batch_sampler: Any) -> bool:
    """Whether the coordinator splits epochs across ranks (no silent double sharding)."""
    from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

    if world.world_size == 1:
        return False
    known = sampler is None or type(sampler) in (RandomSampler, SequentialSampler, DistributedSampler)
    if split is None:
        if iterable:
            raise ValueError(
                f"world size is {world.world_size} and the loader has an IterableDataset: pass split=True "
                "(the coordinator iterates it once for the job and splits its output across ranks, equal "
                "batch counts on every rank) or split=False (it shards itself by rank: every rank then "
                "iterates its own shard, as under torch)"
            )
        if batch_sampler is not None:
            raise ValueError(
                f"world size is {world.world_size} and the loader has a batch_sampler "
                f"({type(batch_sampler).__name__}), which the coordinator cannot split across ranks: pass "
                "split=False and make the batch_sampler shard itself by rank (every rank then iterates its "
                "own shard, as under torch)"
            )
        if not known:
            raise ValueError(
                f"world size is {world.world_size} and the loader has a custom sampler "
                f"({type(sampler).__name__}): pass split=True to let the coordinator split its order "
                "across ranks, or split=False if it already shards per rank (every rank then iterates "
                "what it yields)"
            )
        return True
    if split and batch_sampler is not None:
        raise ValueError(
            "split=True needs a sampler or an IterableDataset, not a batch_sampler; use split=False for a "
            "batch_sampler that shards itself per rank"
        )
    return bool(split)


def _is_iterable_dataset(dataset: Any) -> bool:
    from torch.utils.data import IterableDataset

    return isinstance(dataset, IterableDataset)


class DataLoader:
    """Drop-in replacement for ``torch.utils.data.DataLoader`` that loads on Ray.

    The positional and keyword arguments are torch's, with the same defaults,
    checks and semantics; the keyword-only arguments after ``in_order`` are
    sbloader's.

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
        multiprocessing_context: has no meaning on Ray; a value is ignored with a warning.
        generator: RNG for the sampler and the epoch seed.
        prefetch_factor: batches in flight per worker (default 2 when workers > 0).
        persistent_workers: keep the worker actors alive between epochs.
        pin_memory_device: accepted for compatibility (deprecated in torch).
        in_order: deliver batches in sampler order (deterministic); False
            delivers them as they are ready.
        seed: fixes the epoch seed to ``f(seed, epoch)`` instead of drawing it.
        split: split each epoch across ranks (world size above 1) through the
            job's split coordinator, equal batch counts on every rank. Default:
            True for a map-style dataset with no sampler or torch's Random,
            Sequential or DistributedSampler; anything else (an
            ``IterableDataset``, a custom sampler) must say. ``True`` with an
            ``IterableDataset``: the coordinator iterates it once for the job
            (sharded by ``get_worker_info()`` over ``num_workers`` workers) and
            splits its batches, so ``len()`` raises ``TypeError``; ``False``:
            every rank iterates what its dataset or sampler yields, as under torch.
        memory_budget: bytes the pipeline may hold in the object store.
        batches_per_partition: batches per unit of work (and of replay).
        worker_num_cpus: CPUs per worker actor.
        worker_resources: extra Ray resources per worker actor.
        device: copy batches to this device (e.g. ``"cuda"``) on a side stream.
        zero_copy: wrap the buffers without copying (read-only over Ray's object store).
            Batches made on the trainer's node are writable views of the process's
            shared-memory slots either way (``sbloader/executor/handoff.py``).
        dataset_id: a name for the dataset, checked on ``load_state_dict``.
        report_stalls: print the stall instrument at the end of each epoch.
        name: the loader's name in the job (default: its creation index in the
            process); ranks find the loader's coordinator by job id and name.
        rank: override the rank (default: torchrun's ``RANK``).
        world_size: override the world size (default: ``WORLD_SIZE``).
        job_id: override the job id (default: ``TORCHELASTIC_RUN_ID``).
        stall_report_s: seconds after which a rank that stopped asking is reported.
        allow_trainer_node: let workers run on the trainer's node even when other
            nodes have CPUs (by default they avoid it; see :mod:`sbloader.runtime.placement`).
    """

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
    ) -> None:
        import torch
        from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler
        from torch.utils.data._utils.collate import default_collate, default_convert

        if num_workers < 0:
            raise ValueError("num_workers option should be non-negative; use num_workers=0 to disable multiprocessing.")
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if num_workers == 0 and prefetch_factor is not None:
            raise ValueError(
                "prefetch_factor option could only be specified in multiprocessing. "
                "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
            )
        elif num_workers > 0 and prefetch_factor is None:
            prefetch_factor = 2
        elif prefetch_factor is not None and prefetch_factor < 0:
            raise ValueError("prefetch_factor option should be non-negative")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")
        if batches_per_partition < 1:
            raise ValueError(f"batches_per_partition must be >= 1, found {batches_per_partition}")

        self._iterable = _is_iterable_dataset(dataset)
        if self._iterable:
            if shuffle not in {False, None}:
                raise ValueError(
                    f"DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle={shuffle}"
                )
            if sampler is not None:
                raise ValueError(
                    f"DataLoader with IterableDataset: expected unspecified sampler option, but got sampler={sampler}"
                )
            if batch_sampler is not None:
                raise ValueError(
                    "DataLoader with IterableDataset: expected unspecified batch_sampler option, "
                    f"but got batch_sampler={batch_sampler}"
                )
        else:
            shuffle = bool(shuffle)
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError(
                    "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"
                )
            batch_size = None
            drop_last = False
        elif batch_size is None and drop_last:
            raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive with drop_last")
        from sbloader.runtime.world import World

        self.world = World.detect(rank=rank, world_size=world_size, job_id=job_id)
        self.split = _decide_split(split, self.world, dataset, self._iterable, sampler, batch_sampler)
        if self.split and self._iterable and batch_size is None:
            raise ValueError(
                "split=True with an IterableDataset needs batch_size (auto-batching): the coordinator equalises "
                "the ranks by cutting the last rows into short batches; pass batch_size= or split=False"
            )
        if multiprocessing_context is not None:
            warnings.warn(
                "multiprocessing_context has no meaning for sbloader (workers are Ray actors); it is ignored",
                stacklevel=2,
            )

        # With ``seed`` and no generator, the order of our own RandomSampler is f(seed, epoch) too.
        self._seeded_sampler = not self._iterable and sampler is None and shuffle and seed is not None \
            and generator is None
        own_batch_sampler = False
        if not self._iterable and sampler is None:
            sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
        if batch_size is not None and batch_sampler is None and not self._iterable:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
            own_batch_sampler = True

        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
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
        self.prefetch_factor = prefetch_factor
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
        self._epoch = 0
        self._epoch_explicit = False
        # only batches the loader cuts itself are positions it can replay
        self._user_batch_sampler = batch_sampler is not None and not own_batch_sampler
        self._run: Any = None  # the current EpochRun (positions, batches, what was taken)
        self._resume: Optional[dict] = None  # a loaded state, applied by the next iteration
        self._base_seed: Optional[int] = None
        self._last_stats: Optional[ExecutionStats] = None
        self._last_stalls: Optional[StallStats] = None
        self._torch = torch
        self._actor_cache: dict[int, list] = {}
        self._estimates: Optional[list] = None
        self.name = name if name is not None else f"loader{next(_LOADER_COUNTER)}"
        self.stall_report_s = stall_report_s
        self.allow_trainer_node = allow_trainer_node
        self._coordinator: Any = None
        self._last_split_run: Any = None  # the last epoch this rank finished under torchrun

    def __del__(self) -> None:
        kill_cached(getattr(self, "_actor_cache", None))

    # ----- torch-compatible surface -------------------------------------------

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None or (self._iterable and self.batch_size is not None)

    @property
    def _index_sampler(self) -> Any:
        return self.batch_sampler if self._auto_collation and not self._iterable else self.sampler

    def __len__(self) -> int:
        if self.split and self._iterable:  # the coordinator splits a stream whose total it learns at the end
            raise TypeError(f"object of type '{type(self).__name__}' has no len(): it splits an IterableDataset "
                            "across ranks, and the per-rank count is known only once the dataset is exhausted")
        if self.split:
            from sbloader.distributed.dropin_client import split_len

            return split_len(self)
        if self._iterable:
            length = len(self.dataset)
            if self.batch_size is not None:
                length = length // self.batch_size if self.drop_last else math.ceil(length / self.batch_size)
            return length
        return len(self._index_sampler)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration (its seed is ``f(seed, epoch)`` when ``seed`` is set)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, found {epoch}")
        if self._resume is not None and self._resume.get("epoch") != epoch:
            warnings.warn(
                f"set_epoch({epoch}) after load_state_dict of epoch {self._resume.get('epoch')}: the loaded "
                "state is dropped and epoch starts fresh", stacklevel=2)
            self._resume = None
        self._epoch = epoch
        self._epoch_explicit = True

    @property
    def _stateful(self) -> bool:
        """Whether this loader can checkpoint: a map-style dataset batched by its own BatchSampler."""
        return not self._iterable and self._auto_collation and not self._user_batch_sampler

    def state_dict(self) -> dict:
        """A small JSON-serialisable state: what the training loop consumed so far.

        Taken after the loop received its k-th batch of the epoch, it records the
        first k batches of every rank. Prefetched batches are never in it. Rank 0
        can save it alone; every rank of the resumed job loads it. Under torchrun
        with ``in_order=True`` (the default) the plan fixes each rank's batches and
        the cut is computed here, with no call to the coordinator; with
        ``in_order=False`` the coordinator's delivery logs decide (one actor call,
        waiting, bounded, for a rank that has not received its k-th batch yet).
        """
        from sbloader.loaders import dropin_state as _epoch_state
        from sbloader.core import ledger

        if not self._stateful:
            raise StateDictError(
                "state_dict() needs a map-style dataset batched by the loader itself (batch_size=...); "
                "an IterableDataset, a custom batch_sampler or batch_size=None cannot be replayed"
            )
        run = self._run
        if run is None or run.complete:
            return _epoch_state.make_state(self, run, [])
        if self.split:
            from sbloader.distributed.dropin_client import cut

            consumed = cut(self, run)
        else:
            consumed = ledger.merge(list(run.prior) + [r for b in run.taken for r in run.batch_ranges[b]])
        return _epoch_state.make_state(self, run, consumed)

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Resume from a :meth:`state_dict`: the next iteration replays exactly what was not consumed.

        Args:
            state_dict: a state from :meth:`state_dict` (possibly of another world size).
            strict: check that the dataset, batch size and sampler match; False loads anyway.

        Raises:
            StateDictError: the state does not match this loader ("found X, expected Y").
        """
        from sbloader.loaders import dropin_state as _epoch_state

        if not self._stateful:
            raise StateDictError("load_state_dict() needs a map-style dataset batched by the loader itself")
        state = _epoch_state.validate(self, state_dict, strict)
        _epoch_state.restore_generator(self, state)
        self._resume = dict(state)
        self._run = None
        self._epoch = int(state["epoch"])
        self._epoch_explicit = True
        if state.get("base_seed") is not None:
            self._base_seed = int(state["base_seed"])

    def stats(self) -> Optional[ExecutionStats]:
        """Execution statistics of the latest epoch (None before any, or with num_workers=0)."""
        return self._last_stats

    def stall_stats(self) -> Optional[StallStats]:
        """The data-stall instrument of the latest epoch."""
        return self._last_stalls

    def __iter__(self) -> Iterator[Any]:
        if self.split and self._iterable:
            from sbloader.distributed.dropin_client import iter_split_stream

            return iter_split_stream(self)
        if self.split:
            from sbloader.distributed.dropin_client import iter_split

            return iter_split(self)
        if self.num_workers == 0:
            return self._iter_local()
        return self._iter_remote()

    # ----- iteration ----------------------------------------------------------

    def _pin(self) -> bool:
        if not self.pin_memory:
            return False
        if not self._torch.accelerator.is_available():
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=3,
            )
            return False
        return True

    def _next_epoch(self) -> tuple[int, int]:
        epoch = self._epoch
        if self.seed is None and self.persistent_workers and self.num_workers > 0:
            # torch draws the base seed once per persistent iterator (later epochs
            # reset it without a draw): draw it once too, then derive per epoch.
            if self._base_seed is None:
                self._base_seed = draw_epoch_seed(None, epoch, self.generator)
            seed = epoch_seed_from(self._base_seed, epoch)
        else:
            seed = draw_epoch_seed(self.seed, epoch, self.generator)
        if self._seeded_sampler:
            self.sampler.generator = self._torch.Generator().manual_seed(seed)
        self._epoch = epoch + 1
        self._epoch_explicit = False
        return epoch, seed

    def _iter_local(self) -> Iterator[Any]:
        """``num_workers=0``: load in this process, exactly as torch does."""
        import itertools

        from sbloader.core.context import seed_globals

        if self._stateful:
            from sbloader.loaders.dropin_state import start_run

            self._run = start_run(self, 1)
            epoch, epoch_seed = self._run.epoch, self._run.epoch_seed
        else:
            epoch, epoch_seed = self._next_epoch()  # drawn before the sampler's first draw, as torch
        if self.seed is not None:
            # Only when asked: without ``seed`` the trainer's RNGs stay as torch leaves them.
            seed_globals(epoch_seed)
        pin = self._pin()
        if self._iterable:
            it = iter(self.dataset)
            if self.batch_size is None:
                items: Iterator[Any] = (self.collate_fn(x) for x in it)
            else:
                def batches() -> Iterator[Any]:
                    while True:
                        chunk = list(itertools.islice(it, self.batch_size))
                        if not chunk or (self.drop_last and len(chunk) < self.batch_size):
                            return
                        yield self.collate_fn(chunk)

                items = batches()
        elif self._stateful:
            fetch = _LocalCollate(self.dataset, self.collate_fn, True)
            run = self._run
            for j, indices in enumerate(run.batches):
                if self.seed is not None and j % self.batches_per_partition == 0:
                    # Seeded per partition as a remote worker is (the pool is operator 0): a resumed
                    # epoch replays a batch with the same draws as the uninterrupted run.
                    from sbloader.core.context import task_context

                    seed_globals(task_context(epoch, epoch_seed, run.ids[j], "LoaderWorker", 0).ctx.seed)
                batch = fetch(indices)
                run.taken.append(j)
                yield _pin_batch(batch) if pin else batch
            run.complete = True
            return
        else:
            fetch = _LocalCollate(self.dataset, self.collate_fn, self._auto_collation)
            items = (fetch(i) for i in self._index_sampler)
        for batch in items:
            yield _pin_batch(batch) if pin else batch

    def _worker_op(self) -> Op:
        """The pool of ``num_workers`` remote workers that fetch and collate."""
        workers = max(1, self.num_workers)
        return Op(
            "map_batches", LoaderWorker, "LoaderWorker", index=0,
            num_cpus=self.worker_num_cpus, resources=self.worker_resources,
            concurrency=(workers, workers),
            fn_constructor_args=(self._worker_config(workers),),
            fuse_read=True,
        )

    def _worker_config(self, workers: int) -> Any:
        """The pool's constructor arguments, pickled once per epoch here (as torch's
        workers see the dataset as it is when the epoch's iterator is made)."""
        from sbloader.executor.tasks import pack

        return pack(dict(
            dataset=self.dataset, collate_fn=self.collate_fn, auto_collation=self._auto_collation,
            num_workers=workers, worker_init_fn=self.worker_init_fn,
            batch_size=self.batch_size, drop_last=self.drop_last,
        ))

    def _build(self, epoch: int, epoch_seed: int) -> StreamingExecutor:
        ensure_initialized()
        fp = {"type": type(self.dataset).__name__, "len": _safe_len(self.dataset), "dataset_id": self.dataset_id}
        if self._iterable:
            source = ShardSource(self.num_workers, fp)
        elif self._stateful:
            source = ReadyBatchSource(self._run.batches, self.batches_per_partition, fp, ids=self._run.ids)
        else:
            batches = [list(b) if self._auto_collation else b for b in self._index_sampler]
            source = ReadyBatchSource(batches, self.batches_per_partition, fp)
        op = self._worker_op()
        ids = [p.id for p in source.partitions(epoch, epoch_seed)]
        plan = make_epoch_plan(ids, epoch, epoch_seed, shuffle=False)
        prefetch = max(1, math.ceil((self.prefetch_factor or 2) * self.num_workers / self.batches_per_partition))
        from sbloader.runtime.placement import exclusions_here

        options = ExecutionOptions(memory_budget=self.memory_budget, deterministic=self.in_order,
                                   exclude_nodes=exclusions_here(self.allow_trainer_node),
                                   prefetch_blocks=prefetch, progress=False)
        cache = self._actor_cache if self.persistent_workers else None
        from sbloader.executor.handoff import consumer_arena

        return StreamingExecutor(source, build_stages(source.name, [op]), plan, options, actor_cache=cache,
                                 estimates=self._estimates, arena=consumer_arena())

    def _iter_remote(self) -> Iterator[Any]:
        t_start = time.perf_counter()
        if self._stateful:
            from sbloader.loaders.dropin_state import start_run

            self._run = start_run(self, 1)
            epoch, epoch_seed = self._run.epoch, self._run.epoch_seed
        else:
            epoch, epoch_seed = self._next_epoch()
        executor = self._build(epoch, epoch_seed).start()
        run = self._run if self._stateful else None
        self._last_stats = executor.stats()
        stalls = StallStats()
        self._last_stalls = stalls
        stream = None
        if self.device is not None and str(self.device).startswith("cuda"):
            stream = self._torch.cuda.Stream(device=self.device)
        # A background thread takes ready blocks and makes the writable (or pinned)
        # tensors, up to ``prefetch_factor`` batches ahead; this loop only hands them on.
        fetch = FetchAhead(self._produce(executor, self._pin(), stalls), depth=max(1, self.prefetch_factor or 2))
        held: list[int] = []  # zero-copy blocks the loop still views
        try:
            while True:
                try:
                    batch, index, nbytes = next(fetch)
                except StopIteration:
                    break
                except TimeoutError:
                    raise RuntimeError(f"DataLoader timed out after {self.timeout} seconds") from None
                except UserFunctionError as e:
                    reraise_as_torch(e)
                finally:
                    stalls.wait_ready_s = fetch.wait_s
                if nbytes:
                    held.append(nbytes)
                    while len(held) > 2:  # the loop holds the previous batch while it asks for the next
                        executor.release(held.pop(0))
                if stream is not None:
                    batch = self._to_device(batch, stream)
                stalls.batches += 1
                if run is not None:
                    run.taken.append(index)
                yield batch
            if run is not None:
                run.complete = True
        finally:
            stalls.wall_s = time.perf_counter() - t_start
            fetch.close(wake=executor.shutdown)  # shutting down wakes a thread waiting for a block
            for n in held:
                executor.release(n)
            self._estimates = executor.estimates()
            if self.report_stalls:
                print(f"sbloader epoch {epoch}: {stalls}")

    def _produce(self, executor: StreamingExecutor, pin: bool, stalls: StallStats) -> Iterator[tuple]:
        """(Fetch thread) Each ready batch as ``(tensors, batch index in the epoch, bytes to release)``.

        With copies (the default) a block's bytes are released to the budget as soon
        as its batches are made (a block read from a shared-memory slot keeps its slot
        until its batches are gone: they view it); zero-copy batches view the block,
        so the consumer releases it once the training loop moved on.
        """
        copy = not self.zero_copy
        while True:
            item = executor.get_next(timeout=self.timeout or None)
            if item is None:
                return
            t0 = time.perf_counter()
            block = executor.fetch(item)
            wires = block["batch"]
            del block
            out = []
            for i, wire in enumerate(wires):
                last = i == len(wires) - 1
                out.append((from_wire(wire, pin=pin, copy=copy),
                            item.meta.seq * self.batches_per_partition + i,
                            item.meta.nbytes if last and not copy else 0))
            del wires
            if copy:
                executor.release(item.meta.nbytes)
            stalls.fetch_s += time.perf_counter() - t0
            yield from out
            out = []

    def _to_device(self, batch: Any, stream: Any) -> Any:
        torch = self._torch
        with torch.cuda.stream(stream):
            moved = to_device(batch, self.device, non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for t in tensors(moved):
            t.record_stream(torch.cuda.current_stream(self.device))
        return moved


class _LocalCollate:
    """``num_workers=0``: fetch and collate in the calling process."""

    def __init__(self, dataset: Any, collate_fn: Callable, auto: bool) -> None:
        self.dataset, self.collate_fn, self.auto = dataset, collate_fn, auto

    def __call__(self, item: Any) -> Any:
        samples = [self.dataset[i] for i in item] if self.auto else self.dataset[item]
        return self.collate_fn(samples)


def _pin_batch(batch: Any) -> Any:
    from sbloader.core.wire import from_wire, to_wire

    return from_wire(to_wire(batch), pin=True)


def _safe_len(x: Any) -> Optional[int]:
    try:
        return len(x)
    except TypeError:
        return None
