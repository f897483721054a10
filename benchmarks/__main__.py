"""sbloader's benchmarks from one command.

    python -m benchmarks report [--quick] [--dry-run] [--only a,b]   # every scenario -> results/REPORT.md
    python -m benchmarks run <scenario> [--quick] [--dry-run] [key=value ...]
    python -m benchmarks list

``report`` runs each scenario in a process of its own (``run``), then writes
``benchmarks/results/REPORT.md`` from their sections under ``benchmarks/results/report/``.
``--dry-run`` plans every scenario and runs none (CI runs ``report --quick --dry-run``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from .harness import machine, procs, report, scenario


def _log(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def cmd_list(_: argparse.Namespace) -> int:
    for n in scenario.names():
        mod = scenario.load(n)
        print(f"{n:24s} {mod.TITLE}")
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    machine.ray_worker_env()
    overrides = scenario.parse_overrides(a.params)
    if a.dry_run:
        print(json.dumps(scenario.plan_of(a.scenario, a.quick, overrides), indent=1))
        return 0
    sec = scenario.run_scenario(a.scenario, a.quick, overrides)
    j, md, png = report.write_section(sec)
    print(md.read_text())
    print(f"wrote {j}, {md}" + (f", {png}" if png else ""))
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    todo = scenario.names(report_only=not (a.all or a.dry_run))  # a dry run plans every scenario
    if a.only:
        want = [x.strip() for x in a.only.split(",") if x.strip()]
        bad = sorted(set(want) - set(todo))
        if bad:
            raise SystemExit(f"--only names no scenario {bad}; scenarios: {', '.join(todo)}")
        todo = [n for n in todo if n in want]
    if a.dry_run:
        for n in todo:
            p = scenario.plan_of(n, a.quick, {})
            skipped = "; ".join(f"{k}: {v}" for k, v in p["skipped"].items())
            tag = "" if getattr(scenario.load(n), "REPORT", True) else " [component: report --all]"
            print(f"{n}{tag}: {p['rounds']} rounds x {', '.join(p['contenders'])}  ({p['command']})"
                  + (f"  not installed -> {skipped}" if skipped else ""))
        print(f"planned {len(todo)} scenarios; ran none (--dry-run)")
        return 0
    t0 = time.monotonic()
    m = machine.machine_info()
    command = machine.command_line()
    sections, pngs = [], {}
    budget = a.budget_s
    if not procs.adopt_orphans():  # what a scenario leaves running is re-parented here, so we can wait for it
        _log("-- prctl(PR_SET_CHILD_SUBREAPER) failed: what a scenario leaves running is not waited for")
    for i, n in enumerate(todo):
        # the previous scenario's Ray daemons and workers, cluster, servers: gone before this one starts
        leftover = report.wait_for_leftovers(_log) if i else None
        left = budget - (time.monotonic() - t0)
        # a fair share of what is left (no new round after it; at least one round runs)
        share = max(30.0, left / (len(todo) - i)) if budget else a.timeout_s
        share = min(share, a.timeout_s)
        _log(f"== {n} (no new round after {share:.0f} s)")
        status, err = report.run_in_subprocess(n, a.quick, share, _log)
        path = report.REPORT_DIR / f"{n}.json"
        if status == "ok" and path.exists():
            sec = json.loads(path.read_text())
            if (report.REPORT_DIR / f"{n}.png").exists():
                pngs[n] = f"report/{n}.png"
        else:
            mod = scenario.load(n)
            sec = report.failed_section(n, mod.TITLE, status, err,
                                        scenario.command_for(n, a.quick, {}), m)
        if leftover:
            sec["notes"] = [leftover] + list(sec.get("notes") or [])
        sections.append(sec)
    text = report.report_markdown(sections, command, m, pngs, time.monotonic() - t0)
    out = machine.RESULTS_DIR / "REPORT.md"
    out.write_text(text)
    print(f"wrote {out} ({sum(s.get('status') == 'ok' for s in sections)}/{len(sections)} scenarios measured)")
    return 0 if all(s.get("status") == "ok" for s in sections) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the scenarios")
    r = sub.add_parser("run", help="one scenario")
    r.add_argument("scenario")
    r.add_argument("params", nargs="*", help="key=value overrides of the scenario's PARAMS")
    r.add_argument("--quick", action="store_true", help="the scenario's QUICK sizes")
    r.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    rep = sub.add_parser("report", help="every scenario -> benchmarks/results/REPORT.md")
    rep.add_argument("--quick", action="store_true", help="quick sizes (<= 10 min on 2 cores)")
    rep.add_argument("--dry-run", action="store_true", help="plan every scenario, run none")
    rep.add_argument("--only", default=None, help="comma-separated scenario names")
    rep.add_argument("--all", action="store_true", help="also the component benchmarks (REPORT = False)")
    rep.add_argument("--timeout-s", type=float, default=900.0, help="at most this per scenario")
    rep.add_argument("--budget-s", type=float, default=0.0,
                     help="share this many seconds among the scenarios (0: no total budget; --quick: 480)")
    a, rest = p.parse_known_args(argv)
    if rest and (a.cmd != "run" or any("=" not in x or x.startswith("-") for x in rest)):
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if a.cmd == "run":
        a.params = list(a.params) + rest
    if a.cmd == "report" and a.quick and not a.budget_s:
        a.budget_s = 480.0
    return {"list": cmd_list, "run": cmd_run, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
