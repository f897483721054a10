"""Ray's own messages about failures sbloader handles, kept from the user's terminal.

When a node dies, Ray's drivers print, besides sbloader's one ``lost node`` line, a
``Task MapActor.read_process failed. There are 3 retries remaining, so the task will
be retried`` line per retried call and a ``The node ... has been marked dead`` line
per driver: they reach every rank through the error messages Ray publishes to its
drivers (printed as ``(raylet) ...``). sbloader re-runs lost work and names the lost
node itself, so those lines say nothing the user can act on; ``SBLOADER_RAY_VERBOSE=1``
shows them again. Every other line Ray prints is left as it is.
"""
from __future__ import annotations

import os
from typing import Any

VERBOSE_ENV = "SBLOADER_RAY_VERBOSE"

#: Fragments of the Ray messages hidden (both are about a loss sbloader reports in one line).
CHATTER = (
    "retries remaining, so the task will be retried",
    "has been marked dead because the detector has missed too many heartbeats",
)


def is_chatter(line: str) -> bool:
    """Whether one line of Ray's output is retry or node-death chatter."""
    return any(fragment in line for fragment in CHATTER)


def without_chatter(data: dict) -> dict:
    """Ray's output record (``{"lines": [...], ...}``) with the chatter lines left out."""
    return dict(data, lines=[line for line in data.get("lines", ()) if not is_chatter(line)])


def install() -> bool:
    """Filter the chatter out of what Ray prints in this driver (idempotent); False when
    ``SBLOADER_RAY_VERBOSE=1`` or this Ray prints elsewhere."""
    if os.environ.get(VERBOSE_ENV) == "1":
        return False
    try:
        from ray._private import worker
    except ImportError:
        return False
    original = getattr(worker, "print_to_stdstream", None)
    if original is None:
        return False
    if getattr(original, "sbloader_quiet", False):
        return True

    def quiet(data: Any, ignore_prefix: bool = False) -> None:
        kept = without_chatter(data) if isinstance(data, dict) else data
        if isinstance(kept, dict) and not kept.get("lines"):
            return
        original(kept, ignore_prefix)

    quiet.sbloader_quiet = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = quiet
    return True
