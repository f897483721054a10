"""The benchmark harness's pure parts (benchmarks/harness) and the report's dry run:
interleaving, medians, paired ratios, load accounting and the quiet mark, the words
beside a ratio, report rendering; ``python -m benchmarks report --quick --dry-run``
plans every scenario (so a broken scenario fails here) and runs none."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import load, report, rounds, scenario, trials  # noqa: E402
from benchmarks.harness.render import ratio_words  # noqa: E402

MACHINE = {"date": "2026-01-01T00:00:00+00:00", "nproc": 2, "cpu_count": 2, "cpu_model": "cpu", "mem_total_gib": 24,
           "kernel": "6", "python": "3.11", "versions": {"torch": "2.13", "ray": None}}


def test_interleave_order_runs_each_contender_once_per_round_in_turn():
    assert rounds.interleave_order(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c")]
    rot = rounds.interleave_order(["a", "b", "c"], 3, rotate=True)
    assert [n for _, n in rot] == list("abc" + "bca" + "cab")
    assert rounds.interleave_order(["a"], 0) == []
    with pytest.raises(ValueError):
        rounds.interleave_order(["a"], -1)


def test_interleave_runs_in_turn_and_reruns_a_disturbed_round():
    calls = []
    seen = {"b": 0}

    def b():
        seen["b"] += 1
        calls.append("b")
        return seen["b"] != 1  # the first attempt of round 0 is "disturbed"

    out = rounds.interleave({"a": lambda: calls.append("a") or True, "b": b}, 2, accept=bool)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert [len(v) for v in out.values()] == [2, 2] and all(out["b"])


def test_summarize_median_min_max_leaves_out_missing():
    assert rounds.summarize([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert rounds.summarize([None])["median"] is None
    assert rounds.fmt_range(rounds.summarize([1.0, 2.0, 4.0])) == "2 (1–4)"
    assert rounds.fmt_range({}) == "–"


def test_cpu_account_splits_ours_from_others_and_clamps():
    # 2 cores x 10 s = 2000 ticks of capacity; 1500 busy; ours 5 s of CPU
    acc = load.cpu_account(1500, 2000, 5.0, 100)
    assert acc == {"machine_cpu_frac": 0.75, "outside_cpu_frac": 0.5}
    assert load.cpu_account(100, 2000, 50.0, 100)["outside_cpu_frac"] == 0.0  # ours over busy: clamped
    assert load.cpu_account(0, 0, 1.0, 100) == {"machine_cpu_frac": 0.0, "outside_cpu_frac": 0.0}


def test_quiet_mark_and_proc_parsers():
    assert load.is_quiet(0.05) and not load.is_quiet(0.051) and not load.is_quiet(None)
    assert load.parse_proc_stat("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2\n") == (150, 1000)
    assert load.parse_loadavg("1.50 0.80 0.30 3/400 1234\n") == (1.5, 0.8, 0.3)


def test_summarize_loads_counts_quiet_rounds_and_load_line_says_it():
    runs = [{"outside_cpu_frac": 0.01, "loadavg": [[1.0, 1, 1], [1.2, 1, 1]], "quiet": True},
            {"outside_cpu_frac": 0.40, "loadavg": [[3.0, 1, 1], [3.5, 1, 1]], "quiet": False},
            {"outside_cpu_frac": None, "machine_cpu_frac": 0.2, "loadavg": [], "quiet": False}]
    s = load.summarize_loads(runs)
    assert s["rounds"] == 3 and s["quiet_rounds"] == 1
    assert s["other_cpu_frac_median"] == 0.2 and s["other_cpu_frac_max"] == 0.4
    assert (s["loadavg1_min"], s["loadavg1_max"]) == (1.0, 3.5)
    line = load.load_line(s, 2)
    assert "40%" in line and "1 of 3 runs quiet" in line
    assert load.load_line(load.summarize_loads([]), 2) == "load: not recorded"


def _trials(values, quiet=True):
    t = trials.Trials()
    for r, row in enumerate(values):
        for name, v in row.items():
            t.trials.append(trials.Trial(r, name, {"x": v}, {"quiet": quiet, "outside_cpu_frac": 0.0 if quiet else 0.3,
                                                             "loadavg": [[1, 1, 1], [1, 1, 1]]}))
    return t


def test_paired_ratios_per_round_and_direction():
    t = _trials([{"a": 2.0, "b": 1.0}, {"a": 3.0, "b": 2.0}, {"a": 1.0}])
    assert trials.paired_ratios(t, "x", "a", "b") == [2.0, 1.5]  # round 2 has no b: left out
    assert trials.paired_ratios(t, "x", "a", "b", higher_is_better=False) == [0.5, 2 / 3]


def test_ratio_words_never_call_a_loaded_ratio_a_speed_up():
    assert ratio_words(1.9, "torch", True) == "1.90x torch"
    loaded = ratio_words(1.9, "torch", False)
    assert loaded.startswith("1.90x torch") and "not a speed-up" in loaded
    assert ratio_words(None, "torch", True) == "–"


def test_table_rows_mark_quiet_rounds_and_loaded_ratios():
    rows = trials.table_rows(_trials([{"a": 2.0, "b": 1.0}] * 3, quiet=False), "x", "u", baseline="b")
    assert rows[0]["quiet rounds"] == "0/3" and "not a speed-up" in rows[0]["vs b"]
    assert rows[1]["vs b"] == "1 (baseline)"
    rows = trials.table_rows(_trials([{"a": 2.0, "b": 1.0}] * 3), "x", "u", baseline="b")
    assert rows[0]["quiet rounds"] == "3/3" and rows[0]["vs b"].startswith("2.00x b") and "speed-up" not in rows[0]["vs b"]


def test_section_and_report_rendering_state_provenance_and_load():
    out = scenario.Outcome(_trials([{"sbloader": 2.0, "torch": 1.0}] * 3, quiet=False), "x", "images/s",
                           baseline="torch", skipped={"SPDL": "spdl is not installed"}, notes=["a note"])
    sec = scenario.section("demo", out, title="Demo", what_text="What it measures.", params={"n": 1},
                           command="python -m benchmarks run demo --quick", machine=MACHINE)
    md = report.section_markdown(sec, "report/demo.png")
    for want in ("## Demo", "`python -m benchmarks run demo --quick`", "2 cores (cpu)", "torch 2.13",
                 "2026-01-01", "load: other processes took 30%", "0 of 6 runs quiet", "not speed-ups",
                 "| sbloader |", "![Demo](report/demo.png)", "**SPDL** — spdl is not installed", "a note"):
        assert want in md, want
    failed = report.failed_section("bad", "Bad", "timeout", "over 60 s", "python -m benchmarks run bad", MACHINE)
    text = report.report_markdown([sec, failed], "python -m benchmarks report --quick", MACHINE, {}, 60.0)
    assert "| [Demo](#demo) | ok | 0/6 |" in text and "**Not measured: timeout**" in text
    assert "`python -m benchmarks report --quick`" in text


def test_params_merge_and_overrides():
    assert scenario.merge_params({"a": 1, "b": 2}, {"a": 3}, True, {"b": 5}) == {"a": 3, "b": 5}
    assert scenario.merge_params({"a": 1}, {"a": 3}, False, {}) == {"a": 1}
    with pytest.raises(SystemExit, match="unknown parameter"):
        scenario.merge_params({"a": 1}, {}, False, {"c": 1})
    assert scenario.parse_overrides(["n=3", "s=abc", "f=[1, 2]"]) == {"n": 3, "s": "abc", "f": [1, 2]}


def test_report_quick_dry_run_plans_every_scenario():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "benchmarks", "report", "--quick", "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    names = scenario.names()
    assert names and f"planned {len(names)} scenarios; ran none" in r.stdout
    lines = r.stdout.splitlines()
    for n in names:
        assert any(x.startswith(f"{n}: ") or x.startswith(f"{n} [") for x in lines), n


def test_run_interleaved_records_each_run_and_stops_at_the_budget(monkeypatch):
    seen = []
    contenders = {"a": lambda: seen.append("a") or {"x": 1.0}, "b": lambda: seen.append("b") or {"x": 2.0}}
    t = trials.run_interleaved(contenders, 2, log=lambda s: None)
    assert seen == ["a", "b", "b", "a"] and t.rounds_run == 2  # rotated order
    assert all({"x", "wall_s", "cpu_s"} <= set(x.metrics) and "quiet" in x.load for x in t.trials)
    monkeypatch.setenv(trials.DEADLINE_ENV, "0")  # spent: the first MIN_ROUNDS rounds still run, no later one
    t = trials.run_interleaved(contenders, 4, log=lambda s: None)
    assert trials.MIN_ROUNDS == 2  # a median with a spread, even when the report's budget is spent
    assert [x.round for x in t.trials] == [0, 0, 1, 1] and (t.rounds_run, t.rounds_planned) == (2, 4)
    sec = scenario.section("s", scenario.Outcome(t, "x", "u"), title="S", what_text="", params={}, command="c",
                           machine=MACHINE)
    assert "**2 of 4 rounds**" in sec["notes"][0]


def test_a_failing_contender_is_recorded_and_the_others_go_on():
    def bad():
        raise ValueError("boom")

    t = trials.run_interleaved({"bad": bad, "ok": lambda: {"x": 1.0}}, 2, log=lambda s: None)
    assert [x.contender for x in t.trials] == ["bad", "ok", "ok"]
    assert t.trials[0].error == "ValueError: boom"
    rows = trials.table_rows(t, "x", "u")
    assert rows[0]["error"] == "ValueError: boom" and rows[1]["x (u)"] == "1 (1–1)"


MAX_BENCH_LINES = 300  # issue #48: every file under benchmarks/ stays readable in one sitting


def test_no_file_under_benchmarks_passes_300_lines():
    code = [p for p in (ROOT / "benchmarks").rglob("*") if p.suffix in (".py", ".sh") and p.is_file()]
    assert len(code) > 10, "the benchmarks' code was not found"
    long = {str(p.relative_to(ROOT)): n for p in code if (n := len(p.read_text().splitlines())) > MAX_BENCH_LINES}
    assert not long, f"over {MAX_BENCH_LINES} lines (split them by concern): {long}"


def test_no_benchmark_parses_its_own_arguments_outside_the_harness():
    """Scenarios take their parameters from the harness (``key=value``), not from argparse."""
    parsers = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks" / "scenarios").rglob("*.py")
                     if "argparse" in p.read_text())
    # _node_loss_job.py is issue #46's to port (a job process of node_loss.py)
    assert parsers in ([], ["benchmarks/scenarios/_node_loss_job.py"]), parsers


def test_a_tree_takes_roots_found_at_each_sample():
    """A ``ray start`` cluster's daemons are no descendants of the driver: ``also`` names them (a scenario
    on a quiet machine had every round marked loaded by its own cluster's CPU)."""
    from benchmarks.harness import ProcTree

    found: list = []
    tree = ProcTree(root=-1, include_ray_session=False, also=lambda: found)  # a root that is no process
    assert os.getpid() not in tree.pids()
    found.append(os.getpid())
    assert os.getpid() in tree.pids()  # asked again at this sample


_LEFTOVERS = r"""
import json, os, subprocess, time
from benchmarks.harness import procs, report

assert procs.adopt_orphans()
out = {}
# a "scenario" that exits at once and leaves a sleep running (an orphan: adopted by this process)
subprocess.run(["sh", "-c", "sleep 0.8 >/dev/null 2>&1 & exit 0"], check=True)
deadline = time.monotonic() + 10  # the orphan is sh's fork until it execs sleep (later on a loaded machine)
while any(c.startswith("sh ") for c in procs.left_behind().values()) and time.monotonic() < deadline:
    time.sleep(0.005)
out["found"] = list(procs.left_behind().values())
t0 = time.monotonic()
out["left"] = procs.wait_gone(procs.left_behind, timeout_s=20)
out["waited"] = time.monotonic() - t0
subprocess.run(["sh", "-c", "sleep 30 >/dev/null 2>&1 & exit 0"], check=True)
t0 = time.monotonic()
notes = []
out["note"] = report.wait_for_leftovers(notes.append, timeout_s=0.5)
out["bound"] = time.monotonic() - t0
for pid in procs.left_behind():
    os.kill(pid, 9)
out["after_kill"] = procs.wait_gone(procs.left_behind, timeout_s=5)
out["logged"] = notes
print(json.dumps(out))
"""


def test_the_report_waits_for_what_a_scenario_left_running_and_says_so_at_the_bound():
    """Issue #48: a scenario's Ray daemons still exiting loaded the next one's rounds; the
    report adopts what a scenario leaves (a subreaper, in a child process here) and waits
    for it, at most a bound, then notes what still runs."""
    r = subprocess.run([sys.executable, "-c", _LEFTOVERS], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    out = __import__("json").loads(r.stdout.strip().splitlines()[-1])
    assert out["found"] == ["sleep 0.8"]  # the orphan, found although its parent exited
    assert out["left"] == {} and 0.4 < out["waited"] < 15  # returned after it exited, not at the bound
    assert out["note"] and "still running" in out["note"] and "sleep 30" in out["note"]
    assert 0.4 < out["bound"] < 10 and out["logged"] == [f"-- {out['note']}"]
    assert out["after_kill"] == {}


def test_the_lean_servers_touch_gives_its_objects_new_versions():
    """``bucket_sources`` touches a bucket before each run, so an index or footer a Ray worker kept
    from an earlier run (by URI and version) is not found: each run starts cold, as a new process."""
    import re

    from benchmarks._lean_s3_store import _Store

    st = _Store()
    st.buckets["b"] = {"k.tar": b"x"}
    st.mtimes[("b", "k.tar")] = 1_000_000.0

    def listed() -> str:
        return re.search(rb"<LastModified>(.*?)</LastModified>", st.list_v2("b", {})).group(1).decode()

    before = listed()
    st.touch("b")
    assert st.buckets["b"] == {"k.tar": b"x"} and listed() > before and st.mtimes[("b", "k.tar")] >= 1_000_001.0
