"""The two sides of the ``shuffle_window`` scenario: a worker process per sbloader tree
(``_shuffle_worker.py``), and the tree before issue #39 as a git worktree. Not a scenario."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT


def before_tree(rev: str) -> Path:
    """A worktree of ``rev`` (the tree before the issue) at /tmp/wt39-before."""
    where = Path("/tmp/wt39-before")
    if not (where / "sbloader").exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(where), rev], cwd=ROOT, check=True,
                       capture_output=True)
    return where


class Side:
    """A worker process (``_shuffle_worker.py``) importing sbloader from ``tree``; restarted when
    its Ray is lost (a loaded machine), at most three times."""

    def __init__(self, tree: Path, path: str) -> None:
        self.tree, self.path, self.restarts = tree, path, 0
        self.start()

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(self.tree), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        worker = Path(__file__).with_name("_shuffle_worker.py")
        self.proc = subprocess.Popen([sys.executable, str(worker), self.path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=str(self.tree))
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker of {self.tree} exited at start (rc {self.proc.wait()})")
        self.ready = json.loads(line)["ready"]

    def epoch(self, **req: Any) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:  # the worker died (its Ray lost under a loaded machine): once more on a new one
            self.restarts += 1
            self.proc.wait()
            self.start()
            return self.epoch(**req) if self.restarts <= 3 else {}
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def close(self) -> None:
        self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
        self.proc.stdin.flush()
        self.proc.wait(60)
