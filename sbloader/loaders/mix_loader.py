"""The loader of a data mixture: one loader per source, mixed after their pipelines.

Every source runs its own loader (its own stages and shuffle window, deterministic
under a seed drawn from the mixture's seed and the source's name); the mixture
draws the ``i``-th sample of its stream from the source the schedule names
(:func:`~sbloader.core.mix_plan.schedule`, a pure function of the seed, ``i`` and
the weight history) and cuts batches of ``batch_size`` rows in that order. It runs
in the loop's thread (the sources' loaders prefetch in theirs), so its state is
exactly what the loop took.
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Callable, Iterator, Mapping, Optional

import numpy as np

from sbloader.core import mix_plan
from sbloader.core.mix_plan import WeightChange
from sbloader.loaders import mix_state
from sbloader.loaders.mix_source import CursorState, SourceCursor

PADDING = "sbloader_padding"  # the column a split source marks its repeated rows with
MakeLoader = Callable[[str, int], Any]  # (source name, source seed) -> a deterministic loader


def source_seed(seed: int, name: str) -> int:
    """The seed of a source's own loader: a function of the mixture's seed and the source's name."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) & ((1 << 63) - 1)


class MixLoader:
    """Batches drawn from several sources at set weights (``sbloader.mix(...).to_dataloader()``).

    Args:
        names: the sources, in the order of the schedule's indices.
        make_loader: builds a source's deterministic loader from its name and seed.
        weights: name -> weight (>= 0; normalised).
        seed: the mixture's seed (the schedule and every source's seed derive from it).
        batch_size: rows per batch.
        on_exhausted: what a source that runs out of its epoch does: ``"restart"`` (its
            next epoch starts, reshuffled), ``"stop"`` (the iteration ends) or ``"drop"``
            (it is left out and its weight shared among the rest; the iteration ends when
            every source ran out).
        num_samples: samples per iteration (None: until the mixture ends; endless under
            ``"restart"``).
        drop_last: drop a final short batch.
        source_key: add a column of that name holding each row's source index (``names``).
        fingerprints: name -> the source's fingerprint (what a state must match).
    """

    def __init__(self, names: list, make_loader: MakeLoader, weights: Mapping[str, float], *, seed: int,
                 batch_size: int, on_exhausted: str = "restart", num_samples: Optional[int] = None,
                 drop_last: bool = False, source_key: Optional[str] = None,
                 fingerprints: Optional[dict] = None) -> None:
        if on_exhausted not in mix_plan.ON_EXHAUSTED:
            raise ValueError(f"on_exhausted must be one of {mix_plan.ON_EXHAUSTED}, found {on_exhausted!r}")
        if batch_size is None or batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, found {batch_size}")
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"num_samples must be >= 1 or None, found {num_samples}")
        self.names = list(names)
        self.seed = int(seed)
        self.batch_size = batch_size
        self.on_exhausted = on_exhausted
        self.num_samples = num_samples
        self.drop_last = drop_last
        self.source_key = source_key
        self._fingerprints = fingerprints or {}
        self._cursors = {n: SourceCursor(n, make_loader(n, source_seed(self.seed, n)), ahead=on_exhausted == "restart")
                         for n in self.names}
        for c in self._cursors.values():  # states that credit rows on any world size; the first calls first
            if hasattr(c.loader, "as_mixture_source"):
                c.loader.as_mixture_source()
        self._history: tuple = (WeightChange(0, mix_plan.check_weights(weights, self.names)),)
        self._position = 0
        self._start: Optional[int] = None  # the position the current iteration began at (None: between)
        self._epoch = 0
        first = next(iter(self._cursors.values())).loader
        self.world_size = int(getattr(getattr(first, "world", None), "world_size", 1))

    # ----- weights -----------------------------------------------------------

    @property
    def weights(self) -> dict:
        """The asked weights in force now (as given, not normalised)."""
        return dict(self._history[-1].weights)

    @property
    def history(self) -> list:
        """The weight history: ``[position, {source: weight}, [dropped sources]]`` per change."""
        return [c.to_json() for c in self._history]

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """New weights from the next batch on (sources not named keep theirs; 0 leaves one out,
        a positive weight brings one in). Recorded in the state's weight history."""
        asked = {**self.weights, **dict(weights)}
        new = mix_plan.check_weights(asked, self.names)
        last = self._history[-1]
        if self._live(last, new):
            self._change(WeightChange(self._position, new, last.dropped))
        else:
            raise ValueError(f"the weights {dict(new)} leave no source to draw from: {list(last.dropped)} ran "
                             "out under on_exhausted='drop'; give a source still running a positive weight")

    def _live(self, last: WeightChange, weights: tuple) -> bool:
        return any(w > 0 and n not in last.dropped for n, w in weights)

    def _change(self, change: WeightChange) -> None:
        self._history = mix_plan.append_change(self._history, change)

    # ----- iteration ---------------------------------------------------------

    def __len__(self) -> int:
        if self.num_samples is None:
            raise TypeError("a mixture without num_samples has no length (it runs until its sources end, or for "
                            "good under on_exhausted='restart'); pass num_samples to mix().to_dataloader()")
        n = self.num_samples
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[dict]:
        if self._start is None:
            self._begin_iteration()
        return self._batches()

    def _begin_iteration(self) -> None:
        """A new iteration: sources that ran out start their next epoch; drops are lifted."""
        self._start = self._position
        self._epoch += 1
        for c in self._cursors.values():
            c.restart()
        last = self._history[-1]
        if last.dropped:
            self._change(WeightChange(self._position, last.weights, ()))

    def _batches(self) -> Iterator[dict]:
        start = self._start
        last = self._history[-1]
        for n, w in last.weights:  # every source drawn from starts at once, not at its first draw
            if w > 0 and n not in last.dropped:
                self._cursors[n].start()
        while start is not None and self._start == start:  # a newer iteration ends this one
            want = self.batch_size
            if self.num_samples is not None:
                want = min(want, self.num_samples - (self._position - start))
            drawn, ended = self._draw(want) if want > 0 else (None, True)
            if ended or (self.num_samples is not None and self._position - start >= self.num_samples):
                self._start = None  # the iteration is over once the loop has this batch
            if drawn is not None and not (ended and self.drop_last and len(drawn[1]) < self.batch_size):
                yield self._collate(drawn)

    def _draw(self, want: int) -> tuple:
        """Up to ``want`` rows in schedule order (per source its pieces, and each row's source),
        and whether the iteration ended; ``position`` moves on by the rows drawn."""
        pieces: dict = {j: [] for j in range(len(self.names))}
        orders: list = []
        ended = False
        while want > 0 and not ended:
            s = mix_plan.schedule(self.seed, self._history, self.names, self._position, self._position + want)
            need = np.bincount(s, minlength=len(self.names))
            cut = len(s)
            for j, n in enumerate(self.names):
                have = self._cursors[n].available(int(need[j])) if need[j] else 0
                if have < need[j]:  # source j runs out at its (have+1)-th draw here
                    cut = min(cut, int(np.flatnonzero(s == j)[have]))
            for j, n in enumerate(self.names):
                k = int((s[:cut] == j).sum())
                if k:
                    pieces[j] += self._cursors[n].take(k)
            orders.append(s[:cut])
            self._position += cut
            want -= cut
            if cut < len(s):
                ended = self._exhausted(self.names[int(s[cut])])
        order = np.concatenate(orders) if orders else np.zeros(0, dtype=np.int64)
        return (pieces, order) if len(order) else None, ended

    def _collate(self, drawn: tuple) -> dict:
        """One batch: the pieces of every source put in schedule order."""
        import torch

        pieces, order = drawn
        chunks = [p for j in sorted(pieces) for p in pieces[j]]
        padded = any(PADDING in p for p in chunks)  # a split source's repeated rows (split across ranks)
        keys = [k for k in chunks[0] if k != PADDING]
        for j in sorted(pieces):
            for p in pieces[j]:
                if set(p) - {PADDING} != set(keys):
                    raise ValueError(
                        f"the mixture's sources give different columns: {self.names[j]!r} gives {sorted(p)}, "
                        f"another {sorted(keys)}; map every source to the same columns before mixing")
        # One copy per column: each piece goes straight to its rows of the batch (its source's
        # places in schedule order, consecutive per piece).
        dest = {j: np.flatnonzero(order == j) for j in pieces}
        out: dict = {}
        for j in sorted(pieces):
            at = 0
            for p in pieces[j]:
                n = len(p[next(iter(keys))]) if keys else 0
                rows = Rows(dest[j][at:at + n])
                at += n
                for k in keys:
                    _place(out, k, p[k], rows, len(order), self.names[j])
                if padded:
                    if PADDING not in out:
                        out[PADDING] = torch.zeros(len(order), dtype=torch.bool)
                    if PADDING in p:
                        out[PADDING][rows.index()] = torch.as_tensor(p[PADDING]).bool()
        if self.source_key is not None:
            out[self.source_key] = torch.from_numpy(order.astype(np.int64))
        return out

    def _exhausted(self, name: str) -> bool:
        """Source ``name`` ran out of its epoch at the current position: whether the iteration ends."""
        cursor = self._cursors[name]
        if self.on_exhausted == "restart":
            if cursor.state.taken == cursor.taken_at_start:
                raise ValueError(f"source {name!r} has no rows in its epoch {cursor.state.epoch}; a mixture "
                                 "cannot restart an empty source: give it data or weight 0")
            cursor.restart()
            return False
        if self.on_exhausted == "stop":
            return True
        last = self._history[-1]
        dropped = tuple(sorted(set(last.dropped) | {name}))
        self._change(WeightChange(self._position, last.weights, dropped))
        return not self._live(self._history[-1], last.weights)

    # ----- state -------------------------------------------------------------

    def state_dict(self) -> dict:
        """A small JSON-serialisable state: the position in the mixture, the weight history, and
        every source's own loader state (before the batch it is in) with the rows of it used."""
        return {**mix_state.FORMAT.header(self._fingerprint()), "epoch": self._epoch,
                "position": self._position, "start": self._start if self._start is not None else self._position,
                "between": self._start is None, "history": self.history, "world_size": self.world_size,
                "sources": {n: c.snapshot().to_json() for n, c in self._cursors.items()}}

    def load_state_dict(self, state_dict: dict, strict: bool = True,
                        weights: Optional[Mapping[str, float]] = None) -> None:
        """Resume from :meth:`state_dict`: every source goes on after the rows the loop took from it.

        ``weights``: new weights from the resumed position on (as :meth:`set_weights`).
        On another world size, every source the ranks were partway through a batch of resumes
        after the rows they had used: a split source's loader credits them, row by row; an
        ``IterableDataset`` source (every rank iterates it) makes that batch again and skips them,
        from the position the state holds (rank 0's, on every rank: see the user guide). A loader
        that can do neither is refused unless ``strict=False`` (warning: the used rows of that batch
        on every old rank come again). ``strict=False`` also loads a state of other sources'
        fingerprints.
        """
        state = mix_state.FORMAT.check(state_dict, self._fingerprint(), strict)
        mix_state.check_body(state, self.names)
        history = tuple(WeightChange.from_json(c, self.names) for c in state["history"])
        if history[0].position != 0:
            raise mix_state.StateDictError(f"mix state history: its first change is at {history[0].position}, "
                                           "expected 0")
        cursors = {n: CursorState.from_json(n, state["sources"][n]) for n in self.names}
        found = int(state.get("world_size", 1))
        if found != self.world_size:  # a split source's batches are cut anew: credit the rows used
            cursors = {n: self._credited(n, c, found, strict) for n, c in cursors.items()}
        for n, c in self._cursors.items():
            c.load(cursors[n])
        self._history = history
        self._position = int(state["position"])
        self._start = None if state.get("between") else int(state["start"])
        self._epoch = int(state["epoch"])
        if weights is not None:
            self.set_weights(weights)

    def _credited(self, name: str, cursor: CursorState, world_size: int, strict: bool) -> CursorState:
        """A source's cursor taken on ``world_size`` ranks partway through a batch, for this world size.

        A loader that splits its epoch across ranks credits the used rows of every old rank's batch
        (:meth:`~sbloader.loaders.pipeline_loader.PipelineLoader.credit_rows`): the cursor is then
        between batches. A loader every rank iterates whole (an ``IterableDataset``'s drop-in,
        ``split=False``) makes the same batches on any world size: its batch comes again and the
        used rows are skipped, as on the same world size. Any other is refused
        (:func:`~sbloader.loaders.mix_state.refuse_partway`)."""
        loader = self._cursors[name].loader
        if not cursor.used or cursor.loader is None:
            return cursor
        if hasattr(loader, "credit_rows"):
            return dataclasses.replace(cursor, loader=loader.credit_rows(cursor.loader, cursor.used, world_size,
                                                                         strict), used=0)
        if getattr(loader, "split", True) is False:
            return cursor
        mix_state.refuse_partway(name, cursor.used, world_size, self.world_size, strict)
        return dataclasses.replace(cursor, used=0)

    def _fingerprint(self) -> dict:
        return {"sources": {n: self._fingerprints.get(n) for n in self.names}, "seed": self.seed,
                "batch_size": self.batch_size, "on_exhausted": self.on_exhausted}

    # ----- statistics ----------------------------------------------------------

    def stats(self) -> mix_state.MixStats:
        """Per source: samples taken, realised share against the asked weight, its epoch, the time
        the mixture waited on its pipeline and its pipeline's statistics."""
        last = self._history[-1]
        p = last.effective(self.names)
        since = mix_plan.counts(mix_plan.schedule(self.seed, self._history, self.names, last.position,
                                                  self._position), len(self.names))
        total = sum(c.state.taken for c in self._cursors.values())
        out = {}
        for j, (n, c) in enumerate(self._cursors.items()):
            out[n] = mix_state.SourceStats(
                taken=c.state.taken, share=c.state.taken / total if total else 0.0,
                share_since_change=float(since[j] / since.sum()) if since.sum() else 0.0, weight=float(p[j]),
                epoch=c.state.epoch, ended=c.state.ended, wait_s=c.wait_s,
                pipeline=c.loader.stats() if hasattr(c.loader, "stats") else None)
        return mix_state.MixStats(self._position, int(since.sum()), out)

    def close(self) -> None:
        """Stop every source's running epoch."""
        for c in self._cursors.values():
            c.close()


_RUN_COPY_BYTES = 1024  # rows at least this big are copied run by run (scattered index writes are slow)


class Rows:
    """A piece's places in the batch (ascending), as an index or as runs of consecutive places."""

    def __init__(self, places: np.ndarray) -> None:
        self.places = places
        self._index: Any = None
        self._runs: Optional[list] = None

    def index(self) -> Any:
        """The places as a torch index."""
        import torch

        if self._index is None:
            self._index = torch.from_numpy(self.places)
        return self._index

    def runs(self) -> list:
        """``(first place, first row, end row)`` per run of consecutive places."""
        if self._runs is None:
            cuts = np.flatnonzero(np.diff(self.places) != 1) + 1
            starts, ends = np.concatenate([[0], cuts]), np.concatenate([cuts, [len(self.places)]])
            self._runs = [(int(self.places[a]), int(a), int(b)) for a, b in zip(starts, ends) if b > a]
        return self._runs


def _place(out: dict, key: str, col: Any, rows: Any, size: int, source: str) -> None:
    """Put a piece's column at ``rows`` of the batch's column ``key`` (made on first use): a tensor
    into a tensor of the same dtype and row shape, anything else (strings...) into a list."""
    import torch

    if isinstance(col, torch.Tensor):
        if key not in out:
            out[key] = col.new_empty((size,) + tuple(col.shape[1:]))
        into = out[key]
        if not isinstance(into, torch.Tensor) or into.dtype != col.dtype or into.shape[1:] != col.shape[1:]:
            found = f"{col.dtype} {tuple(col.shape[1:])}"
            expected = (f"{into.dtype} {tuple(into.shape[1:])}" if isinstance(into, torch.Tensor)
                        else "a list")
            raise ValueError(f"column {key!r} of source {source!r}: found {found} per batch, expected {expected} "
                             "(another source's); give every source the same dtypes and shapes before mixing")
        if col[:1].numel() * col.element_size() >= _RUN_COPY_BYTES:  # big rows: a copy per run of places
            for at, lo, hi in rows.runs():
                into[at:at + hi - lo].copy_(col[lo:hi])
        else:
            into[rows.index()] = col
        return
    if key not in out:
        out[key] = [None] * size
    if not isinstance(out[key], list):
        raise ValueError(f"column {key!r} of source {source!r} is not a tensor but another source's is; give "
                         "every source the same column types before mixing")
    for i, v in zip(rows.places.tolist(), list(col)):
        out[key][i] = v
