"""Run a Python script as a user would: a fresh process in a session of its own, killed (with
everything it started) when it overruns, on this checkout's ``sbloader`` and no cluster address."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional

REPO = str(Path(__file__).resolve().parents[1])


def script_env(drop: Iterable[str] = (), **extra: str) -> dict:
    """This process's environment without ``RAY_ADDRESS`` (and ``drop``), with this checkout first on
    ``PYTHONPATH`` and ``extra`` set."""
    gone = {"RAY_ADDRESS", *drop}
    env = {k: v for k, v in os.environ.items() if k not in gone}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


@dataclass
class Ran:
    """A script's end: its exit code, its output, and its pid (its session's id)."""

    returncode: int
    stdout: str
    stderr: str
    pid: int


def run_script(args: list, timeout: float, env: Optional[Mapping[str, str]] = None) -> Ran:
    """``python ARGS`` in its own session, its output captured; on ``timeout`` its whole process group is
    killed and the test fails with the end of its stderr ("the script did not exit")."""
    proc = subprocess.Popen([sys.executable, *args], env=dict(env if env is not None else script_env()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the script did not exit within {timeout:g} s; its output: {out[-2000:]!r}; "
                             f"its stderr: {err[-3000:]}") from None
    return Ran(proc.returncode, out, err, proc.pid)
