"""What a drop-in loader's epoch runs with, and what it keeps from one epoch to the next.

Both are plain data, importable without Ray: ``import sbloader`` and building a
``DataLoader`` import neither Ray nor the executor (an epoch that needs them does).
"""
from __future__ import annotations

import weakref
import math
import os
import sys
import uuid
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

from sbloader.core.ops import Op
from sbloader.core.stats import ExecutionStats
from sbloader.runtime.loaded_modules import loaded

if TYPE_CHECKING:
    from sbloader.executor.options import ExecutionOptions
    from sbloader.loaders.dropin_state import EpochRun
    from sbloader.loaders.tensors import TensorOptions


@dataclass(frozen=True)
class DropinSettings:
    """The loader's arguments an epoch runs with (a snapshot taken when the iteration starts).

    Attributes: those of :class:`~sbloader.loaders.dataloader.DataLoader`, resolved
    (``pin``: page-locked copies only with an accelerator; ``auto_collation``: the
    loader batches; ``iterable``: the dataset is an ``IterableDataset``).
    """

    dataset: Any
    collate_fn: Callable
    auto_collation: bool
    iterable: bool
    batch_size: Optional[int]
    drop_last: bool
    num_workers: int
    worker_init_fn: Optional[Callable]
    prefetch_factor: Optional[int]
    in_order: bool
    timeout: float
    pin: bool
    zero_copy: bool
    device: Any
    memory_budget: Optional[int]
    batches_per_partition: int
    worker_num_cpus: float
    worker_resources: Optional[dict]
    allow_trainer_node: bool
    persistent_workers: bool
    seed: Optional[int]
    dataset_id: Optional[str]
    report_stalls: bool
    start_timeout: Optional[float] = None
    local_start: bool = True
    multiprocessing_context: Any = None
    ahead: int = field(init=False)  # batches made ahead of the loop (torch's ``prefetch_factor``)
    to_device: Any = field(init=False)  # the copy of each batch to ``device`` (None: batches stay on the CPU)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ahead", max(1, self.prefetch_factor or 2))
        object.__setattr__(self, "to_device", self._device_copy() if self.device is not None else None)

    def worker_op(self, base_seed: Optional[int] = None) -> Op:
        """The pool of ``num_workers`` remote workers that fetch and collate (``base_seed``: the
        seed each worker adds its id to before ``worker_init_fn``, as torch's; None: a random one)."""
        from sbloader.executor.tasks import pack
        from sbloader.loaders.worker import LoaderWorker

        workers = max(1, self.num_workers)
        config = pack(dict(  # pickled once per epoch here: the workers see the dataset as it is now
            dataset=self.dataset, collate_fn=self.collate_fn, auto_collation=self.auto_collation,
            num_workers=workers, worker_init_fn=self.worker_init_fn,
            batch_size=self.batch_size, drop_last=self.drop_last, base_seed=base_seed))
        return Op("map_batches", LoaderWorker, "LoaderWorker", index=0, num_cpus=self.worker_num_cpus,
                  resources=self.worker_resources, concurrency=(workers, workers),
                  fn_constructor_args=(config,), fuse_read=True)

    def source_fingerprint(self) -> dict:
        """How the epoch's sources describe the dataset."""
        return {"type": type(self.dataset).__name__, "len": safe_len(self.dataset), "dataset_id": self.dataset_id}

    def coordinator_options(self) -> ExecutionOptions:
        """The execution options of the loader's epochs on the coordinator."""
        from sbloader.executor.launch import options_here

        return options_here(memory_budget=self.memory_budget, deterministic=self.in_order, progress=False,
                            prefetch_blocks=max(2, (self.prefetch_factor or 2) * max(1, self.num_workers)),
                            allow_trainer_node=self.allow_trainer_node)

    def epoch_items(self, run: Optional["EpochRun"], index_sampler: Any) -> list:
        """A map-style epoch's work items, in sampler order: index lists (one index each without
        auto-batching), from the run's plan or, without one, from the batch sampler."""
        if run is not None:
            return run.batches if self.auto_collation else [b[0] for b in run.batches]  # batch_size=None
        return [list(b) if self.auto_collation else b for b in index_sampler]

    def _device_copy(self) -> Any:
        from sbloader.loaders.tensors import DeviceCopy

        return DeviceCopy(self.device, self.pin)

    def reporter(self, what: str, stalls: Any) -> Callable[[], None]:
        """Prints the epoch's stall instrument at its end when ``report_stalls`` is set."""
        def report() -> None:
            if self.report_stalls:
                print(f"sbloader {what}: {stalls}")
        return report

    def warm_key(self) -> tuple:
        """What this loader's pool actors are started with (:func:`pool_key`)."""
        return pool_key(self.num_workers, self.worker_num_cpus, self.worker_resources, self.allow_trainer_node)

    def tensors(self) -> TensorOptions:
        """How a worker's wire batch becomes the loop's tensors."""
        from sbloader.loaders.tensors import TensorOptions

        return TensorOptions(pin=self.pin, zero_copy=self.zero_copy)


def resolve(loader: Any, auto_collation: bool) -> DropinSettings:
    """The arguments ``loader``'s next epoch runs with, as they are now (``auto_collation``: it batches):
    ``pin`` only with an accelerator (torch's warning otherwise), and each worker's CPUs fitted to what the
    cluster (or this machine) has free of the process's other loaders (:func:`fitted_worker_cpus`; a split
    loader's pool is the job's)."""
    pin = False
    if loader.pin_memory:
        pin = loader._torch.accelerator.is_available()
        if not pin:
            warnings.warn("'pin_memory' argument is set as true but no accelerator is found, "
                          "then device pinned memory won't be used.", stacklevel=4)
    free = None if loader.split else free_cpus(cpus_held_by_loaders(loader._carry))
    return DropinSettings(
        dataset=loader.dataset, collate_fn=loader.collate_fn, auto_collation=auto_collation,
        iterable=loader._iterable, batch_size=loader.batch_size, drop_last=loader.drop_last,
        num_workers=loader.num_workers, worker_init_fn=loader.worker_init_fn, prefetch_factor=loader.prefetch_factor,
        in_order=loader.in_order, timeout=loader.timeout, pin=pin, zero_copy=loader.zero_copy, device=loader.device,
        memory_budget=loader.memory_budget, batches_per_partition=loader.batches_per_partition,
        worker_num_cpus=fitted_worker_cpus(loader.num_workers, loader.worker_num_cpus, available_cpus(), free),
        worker_resources=loader.worker_resources, allow_trainer_node=loader.allow_trainer_node,
        persistent_workers=loader.persistent_workers, seed=loader.seed, dataset_id=loader.dataset_id,
        report_stalls=loader.report_stalls, start_timeout=loader.start_timeout, local_start=loader.local_start,
        multiprocessing_context=loader.multiprocessing_context)


@dataclass(eq=False)  # hashed by identity (kept in a WeakSet)
class DropinCarry:
    """What a drop-in loader keeps from one epoch to the next.

    Attributes:
        actor_cache: the worker actors (``persistent_workers``; the pool's per epoch otherwise).
        warm_cache: without ``persistent_workers``, the last epoch's actor processes, rebuilt by
            the next epoch (:mod:`~sbloader.loaders.warm_workers`).
        estimates: the stages' output block sizes measured by the last epoch.
        stats: the latest epoch's execution statistics.
        coordinator: the loader's split coordinator, once found.
        last_split_run: the last epoch this rank finished split by the coordinator (a
            coordinator lost after it is told, so the ranks still in it can go on).
        dropped: the loader is gone; an epoch that outlives it kills the actors it
            hands back to ``actor_cache`` (nobody will use them again).
    """

    actor_cache: dict = field(default_factory=dict)
    estimates: Optional[list] = None
    stats: Optional[ExecutionStats] = None
    coordinator: Any = None
    last_split_run: Optional[EpochRun] = None
    lease_interval_s: float = 1.0  # seconds one request's lease lasts (below a quarter of stall_report_s)
    dropped: bool = False
    held_cpus: float = 0.0  # CPUs its actors kept between epochs (warm or persistent) or started ahead ask for
    warm_cache: dict = field(default_factory=dict)  # persistent_workers=False: actors kept warm (warm_workers)
    warm_timer: Any = None
    warm_key: Any = None  # what its warm actors were started with (warm_workers.pool_key)
    starts: int = 0  # local-start epochs begun: only the latest one's background start takes the actors
    pools_running: int = 0  # its epochs whose pool runs now (an abandoned one may still run beside a new one)
    pool_cpus: float = 0.0  # CPUs the actors of those pools ask for (held until each epoch closes)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)  # the loader's, for its coordinator
    rank: Optional[int] = None  # the rank it said hello to its coordinator as

    def drop(self) -> None:
        """The loader is gone: its kept actors go to the process's idle pool (an epoch still running
        hands its actors over when it closes); its coordinator is told (it retires once every rank's
        loader is gone)."""
        self.dropped = True
        try:
            if self.coordinator is not None and self.rank is not None:
                self.coordinator.shutdown.remote(self.rank, self.id)  # not awaited
        except Exception:  # the coordinator (or Ray, at exit) is gone: nothing to release
            pass
        try:
            # never an import here (a __del__, maybe at exit): what killed nothing was never loaded
            pools, warm = loaded("sbloader.executor.pools"), loaded("sbloader.loaders.warm_workers")
            if pools is None or warm is None:
                return
            warm.hand_to_process(self)
        except Exception:  # the interpreter is tearing down (module globals gone): Ray went before
            pass


def pool_key(num_workers: int, num_cpus: float, resources: Optional[dict], allow_trainer_node: bool) -> Tuple:
    """What a pool's actors were started with: two loaders with the same key can share them."""
    return (max(1, num_workers), float(num_cpus), tuple(sorted((resources or {}).items())), bool(allow_trainer_node))


_CARRIES: "weakref.WeakSet[DropinCarry]" = weakref.WeakSet()  # the drop-in loaders of this process


def cpus_held_by_loaders(exclude: Optional[DropinCarry] = None) -> float:
    """CPUs the drop-in pools of this process ask for (known here before Ray places them): every epoch's pool
    still running (a dropped loader's, or an abandoned iterator's a traceback keeps, included) and the actors
    live loaders keep between epochs."""
    return sum(c.pool_cpus + (0.0 if c.dropped else c.held_cpus) for c in list(_CARRIES) if c is not exclude)


def safe_len(x: Any) -> Optional[int]:
    """``len(x)``, or None for an object without one."""
    try:
        return len(x)
    except TypeError:
        return None


def ray_is_up() -> bool:
    """Whether Ray is initialized in this process, without importing it (a loader's construction
    never does: Ray is imported and started in the background)."""
    ray = sys.modules.get("ray")
    is_initialized = getattr(ray, "is_initialized", None)  # None while another thread imports it
    return is_initialized is not None and bool(is_initialized())


def available_cpus() -> Optional[float]:
    """CPUs the workers can run on: the Ray cluster's when Ray is up, this machine's (its CPU
    affinity) when the embedded Ray would start here, None when a cluster is named but not joined."""
    if ray_is_up():
        from sbloader.runtime import cluster_state

        return cluster_state.cpus()
    if os.environ.get("RAY_ADDRESS"):
        return None
    try:
        return float(len(os.sched_getaffinity(0)))
    except AttributeError:
        return float(os.cpu_count() or 1)


def excess_workers_message(num_workers: int, worker_num_cpus: float, cpus: Optional[float]) -> Optional[str]:
    """torch's warning for more workers than the CPUs can run (None when they fit or are unknown)."""
    if num_workers <= 0 or cpus is None or num_workers * worker_num_cpus <= cpus:
        return None
    return (f"This DataLoader will create {num_workers} worker processes in total (Ray actors of "
            f"{worker_num_cpus:g} CPU each). Our suggested max number of worker in current system is "
            f"{int(cpus // max(worker_num_cpus, 1e-9))} ({cpus:g} CPUs in the Ray cluster or on this machine), "
            "which is smaller than what this DataLoader is going to create. Please be aware that excessive worker "
            "creation might get DataLoader running slow or even freeze, lower the worker number to avoid "
            "potential slowness/freeze if necessary (they all start: each asks Ray for an equal share of the CPUs).")


def fitted_worker_cpus(num_workers: int, worker_num_cpus: float, cpus: Optional[float],
                       free: Optional[float] = None) -> float:
    """CPUs each worker actor asks Ray for: ``worker_num_cpus``, or an equal share of the ``cpus``
    (the cluster's) or of the ``free`` ones (not held by other loaders' workers) when ``num_workers``
    of them would not fit; 0 when none is free. torch's worker processes share the cores the same
    way: every worker starts, none waits for a CPU another loader (a live one, or one an exception's
    traceback keeps) holds."""
    if num_workers <= 0 or cpus is None:
        return worker_num_cpus
    room = cpus if free is None else max(0.0, min(cpus, free))
    if num_workers * worker_num_cpus <= room:
        return worker_num_cpus
    return math.floor(room / num_workers * 1e4) / 1e4


def free_cpus(held_here: float = 0.0) -> Optional[float]:
    """CPUs of the Ray cluster less ``held_here`` (what this process's other live loaders' workers
    asked for: a loader kept alive by a traceback keeps its actors). Before Ray is up, this machine's
    CPUs (what the embedded Ray will have) less the same: a loader whose epoch started locally holds
    its pool's CPUs already, and a second loader built meanwhile must not ask for them too (its pool
    would wait for good: CI, test_a_script_prints_nothing_at_exit); None when a cluster is named but
    not joined yet.

    Not Ray's momentary ``available_resources()``: the tasks and actors of a pipeline that just
    ended still show there for a moment, and a share of 0 would let the workers run unreserved
    (anywhere, the trainer's node included)."""
    cpus = available_cpus()
    return None if cpus is None else max(0.0, cpus - held_here)


def warn_excess_workers(num_workers: int, worker_num_cpus: float) -> None:
    """Warn as torch does when the workers ask for more CPUs than there are (:func:`excess_workers_message`)."""
    msg = excess_workers_message(num_workers, worker_num_cpus, available_cpus())
    if msg is not None:
        warnings.warn(msg, stacklevel=3)
