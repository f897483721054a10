"""torchdata 0.11's own StatefulDataLoader tests (``test/stateful_dataloader/test_state_dict.py``
at tag ``v0.11.0``, unmodified) with ``StatefulDataLoader`` replaced by ``sbloader.DataLoader``,
the whole file in one pytest process, beside the same file with torchdata's own loader: tests
passed, hung (cut by the per-test timeout), the file's wall time; the notes list every test that
does not pass with why, and the 10 slowest. The file is not vendored: ``test_file=`` a copy,
``mirror=`` a git clone of pytorch/data, else it is downloaded. Runner:
``scripts/conformance/torchdata_suite.py``."""
from __future__ import annotations

import os
from typing import Any

from benchmarks.harness import Outcome, Plan, run_interleaved

from . import _conformance as conf
from ._common import missing_peers

ORDER = 90
REPORT = False  # 4+ minutes: a component benchmark (`run torchdata_suite`, `report --all`)
TITLE = "torchdata's StatefulDataLoader test file with the drop-in"
PARAMS = {"test_file": "", "mirror": "", "timeout_s": 120, "keyword": "", "rounds": 1}
QUICK = {"keyword": "TestSnapshotEnd or TestMultiEpochState or TestStateInitializationDataset"}
PEERS = {"torchdata": "torchdata"}


def plan(**p: Any) -> Plan:
    """sbloader, and torchdata's own loader where it is installed; one pytest process each."""
    skipped = missing_peers(PEERS)
    if p["test_file"] and not os.path.exists(p["test_file"]):
        skipped["sbloader"] = f"test_file {p['test_file']!r} does not exist"
    names = [n for n in ("sbloader", "torchdata") if n not in skipped]
    return Plan(names or ["sbloader"], p["rounds"], skipped,
                f"one pytest process per run, {p['timeout_s']} s per test" + (f", -k {p['keyword']!r}"
                                                                            if p["keyword"] else ", the whole file"))


def run(**p: Any) -> Outcome:
    """Fetch the file once, then run it with each loader."""
    runner = conf.script("torchdata_suite")
    keep = conf.workdir("torchdata-suite")
    test_file = runner.fetch_test_file(p["test_file"] or None, p["mirror"] or None, keep)
    done: dict[str, dict] = {}

    def contender(standin: bool) -> Any:
        def go() -> dict:
            r = runner.run(test_file, p["timeout_s"], p["keyword"] or None, conf.workdir("torchdata-suite"), standin)
            done["sbloader" if standin else "torchdata"] = r
            t = conf.totals(r["outcomes"])
            return {"passed": t.get("passed", 0), "tests": len(r["outcomes"]), "hung": len(conf.hung(r["outcomes"])),
                    "wall_s": r["wall_s"]}
        return go
    contenders = {"sbloader": contender(True)}
    if not missing_peers(PEERS):
        contenders["torchdata"] = contender(False)
    trials = run_interleaved(contenders, p["rounds"])
    notes = []
    if "sbloader" in done:
        r = done["sbloader"]
        failing = {t: v for t, v in r["outcomes"].items() if v[0] != "passed"}
        notes += [f"sbloader: {conf.totals(r['outcomes'])}; hung: {conf.hung(r['outcomes']) or 'none'}",
                  conf.failures_note(failing, runner.BY_DESIGN), conf.slowest_note(r["seconds"])]
    if "torchdata" in done:
        notes.append(f"torchdata's own loader: {conf.totals(done['torchdata']['outcomes'])}")
    return Outcome(trials, "passed", "tests", baseline="torchdata" if "torchdata" in contenders else None,
                   extra=("tests", "hung", "wall_s"), skipped=missing_peers(PEERS), timing=False, notes=notes,
                   raw={k: {"outcomes": v["outcomes"], "seconds": v["seconds"]} for k, v in done.items()})
