"""PyTorch's own ``test/test_dataloader.py`` with ``torch.utils.data.DataLoader`` swapped for
``sbloader.DataLoader`` (in the pytest process and every process it starts), the whole file in
one pytest process: of the tests that build a DataLoader and pass with torch's own loader, how
many pass with the swap; the file's wall time; the notes list every test that differs with why,
and the 10 slowest. torch's reference run takes ~40 min here, so it is read from a committed
result (``reference=``) unless ``modes`` asks for it. The file is not vendored (``test_file=``:
the file at the tag of the installed torch). Runner: ``scripts/conformance/torch_dataloader_suite.py``."""
from __future__ import annotations

import json
import os
from typing import Any

from benchmarks.harness import Outcome, Plan, run_interleaved
from benchmarks.harness.machine import BENCH_DIR

from . import _conformance as conf

ORDER = 91
REPORT = False  # 9+ minutes: a component benchmark (`run torch_suite`, `report --all`)
TITLE = "torch's test_dataloader.py with the drop-in"
PARAMS = {"test_file": "", "reference": str(BENCH_DIR / "results" / "torch_suite.json"), "modes": ["sbloader"],
          "timeout_s": 150, "keyword": "", "rounds": 1}
QUICK = {"keyword": "test_sampler or test_worker_init_fn or test_len"}
# What differs on purpose or by the design of remote workers (docs/user_guide.md lists them too).
WHY = {"test_partial_workers": "reads torch's private `it._workers` (worker process objects)",
       "test_iterable_style_dataset": "reads torch's private `it._workers` (worker process objects)",
       "test_worker_seed": "an mp.Value in the dataset: the pool's actors are not forked from the trainer"}


def plan(**p: Any) -> Plan:
    """The modes asked for; the reference read from a file where torch's is not run."""
    skipped = {}
    if not p["test_file"] or not os.path.exists(p["test_file"]):
        skipped["sbloader"] = ("test_file= must name torch's test/test_dataloader.py (pytorch/pytorch, the tag of "
                               f"the installed torch); got {p['test_file']!r}")
    return Plan([m for m in p["modes"] if m not in skipped] or list(p["modes"]), p["rounds"], skipped,
                "reference: " + ("torch's run here" if "torch" in p["modes"] else p["reference"]))


def run(**p: Any) -> Outcome:
    """Each mode in its own pytest process, then the comparison against torch's passes."""
    if not p["test_file"] or not os.path.exists(p["test_file"]):
        raise SystemExit(plan(**p).skipped["sbloader"])
    runner = conf.script("torch_dataloader_suite")
    runs: dict[str, dict] = {}
    if "torch" not in p["modes"]:
        with open(p["reference"]) as f:
            runs["torch"] = json.load(f)["runs"]["torch"]

    def mode(m: str) -> Any:
        def go() -> dict:
            runs[m] = runner.run_mode(m, p["test_file"], p["timeout_s"], p["keyword"] or None,
                                      conf.workdir(f"torch-suite-{m}"))
            t = conf.totals(runs[m]["outcomes"])
            return {"passed": t.get("passed", 0), "tests": len(runs[m]["outcomes"]),
                    "hung": len(conf.hung(runs[m]["outcomes"])), "wall_s": runs[m]["wall_s"]}
        return go
    trials = run_interleaved({m: mode(m) for m in p["modes"]}, p["rounds"])
    summary = runner.summarize(runs)
    notes = []
    if summary:
        if p["keyword"]:  # the reference covers the whole file: compare only what ran here
            ran = set(runs["sbloader"]["outcomes"])
            summary["failing"] = {t: v for t, v in summary["failing"].items() if t in ran}
        why = {t: w for t in summary["failing"] for k, w in WHY.items() if t.endswith("::" + k)}
        notes += [f"**{summary['sbloader_passed']} of {summary['reference']}** tests that build a DataLoader and "
                  f"pass with torch's loader pass with sbloader's (reference: {'this run' if 'torch' in p['modes'] else p['reference']})",
                  conf.failures_note({t: tuple(v) for t, v in summary["failing"].items()}, why)]
    if "sbloader" in runs:
        notes.append(conf.slowest_note(runs["sbloader"].get("seconds") or {}))
    return Outcome(trials, "passed", "tests", extra=("tests", "hung", "wall_s"), timing=False, notes=notes,
                   raw={"summary": summary, "sbloader": runs.get("sbloader", {})})
