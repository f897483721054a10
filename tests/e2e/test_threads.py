"""The embedded Ray outlives the thread that started it (``tests/scripts/thread_job.py``).

Linux sends a child its parent-death signal when the *thread* that spawned it
exits; sbloader starts its Ray from an owner thread that lives as long as the
process, and the Ray still dies with the process.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "thread_job.py")
ENV = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
ENV.pop("RAY_ADDRESS", None)
#: Seconds a killed job's Ray agents may live on: 2 s of polling + the 60 s publish to a dead GCS + slack.
AGENTS_EXIT_S = 75


def _run(scenario: str) -> dict:
    proc = subprocess.run([sys.executable, SCRIPT, scenario], capture_output=True, text=True, timeout=240, env=ENV)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1, f"thread job {scenario} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return lines[0]


def test_ray_started_in_a_thread_that_ends_serves_the_rest_of_the_process():
    out = _run("repro")
    assert out["thread_rows"] == 100 and out["main_rows"] == 100
    squares = sorted(i * i for i in range(64))
    assert out["epochs"] == [squares, squares], "each epoch, each on a new thread, exactly once"
    assert out["gcs_before_threads"] == 1


def test_four_threads_starting_their_first_loader_at_once_start_one_ray():
    out = _run("concurrent")
    assert out["results"] == [list(range(40))] * 4
    assert out["gcs_servers"] == 1


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _hold_started() -> subprocess.Popen:
    """A ``hold`` job: its Ray started from a thread that ended, then it sleeps."""
    return subprocess.Popen([sys.executable, SCRIPT, "hold"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)


def _hold_info(proc: subprocess.Popen) -> dict:
    """What a ``hold`` job printed once its Ray was up: its pid and descendants."""
    line = ""
    deadline = time.monotonic() + 120
    while not line.startswith("{") and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
    assert line.startswith("{"), f"hold job failed:\n{proc.stderr.read()[-3000:]}"
    return json.loads(line)


def test_ray_started_from_a_thread_dies_with_its_process_on_sigkill_and_sigterm():
    """One job killed with SIGKILL, one with SIGTERM, side by side (each waits the same up to 60 s for
    its Ray's agents, so both at once take the time of one): every process of each job's Ray is gone."""
    procs: list = []
    try:
        jobs = {}
        procs += [_hold_started(), _hold_started()]  # both Rays start at once
        for sig, proc in zip((signal.SIGKILL, signal.SIGTERM), procs):
            info = _hold_info(proc)
            ray_pids = [int(p) for p, name in info["descendants"].items()
                        if name.startswith(("gcs_server", "raylet")) or "ray" in name.lower()]
            assert any(name.startswith("gcs_server") for name in info["descendants"].values()), (sig, info)
            assert all(_alive(p) for p in ray_pids), f"{sig!r}: the Ray died with the thread that started it"
            jobs[sig] = (proc, info)
        for sig, (proc, _) in jobs.items():
            os.kill(proc.pid, sig)
        for proc, _ in jobs.values():
            proc.wait(timeout=30)
        # Ray's agents poll for their raylet (5 x 0.4 s), then report its unexpected death to the GCS
        # before they exit: ray/_private/process_watcher.py publishes it with a 60 s timeout, and the
        # GCS died too (CI saw both agents alive after 30 s). They must be gone once that has run out.
        deadline = time.monotonic() + AGENTS_EXIT_S
        every = [p for _, info in jobs.values() for p in info["descendants"]]
        while any(_alive(int(p)) for p in every) and time.monotonic() < deadline:
            time.sleep(0.2)
        for sig, (_, info) in jobs.items():
            left = {p: n for p, n in info["descendants"].items() if _alive(int(p))}
            assert not left, f"{sig!r}: processes of the killed job's Ray survived {AGENTS_EXIT_S} s: {left}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
