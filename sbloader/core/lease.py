"""How many batches a rank asks the split coordinator for at once (pure).

Every request costs the coordinator a Ray actor call (a fixed CPU cost) whatever
it carries, so a rank that asks for one or two batches per request makes the
coordinator's CPU per batch that fixed cost, and its request rate grows with the
job's batch rate. A rank instead *leases* enough batches to last it about
``interval_s`` at the rate it consumes them: each rank then calls about once per
``interval_s`` whatever its speed, and the coordinator's CPU per batch falls by
the lease. The lease is bounded below by the rank's prefetch (``ask``) and above
by ``cap``: leased batches are held by the rank until consumed, so they count in
the pipeline's memory budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

#: Seconds of consumption one request should cover.
LEASE_INTERVAL_S = 1.0
#: Most batches one request leases.
MAX_LEASE = 8


def lease_size(rate: float, ask: int, interval_s: float = LEASE_INTERVAL_S, cap: int = MAX_LEASE) -> int:
    """Batches to ask for in the next request.

    Args:
        rate: batches per second the rank consumes (0 or less: not known yet).
        ask: the rank's prefetch, the least it asks for.
        interval_s: seconds of consumption one request should cover.
        cap: the most it asks for (at least ``ask``).

    Returns:
        ``clamp(ceil(rate * interval_s), ask, max(ask, cap))``.
    """
    if ask < 1:
        raise ValueError(f"ask must be at least 1 batch, found {ask}")
    if interval_s < 0:
        raise ValueError(f"interval_s must be >= 0 seconds, found {interval_s}")
    top = max(ask, cap)
    if not rate > 0 or not math.isfinite(rate):  # unknown (or infinite: a consumer that does not wait)
        return ask if not rate > 0 else top
    return int(min(top, max(ask, math.ceil(rate * interval_s - 1e-9))))


@dataclass
class RateMeter:
    """A rank's consumption rate (batches per second), an exponential moving average over
    the gaps between the batches it takes.

    Attributes:
        alpha: weight of the newest gap.
        rate: the current estimate (0: fewer than two batches seen).
    """

    alpha: float = 0.2
    rate: float = 0.0
    _last: float = -1.0
    _gap: float = 0.0

    def took(self, now: float) -> float:
        """Record a batch taken at ``now`` (seconds, monotonic); the updated rate."""
        if self._last >= 0:
            gap = max(0.0, now - self._last)
            self._gap = gap if self._gap == 0.0 else (1 - self.alpha) * self._gap + self.alpha * gap
            self.rate = 1.0 / self._gap if self._gap > 0 else math.inf
        self._last = now
        return self.rate
