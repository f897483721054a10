"""Where a command's CPU goes, by kind of process: Ray workers by their task or actor, Ray's daemons, scripts.

The suite is CPU-bound on 2 cores (issue #48): its time is the core-seconds its processes use.
This runs a command and samples every process that appears meanwhile (``/proc``, every 0.5 s),
then prints their CPU grouped by kind: a Ray worker by the name Ray gives its process
(``ray::MapActor``, ``ray::read_stage_task``, ``ray::SplitCoordinator``...), Ray's daemons
(raylet, GCS, log monitor, agents), and other processes by their command line.

    python scripts/cpu_by_process.py python3 -m pytest -q tests/e2e/test_ray_cluster.py -k ray_train

A process's CPU after its last sample is missed (a short-lived process counts less than it used);
what ran before the command started is left out. Linux only. Found with it (2026-12-03): the
Ray Train test's 210 core-s are 51 worker processes at ~3.3 core-s each (each imports torch),
~60 of them Ray Train's own actors (four ``fit`` calls).
"""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_DAEMONS = ("raylet", "gcs_server", "log_monitor", "dashboard_agent", "runtime_env", "dashboard.py", "monitor.py",
            "torchrun")
_PROVISIONAL = ("ray worker (starting)", "ray worker IDLE")  # relabelled when the worker takes a task


def _label(pid: str) -> str | None:
    """The kind of process ``pid`` is, from its command line (None: gone, or a kernel thread)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = [c.decode(errors="replace") for c in f.read().split(b"\0") if c]
    except OSError:
        return None
    if not cmd:
        return None
    line = " ".join(cmd)
    if line.startswith("ray::"):
        return "ray worker " + line.split()[0][5:].split(".")[0][:40]
    if "default_worker.py" in line:
        return "ray worker (starting)"
    for name in _DAEMONS:
        if name in line:
            return name
    if "xdist" in line or "execnet" in line:
        return "pytest-xdist worker"
    return " ".join([os.path.basename(cmd[0])] + [os.path.basename(c)[:40] for c in cmd[1:3]])


def _cpu_seconds(pid: str) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def main(argv: list[str]) -> int:
    """Run ``argv``, print its processes' CPU by kind to stderr, return its exit code."""
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    before = {p for p in os.listdir("/proc") if p.isdigit()}
    seen: dict[str, list] = {}  # pid -> [cpu seconds at the last sample, label]
    proc = subprocess.Popen(argv)
    while proc.poll() is None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid in before:
                continue
            try:
                cpu = _cpu_seconds(pid)
            except OSError:
                continue
            entry = seen.setdefault(pid, [0.0, None])
            entry[0] = cpu
            if entry[1] is None or entry[1] in _PROVISIONAL:
                entry[1] = _label(pid) or entry[1]
        time.sleep(0.5)  # a scan of ~1,000 processes costs ~20 ms
    kinds: dict = collections.defaultdict(lambda: [0.0, 0])
    for cpu, label in seen.values():
        kinds[label or "?"][0] += cpu
        kinds[label or "?"][1] += 1
    for label, (cpu, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"{cpu:8.1f} core-s {n:5d} processes  {label[:110]}", file=sys.stderr)
    print(f"{sum(c for c, _ in kinds.values()):8.1f} core-s in all (sampled)", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
