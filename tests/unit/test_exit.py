"""A process that exits with an epoch still open exits cleanly (issue #48: a Lightning job aborted at exit).

A daemon fetch thread still dropping batches of torch tensors while the interpreter
finalizes dies inside torch's tensor destructor, and the process aborts ("terminate
called without an active exception", exit code -6), after a training run that was
otherwise correct. At exit sbloader closes its open epochs and waits for their
threads, whether or not Ray ever came up.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "exit_open_epoch.py"


def _run(tmp_path: Path, *args: str, quiet: bool = False) -> dict:
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(SCRIPT.parents[2]), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), *args], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if quiet:  # nothing printed that the script did not ask for
        assert proc.stderr.strip() == "", proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_an_open_epoch_is_closed_and_its_thread_joined_before_the_interpreter_finalizes(tmp_path):
    report = _run(tmp_path)
    assert report["closed"] == "before finalizing"
    assert report["running"] == [], "a fetch thread still ran after sbloader's exit hook"


@pytest.mark.parametrize("attempt", range(3))
def test_a_drop_in_left_mid_epoch_on_local_workers_exits_cleanly(tmp_path, attempt):
    report = _run(tmp_path, "loader")
    assert report["running"] == []


def test_a_job_that_ends_while_ray_still_starts_waits_for_the_start_and_stops_ray(tmp_path):
    """A short job ends on the local workers while the embedded Ray (and the pool's actors) still start
    in the background: sbloader's exit hook waits for those starts and stops the Ray that came up, so
    no thread is inside Ray's start when the interpreter finalizes (the Lightning resume on 1 device
    aborted so: "FATAL: exception not rethrown"), and nothing is printed (Ray's own exit hook, run
    first, reset Ray's state under the start: "'NoneType' object has no attribute 'internal_kv_get'")."""
    report = _run(tmp_path, "starting", quiet=True)
    assert report["started_at_exit"], "the epoch ended after Ray was up: nothing to show here"
    assert report["running"] == [], "a background start still ran after sbloader's exit hook"
    assert report["ray_up"] is False, "the Ray that came up during the exit was left running"
