"""The consumer's pace: whether the pipeline or the training loop is the bottleneck."""
from __future__ import annotations

from typing import Optional


def toward(prev: Optional[float], x: float, weight: float) -> float:
    """A running estimate moved ``weight`` of the way to ``x`` (``x`` itself when there is none)."""
    return x if prev is None else prev + weight * (x - prev)


class ConsumerPace:
    """Seconds the consumer spends per row between taking rows and asking for more (a
    moving average): the training loop's own time, its waits for data left out.

    The executor measures it at ``get_next`` (after the first ``skip`` blocks) unless a
    loader reports it itself (``external``): a loader whose fetch thread takes blocks
    ahead of the loop must report the loop's pace, since the thread asks again at once
    while its queue has room.

    Args:
        skip: blocks taken before the executor's own measurement starts.
        alpha: weight of the newest interval in the average.
    """

    def __init__(self, skip: int = 4, alpha: float = 0.25) -> None:
        self._skip, self._alpha = skip, alpha
        self.external = False
        self._taken = 0
        self._last: Optional[float] = None
        self._last_rows = 0
        self.row_s: Optional[float] = None

    def asked(self, t: float) -> None:
        """(Executor) the consumer asks for a block at ``t`` (``time.perf_counter()``)."""
        if self.external or self._last is None or self._taken <= self._skip:
            return
        self.add(t - self._last, self._last_rows)

    def took(self, t: float, rows: int) -> None:
        """(Executor) the consumer got a block of ``rows`` rows at ``t``."""
        self._taken += 1
        self._last, self._last_rows = t, rows

    def add(self, seconds: float, rows: int) -> None:
        """The consumer spent ``seconds`` on ``rows`` rows."""
        if rows <= 0:
            return
        self.row_s = toward(self.row_s, seconds / rows, self._alpha)
