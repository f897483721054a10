"""A new user's first run: a fresh Python process that imports the loader and takes
the first batch of a ``DataLoader(list(range(1000)), batch_size=32, shuffle=True,
num_workers=2)`` (the README's first-run figure): sbloader (its embedded Ray starts
here) against torch's DataLoader, same arguments. Seconds from the import to the
first batch, measured inside the process; the process's whole life beside it. Beside
them, the native pipeline of the same rows (``from_items(...).to_dataloader(32,
shuffle=True)``), with its local start and without it (``local_start=False``: the
first batch waits for Ray), and an ``IterableDataset`` of the same rows (each worker its own copy)
with both loaders."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from benchmarks.harness import ROOT, Outcome, Plan, run_interleaved

ORDER = 5
TITLE = "First run: import to first batch in a fresh process"
PARAMS = {"rounds": 3, "leave_out": []}
QUICK = {"rounds": 3, "leave_out": ["sbloader native, local_start=False"]}  # report --quick: 2 rounds in its share
SNIPPET = """
import json, time
t0 = time.perf_counter()
import {mod} as m
t1 = time.perf_counter()
loader = {make}
next(iter(loader))
t2 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "first_batch_s": t2 - t0}}), flush=True)
"""


DROPIN = "m.DataLoader(list(range(1000)), batch_size=32, shuffle=True, num_workers=2)"
NATIVE = "m.from_items([{{'x': i}} for i in range(1000)]).to_dataloader(32, shuffle=True{extra})"
STREAM = ("m.DataLoader(type('Stream', (__import__('torch.utils.data', fromlist=['IterableDataset']).IterableDataset,),"
          " {'__iter__': lambda self: iter(range(1000))})(), batch_size=32, num_workers=2)")
CONTENDERS = {
    "sbloader": ("sbloader", DROPIN),
    "torch": ("torch.utils.data", DROPIN),
    "sbloader IterableDataset": ("sbloader", STREAM),
    "torch IterableDataset": ("torch.utils.data", STREAM),
    "sbloader native": ("sbloader", NATIVE.format(extra="")),
    "sbloader native, local_start=False": ("sbloader", NATIVE.format(extra=", local_start=False")),
}


def plan(**p: Any) -> Plan:
    """sbloader and torch (map-style and an IterableDataset), and sbloader's native pipeline with and without
    its local start, a fresh process per run."""
    return Plan(_chosen(p), p["rounds"], notes="no RAY_ADDRESS: the embedded Ray starts")


def _chosen(p: dict) -> list[str]:
    """The contenders run (``leave_out=`` names some not to run)."""
    return [n for n in CONTENDERS if n not in p["leave_out"]]


def fresh(mod: str, make: str = DROPIN) -> dict[str, float]:
    """Run the snippet (import ``mod``, build ``make``, take a batch) in a new interpreter; its figures and the
    process's life."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", SNIPPET.format(mod=mod, make=make)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{mod}: exit status {r.returncode}: {r.stderr.strip()[-300:]}")
    lines = [x for x in r.stdout.splitlines() if x.startswith('{"import_s"')]
    if not lines:
        raise RuntimeError(f"{mod}: no figures printed; stdout {r.stdout[-200:]!r}, stderr {r.stderr[-300:]!r}")
    out = json.loads(lines[-1])
    out["process_s"] = time.perf_counter() - t0
    return out


def run(**p: Any) -> Outcome:
    """``rounds`` fresh processes each, interleaved."""
    trials = run_interleaved({name: (lambda mod=mod, make=make: fresh(mod, make))
                              for name, (mod, make) in CONTENDERS.items() if name in _chosen(p)}, p["rounds"])
    return Outcome(trials, "first_batch_s", "s", higher_is_better=False, baseline="torch",
                   extra=("import_s", "process_s"),
                   notes=["the README's first-run snippet; process_s includes the interpreter's start "
                          "and sbloader's shutdown of its embedded Ray"])
