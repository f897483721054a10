"""A torchrun job's own record of a hang: each rank process writes where its threads are to
``stacks-{pid}.txt`` in its working folder once the job has run ``SBLOADER_TEST_DUMP_AFTER``
seconds (``tests/e2e/_jobs.run_standalone`` sets it a little under the time it gives the job,
and adds the files to a killed job's output)."""
from __future__ import annotations

import faulthandler
import os

_FILES: list = []  # kept open until the process ends: faulthandler writes to the descriptor


def arm() -> None:
    """Schedule the dump (a no-op without ``SBLOADER_TEST_DUMP_AFTER``)."""
    after = os.environ.get("SBLOADER_TEST_DUMP_AFTER")
    if not after:
        return
    f = open(f"stacks-{os.getpid()}.txt", "w")
    _FILES.append(f)
    faulthandler.dump_traceback_later(float(after), exit=False, file=f)
