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
from pathlib import Path

import pytest
from own_session import run_script, script_env

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "exit_open_epoch.py"


def _run(tmp_path: Path, *args: str, quiet: bool = False) -> dict:
    out = tmp_path / "report.json"
    proc = run_script([str(SCRIPT), str(out), *args], 120)
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


def test_a_job_that_ends_while_ray_still_starts_cuts_the_start_short_and_leaves_no_ray(tmp_path):
    """A short job ends on the local workers while the embedded Ray (and the pool's actors) still start
    in the background: sbloader's exit hook cuts Ray's start short and waits for it to unwind (and for
    the pool's prestart, which starts nothing now), so no thread is inside Ray's start when the
    interpreter finalizes (the Lightning resume on 1 device aborted so: "FATAL: exception not
    rethrown"), no Ray is left up, and nothing is printed (Ray's own exit hook, run first, once reset
    Ray's state under the start: "'NoneType' object has no attribute 'internal_kv_get'")."""
    report = _run(tmp_path, "starting", quiet=True)
    assert report["started_at_exit"], "the epoch ended after Ray was up: nothing to show here"
    assert report["running"] == [], "a background start still ran after sbloader's exit hook"
    assert report["ray_up"] is False, "the Ray that came up during the exit was left running"


STARTING = SCRIPT.parent / "exit_ray_starting.py"


def _alive_in(sid: int) -> list[str]:
    """Live processes (not zombies) of session ``sid``, or whose command line names a Ray session that
    process ``sid`` started (``session_<date>_<pid>``): a Ray daemon that left the session too."""
    import re

    named = re.compile(rb"session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_%d(?![0-9])" % sid)
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if fields[0] not in ("Z", "X") and (int(fields[3]) == sid or named.search(cmdline)):
            args = cmdline.replace(b"\0", b" ")[:120].decode(errors="replace")
            out.append(f"{entry}: {args}")
    return out


@pytest.mark.parametrize("when,tail", [("first", "ok"), ("first", "exit3"), ("first", "raise"),
                                       ("daemons", "ok"), ("daemons", "exit3"), ("daemons", "raise"), ("up", "ok")])
def test_a_script_that_ends_while_ray_starts_exits_quietly_with_its_code_and_leaves_no_ray(tmp_path, when, tail):
    """torch's quick-start snippet on the drop-in ends while the embedded Ray still starts in the background
    (``first``: at once; ``daemons``: once the start has spawned Ray's daemons): the exit cuts the start short
    instead of waiting for it (seconds) and for Ray's shutdown. Nothing is printed but the script's own
    traceback, its exit code stands (0, ``sys.exit(3)``, 1 for an uncaught error), and no process of the
    start outlives the script (the raylet's agents did for a minute when their raylet was killed alone).
    ``up``: Ray came up first and stops as before."""
    out = tmp_path / "report.json"
    proc = run_script([str(STARTING), str(out), when, tail], 180, script_env(drop=("SBLOADER_HANDOVER_AT",)))
    stdout, stderr = proc.stdout, proc.stderr
    assert proc.returncode == {"ok": 0, "exit3": 3, "raise": 1}[tail], stderr[-3000:]
    assert stdout == ""
    if tail == "raise":  # the script's traceback, and nothing else
        assert stderr.startswith("Traceback (most recent call last):") and stderr.count("Traceback") == 1, stderr[-3000:]
        assert stderr.endswith("ValueError: boom\n"), stderr[-3000:]
    else:
        assert stderr == "", stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ray_up"] is False
    if when == "daemons":
        assert report["daemons"], "the start had spawned no daemon yet: nothing to show here"
        assert report["start"] == "cut", report
    elif when == "first":
        assert report["start"] in ("cut", "not begun", "up"), report
    else:
        assert report["start"] == "up", report
    left = _alive_in(proc.pid)
    if when == "up":  # Ray's own shutdown: its daemons go within seconds (parent-death signal, reaper)
        import time

        deadline = time.monotonic() + 10
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = _alive_in(proc.pid)
    assert not left, f"processes of the script's Ray outlived it: {left}"
