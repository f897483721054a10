"""Ranks that arrive late: what the coordinator keeps of the epochs it has seen, and what it says
when a rank asks for an epoch it cannot know.

Ranks start seconds apart (a slow import, a model load on one GPU), so an epoch
shorter than that gap (an empty or nearly empty stream, the tail of a resumed
epoch, a validation set smaller than the world size) can end on rank 0 before
another rank asks for it. The coordinator therefore holds an epoch until *every*
rank has ended it (left it, or asked and acknowledged its whole share: see
``Epoch.finished``), and remembers the epochs it dropped (:class:`EndedEpochs`, the
last :data:`ENDED_KEPT`): a rank that asks for one of those gets the end of the
epoch, never an error. At most :data:`MAX_HELD_EPOCHS` epochs are held at once; the
oldest beyond that is dropped (a rank that never came for it is named in a warning).
A request for an epoch it has not seen waits for rank 0 to start it, at most
:data:`JOIN_TIMEOUT_S`, then fails saying who asked for what and what rank 0 is doing
(:func:`unknown_epoch`).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Optional

from sbloader.core.errors import SbloaderError

#: Ended epochs remembered (per-rank count and kind): a few bytes each.
ENDED_KEPT = 16
#: Epochs held at once (with their delivery logs and undelivered batches) waiting for late ranks.
MAX_HELD_EPOCHS = 4
#: Seconds a rank waits for rank 0 to start an epoch (the join's timeout).
JOIN_TIMEOUT_S = 300.0


class EndedEpochs:
    """The epochs a coordinator dropped once every rank ended them: per epoch, its per-rank
    count (None: a stream's) and whether it was a stream; the last :data:`ENDED_KEPT`."""

    def __init__(self, kept: int = ENDED_KEPT) -> None:
        self._kept = kept
        self._ended: OrderedDict[int, tuple[Optional[int], bool]] = OrderedDict()

    def add(self, epoch: int, per_rank: Optional[int], stream: bool) -> None:
        self._ended[epoch] = (per_rank, stream)
        self._ended.move_to_end(epoch)
        while len(self._ended) > self._kept:
            self._ended.popitem(last=False)

    def __contains__(self, epoch: int) -> bool:
        return epoch in self._ended

    def per_rank(self, epoch: int) -> Optional[int]:
        return self._ended[epoch][0]

    def reply(self, epoch: int) -> dict:
        """``next_batches``' answer for an ended epoch: nothing more, and the end."""
        if self._ended[epoch][1]:
            return {"batches": [], "done": True}
        return {"refs": [], "metas": [], "index": [], "done": True}

    def epochs(self) -> list[int]:
        return sorted(self._ended)


def rank0_doing(epochs: dict, ended: EndedEpochs, now: Optional[float] = None) -> str:
    """What rank 0 is doing, as the coordinator sees it (``epochs``: the epochs held, by number)."""
    now = time.monotonic() if now is None else now
    if not epochs and not ended.epochs():
        return "rank 0 has started no epoch on this coordinator"
    text = f"rank 0 started epoch(s) {sorted(epochs)} (held) and {ended.epochs()} (ended) here"
    if epochs:
        e = max(epochs)
        lg = epochs[e].logs[0]
        pr = epochs[e].per_rank
        share = f"{lg.count} of {pr if pr is not None else 'an unknown number of'} batches"
        seen = f"last asked {now - lg.last_seen:.0f} s ago" if lg.asked else "has not asked for any"
        text += f"; in epoch {e} it has received {share} and {seen}"
    return text


def unknown_epoch(epoch: int, rank: Optional[int], timeout: float, epochs: dict, ended: EndedEpochs) -> SbloaderError:
    """The error for a rank that asked for an epoch rank 0 did not start within ``timeout``."""
    who = f"rank {rank}" if rank is not None else "a rank"
    return SbloaderError(
        f"{who} asked for epoch {epoch}, which rank 0 did not start within {timeout:.0f} s; "
        f"{rank0_doing(epochs, ended)}. Every rank must iterate the loader the same number of times "
        "(and load the same state); is rank 0 iterating this loader, or is it stuck?"
    )


def overflow(epochs: dict, limit: int = MAX_HELD_EPOCHS) -> list[tuple[int, list[int]]]:
    """The oldest held epochs beyond ``limit``, each with the ranks that never ended it."""
    out = []
    for e in sorted(epochs)[:max(0, len(epochs) - limit)]:
        ep: Any = epochs[e]
        out.append((e, [r for r, lg in enumerate(ep.logs) if not (lg.left or lg.asked)]))
    return out
