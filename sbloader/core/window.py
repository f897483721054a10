"""The shuffle window: how much of the epoch a shuffled batch may draw from (pure).

A source whose partition is one unit of I/O holding adjacent rows (a Parquet row
group, a video, a WebDataset shard) cannot draw a partition's members from the
epoch seed without reading its input more than once. Its batches are instead
drawn from several open partitions at once (:class:`~sbloader.core.cut.Cutter`),
and an open partition's block stays in memory until its last row was taken. The
window bounds what the open partitions hold:

- by default a share (:data:`DEFAULT_SHARE`) of the pipeline's memory budget, in
  bytes: a dataset whose output fits mixes exactly like a uniform shuffle (every
  partition open, each batch a draw without replacement over all remaining rows),
  a larger one as widely as that memory allows;
- or what the user set: ``shuffle_window="64 MiB"`` (bytes), ``"20000 rows"``, or
  an int, read as before as a count of open partitions (``1``: cut the partitions
  in turn, the least memory).

A budget window opens its first partitions progressively (:func:`ramp_partitions`,
:func:`ramp_rows`): the first batch draws from at most :data:`FIRST_PARTITIONS`
partitions (as the count window of 8 did) or :data:`FIRST_PARTITIONS` batches' worth
of rows, whichever is more, the next from twice as many, and so on, so the first
batch never waits for the whole window to be read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

#: Share of the memory budget the default window may hold. The other half is left to
#: the executor: blocks in flight through the stages and ready ahead of the consumer
#: (each stage needs at least one in flight, and the consumer's prefetch), so the
#: window never starves the pipeline that fills it.
DEFAULT_SHARE = 0.5

#: Partitions the first batch of a budget window draws from at most (doubling with
#: every batch after it): the first batch waits for as many partitions as the fixed
#: window of 8 partitions did before.
FIRST_PARTITIONS = 8

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_TEXT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


@dataclass(frozen=True)
class WindowSpec:
    """What the user asked of the shuffle window (one of the attributes set, or ``share``).

    Attributes:
        partitions: a fixed count of open partitions (an int ``shuffle_window``).
        rows: the most rows the open partitions may hold.
        bytes: the most bytes the open partitions' blocks may hold.
        share: the share of the memory budget the open partitions may hold (the default).
    """

    partitions: Optional[int] = None
    rows: Optional[int] = None
    bytes: Optional[int] = None
    share: Optional[float] = None

    def __str__(self) -> str:
        if self.partitions is not None:
            return f"{self.partitions} partitions"
        if self.rows is not None:
            return f"{self.rows} rows"
        if self.bytes is not None:
            return _size(self.bytes)
        return f"{self.share:.0%} of memory_budget"


@dataclass(frozen=True)
class Window:
    """The shuffle window of one epoch, resolved (what :class:`~sbloader.core.cut.Cutter` obeys).

    Attributes:
        partitions: the most partitions open at once (None: no count limit).
        cap: the most weight the open partitions may hold, in ``unit`` (None: no limit).
        unit: what a partition weighs: ``"rows"`` (its output rows) or ``"bytes"`` (its block's bytes).
        ramp: open the first partitions progressively (:func:`ramp_partitions`).
    """

    partitions: Optional[int] = None
    cap: Optional[int] = None
    unit: str = "rows"
    ramp: bool = False

    def __post_init__(self) -> None:
        if self.partitions is not None and self.partitions < 1:
            raise ValueError(f"a shuffle window needs at least 1 partition, found {self.partitions}")
        if self.unit not in ("rows", "bytes"):
            raise ValueError(f"a shuffle window counts rows or bytes, found {self.unit!r}")

    @property
    def in_turn(self) -> bool:
        """One partition at a time: batches are cut from the partitions in turn."""
        return self.partitions == 1


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def parse_window(value: Any) -> WindowSpec:
    """A ``shuffle_window`` argument as a :class:`WindowSpec`.

    Accepted: None (the default: :data:`DEFAULT_SHARE` of the memory budget), a positive
    int (open partitions, as before), ``"<n> rows"``, ``"<n> <unit>"`` with unit B, KB,
    MB, GB, KiB, MiB or GiB, or a :class:`WindowSpec`.

    Raises:
        ValueError: naming what was found and what is accepted.
    """
    if value is None:
        return WindowSpec(share=DEFAULT_SHARE)
    if isinstance(value, WindowSpec):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return WindowSpec(partitions=int(value))
    if hasattr(value, "__index__") and not isinstance(value, bool) and int(value) >= 1 and int(value) == value:
        return WindowSpec(partitions=int(value))  # a numpy integer
    if isinstance(value, str):
        m = _TEXT.match(value.lower())
        if m:
            n, unit = float(m.group(1)), m.group(2)
            if unit in ("row", "rows") and n >= 1 and n == int(n):
                return WindowSpec(rows=int(n))
            if unit in _UNITS and n * _UNITS[unit] >= 1:
                return WindowSpec(bytes=int(n * _UNITS[unit]))
    raise ValueError(
        f"shuffle_window must be a positive number of partitions (int), '<n> rows', or a size such as "
        f"'256 MiB'; found {value!r}"
    )


def resolve(spec: WindowSpec, budget_bytes: int, unit: str, row_bytes: Optional[float] = None) -> Window:
    """The window of an epoch from what was asked and the pipeline's memory budget.

    Args:
        spec: what the user asked.
        budget_bytes: the pipeline's memory budget.
        unit: what the cutter can weigh partitions in: ``"bytes"`` (a consumer that sees
            the blocks as they come) or ``"rows"`` (a plan made before any block exists).
        row_bytes: for ``unit="rows"``, the estimated bytes of one output row, to turn a
            bytes window into rows (None: unknown, the window is the fixed count
            :data:`FIRST_PARTITIONS`).
    """
    if spec.partitions is not None:
        return Window(partitions=spec.partitions)
    if spec.rows is not None:
        return Window(cap=spec.rows, unit="rows", ramp=True)
    nbytes = spec.bytes if spec.bytes is not None else int(budget_bytes * (spec.share or DEFAULT_SHARE))
    if unit == "bytes":
        return Window(cap=max(1, nbytes), unit="bytes", ramp=True)
    if not row_bytes or row_bytes <= 0:
        return Window(partitions=FIRST_PARTITIONS)
    return Window(cap=max(1, int(nbytes / row_bytes)), unit="rows", ramp=True)


def ramp_partitions(batch_index: int) -> int:
    """Partitions a budget window may have open when cutting batch ``batch_index`` of the
    epoch: :data:`FIRST_PARTITIONS`, doubling with every batch (the first batch waits for
    a few partitions only; within a few batches the window is as wide as its budget)."""
    return FIRST_PARTITIONS << min(max(0, batch_index), 40)


def ramp_rows(batch_index: int, batch_rows: int) -> int:
    """Rows (left in the open partitions) below which a budget window may open one more
    partition at batch ``batch_index``, whatever :func:`ramp_partitions` says:
    :data:`FIRST_PARTITIONS` batches' worth, doubling with every batch. Small partitions
    (a few rows each) so open enough of them for the first batches to mix, while the
    first batch still waits for a few batches' worth of rows only."""
    return FIRST_PARTITIONS * max(1, batch_rows) << min(max(0, batch_index), 40)


def drawn_share(widest: int, partitions: int) -> float:
    """The share of an epoch's partitions a batch could draw from, the window at its widest."""
    return 1.0 if partitions <= 0 else min(1.0, widest / partitions)


def narrow_message(window: WindowSpec, share: float, widest: int, partitions: int) -> str:
    """The one-line note (``stats()``) and warning of a dataset larger than its window."""
    return (f"shuffle window: a batch drew from at most {widest} of {partitions} partitions ({share:.0%} of the "
            f"epoch; window {window}); the data does not fit it, so batches mix less than torch's shuffle. Raise "
            "shuffle_window (e.g. '2 GiB' or '100000 rows') or memory_budget, or write the data shuffled / in "
            "smaller row groups (docs/user_guide.md, Shuffling)")
