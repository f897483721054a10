"""Which failed requests to a store are tried again, and how long to wait before each try:
exponential backoff with full jitter (throttling, 5xx, timeouts and dropped connections are
retried; a missing object, a missing bucket and refused credentials are not)."""
from __future__ import annotations

import random
from dataclasses import dataclass

_NOT_RETRYABLE_WORDS = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket",
                        "NoSuchKey", "response code: 400", "response code: 401", "response code: 403",
                        "response code: 404")


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of one request, with exponential backoff and full jitter.

    Attributes:
        attempts: tries in all (>= 1).
        base_s: the first backoff's upper bound; it doubles each retry.
        max_s: the largest backoff.
    """

    attempts: int = 6
    base_s: float = 0.05
    max_s: float = 2.0

    def backoff(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry`` (0-based): uniform in ``[0, min(max, base * 2**retry)]``."""
        return rng.uniform(0.0, min(self.max_s, self.base_s * (2 ** retry)))


def is_retryable(exc: BaseException) -> bool:
    """Whether a failed request may succeed when tried again: throttling (503, SlowDown),
    5xx, timeouts and dropped connections are; a missing object, a missing bucket and
    refused credentials are not."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError):
        msg = str(exc)
        return not any(w in msg for w in _NOT_RETRYABLE_WORDS)
    return False
