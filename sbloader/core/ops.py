"""Logical operators of a Dataset and how each transforms one block.

The functions here run inside remote tasks and actors. They keep the hidden row
column (:data:`~sbloader.core.block.ROW_COLUMN`) aligned with the data, so every output
row still names its source row. ``map_batches`` never builds a batch across two
partitions, which keeps provenance exact and replays partition-local.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from sbloader.core.block import ROW_COLUMN, Block, from_rows, iter_rows, num_rows, slice_block, strip_hidden, to_column

Concurrency = Union[None, int, tuple[int, int]]


@dataclass(frozen=True)
class Op:
    """One logical operator.

    Attributes:
        kind: ``"map"``, ``"map_batches"``, ``"filter"`` or ``"flat_map"``.
        fn: the user function, or a callable class for an actor pool.
        name: display name (``MapBatches(decode)``).
        index: position in the dataset's operator list (salts the RNG).
        batch_size: rows per call of ``map_batches`` (None: the whole block).
        num_cpus: CPUs per task or actor.
        num_gpus: GPUs per task or actor.
        resources: extra Ray resources per task or actor.
        concurrency: max tasks in flight (functions) or ``(min, max)`` actors.
        fn_args: extra positional arguments for each call.
        fn_kwargs: extra keyword arguments for each call.
        fn_constructor_args: arguments of the callable class's constructor.
        fn_constructor_kwargs: keyword arguments of its constructor.
        fuse_read: (callable class as first operator only) read the source inside
            the pool's actors instead of separate tasks, as torch's workers do.
    """

    kind: str
    fn: Any
    name: str
    index: int = 0
    batch_size: Optional[int] = None
    num_cpus: Optional[float] = None
    num_gpus: Optional[float] = None
    resources: Optional[Mapping[str, float]] = None
    concurrency: Concurrency = None
    fn_args: tuple = ()
    fn_kwargs: Mapping[str, Any] = field(default_factory=dict)
    fn_constructor_args: tuple = ()
    fn_constructor_kwargs: Mapping[str, Any] = field(default_factory=dict)
    fuse_read: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("map", "map_batches", "filter", "flat_map"):
            raise ValueError(f"unknown operator kind {self.kind!r}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, found {self.batch_size}")
        if self.is_actor and self.kind != "map_batches":
            raise TypeError(f"{self.kind} takes a function; callable classes are for map_batches, found {self.fn!r}")
        if not self.is_actor and not callable(self.fn):
            raise TypeError(f"{self.kind} needs a callable, found {type(self.fn).__name__}")
        if not self.is_actor and (self.fn_constructor_args or self.fn_constructor_kwargs):
            raise ValueError("fn_constructor_args/kwargs only apply to a callable class")
        c = self.concurrency
        if isinstance(c, tuple):
            if len(c) != 2 or not (1 <= c[0] <= c[1]) or not self.is_actor:
                raise ValueError(
                    f"concurrency=(min, max) needs 1 <= min <= max and a callable class, found {c!r}"
                )
        elif c is not None and (not isinstance(c, int) or c < 1):
            raise ValueError(f"concurrency must be a positive int or (min, max), found {c!r}")
        for v, what in ((self.num_cpus, "num_cpus"), (self.num_gpus, "num_gpus")):
            if v is not None and v < 0:
                raise ValueError(f"{what} must be >= 0, found {v}")

    @property
    def is_actor(self) -> bool:
        """True when ``fn`` is a class: it runs in an actor pool."""
        return inspect.isclass(self.fn)

    def ray_resources(self) -> dict[str, Any]:
        """The ``.options(...)`` resources for the task or actor.

        A task holds one CPU unless ``num_cpus`` says otherwise. An actor stage given no
        ``num_cpus`` is placed as Ray places its default actors: it needs a CPU to be placed
        and holds none while it runs (``num_cpus`` left out of its options), so the tasks
        that feed it keep every core, and the operating system shares the cores between
        them by the work each does. The executor still counts one CPU per such actor
        when it sizes the pool (:func:`sbloader.executor.diagnostics.resource_demand`).
        An actor stage given ``num_gpus`` holds no CPU either: its work runs on the GPU.
        Pass ``num_cpus=`` to make the actor hold CPUs of its own.
        """
        out: dict[str, Any] = {}
        if self.num_cpus is not None:
            out["num_cpus"] = self.num_cpus
        elif not self.is_actor:
            out["num_cpus"] = 1.0
        elif self.num_gpus:
            out["num_cpus"] = 0.0
        if self.num_gpus:
            out["num_gpus"] = self.num_gpus
        if self.resources:
            out["resources"] = dict(self.resources)
        return out

    def pool_range(self) -> tuple[int, Optional[int]]:
        """``(min, max)`` actors of an actor pool from ``concurrency`` (max None: as many as
        the room the other stages' reservations leave, :mod:`sbloader.executor.reservations`)."""
        c = self.concurrency
        if isinstance(c, tuple):
            return c
        if isinstance(c, int):
            return (c, c)
        return (1, None)


def rows_changing(ops: Sequence[Op]) -> bool:
    """Whether an operator may change the number of rows (``filter``, ``flat_map``)."""
    return any(op.kind in ("filter", "flat_map") for op in ops)


def known_rows(source_rows: Optional[int], ops: Sequence[Op]) -> Optional[int]:
    """Rows a pipeline yields when known without running it: the source's count when no
    operator may change it (``filter``, ``flat_map``, and ``map_batches``, whose batches
    may hold any number of rows)."""
    if any(op.kind in ("filter", "flat_map", "map_batches") for op in ops):
        return None
    return source_rows


def op_name(kind: str, fn: Any) -> str:
    """A readable operator name like ``MapBatches(decode)``."""
    label = getattr(fn, "__name__", None) or type(fn).__name__
    return {"map": "Map", "map_batches": "MapBatches", "filter": "Filter", "flat_map": "FlatMap"}[kind] + f"({label})"


def _check_batch(out: Any, name: str) -> Block:
    if not isinstance(out, Mapping):
        raise TypeError(
            f"{name} must return a dict of column name -> array, found {type(out).__name__}"
        )
    cols = {str(k): v if isinstance(v, np.ndarray) else to_column(list(v)) if isinstance(v, (list, tuple)) else np.asarray(v) for k, v in out.items()}
    lengths = {k: len(v) for k, v in cols.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{name} returned columns of different lengths: {lengths}")
    return cols


def apply_op(op: Op, fn: Callable, block: Block) -> Block:
    """Apply one operator to a block, keeping the hidden row column aligned.

    Args:
        op: the operator.
        fn: the callable to run (the function, or the actor's instance).
        block: input block with the hidden row column.

    Returns:
        The output block, with the hidden row column.
    """
    rows_col = block.get(ROW_COLUMN)
    data = strip_hidden(block)
    n = num_rows(block)
    if op.kind == "map_batches":
        size = op.batch_size or max(1, n)
        outs, row_ids = [], []
        for start in range(0, n, size):
            stop = min(start + size, n)
            chunk = slice_block(data, start, stop)
            out = _check_batch(fn(chunk, *op.fn_args, **op.fn_kwargs), op.name)
            m = num_rows(out)
            src = rows_col[start:stop]
            # Same row count: rows map one to one. Otherwise every output row is
            # attributed to the first source row of its chunk (chunk-exact).
            row_ids.append(src if m == stop - start else np.full(m, src[0] if len(src) else 0, dtype=np.int64))
            outs.append(out)
        from sbloader.core.block import concat

        result = concat(outs) if outs else {k: v[:0] for k, v in data.items()}
        result[ROW_COLUMN] = np.concatenate(row_ids).astype(np.int64) if row_ids else np.empty(0, np.int64)
        return result
    if op.kind == "map":
        rows = [fn(r, *op.fn_args, **op.fn_kwargs) for r in iter_rows(data)]
        for r in rows[:1]:
            if not isinstance(r, Mapping):
                raise TypeError(f"{op.name} must return a dict per row, found {type(r).__name__}")
        result = from_rows(rows) if rows else {k: v[:0] for k, v in data.items()}
        result[ROW_COLUMN] = rows_col.copy() if rows_col is not None else np.arange(n)
        return result
    if op.kind == "filter":
        keep = np.fromiter((bool(fn(r, *op.fn_args, **op.fn_kwargs)) for r in iter_rows(data)), dtype=bool, count=n)
        return {k: v[keep] for k, v in block.items()}
    # flat_map
    rows, row_ids = [], []
    for i, r in enumerate(iter_rows(data)):
        produced = fn(r, *op.fn_args, **op.fn_kwargs)
        for out in produced:
            if not isinstance(out, Mapping):
                raise TypeError(f"{op.name} must yield dicts, found {type(out).__name__}")
            rows.append(out)
            row_ids.append(rows_col[i])
    result = from_rows(rows) if rows else {}
    result[ROW_COLUMN] = np.asarray(row_ids, dtype=np.int64)
    return result
