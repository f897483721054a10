"""Exit while the embedded Ray still starts in the background (``tests/unit/test_exit.py``).

    python exit_ray_starting.py OUT WHEN TAIL

A drop-in's first batch comes from the local workers while Ray starts in the background
(torch's quick-start snippet). The script then ends ``WHEN``: ``first`` (at once), ``daemons``
(once the start has spawned Ray's first daemon: the start is half done) or ``up`` (once Ray is
up); by ``TAIL``: ``ok`` (it falls off its end), ``exit3`` (``sys.exit(3)``) or ``raise`` (an
uncaught ``ValueError("boom")``). An exit hook that runs after sbloader's writes to ``OUT`` how
the start ended (``cut``: cut short by the exit; ``not begun``: ``ray.init`` was never called;
``up``; else the error) and the daemons the start had spawned (pids) when the script ended.
"""
from __future__ import annotations

import atexit
import json
import sys
import time

OUT, WHEN, TAIL = sys.argv[1:4]
REPORT: dict = {}


def _last() -> None:  # registered before sbloader's exit hooks: runs after them
    from sbloader.runtime import background, start_cut

    error = background.failed()
    ray = sys.modules.get("ray")
    if start_cut.was_cut(error):
        REPORT["start"] = "cut" if "before Ray's start was done" in str(error) else "not begun"
    elif error is not None:
        REPORT["start"] = "not begun" if "the process exits" in str(error) else repr(error)
    else:
        REPORT["start"] = "up" if background._STATE["done"].is_set() else "still running"
    REPORT["ray_up"] = bool(ray is not None and ray.is_initialized())
    with open(OUT, "w") as f:
        json.dump(REPORT, f)


atexit.register(_last)

import sbloader  # noqa: E402

loader = sbloader.DataLoader(list(range(1000)), batch_size=32, shuffle=True, num_workers=2)
next(iter(loader))

from sbloader.runtime import background, start_cut  # noqa: E402

deadline = time.monotonic() + 120
if WHEN == "daemons":
    while not start_cut.session_children() and not background.ready() and time.monotonic() < deadline:
        time.sleep(0.01)
elif WHEN == "up":
    while not background.ready() and time.monotonic() < deadline:
        time.sleep(0.05)
REPORT["daemons"] = start_cut.session_children()
if TAIL == "exit3":
    sys.exit(3)
if TAIL == "raise":
    raise ValueError("boom")
