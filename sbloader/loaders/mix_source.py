"""One source of a mixture: its own loader, read row by row as the mixture's schedule asks.

A :class:`SourceCursor` owns the source's loader (its own pipeline, stages and
shuffle window, run deterministic under a seed of its own) and keeps the batches
it pulled but the mixture has not used whole. Its state is the loader's state
*before* the first of those batches plus the rows of it already used: a resumed
cursor loads that state, pulls the same batch again (the loader is deterministic)
and skips the used rows, so within the source's epoch no row is repeated or skipped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from sbloader.core.errors import StateDictError

#: A source's next epoch begins when this many of its batches are left to pull (or all are made).
AHEAD_BATCHES = 2


@dataclass
class CursorState:
    """What a cursor records (JSON: :meth:`to_json`).

    Attributes:
        loader: the source loader's state before the first batch not used whole.
        used: rows of that batch already used.
        taken: rows the mixture took from this source, in all.
        epoch: the source's epoch being read.
        ended: the source ran out of its epoch (and has not started the next).
    """

    loader: Optional[dict] = None  # set by SourceCursor.snapshot()
    used: int = 0
    taken: int = 0
    epoch: int = 0
    ended: bool = False

    def to_json(self) -> dict:
        """The JSON form."""
        return {"loader": self.loader, "used": self.used, "taken": self.taken, "epoch": self.epoch,
                "ended": self.ended}

    @staticmethod
    def from_json(name: str, value: Any) -> "CursorState":
        """Read a source's entry of a mixture state (checked)."""
        keys = {"loader", "used", "taken", "epoch", "ended"}
        if not isinstance(value, dict) or set(value) != keys:
            raise StateDictError(f"mix state of source {name!r}: found {value!r}, expected a dict with keys "
                                 f"{sorted(keys)}")
        for key in ("used", "taken", "epoch"):
            if not isinstance(value[key], int) or value[key] < 0:
                raise StateDictError(f"mix state of source {name!r}: {key} found {value[key]!r}, expected an "
                                     "int >= 0")
        return CursorState(value["loader"], value["used"], value["taken"], value["epoch"], bool(value["ended"]))


def rows_of(batch: Any) -> int:
    """Rows in a batch (a dict of tensors or arrays)."""
    for col in batch.values():
        return len(col)
    return 0


def _slice(batch: Any, lo: int, hi: int) -> dict:
    return {k: v[lo:hi] for k, v in batch.items()}


class SourceCursor:
    """Reads one source's rows in order, for the mixture (not thread-safe: the loop's thread only).

    Args:
        name: the source's name in the mixture.
        loader: the source's loader (deterministic, seeded; ``iter()`` runs its next epoch).
        ahead: begin the source's next epoch when :data:`AHEAD_BATCHES` of its batches are left (a source
            that restarts: ``sbloader/loaders/epoch_ahead.py``), where its loader can (``start_ahead``).
    """

    def __init__(self, name: str, loader: Any, ahead: bool = False) -> None:
        self.name = name
        self.loader = loader
        self._ahead = ahead and hasattr(loader, "start_ahead")
        self._asked = False  # the next epoch was asked for ahead during this one
        self._length: Optional[int] = None  # the loader's batches per epoch (-1: unknown)
        self._pulled = 0  # batches pulled since this iteration of the loader began
        self.state = CursorState()
        self.taken_at_start = 0  # rows taken when the current epoch started (an empty epoch takes none)
        self.wait_s = 0.0  # time the mixture waited on this source's pipeline
        self._it: Optional[Iterator[Any]] = None
        self._buf: list = []  # (loader state before it, batch) pulled, the first used up to state.used rows
        self._fresh: Optional[dict] = None  # a loaded state not iterated yet
        self._reading: Optional[int] = None  # the loader's epoch being read
        self._skip = 0  # rows of the first batch pulled after a resume that were used before

    # ----- reading ------------------------------------------------------------

    def available(self, n: int) -> int:
        """Rows ready to take, up to ``n``: fewer only where the source's epoch ends first."""
        have = sum(rows_of(b) for _, b in self._buf) - self.state.used
        while have < n and not self.state.ended:
            pulled = self._pull()
            if pulled is None:
                break
            self._buf.append(pulled)
            have = sum(rows_of(b) for _, b in self._buf) - self.state.used  # a resumed first batch skips rows
        return min(n, have)

    def start(self) -> None:
        """Start the source's epoch now, so its pipeline works ahead while the others start too
        (the first batch of a mixture needs rows of every source it draws)."""
        if self._it is None and not self.state.ended:
            t0 = time.perf_counter()
            self._it = iter(self.loader)
            self._fresh, self._asked, self._pulled = None, False, 0
            self.wait_s += time.perf_counter() - t0

    def take(self, n: int) -> list:
        """The next ``n`` rows as slices of batches (``n`` at most :meth:`available`)."""
        pieces = []
        while n > 0:
            if not self._buf:
                raise RuntimeError(f"source {self.name!r}: took more rows than available(); a mixture bug")
            first = self._buf[0][1]
            lo = self.state.used
            hi = min(rows_of(first), lo + n)
            pieces.append(_slice(first, lo, hi))
            n -= hi - lo
            self.state.taken += hi - lo
            if hi == rows_of(first):
                self._buf.pop(0)
                self.state.used = 0
            else:
                self.state.used = hi
        return pieces

    def snapshot(self) -> CursorState:
        """The cursor's state now: the loader's state before the first batch not used whole."""
        if self._buf:
            return CursorState(self._buf[0][0], self.state.used, self.state.taken, self.state.epoch,
                               self.state.ended)
        loader = self._fresh if self._fresh is not None else self.loader.state_dict()
        # Every batch of the epoch taken, its end not yet seen: the loader's state is already its next
        # epoch's, so the source has ended (a resumed "stop" must stop where this one will).
        ended = self.state.ended or (self._reading is not None and loader.get("epoch", 0) > self._reading)
        return CursorState(loader, 0, self.state.taken, self.state.epoch, ended)

    def restart(self) -> None:
        """Start the source's next epoch (it ran out of this one)."""
        if self.state.ended:
            self.state.ended = False
            self.state.epoch += 1
            self.taken_at_start = self.state.taken

    def _pull(self) -> Optional[tuple]:
        """(the loader's state before it, the source's next batch), or None at the end of its epoch."""
        t0 = time.perf_counter()
        try:
            if self._it is None:
                self._it = iter(self.loader)
                self._fresh, self._asked, self._pulled = None, False, 0
            before = self.loader.state_dict()
            if self._reading is None:
                self._reading = int(before.get("epoch", 0))
            batch = next(self._it)
            self._pulled += 1
            if self._ahead and not self._asked and self._near_end():
                self._asked = True
                self.loader.start_ahead()
        except StopIteration:
            self._it, self._reading = None, None
            self.state.ended = True
            return None
        finally:
            self.wait_s += time.perf_counter() - t0
        if self._skip:
            if self._skip >= rows_of(batch):
                raise StateDictError(
                    f"source {self.name!r}: the resumed state had used {self._skip} rows of a batch, but the "
                    f"batch pulled again has {rows_of(batch)}; the source's loader did not repeat its batches. "
                    "Resume with the same sources, batch size and seed")
            self.state.used, self._skip = self._skip, 0
        return before, batch

    def _near_end(self) -> bool:
        """Whether the source's epoch is near its end: at most :data:`AHEAD_BATCHES` of its batches left
        (its length known; counted from this iteration's start, so an epoch resumed partway asks later),
        or every batch made."""
        if self._length is None:
            try:
                self._length = len(self.loader)
            except TypeError:  # not known before the epoch ends (filter, flat_map)
                self._length = -1
        left = self._length - self._pulled if self._length >= 0 else None
        return (left is not None and left <= AHEAD_BATCHES) or getattr(self._it, "produced", False)

    # ----- state --------------------------------------------------------------

    def load(self, state: CursorState) -> None:
        """Resume from ``state``: the next rows are those after the ones it had taken."""
        self._stop()
        self.state = CursorState(None, 0, state.taken, state.epoch, state.ended)
        self._buf = []
        self._skip = state.used
        self.taken_at_start = -1  # unknown: not checked for emptiness until the next epoch
        self._fresh = state.loader
        if state.loader is not None:
            self.loader.load_state_dict(state.loader)

    def close(self) -> None:
        """Stop the source's running epoch (its pipeline); reading on later resumes where it was."""
        if self._it is not None:
            snap = self.snapshot()
            self.load(snap)  # the loader's next epoch would skip the rest of this one

    def _stop(self) -> None:
        it, self._it, self._reading = self._it, None, None
        if it is not None and hasattr(it, "close"):
            it.close()
