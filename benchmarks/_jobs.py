"""Child jobs of the benchmarks: torchrun jobs and single trainer processes.

- :func:`torchrun_cmd`: the launcher's command line for ``n`` local ranks.
- :func:`job_env`: the environment a job's processes start with.
- :func:`wait_or_kill`: wait for a job with a deadline; kill it past the deadline.
- :func:`write_paths_file`: hand a job its list of files (one path a line).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence, Union

HERE = Path(__file__).resolve().parent


def torchrun_cmd(n: int) -> list[str]:
    """``torchrun --standalone --nproc-per-node=n`` (``python -m torch.distributed.run``
    where no ``torchrun`` is on ``PATH``); the script and its arguments follow."""
    exe = shutil.which("torchrun")
    base = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    return base + ["--standalone", f"--nproc-per-node={n}"]


def job_env(*first: Union[str, Path]) -> dict[str, str]:
    """This process's environment for a child job.

    ``PYTHONPATH`` starts with this folder (the workload modules, pickled by
    reference), then ``first``, then what it held already. Unless already set: Ray on
    loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), Ray's usage stats off,
    one OpenMP thread. A caller that must force one of these sets it afterwards.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE)] + [str(p) for p in first]
                                        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> int:
    """``proc``'s exit status; past ``timeout_s`` it is killed (a torchrun agent's ranks
    die with it) and -9 is returned."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return -9


def write_paths_file(paths: Sequence[str], prefix: str) -> str:
    """A new temporary file holding ``paths``, one a line (the caller removes it)."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(paths))
    return path
