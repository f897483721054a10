"""PyTorch's own DataLoader tests, run with ``torch.utils.data.DataLoader`` swapped for ``sbloader.DataLoader``.

A new user's check of the drop-in claim: take torch's ``test/test_dataloader.py``
(not vendored here: download it from pytorch/pytorch at the tag matching the
installed torch) and run it twice with pytest, each run in its own subprocess:

- ``torch``: as it is (the reference: what passes on this machine);
- ``sbloader``: with ``torch.utils.data.DataLoader`` replaced by ``sbloader.DataLoader``
  before the test module is imported, in the pytest process and in every Python
  process it starts (``spawn`` children, ``subprocess`` scripts), through a
  ``sitecustomize`` that patches ``torch.utils.data`` as soon as it is imported.

Both runs record which tests construct a DataLoader (the constructor notes
``PYTEST_CURRENT_TEST``), so the summary compares like with like: of the tests that
build a DataLoader and pass with torch, how many pass with sbloader, and the first
line of every failure. A hanging test is cut by pytest-timeout (``--timeout``).

Usage::

    python3 scripts/conformance/torch_dataloader_suite.py --torch-test /path/to/test_dataloader.py \\
        [--timeout 180] [--modes torch sbloader] [--shards 4] [-k EXPR] [--out benchmarks/results/torch_suite]

Needs ``expecttest`` (torch.testing._internal imports it) and ``pytest-timeout``
(the ``bench`` extra).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Written as sitecustomize.py into a folder put first on PYTHONPATH: every Python process of the run
# loads it at start-up. It patches torch.utils.data lazily (on its import), so Ray's own processes that
# never import torch pay nothing.
SITECUSTOMIZE = r'''
import importlib.abc
import importlib.util
import os
import sys

_MODE = os.environ.get("SBLOADER_SUITE_MODE")
_RECORD = os.environ.get("SBLOADER_SUITE_RECORD")


def _recording(cls):
    original = cls.__init__
    if getattr(original, "_suite_recording", False):
        return
    def __init__(self, *args, **kwargs):
        test = os.environ.get("PYTEST_CURRENT_TEST")
        if test and _RECORD:
            with open(_RECORD, "a") as f:
                f.write(test.rsplit(" (", 1)[0] + "\n")
        original(self, *args, **kwargs)
    __init__._suite_recording = True
    cls.__init__ = __init__


def _patch(module):
    if _MODE == "sbloader":
        import sbloader
        _recording(sbloader.DataLoader)
        module.DataLoader = sbloader.DataLoader
        sys.modules["torch.utils.data.dataloader"].DataLoader = sbloader.DataLoader
    else:
        _recording(module.DataLoader)


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.utils.data":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)
        spec.loader.exec_module = exec_and_patch
        return spec


if _MODE:
    sys.meta_path.insert(0, _Hook())
'''


def run_mode(mode: str, test_file: str, timeout: int, keyword: Optional[str], workdir: str,
             shards: int = 1) -> dict:
    """One mode's pytest run of ``test_file`` (``shards`` pytest processes side by side, each over
    every ``shards``-th test): per-test outcome and which tests built a DataLoader."""
    site = os.path.join(workdir, "site")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    record = os.path.join(workdir, f"{mode}.built")
    open(record, "w").close()
    env = dict(os.environ, SBLOADER_SUITE_MODE=mode, SBLOADER_SUITE_RECORD=record,
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    test_dir = os.path.dirname(os.path.abspath(test_file))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, test_dir, REPO, os.environ.get("PYTHONPATH", "")) if p)
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    selection = [os.path.abspath(test_file)] + (["-k", keyword] if keyword else [])
    groups = [selection]
    if shards > 1:
        listed = subprocess.run(base + ["--collect-only"] + selection, cwd=test_dir, env=env, capture_output=True,
                                text=True).stdout.splitlines()
        ids = [line.strip() for line in listed if "::" in line]
        groups = [ids[i::shards] for i in range(shards) if ids[i::shards]]
    t0 = time.time()
    procs = []
    for i, group in enumerate(groups):
        junit = os.path.join(workdir, f"{mode}.{i}.xml")
        log = open(os.path.join(workdir, f"{mode}.{i}.log"), "w")
        cmd = base + ["-v", f"--timeout={timeout}", "--timeout-method=signal", f"--junitxml={junit}",
                      "-o", "junit_family=xunit1"] + group
        procs.append((subprocess.Popen(cmd, cwd=test_dir, env=env, stdout=log, stderr=subprocess.STDOUT), junit, log))
    outcomes: dict = {}
    seconds: dict = {}
    codes = []
    for proc, junit, log in procs:
        codes.append(proc.wait())
        log.close()
        if os.path.exists(junit):
            outcomes.update(parse_junit(junit))
            seconds.update(junit_seconds(junit))
    wall = time.time() - t0
    with open(record) as f:
        built = {line.strip().split("::", 1)[-1] for line in f if line.strip()}
    return {"outcomes": outcomes, "built": sorted(built), "wall_s": round(wall, 1), "returncodes": codes,
            "seconds": seconds}


def junit_seconds(path: str) -> dict:
    """``{Class::test: seconds}`` from pytest's JUnit XML (where the file's time goes)."""
    return {f"{c.get('classname', '').rsplit('.', 1)[-1]}::{c.get('name')}": round(float(c.get("time") or 0), 1)
            for c in ET.parse(path).getroot().iter("testcase")}


def parse_junit(path: str) -> dict:
    """``{Class::test: (outcome, first line of the message)}`` from pytest's JUnit XML."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                msg = (node.get("message") or node.text or "").strip().splitlines()[0:1]
                msg = msg[0][:300] if msg else ""
                break
        out[name] = (outcome, msg)
    return out


def summarize(runs: dict) -> dict:
    """The comparison: tests that build a DataLoader and pass with torch, and how sbloader does on them."""
    torch_run, sb_run = runs.get("torch"), runs.get("sbloader")
    summary: dict = {}
    if torch_run is None or sb_run is None:
        return summary
    built = set(torch_run["built"]) | set(sb_run["built"])
    reference = sorted(t for t, (o, _) in torch_run["outcomes"].items() if o == "passed" and t in built)
    passing = [t for t in reference if sb_run["outcomes"].get(t, ("missing", ""))[0] == "passed"]
    failing = {t: sb_run["outcomes"].get(t, ("missing", "")) for t in reference if t not in passing}
    summary.update(reference=len(reference), sbloader_passed=len(passing),
                   torch_totals=_totals(torch_run["outcomes"]), sbloader_totals=_totals(sb_run["outcomes"]),
                   failing={t: list(v) for t, v in sorted(failing.items())})
    return summary


def _totals(outcomes: dict) -> dict:
    totals: dict = {}
    for outcome, _ in outcomes.values():
        totals[outcome] = totals.get(outcome, 0) + 1
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--torch-test", required=True, help="torch's test/test_dataloader.py")
    parser.add_argument("--modes", nargs="+", default=["torch", "sbloader"], choices=["torch", "sbloader"])
    parser.add_argument("--timeout", type=int, default=180, help="seconds per test before it counts as hung")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("--shards", type=int, default=1,
                        help="pytest processes per mode side by side (each starts its own Ray)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "torch_suite"))
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="sbloader-torch-suite-")
    import torch

    # the modes run side by side (each its own pytest process): the wall time of the slower one
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(args.modes)) as pool:
        futures = {m: pool.submit(run_mode, m, args.torch_test, args.timeout, args.keyword, workdir, args.shards)
                   for m in args.modes}
    runs = {m: f.result() for m, f in futures.items()}
    for mode, run in runs.items():
        print(f"{mode}: {_totals(run['outcomes'])} in {run['wall_s']} s ({len(run['built'])} tests built a "
              f"DataLoader); logs in {workdir}", flush=True)
    summary = summarize(runs)
    result = {"command": " ".join(sys.argv), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
              "nproc": os.cpu_count(), "loadavg": os.getloadavg(), "summary": summary, "runs": runs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1, default=list)
    if summary:
        print(f"\n{summary['sbloader_passed']} of {summary['reference']} tests that build a DataLoader and pass "
              "with torch pass with sbloader.DataLoader")
        for test, (outcome, msg) in summary["failing"].items():
            print(f"  {outcome:7s} {test}: {msg}")


if __name__ == "__main__":
    main()
