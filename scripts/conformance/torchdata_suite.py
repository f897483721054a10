"""torchdata's StatefulDataLoader tests, run with ``StatefulDataLoader`` replaced by ``sbloader.DataLoader``.

A new user's check of the resume contract: take torchdata 0.11's
``test/stateful_dataloader/test_state_dict.py`` (fetched at run time, never
vendored here) and run it with pytest in ONE process (the file as a whole, so
loaders left behind by earlier tests would starve later ones, as they would in a
trainer), with a ``torchdata.stateful_dataloader`` stand-in whose
``StatefulDataLoader`` is ``sbloader.DataLoader`` and whose ``Stateful`` is
torchdata's protocol. A hung test is cut by pytest-timeout (``--timeout``) and
counts as failed.

Where the file comes from (the first that works):

1. ``--test-file PATH``: a copy you fetched yourself;
2. ``--mirror DIR``: a git clone of pytorch/data (``git show v0.11.0:<path>``);
3. the file at tag ``v0.11.0`` on GitHub (needs the internet).

Usage::

    python3 scripts/conformance/torchdata_suite.py [--mirror /path/to/pytorch-data] [--timeout 60] [-k EXPR] \\
        [--out benchmarks/results/torchdata_suite]

Needs ``parameterized``, ``expecttest`` and ``pytest-timeout`` (the ``bench`` extra).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_dataloader_suite import junit_seconds, parse_junit  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TAG = "v0.11.0"
PATH = "test/stateful_dataloader/test_state_dict.py"
URL = f"https://raw.githubusercontent.com/pytorch/data/{TAG}/{PATH}"

# The stand-in package: torchdata's Stateful protocol (as torchdata 0.11 defines it) and sbloader's loader.
STANDIN = '''
from typing import Any, Dict, Protocol, runtime_checkable

from sbloader import DataLoader as StatefulDataLoader


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Dict[str, Any]:
        ...

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        ...
'''

# What the user guide lists as differing by design (docs/user_guide.md, "StatefulDataLoader"): a
# worker-count change is allowed here.
BY_DESIGN = {
    "TestNumWorkersMismatch_shard3::test_num_workers_mismatch":
        "asserts a state of 0 workers is refused by a 3-worker loader; sbloader resumes across worker counts",
}


# pytest-timeout cancels a test's timer when pytest reports an exception (pytest_exception_interact),
# and pytest reports each failed unittest subTest that way: the test's later subtests then ran with no
# timeout, and one that hung stalled the whole file. This plugin arms the timer again after each report
# inside a test's call, with what is left of the test's timeout (at least 1 s): a test never runs past it.
CONFTEST = '''
import time

import pytest
import pytest_timeout


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item._suite_t0 = time.monotonic()


@pytest.hookimpl(trylast=True)
def pytest_exception_interact(node, call, report):
    if getattr(report, "when", None) != "call" or not hasattr(node, "cancel_timeout"):
        return
    settings = pytest_timeout._get_item_settings(node)
    if settings.timeout and not pytest_timeout.SUPPRESS_TIMEOUT:
        left = settings.timeout - (time.monotonic() - getattr(node, "_suite_t0", time.monotonic()))
        node.config.pluginmanager.hook.pytest_timeout_set_timer(
            item=node, settings=settings._replace(timeout=max(1.0, left)))
'''


def fetch_test_file(test_file: Optional[str], mirror: Optional[str], workdir: str) -> str:
    """The test file's path in ``workdir`` (beside the harness's conftest): copied from the one
    given, shown from a git mirror, or downloaded."""
    dest = os.path.join(workdir, "test_state_dict.py")
    with open(os.path.join(workdir, "conftest.py"), "w") as f:
        f.write(CONFTEST)
    if test_file:
        with open(test_file) as src, open(dest, "w") as f:
            f.write(src.read())
        return dest
    if mirror:
        text = subprocess.run(["git", "-C", mirror, "show", f"{TAG}:{PATH}"], check=True, capture_output=True,
                              text=True).stdout
    else:
        with urllib.request.urlopen(URL, timeout=60) as r:
            text = r.read().decode()
    with open(dest, "w") as f:
        f.write(text)
    return dest


def run(test_file: str, timeout: int, keyword: Optional[str], workdir: str, standin: bool = True) -> dict:
    """One pytest process over the whole file: per-test outcome and seconds. ``standin=False``
    runs it with torchdata's own ``StatefulDataLoader`` (the reference)."""
    site = os.path.join(workdir, "site", "torchdata", "stateful_dataloader")
    if standin:
        os.makedirs(site, exist_ok=True)
        open(os.path.join(os.path.dirname(site), "__init__.py"), "w").close()
        with open(os.path.join(site, "__init__.py"), "w") as f:
            f.write(STANDIN)
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    paths = (os.path.join(workdir, "site") if standin else "", os.path.dirname(os.path.abspath(test_file)), REPO,
             os.environ.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    label = "sbloader" if standin else "torchdata"
    junit = os.path.join(workdir, f"{label}.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-v", f"--timeout={timeout}",
           "--timeout-method=signal", f"--junitxml={junit}", "-o", "junit_family=xunit1",
           os.path.abspath(test_file)] + (["-k", keyword] if keyword else [])
    t0 = time.time()
    with open(os.path.join(workdir, f"{label}.log"), "w") as log:
        code = subprocess.run(cmd, cwd=os.path.dirname(os.path.abspath(test_file)), env=env, stdout=log,
                              stderr=subprocess.STDOUT).returncode
    outcomes = parse_junit(junit) if os.path.exists(junit) else {}
    return {"outcomes": outcomes, "seconds": junit_seconds(junit) if os.path.exists(junit) else {},
            "wall_s": round(time.time() - t0, 1), "returncode": code}


def loadavg() -> list:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [f"# torchdata {TAG} `{PATH}` with `StatefulDataLoader` = `sbloader.DataLoader`", "",
             f"`{result['command']}` — {result['date']}, torch {result['torch']}, {result['nproc']} CPUs, "
             f"load before/after {' '.join(result['load_before'])} / {' '.join(result['load_after'])}, "
             f"one pytest process, {result['run']['wall_s']} s", "",
             f"**{s['passed']} of {s['total']} pass** ({s['totals']}); by design: {len(s['by_design'])}; "
             f"hung (cut at {result['timeout']} s): {len(s['hung'])}", "", "| test | outcome | first line |",
             "|---|---|---|"]
    for test, (outcome, msg) in sorted(result["run"]["outcomes"].items()):
        if outcome != "passed":
            why = BY_DESIGN.get(test, msg).replace("|", "\\|")
            lines.append(f"| {test} | {outcome}{' (by design)' if test in BY_DESIGN else ''} | {why} |")
    seconds = result["run"].get("seconds") or {}
    if seconds:
        lines += ["", f"The 15 slowest of {len(seconds)} tests ({sum(seconds.values()):.0f} s in tests):", "",
                  "| test | s |", "|---|---|"]
        lines += [f"| {t} | {v} |" for t, v in sorted(seconds.items(), key=lambda kv: -kv[1])[:15]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--test-file", default=None, help="torchdata's test_state_dict.py, already fetched")
    parser.add_argument("--mirror", default=None, help="a git clone of pytorch/data to show the file from")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per test before it counts as hung")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "torchdata_suite"))
    args = parser.parse_args()
    import torch

    workdir = tempfile.mkdtemp(prefix="sbloader-torchdata-suite-")
    test_file = fetch_test_file(args.test_file, args.mirror, workdir)
    before = loadavg()
    run_ = run(test_file, args.timeout, args.keyword, workdir)
    outcomes = run_["outcomes"]
    totals: dict = {}
    for outcome, _ in outcomes.values():
        totals[outcome] = totals.get(outcome, 0) + 1
    hung = sorted(t for t, (o, m) in outcomes.items() if o != "passed" and "Timeout" in m)
    summary = {"total": len(outcomes), "passed": totals.get("passed", 0), "totals": totals,
               "by_design": sorted(t for t in BY_DESIGN if t in outcomes and outcomes[t][0] != "passed"),
               "hung": hung,
               "other_failures": sorted(t for t, (o, _) in outcomes.items() if o != "passed" and t not in BY_DESIGN)}
    result = {"command": " ".join(["python3"] + sys.argv), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M"), "nproc": os.cpu_count(), "load_before": before,
              "load_after": loadavg(), "timeout": args.timeout, "summary": summary, "run": run_}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1, default=list)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(result))
    print(f"{summary['passed']} of {summary['total']} pass ({totals}); {len(hung)} hung; log in {workdir}")
    for test in summary["other_failures"]:
        print(f"  {outcomes[test][0]:7s} {test}: {outcomes[test][1]}")


if __name__ == "__main__":
    main()
