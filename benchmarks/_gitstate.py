"""The code a benchmark ran: the commit and the sbloader files that differ from it."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def git_state() -> dict[str, Any]:
    """``{"commit": HEAD, "sbloader_changed": [files of sbloader/ differing from HEAD, or untracked]}``."""
    def run(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = run("status", "--porcelain", "--", "sbloader").splitlines()
    return {"commit": run("rev-parse", "HEAD") or None, "sbloader_changed": [c[3:] for c in changed]}
