"""tests/ray_logs.py: only an exited worker's old log files are deleted (the suite's own helper)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from ray_logs import drop_dead_workers_logs


def test_only_the_old_logs_of_exited_workers_go(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    live = str(os.getpid())
    names = {
        f"worker-{'a' * 56}-01000000-{dead}.out": False, f"worker-{'a' * 56}-01000000-{dead}.err": False,
        f"python-core-worker-{'b' * 56}_{dead}.log": False,
        f"worker-{'c' * 56}-01000000-{live}.out": True, f"python-core-worker-{'d' * 56}_{live}.log": True,
        "raylet.out": True, "gcs_server.err": True, f"python-core-driver-{'e' * 56}_{dead}.log": True,
    }
    old = time.time() - 60
    for name in names:
        (tmp_path / name).write_text("a line\n")
        os.utime(tmp_path / name, (old, old))
    fresh = tmp_path / f"worker-{'f' * 56}-01000000-{dead}.err"  # written a moment ago: its lines may not be out yet
    fresh.write_text("the last line\n")
    names[fresh.name] = True
    assert drop_dead_workers_logs(str(tmp_path)) == 3
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, kept in names.items() if kept)
    assert drop_dead_workers_logs(str(tmp_path / "gone")) == 0
