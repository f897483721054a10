"""Ray's own messages about failures sbloader handles, kept from the user's terminal.

When a node dies, Ray's drivers print, besides sbloader's one ``lost node`` line, a
``Task MapActor.read_process failed. There are 3 retries remaining, so the task will
be retried`` line per retried call and a ``The node ... has been marked dead`` line
per driver: they reach every rank through the error messages Ray publishes to its
drivers (printed as ``(raylet) ...``); the coordinator's ``Attempting to recover N lost
objects by resubmitting their tasks ...`` line when a rank asks for a block lost with
its node (sbloader makes it again from its provenance). sbloader re-runs lost work and names the lost
node itself, so those lines say nothing the user can act on; ``SBLOADER_RAY_VERBOSE=1``
shows them again. Every other line Ray prints is left as it is.
"""
from __future__ import annotations

import os
from typing import Any

VERBOSE_ENV = "SBLOADER_RAY_VERBOSE"

#: Fragments of the Ray messages hidden (all are about a loss sbloader reports in one line).
CHATTER = (
    "retries remaining, so the task will be retried",
    "has been marked dead because the detector has missed too many heartbeats",
    "lost objects by resubmitting their tasks or setting a new primary location",
)


def is_chatter(line: str) -> bool:
    """Whether one line of Ray's output is retry or node-death chatter."""
    return any(fragment in line for fragment in CHATTER)


def without_chatter(data: dict) -> dict:
    """Ray's output record (``{"lines": [...], ...}``) with the chatter lines left out."""
    return dict(data, lines=[line for line in data.get("lines", ()) if not is_chatter(line)])


def _quiet(print_fn: Any) -> Any:
    """``print_fn`` (Ray's printer of output records) leaving the chatter out; a record left
    with no line is not printed."""
    if getattr(print_fn, "sbloader_quiet", False):
        return print_fn

    def quiet(data: Any, *args: Any, **kwargs: Any) -> None:
        kept = without_chatter(data) if isinstance(data, dict) else data
        if isinstance(kept, dict) and not kept.get("lines"):
            return
        print_fn(kept, *args, **kwargs)

    quiet.sbloader_quiet = True  # type: ignore[attr-defined]
    return quiet


def install() -> bool:
    """Filter the chatter out of what Ray prints in this driver (idempotent); False when
    ``SBLOADER_RAY_VERBOSE=1`` or this Ray prints elsewhere.

    Two ways reach the terminal: the error messages Ray publishes to drivers (printed by
    ``print_to_stdstream``, looked up at each call) and the workers' log lines (the
    ``ray_print_logs`` handler ``ray.init`` registered with the printer it had then:
    it is replaced by a filtering one).
    """
    if os.environ.get(VERBOSE_ENV) == "1":
        return False
    try:
        from ray._private import worker
    except ImportError:
        return False
    original = getattr(worker, "print_to_stdstream", None)
    if original is None:
        return False
    worker.print_to_stdstream = _quiet(original)
    dispatcher = getattr(worker, "global_worker_stdstream_dispatcher", None)
    for name, handler in list(getattr(dispatcher, "handlers", ())):
        if name == "ray_print_logs" and not getattr(handler, "sbloader_quiet", False):
            dispatcher.remove_handler(name)
            dispatcher.add_handler(name, _quiet(handler))
    return True
