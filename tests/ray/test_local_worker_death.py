"""A local worker that dies (issue #45): the drop-in raises torch's error, naming the signal as torch's does.

torch learns how a worker ended from its SIGCHLD handler, which it installs from the main thread only; the
local start runs torch's iterator in the loader's fetch thread. torch's own ``test_segfault`` reads the
signal's name (``DataLoader worker (pid N) is killed by signal: Segmentation fault``) in the error's chain.
Each case runs in a fresh process, as torch's test does: there torch's handler is not installed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")

_SCRIPT = """
import sys, traceback
sys.path.insert(0, {scripts!r})
import sbloader
from segfaults import Segfaults, quiet

if __name__ == "__main__":
    loader = sbloader.DataLoader(Segfaults(10), batch_size=2, num_workers=2, worker_init_fn=quiet,
                                 multiprocessing_context={ctx!r})
    try:
        next(iter(loader))
        print("no error")
    except Exception:
        print(traceback.format_exc())
"""


@pytest.mark.parametrize("ctx", [None, "spawn"])
def test_a_segfaulted_local_worker_names_its_signal_as_torchs(tmp_path, ctx):
    script = tmp_path / "segfaults.py"
    script.write_text(_SCRIPT.format(ctx=ctx, scripts=str(SCRIPTS)))
    env = dict(os.environ, SBLOADER_HANDOVER_AT="100")  # the whole epoch on the local workers
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env,
                         cwd=tmp_path).stdout
    assert "RuntimeError: DataLoader worker (pid(s)" in out and "exited unexpectedly" in out, out
    assert "DataLoader worker (pid " in out and ") is killed by signal: Segmentation fault" in out, out
