"""The remote side of the drop-in DataLoader: what torch's worker processes did.

``LoaderWorker`` is the callable class of the actor pool (``num_workers`` actors):
it reads the partitions of :mod:`sbloader.sources.batches` (index lists, or worker
shards of an ``IterableDataset``), calls ``dataset[i]`` and ``collate_fn`` and
returns ready, collated batches with tensors as NumPy buffers.
"""
from __future__ import annotations

import os
import random
from contextlib import contextmanager
from typing import Any, Callable, Optional

import numpy as np

from sbloader.core.batch_slice import mark_padding
from sbloader.core.block import BATCH_ROWS_COLUMN, SHARD_STATE_COLUMN
from sbloader.core.context import actor_info, get_context
from sbloader.core.wire import to_wire
from sbloader.loaders.failed_batch import WORKER_INIT_FN, FailedBatch
from sbloader.loaders.iterable_resume import iterate_shard
from sbloader.loaders.shard_segments import LiveShards
from sbloader.sources.batches import PaddedBatch



def _set_torch_worker_info(worker_id: int, num_workers: int, seed: int, dataset: Any) -> None:
    # torch's get_worker_info() reads this module global, set by torch's own
    # worker loop; we set it the same way in our remote workers.
    from torch.utils.data._utils import worker as torch_worker

    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset
    )


@contextmanager
def _stack_in_private_memory() -> Any:
    """Within the block, torch's ``default_collate`` stacks tensors in private memory.

    Under torch's ``get_worker_info()`` (which the actors set, as torch's workers do),
    ``default_collate`` stacks every tensor into a fresh shared-memory segment, for
    torch's pipe to the main process, on pages faulted in anew each time (several
    times the private stacking: ``benchmarks/results/collate.md``). Here a batch leaves by a copy into a
    slot or Ray's object store anyway. ``get_worker_info()`` stays visible to the
    dataset and to a custom ``collate_fn``; only the tensor stacking of the collate
    map (what ``default_collate`` calls, also from a custom ``collate_fn``) changes.
    """
    import torch
    from torch.utils.data._utils import collate as torch_collate
    from torch.utils.data._utils import worker as torch_worker

    fn_map = torch_collate.default_collate_fn_map
    original = fn_map.get(torch.Tensor)
    if original is not torch_collate.collate_tensor_fn:  # changed by the user: leave it
        yield
        return

    def stack_private(batch: Any, *, collate_fn_map: Any = None) -> Any:
        info, torch_worker._worker_info = torch_worker._worker_info, None
        try:
            return original(batch, collate_fn_map=collate_fn_map)
        finally:
            torch_worker._worker_info = info

    fn_map[torch.Tensor] = stack_private
    try:
        yield
    finally:
        fn_map[torch.Tensor] = original


def _fresh(config: Any) -> dict:
    """The config's arguments, unpickled anew: every construction (a warm actor's next epoch too) gets
    the dataset as the trainer pickled it, never a copy an earlier epoch mutated."""
    from sbloader.executor.tasks import Packed

    if isinstance(config, Packed):
        import ray.cloudpickle as cloudpickle

        return cloudpickle.loads(config.data)
    import copy

    return copy.deepcopy(config)


def _objects(items: list) -> np.ndarray:
    col = np.empty((len(items),), dtype=object)
    for i, x in enumerate(items):
        col[i] = x
    return col


def _seed_all(seed: int) -> None:
    """Seed ``random``, NumPy and torch as torch seeds a worker before ``worker_init_fn``."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


def _rng_states() -> tuple:
    import torch

    return random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.initial_seed()


def _set_rng_states(states: tuple) -> None:
    import torch

    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


def _same_states(a: tuple, b: tuple) -> bool:
    """Whether two :func:`_rng_states` snapshots are equal (worker_init_fn left the RNGs alone)."""
    np_a, np_b = a[1], b[1]
    return (a[0] == b[0] and a[3] == b[3] and bool(a[2].equal(b[2]))
            and np_a[0] == np_b[0] and np.array_equal(np_a[1], np_b[1]) and tuple(np_a[2:]) == tuple(np_b[2:]))


class LoaderWorker:
    """Callable class of the loader's actor pool: fetch samples and collate.

    Args:
        config: a :class:`~sbloader.executor.tasks.Packed` dict (or the dict) of
            the keyword arguments below. Packed by the trainer, so the coordinator
            that creates the pool under torchrun forwards bytes and never unpickles
            the dataset (which would import torch there: ~1 s on the resume path).

    Keyword arguments in ``config``:
        dataset: the user's dataset (a copy per actor, as torch's workers have).
        collate_fn: applied to each list of samples (or each sample when
            auto-batching is off).
        auto_collation: whether work items are index lists (batches).
        num_workers: the loader's ``num_workers``.
        worker_init_fn: called once with the worker id when the actor starts.
        batch_size: rows per batch for an ``IterableDataset``.
        drop_last: drop a short final batch of an ``IterableDataset`` shard.
        base_seed: the epoch's base seed (None: a fresh random one).

    Seeds (torch's order): the worker seeds ``random``, NumPy and torch with
    ``base_seed + worker_id`` first, then calls ``worker_init_fn``. If
    ``worker_init_fn`` leaves any of those RNGs changed (it seeded or drew), the
    worker keeps its own RNG streams from then on, as a torch worker does, and the
    per-partition seeding is not applied to it. Otherwise each partition runs
    under its own seed (:mod:`sbloader.core.context`), so a replayed partition
    reproduces its samples bit for bit.
    """

    def __init__(self, config: Any) -> None:
        self._config = config  # unpacked again for each further IterableDataset shard's own copy
        self._shard_datasets: dict = {}
        self._live = LiveShards(_rng_states, _set_rng_states)  # shards' generators between their segments
        self._setup(**_fresh(config))

    def _setup(self, dataset: Any, collate_fn: Callable, auto_collation: bool, num_workers: int,
               worker_init_fn: Optional[Callable[[int], None]] = None,
               batch_size: Optional[int] = None, drop_last: bool = False, base_seed: Optional[int] = None) -> None:
        info = actor_info()
        self._id = info[0] if info else 0
        self._dataset = dataset
        self._collate = collate_fn
        self._auto = auto_collation
        self._num_workers = num_workers
        self._batch_size = batch_size
        self._drop_last = drop_last
        self.pid = os.getpid()
        self._init_error: Optional[Exception] = None
        self._rng_states: Optional[tuple] = None  # the worker's own RNG streams, once worker_init_fn set them
        base = base_seed if base_seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self._seed = (base + self._id) % 2**63
        _seed_all(self._seed)
        _set_torch_worker_info(self._id, num_workers, self._seed, dataset)
        if worker_init_fn is not None:
            before = _rng_states()
            try:
                worker_init_fn(self._id)
            except Exception as e:  # raised at the loop's next batch, as torch does
                self._init_error = FailedBatch.remote(e, WORKER_INIT_FN, -1, -1, self._id, fatal=True)
            after = _rng_states()
            if not _same_states(before, after):
                self._rng_states = after

    def __call__(self, batch: dict) -> dict:
        ctx = get_context()
        seed = ctx.seed if ctx is not None else 0
        out, rows, snaps = [], [], []  # wire batches, the samples in each (for the split of a stream), shard snapshots
        if self._init_error is not None:
            out = [self._init_error] * len(batch["task"])
            rows = [0] * len(out)
            snaps = [None] * len(out)
        elif self._rng_states is not None:  # worker_init_fn's seed stands: the worker's streams go on
            _set_rng_states(self._rng_states)
            seed = self._seed
            try:
                with _stack_in_private_memory():
                    self._run_tasks(batch["task"], seed, out, rows, snaps)
            finally:
                self._rng_states = _rng_states()
        else:
            with _stack_in_private_memory():
                self._run_tasks(batch["task"], seed, out, rows, snaps)
        block = {"batch": _objects(out), BATCH_ROWS_COLUMN: np.asarray(rows, dtype=np.int64)}
        if any(x is not None for x in snaps):
            block[SHARD_STATE_COLUMN] = _objects(snaps)
        return block

    def _run_tasks(self, tasks: Any, seed: int, out: list, rows: list, snaps: list) -> None:
        """Fetch and collate each work item, appending wire batches, their sample counts and (for a
        shard of an ``IterableDataset``) ``(shard, snapshot after the batch)``."""
        for task in tasks:
            if isinstance(task, tuple) and len(task) in (2, 3, 4) and task[0] == "shard":
                shard = int(task[1])
                ctx = get_context()
                epoch = (ctx.epoch, ctx.epoch_seed) if ctx is not None else (0, 0)
                _set_torch_worker_info(shard, self._num_workers, seed, self._kept_dataset(shard))
                resume = task[2] if len(task) >= 3 else None
                limit = task[3] if len(task) == 4 else None

                def open_shard(shard: int = shard, epoch: tuple = epoch, resume: Optional[dict] = resume) -> Any:
                    dataset = self._unused_dataset(shard, epoch)
                    _set_torch_worker_info(shard, self._num_workers, seed, dataset)
                    return iterate_shard(dataset, self._batch_size, self._drop_last,
                                         lambda x: to_wire(self._collate(x)), resume)
                for wire, n, snap in self._live.take(shard, epoch, resume, limit, open_shard):
                    out.append(wire)
                    rows.append(n)
                    snaps.append((task[1], snap))
            else:
                snaps.append(None)
                _set_torch_worker_info(self._id, self._num_workers, seed, self._dataset)
                rows.append(len(task.indices) if isinstance(task, PaddedBatch) else len(task) if self._auto else 1)
                try:
                    out.append(self._make(task))
                except Exception as e:  # this batch's error, raised at this batch; the next ones go on
                    ctx = get_context()
                    out.append(FailedBatch.remote(e, "LoaderWorker", ctx.partition_id if ctx else -1,
                                                  ctx.epoch if ctx else -1, self._id))

    def _kept_dataset(self, shard: int) -> Any:
        """Shard ``shard``'s own copy of the dataset, as torch's worker ``shard`` has its own: the
        actor's for its first shard, a fresh copy for any other (kept with persistent workers)."""
        if shard not in self._shard_datasets:
            ds = self._dataset if not self._shard_datasets else _fresh(self._config)["dataset"]
            self._shard_datasets[shard] = (ds, None)
        return self._shard_datasets[shard][0]

    def _unused_dataset(self, shard: int, epoch: tuple) -> Any:
        """The copy shard ``shard`` is opened on in ``epoch``: the kept one, unless this actor already
        iterated it this epoch (a segment of the shard ran here, then elsewhere, or a replay): that copy
        has moved on (a dataset that is its own iterator, a read-ahead), so a fresh one replaces it."""
        ds = self._kept_dataset(shard)
        if self._shard_datasets[shard][1] == epoch:
            ds = _fresh(self._config)["dataset"]
        self._shard_datasets[shard] = (ds, epoch)
        return ds

    def _make(self, task: Any) -> Any:
        """One batch of sample indices (or one sample, without auto-batching), fetched and collated."""
        if isinstance(task, PaddedBatch):
            batch = self._collate([self._dataset[i] for i in task.indices])
            return to_wire(mark_padding(batch, len(task.indices), task.pad))
        samples = [self._dataset[i] for i in task] if self._auto else self._dataset[task]
        return to_wire(self._collate(samples))
