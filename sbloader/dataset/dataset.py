"""Dataset: a lazy, immutable logical plan over a source.

Every transformation returns a new Dataset; nothing runs until iteration. Each
iteration is one *execution* (one epoch): the plan is cut into stages and run by
a :class:`~sbloader.executor.executor.StreamingExecutor`.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Optional

from sbloader.core.block import Batch
from sbloader.core.ops import Concurrency, Op, known_rows, op_name, rows_changing
from sbloader.core.plan import EpochPlan, draw_epoch_seed, make_epoch_plan
from sbloader.core.stats import ExecutionStats
from sbloader.executor.executor import StreamingExecutor
from sbloader.executor.launch import arena_here, options_here, start_execution
from sbloader.core.window import WindowSpec
from sbloader.loaders.batching import Row, iter_blocks, iter_rows, window_of
from sbloader.loaders.shuffle_window import prefetch_hint, window_batches
from sbloader.loaders.pipeline_loader import PipelineLoader
from sbloader.loaders.torch_iterable import TorchIterableDataset
from sbloader.loaders.tensors import columns_to_torch
from sbloader.sources.base import Source


class Dataset:
    """A lazy pipeline: a source followed by operators.

    Build one with :func:`sbloader.from_items`, :func:`sbloader.range` or
    :func:`sbloader.from_torch`, chain ``map``/``map_batches``/``filter``/
    ``flat_map``, then iterate.
    """

    def __init__(self, source: Source, ops: tuple[Op, ...] = ()) -> None:
        self._source = source
        self._ops = ops
        self._last: list[Optional[ExecutionStats]] = [None]

    # ----- transformations -------------------------------------------------

    def _with(self, kind: str, fn: Any, **kw: Any) -> "Dataset":
        op = Op(kind, fn, op_name(kind, fn), index=len(self._ops), **kw)
        return Dataset(self._source, self._ops + (op,))

    def map(self, fn: Callable[[dict], dict], *, num_cpus: Optional[float] = None,
            num_gpus: Optional[float] = None, resources: Optional[Mapping[str, float]] = None,
            concurrency: Optional[int] = None, fn_args: tuple = (), fn_kwargs: Optional[dict] = None) -> "Dataset":
        """Apply ``fn(row) -> row`` to every row (rows are dicts)."""
        return self._with("map", fn, num_cpus=num_cpus, num_gpus=num_gpus, resources=resources,
                          concurrency=concurrency, fn_args=fn_args, fn_kwargs=fn_kwargs or {})

    def map_batches(self, fn: Any, *, batch_size: Optional[int] = None, num_cpus: Optional[float] = None,
                    num_gpus: Optional[float] = None, resources: Optional[Mapping[str, float]] = None,
                    concurrency: Concurrency = None, fn_args: tuple = (), fn_kwargs: Optional[dict] = None,
                    fn_constructor_args: tuple = (), fn_constructor_kwargs: Optional[dict] = None) -> "Dataset":
        """Apply ``fn(batch) -> batch`` to batches (dicts of NumPy arrays).

        A function runs as Ray tasks; a callable class runs in an actor pool, built
        once per actor, whose size autoscales within ``concurrency=(min, max)``.
        Batches never span two partitions.

        Args:
            fn: a function, or a class whose instances are callable on a batch.
            batch_size: rows per call (None: a whole block).
            num_cpus: CPUs per task or actor (default 1).
            num_gpus: GPUs per task or actor.
            resources: extra Ray resources per task or actor.
            concurrency: tasks in flight (function) or ``n``/``(min, max)`` actors.
            fn_args: extra positional arguments per call.
            fn_kwargs: extra keyword arguments per call.
            fn_constructor_args: constructor arguments of a callable class.
            fn_constructor_kwargs: constructor keyword arguments of a callable class.
        """
        return self._with("map_batches", fn, batch_size=batch_size, num_cpus=num_cpus, num_gpus=num_gpus,
                          resources=resources, concurrency=concurrency, fn_args=fn_args,
                          fn_kwargs=fn_kwargs or {}, fn_constructor_args=fn_constructor_args,
                          fn_constructor_kwargs=fn_constructor_kwargs or {})

    def filter(self, fn: Callable[[dict], bool], *, num_cpus: Optional[float] = None,
               concurrency: Optional[int] = None) -> "Dataset":
        """Keep the rows for which ``fn(row)`` is true."""
        return self._with("filter", fn, num_cpus=num_cpus, concurrency=concurrency)

    def flat_map(self, fn: Callable[[dict], Any], *, num_cpus: Optional[float] = None,
                 concurrency: Optional[int] = None) -> "Dataset":
        """Replace each row by the rows ``fn(row)`` yields (zero or more dicts)."""
        return self._with("flat_map", fn, num_cpus=num_cpus, concurrency=concurrency)

    # ----- introspection ----------------------------------------------------

    @property
    def source(self) -> Source:
        """The dataset's source."""
        return self._source

    @property
    def ops(self) -> tuple[Op, ...]:
        """The logical operators, in order."""
        return self._ops

    def num_partitions(self) -> int:
        """Partitions of the source."""
        return len(self._source.partitions(0, 0))

    def num_rows(self) -> Optional[int]:
        """Rows the dataset yields, if known without running (no filter, flat_map or map_batches)."""
        return known_rows(self._source.num_rows(), self._ops)

    def num_rows_changing(self) -> bool:
        """Whether an operator may change the number of rows (``filter``, ``flat_map``)."""
        return rows_changing(self._ops)

    def count(self) -> int:
        """Rows the dataset yields (runs the pipeline when not known)."""
        n = self.num_rows()
        if n is not None:
            return n
        return sum(meta.num_rows for _, meta in iter_blocks(self.execute(seed=0)))

    def take(self, n: int = 20) -> list[Row]:
        """The first ``n`` rows (deterministic order)."""
        out: list[Row] = []
        for row in self.iter_rows(deterministic=True, seed=0):
            out.append(row)
            if len(out) >= n:
                break
        return out

    def stats(self) -> Optional[ExecutionStats]:
        """Statistics of the latest execution (None before any)."""
        return self._last[0]

    def __repr__(self) -> str:
        chain = " -> ".join([f"Read{self._source.name}"] + [op.name for op in self._ops])
        return f"Dataset({chain})"

    # ----- execution ------------------------------------------------------

    def plan(self, *, epoch: int = 0, seed: Optional[int] = None, shuffle: bool = False,
             generator: Any = None, epoch_seed: Optional[int] = None) -> EpochPlan:
        """The epoch plan an iteration with these arguments executes (``epoch_seed``:
        that epoch seed instead of one drawn from ``seed`` or ``generator``)."""
        if epoch_seed is None:
            epoch_seed = draw_epoch_seed(seed, epoch, generator)
        ids = [p.id for p in self._source.partitions(epoch, epoch_seed, shuffle=shuffle)]
        return make_epoch_plan(ids, epoch, epoch_seed, shuffle)

    def execute(self, *, epoch: int = 0, seed: Optional[int] = None, shuffle: bool = False,
                deterministic: bool = False, memory_budget: Optional[int] = None,
                prefetch_blocks: int = 2, progress: Optional[bool] = None,
                plan: Optional[EpochPlan] = None, allow_trainer_node: bool = False,
                actor_cache: Optional[dict] = None,
                estimates: Optional[list] = None, arena: Any = None) -> StreamingExecutor:
        """Start one execution and return its executor (advanced; iterate instead).

        ``actor_cache`` (a dict kept by the caller) keeps the actor pools' actors
        for the next execution instead of killing them at the end. ``estimates``
        (an earlier execution's ``executor.estimates()``) are the stages' output
        block sizes to start from, so the first tasks need not run one at a time.
        ``arena`` (a ``SlotArena`` kept by the caller) hands blocks made on this
        node over in shared memory; read them with ``executor.fetch``.

        On a cluster, tasks and actors avoid this process's node when other nodes
        have CPUs (``allow_trainer_node=True`` lets them use it too).
        """
        options = options_here(memory_budget=memory_budget, deterministic=deterministic,
                               prefetch_blocks=prefetch_blocks, progress=progress,
                               allow_trainer_node=allow_trainer_node)
        plan = plan or self.plan(epoch=epoch, seed=seed, shuffle=shuffle)
        executor = start_execution(self._source, self._ops, plan, options, actor_cache=actor_cache,
                                   estimates=estimates, arena=arena)
        self._last[0] = executor.stats()
        return executor

    def _slot_arena(self) -> Any:
        """This process's shared-memory slots (``sbloader/executor/handoff.py``), or None."""
        return arena_here()

    def iter_rows(self, **execute_kwargs: Any) -> Iterator[Row]:
        """Iterate rows (dicts with ``.provenance``). Takes :meth:`execute`'s arguments.

        Under ``shuffle=True`` the rows of each partition come together (shuffled
        among themselves); :meth:`iter_batches` draws each batch from several
        partitions of a source whose partitions hold adjacent rows (``shuffle_window``).
        """
        execute_kwargs.setdefault("arena", self._slot_arena())
        return iter_rows(iter_blocks(self.execute(**execute_kwargs)))

    def iter_batches(self, batch_size: Optional[int] = 256, *, drop_last: bool = False,
                     shuffle_window: Any = None, **execute_kwargs: Any) -> Iterator[Batch]:
        """Iterate batches (dicts of NumPy arrays with ``.provenance``).

        Args:
            batch_size: rows per batch (None: one batch per block).
            drop_last: drop a final short batch.
            shuffle_window: under ``shuffle=True``, what the partitions each batch is
                drawn from at once may hold: a size, rows or a count of partitions
                (default: the source's, see the user guide); 1 cuts each partition's
                batches on its own.
            **execute_kwargs: :meth:`execute`'s arguments (epoch, seed, shuffle,
                deterministic, memory_budget, prefetch_blocks, progress).

        In a process whose Ray is not up yet, a pipeline of functions starts on local worker
        processes while Ray starts (``sbloader/loaders/native_start.py``; ``SBLOADER_LOCAL_START=0``
        waits for Ray).
        """
        spec = window_of(self._source, shuffle_window) if execute_kwargs.get("shuffle") else WindowSpec(partitions=1)
        if prefetch_hint(spec):
            execute_kwargs["prefetch_blocks"] = max(execute_kwargs.get("prefetch_blocks", 2), prefetch_hint(spec))
        executor = self._local_start(execute_kwargs)
        if executor is None:
            execute_kwargs.setdefault("arena", self._slot_arena())
            executor = self.execute(**execute_kwargs)
        return window_batches(self, executor, spec, batch_size, drop_last)

    def _local_start(self, kwargs: dict) -> Any:
        """The execution started on local processes while Ray starts, or None where it does not apply."""
        from sbloader.loaders import native_start
        from sbloader.runtime import background

        if not native_start.enabled(self, True, kwargs.get("actor_cache") is not None):
            return None
        budget = native_start.budget_before_ray(kwargs.get("memory_budget"))
        if budget is None:
            return None
        background.start()
        plan = kwargs.get("plan") or self.plan(epoch=kwargs.get("epoch", 0), seed=kwargs.get("seed"),
                                               shuffle=kwargs.get("shuffle", False))

        def start(rest: EpochPlan) -> StreamingExecutor:
            return self.execute(**{**kwargs, "plan": rest, "arena": kwargs.get("arena") or self._slot_arena()})

        phased = native_start.PhasedExecution(self, plan, start, budget, lambda stats: self._last.__setitem__(0, stats))
        self._last[0] = phased.stats()
        return phased

    def iter_torch_batches(self, batch_size: Optional[int] = 256, *, drop_last: bool = False,
                           dtypes: Optional[Mapping[str, Any]] = None, device: Optional[str] = None,
                           zero_copy: bool = False, collate_fn: Optional[Callable] = None,
                           **execute_kwargs: Any) -> Iterator[Any]:
        """Iterate batches as dicts of torch tensors (writable unless ``zero_copy``).

        Args:
            batch_size: rows per batch.
            drop_last: drop a final short batch.
            dtypes: torch dtype per column.
            device: move tensors to this device.
            zero_copy: wrap the buffers without copying (read-only over the object store's).
            collate_fn: applied to each NumPy batch instead of the tensor conversion.
            **execute_kwargs: :meth:`iter_batches`' and :meth:`execute`'s arguments.
        """
        for batch in self.iter_batches(batch_size, drop_last=drop_last, **execute_kwargs):
            yield collate_fn(batch) if collate_fn is not None else columns_to_torch(batch, dtypes, device, zero_copy)

    def to_dataloader(self, batch_size: int = 256, **kwargs: Any) -> PipelineLoader:
        """A loader yielding dicts of torch tensors, one epoch per iteration.

        Args:
            batch_size: rows per batch.
            **kwargs: :class:`~sbloader.loaders.pipeline_loader.PipelineLoader` options
                (shuffle, seed, drop_last, deterministic, memory_budget,
                prefetch_blocks, pin_memory, device, zero_copy, dtypes, collate_fn,
                persistent_workers, allow_trainer_node).
        """
        return PipelineLoader(self, batch_size, **kwargs)

    def to_torch_dataset(self, batch_size: int = 256, **kwargs: Any) -> Any:
        """An ``IterableDataset`` of ready batches, for ``torch.utils.data.DataLoader(it, batch_size=None)``."""
        return TorchIterableDataset(PipelineLoader(self, batch_size, **kwargs))
