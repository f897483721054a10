"""What to write next to every figure: the machine, the versions, the date, the command,
the commit; and the environment Ray's workers need to import benchmark code."""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

BENCH_DIR = Path(__file__).resolve().parents[1]
ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
VERSIONED = ("sbloader", "torch", "ray", "numpy", "pyarrow", "pillow", "simplejpeg", "nvidia-dali-cuda120",
             "spdl", "tensorflow-cpu", "boto3", "moto")


def ray_worker_env() -> None:
    """Call before Ray starts: a local Ray on loopback only, patient health checks, and Ray's workers import the
    benchmark modules (workload functions are pickled by reference, not by value): the
    repository root (``benchmarks.*``) and ``benchmarks/`` (the older ``_x`` modules)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # A loaded 2-core machine (load average 20+) delays the raylet's health checks past
    # Ray's 5 misses of 3 s and the GCS then declares the node dead mid-run: allow ~90 s.
    os.environ.setdefault("RAY_health_check_failure_threshold", "30")
    want = [str(BENCH_DIR), str(ROOT)]
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in want]
    os.environ["PYTHONPATH"] = os.pathsep.join(want + rest)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mem_total_bytes() -> int:
    """Physical memory from /proc/meminfo."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def version(dist: str) -> Optional[str]:
    """An installed distribution's version, without importing it (None if absent)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """nproc, memory, CPU model, Python/library versions and the date (UTC)."""
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "mem_total_gib": round(mem_total_bytes() / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": {d: version(d) for d in VERSIONED},
    }


def machine_line(machine: dict[str, Any]) -> str:
    """One line: cores, CPU model, memory, kernel."""
    return (f"{machine['nproc']} cores ({machine['cpu_model']}), {machine['mem_total_gib']} GiB, "
            f"kernel {machine['kernel']}")


def versions_line(machine: dict[str, Any]) -> str:
    """One line: python and every installed library of :data:`VERSIONED`."""
    return "python " + machine["python"] + ", " + ", ".join(
        f"{k} {v}" for k, v in machine["versions"].items() if v)


def command_line() -> str:
    """The exact command line of this process (as a shell would take it)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith("benchmarks/__main__.py"):
        argv = ["-m", "benchmarks"] + argv[1:]
    return shlex.join([Path(sys.executable).name] + argv)


def git_state() -> dict[str, Any]:
    """``{"commit": HEAD, "sbloader_changed": [files of sbloader/ differing from HEAD]}``."""
    def run(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20).stdout
            return out.rstrip()  # not strip(): a porcelain line starts with a space (" M sbloader/...")
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = run("status", "--porcelain", "--", "sbloader").splitlines()
    return {"commit": run("rev-parse", "HEAD") or None, "sbloader_changed": [c[3:] for c in changed]}
