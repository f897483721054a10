"""The shuffle window of a native loader's epoch: resolved once, kept in the checkpoint,
reported when the data does not fit it.

One consumer weighs the blocks it holds in bytes, as they come (each block's bytes
replay with it, so the cut stays a function of the epoch seed); a job split across
ranks plans every batch before any block exists, so its window is in rows: a bytes
window is turned into rows from the source's stored bytes per row. Either way the
resolved window is recorded in the epoch's run (``PipelineRun.window``), so a
resumed epoch, on any world size, cuts with the window it started with. See
:mod:`sbloader.core.window` for the arithmetic and ``docs/user_guide.md`` (Shuffling).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Iterator, Optional

from sbloader.core.block import BlockMeta
from sbloader.core.cut import Cutter
from sbloader.core.window import FIRST_PARTITIONS, Window, WindowSpec, drawn_share, narrow_message, resolve
from sbloader.loaders.batching import BlockFeed, ShuffleWindow, iter_batches, iter_blocks

_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # datasets already warned about


def prefetch_hint(spec: WindowSpec) -> int:
    """Ready blocks the executor should keep ahead for a window (0: no change)."""
    if spec.partitions is not None:
        return spec.partitions + 1 if spec.partitions > 1 else 0
    return FIRST_PARTITIONS + 1


def default_budget(memory_budget: Optional[int]) -> int:
    """The pipeline's memory budget: the one given, or the executor's default."""
    if memory_budget is not None:
        return int(memory_budget)
    from sbloader.executor.budget import default_budget as executor_default

    return executor_default()


def stored(run: Any) -> Optional[Window]:
    """The window a (resumed) run recorded, or None."""
    w = getattr(run, "window", None)
    if not w:
        return None
    cap, unit = w
    return Window(cap=int(cap), unit=str(unit), ramp=True)


def record(run: Any, window: Window) -> Window:
    """Keep a budget window in the run (its checkpoint carries it); returns it."""
    if window.cap is not None:
        run.window = [int(window.cap), window.unit]
    return window


def local_window(spec: WindowSpec, run: Any, budget_bytes: int) -> Window:
    """One consumer's window: in bytes of the blocks it holds (rows where asked in rows)."""
    if spec.partitions is not None:
        return Window(partitions=spec.partitions)
    return record(run, stored(run) or resolve(spec, budget_bytes, "bytes"))


def split_window(spec: WindowSpec, run: Any, source: Any, budget_bytes: int) -> Window:
    """A job's window, the same on every rank: in rows, from the source's stored bytes per row."""
    if spec.partitions is not None:
        return Window(partitions=spec.partitions)
    row_bytes = getattr(source, "row_bytes", None)
    row_bytes = row_bytes() if row_bytes else None
    kept = stored(run)
    if kept is not None and kept.unit == "bytes":  # an epoch begun by one consumer, resumed split
        kept = resolve(WindowSpec(bytes=kept.cap), budget_bytes, "rows", row_bytes)
        if kept.cap is None:
            return kept
    return record(run, kept or resolve(spec, budget_bytes, "rows", row_bytes))


def block_weight(window: Window, run: Any) -> Callable[[BlockMeta], int]:
    """What a block weighs: its bytes, or its partition's whole rows (a resumed partition's
    block holds the rows consumed before too)."""
    if window.unit == "bytes":
        return lambda meta: int(meta.nbytes)
    return lambda meta: int(meta.num_rows) + int(run.consumed(meta.partition_id))


class Report:
    """Says, once, that an epoch did not fit its window: a line in ``stats()`` and a warning
    per dataset naming the knob.

    Args:
        dataset: the loader's dataset (warned about once).
        spec: the window asked for.
        partitions: partitions of the epoch.
        stats: where the line goes (an :class:`~sbloader.core.stats.ExecutionStats`), or
            None (set later with :meth:`into`).
    """

    def __init__(self, dataset: Any, spec: WindowSpec, partitions: int, stats: Any = None) -> None:
        self.dataset, self.spec, self.partitions, self.stats = dataset, spec, partitions, stats
        self.note = ""

    def observe(self, cutter: Cutter) -> None:
        """(After each batch) note a window the epoch did not fit."""
        if cutter.narrowed and not self.note:
            self.narrowed(cutter.widest)

    def narrowed(self, widest: int) -> None:
        """The epoch did not fit: a batch drew from at most ``widest`` partitions."""
        self.note = narrow_message(self.spec, drawn_share(widest, self.partitions), widest, self.partitions)
        self.into(self.stats)
        warn_once(self.dataset, self.note)

    def into(self, stats: Any) -> None:
        """Put the line into ``stats`` (if any)."""
        self.stats = stats
        if stats is not None and self.note:
            stats.shuffle_note = self.note


def warn_once(dataset: Any, message: str) -> None:
    """A warning, once per dataset."""
    try:
        if dataset in _WARNED:
            return
        _WARNED.add(dataset)
    except TypeError:  # not weak-referenceable: warn every time rather than never
        pass
    warnings.warn(message, stacklevel=3)


def window_batches(dataset: Any, executor: Any, spec: WindowSpec, batch_size: Optional[int],
                   drop_last: bool) -> Iterator[Any]:
    """(``Dataset.iter_batches``) One execution's batches, drawn through its shuffle window."""
    stats = executor.stats()
    window = resolve(spec, stats.memory_budget, "bytes")
    if window.in_turn or batch_size is None:
        return iter_batches(iter_blocks(executor), batch_size, drop_last)
    feed = BlockFeed(executor, hold=None)
    report = Report(dataset, spec, len(dataset.source.partitions(0, 0)), stats)
    return iter_batches(iter(feed), batch_size, drop_last,
                        ShuffleWindow(window, executor.epoch_seed, 0, feed.release, observe=report.observe))
