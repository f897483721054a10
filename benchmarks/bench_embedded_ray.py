"""What the embedded Ray costs, and what each of sbloader's embedded settings saves.

Each variant runs in fresh child processes (one Ray per process), in turn per round:

- ``fresh``: ``sbloader.init()``, settle, then PSS summed over all Ray processes, the
  process count and CPU over an idle window, before any pipeline ran;
- ``use``: a first pipeline as a user runs it (Ray started lazily by the first
  iterator: time to first batch includes start-up), then the idle footprint
  after use, then the per-task overhead (CPU per task by process class over 1000
  one-block tasks), then checks that must keep passing: the sanity pipeline, a
  worker's stderr forwarded to the driver, a user error re-raised with its
  message, a task whose worker died retried to completion, token
  authentication on, and Ray bound to 127.0.0.1.

Variants: ``before`` (Ray's defaults with sbloader's environment: loopback, usage
stats off, and the settings that are not about daemons), one group of
``_system_config`` keys at a time on top of it, and ``shipped`` (``sbloader.init()``
as committed, all of them). The variants replace ``sbloader.runtime.session``'s embedded
settings in the child.

Run: ``python benchmarks/bench_embedded_ray.py [--quick]`` (~25 min; ``--quick`` ~3 min;
``--from-json results/embedded_ray.json`` re-renders the Markdown). Writes
``benchmarks/results/embedded_ray.json`` and ``embedded_ray.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

TITLE = "The embedded Ray: footprint and settings"
BEFORE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}

# name -> _system_config of the variant (None: sbloader as shipped, nothing replaced).
VARIANTS: dict[str, Optional[dict]] = {
    "before": {},
    "no prestarted workers": {"prestart_worker_first_driver": False},
    "no metrics": {"enable_metrics_collection": False, "emit_main_service_metrics": False},
    "no task events": {"task_events_report_interval_ms": 0, "enable_timeline": False},
    "no event stats, debug dumps": {"event_stats": False, "debug_dump_period_milliseconds": 0},
    "shipped": None,
}
NOTES = """
## What each Ray process is for, and what can go (Ray 2.60 source)

| process | a loader needs it? | how to switch it off |
|---|---|---|
| `gcs_server` | yes: cluster metadata, actors, object directory | – |
| `raylet` | yes: scheduling, workers, object store | – |
| `log_monitor.py` | yes: forwards workers' stdout/stderr to the driver (`log_to_driver`), where a user's prints and tracebacks show | `RayParams.include_log_monitor`, not exposed by `ray.init`; kept |
| `dashboard.py --minimal --modules-to-load=UsageStatsHead` | no: with `include_dashboard=False` it still starts (`Node.start_head_processes` always calls `start_api_server`; the flag only picks the modules), and only runs usage stats, which `RAY_USAGE_STATS_ENABLED=0` turns off | not through `ray.init`; only by patching `Node.start_api_server` |
| autoscaler `monitor.py` | no: a fixed single node never scales | `RayParams.no_monitor` (`ray start --no-monitor`), not exposed by `ray.init` |
| `ray::DashboardAgent`, `ray::RuntimeEnvAgent` | the runtime-env agent serves `runtime_env`; the dashboard agent nothing here | none: the raylet refuses to start without both agent commands ("Dashboard agent command must be non empty") |
| `ray::IDLE` workers | prestarted: no; after use: yes | prestart: `prestart_worker_first_driver=False` (applied); the idle ones after use stay up to `num_workers_soft_limit` (= num_cpus), which saves a worker start (~0.5-1 s of CPU) per epoch: kept |

Applied in `sbloader/_runtime.py` (`_EMBEDDED_SYSTEM_CONFIG`, passed as `_system_config` to the
embedded `ray.init` only; a user's own `_system_config` keys win): no prestarted workers; no
metrics recording/export (`enable_metrics_collection`, `emit_main_service_metrics`); no task
events or timeline (`task_events_report_interval_ms=0`, `enable_timeline`): only the state API
and the dashboard read them, and the embedded Ray has neither; no event-loop stats and
`debug_state.txt` dumps (`event_stats`, `debug_dump_period_milliseconds=0`). Token
authentication (on by default for a local `ray.init`, `RAY_AUTH_MODE` unset) and loopback stay.

Kept on purpose: the log monitor (worker logs and errors), the memory monitor
(`memory_monitor_refresh_ms`: kills and retries tasks before the kernel OOM-kills the node),
task retries, `worker_niceness` (workers yield the CPU to the trainer), the idle-worker soft
limit, and the raylet's 100 ms resource reports (actor placement waits on them).

Not applied (private API, version-fragile): starting the node with
`ray._private.node.Node(RayParams(no_monitor=True, ...), head=True)` and then
`ray.init(address=...)` would drop the monitor (~48 MiB PSS); dropping the dashboard process
(~58 MiB) needs a patch of `Node.start_api_server`. That is all that is left to gain at idle:
gcs, raylet, the log monitor and both agents (~230 MiB) are required.
"""
LOG_MARK = "SBLOADER-LOG-FORWARD-CHECK"
ERROR_MARK = "sbloader-error-check"


# ----- child side -------------------------------------------------------------

def _apply_variant(config: Optional[dict], keep_env: dict) -> None:
    import sbloader.runtime.session as rt

    if config is None:
        return
    # The environment as before, plus what other settings sbloader ships that are
    # not about daemons (e.g. how often freed objects are released): kept in all.
    rt._EMBEDDED_ENV = {**BEFORE_ENV, **keep_env}
    rt._EMBEDDED_SYSTEM_CONFIG = dict(config)


def _ray_idle(seconds: float) -> dict[str, Any]:
    snap = h.snapshot(keep=lambda pid: pid == os.getpid() or h.is_ray_process(pid))
    with h.measure("idle", interval_s=1.0) as m:
        time.sleep(seconds)
    r = m.result
    ray_classes = {k: v for k, v in snap["by_class"].items() if k != "trainer"}
    ray_cpu = sum(v for k, v in r.cpu_s_by_class.items() if k != "trainer")
    return {
        "ray_pss_bytes": sum(v["pss_bytes"] for v in ray_classes.values()),
        "ray_processes": sum(v["processes"] for v in ray_classes.values()),
        "by_class": snap["by_class"],
        "processes": [p for p in snap["processes_detail"] if p["class"] != "trainer"],
        "ray_cpu_pct": round(100 * ray_cpu / r.wall_s, 2),
        "cpu_s_by_class": r.cpu_s_by_class,
        "outside_cpu_frac": r.outside_cpu_frac,
    }


def _light(batch: dict) -> dict:
    import numpy as np

    return {"x": np.sqrt(batch["id"].astype("float64"))}


def _print_mark(batch: dict) -> dict:
    print(LOG_MARK, file=sys.stderr, flush=True)
    return batch


def _raise(batch: dict) -> dict:
    raise ValueError(ERROR_MARK)


def _die_once(batch: dict, marker: str) -> dict:
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL)  # first attempt only
    except FileExistsError:
        return batch
    os.close(fd)
    os._exit(1)  # the worker dies mid-task: Ray must retry it


def _checks() -> dict[str, Any]:
    import ray
    import sbloader
    from ray._raylet import AuthenticationMode, get_authentication_mode

    out: dict[str, Any] = {}
    batches = list(sbloader.range(100).map_batches(lambda b: b).iter_batches(10))
    out["sanity_pipeline"] = (len(batches[0]["id"]) == 10
                              and sorted(int(i) for b in batches for i in b["id"]) == list(range(100)))
    list(sbloader.range(4, num_partitions=1).map_batches(_print_mark).iter_batches(4))
    try:
        list(sbloader.range(4, num_partitions=1).map_batches(_raise).iter_batches(4))
        out["user_error_reraised"] = False
    except Exception as e:  # noqa: BLE001 - we check the message, whatever the class
        out["user_error_reraised"] = ERROR_MARK in str(e)
        out["user_error_class"] = type(e).__name__
    with tempfile.TemporaryDirectory() as d:
        marker = os.path.join(d, "died")
        try:
            rows = sum(len(b["id"]) for b in sbloader.range(40, num_partitions=4)
                       .map_batches(_die_once, fn_args=(marker,)).iter_batches(10))
            out["dead_worker_retried"] = rows == 40 and os.path.exists(marker)
        except Exception as e:  # noqa: BLE001
            out["dead_worker_retried"] = False
            out["dead_worker_error"] = repr(e)[:300]
    out["token_auth"] = get_authentication_mode() == AuthenticationMode.TOKEN
    out["gcs_address"] = ray.get_runtime_context().gcs_address
    out["loopback"] = out["gcs_address"].startswith("127.0.0.1:")
    time.sleep(1.5)  # let the log monitor forward the worker's stderr before we exit
    return out


def child(kind: str, config: Optional[dict], keep_env: dict, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this (fresh) process."""
    t_proc = time.perf_counter()
    import sbloader

    _apply_variant(config, keep_env)
    res: dict[str, Any] = {"kind": kind, "import_s": time.perf_counter() - t_proc}
    if kind == "fresh":
        t = time.perf_counter()
        sbloader.init(num_cpus=args.num_cpus)
        res["init_s"] = time.perf_counter() - t
        time.sleep(args.settle_s)
        res["idle"] = _ray_idle(args.idle_s)
        return res
    # kind == "use": the lazy path (the first iterator starts Ray)
    import torch  # noqa: F401  - a trainer has it imported (sbloader draws epoch seeds with it)

    ds = sbloader.range(4000).map_batches(_light)
    t = time.perf_counter()
    it = iter(ds.iter_batches(256))
    next(it)
    res["first_batch_incl_start_s"] = time.perf_counter() - t
    res["first_epoch_s"] = (sum(1 for _ in it), time.perf_counter() - t)[1]
    time.sleep(args.settle_s)
    res["idle_after_use"] = _ray_idle(args.idle_s)
    tiny = sbloader.range(4000, rows_per_partition=4).map_batches(_light)
    n_tasks = tiny.num_partitions()
    with h.measure("tasks") as m:
        for b in m.watch(lambda: tiny.iter_batches(None)):
            m.add_items(1)
    r = m.result
    res["per_task"] = {
        "tasks": n_tasks,
        "wall_ms_per_task": 1e3 * r.wall_s / n_tasks,
        "cpu_us_per_task": {c: round(1e6 * v / n_tasks) for c, v in r.cpu_s_by_class.items()},
        "outside_cpu_frac": r.outside_cpu_frac,
    }
    res["checks"] = _checks()
    return res


# ----- parent side ------------------------------------------------------------

def run_child(kind: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one child; its stderr is searched for the forwarded worker log line."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        cmd = [sys.executable, __file__, "--child", kind, "--variant", name, "--result", f.name,
               "--idle-s", str(args.idle_s), "--settle-s", str(args.settle_s)]
        if args.num_cpus:
            cmd += ["--num-cpus", str(args.num_cpus)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise RuntimeError(f"child {kind}/{name} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        res = json.load(open(f.name))
    if kind == "use":
        res["checks"]["worker_log_forwarded"] = LOG_MARK in p.stdout + p.stderr
    return res


def _shipped_settings() -> tuple[dict, dict]:
    import sbloader.runtime.session as rt

    return dict(rt._EMBEDDED_ENV), dict(getattr(rt, "_EMBEDDED_SYSTEM_CONFIG", {}))


def report(args: argparse.Namespace, runs: dict[str, list[dict]], fresh8: dict[str, list[dict]]) -> tuple[dict, str]:
    shipped_env, shipped_cfg = _shipped_settings()
    rows, summary = [], {}
    for name, rs in runs.items():
        fresh = [r for r in rs if r["kind"] == "fresh"]
        use = [r for r in rs if r["kind"] == "use"]
        s = {
            "init_s": h.summarize([r["init_s"] for r in fresh]),
            "fresh_ray_pss_bytes": h.summarize([r["idle"]["ray_pss_bytes"] for r in fresh]),
            "fresh_ray_processes": h.summarize([r["idle"]["ray_processes"] for r in fresh]),
            "fresh_ray_cpu_pct": h.summarize([r["idle"]["ray_cpu_pct"] for r in fresh]),
            "used_ray_pss_bytes": h.summarize([r["idle_after_use"]["ray_pss_bytes"] for r in use]),
            "used_ray_processes": h.summarize([r["idle_after_use"]["ray_processes"] for r in use]),
            "used_ray_cpu_pct": h.summarize([r["idle_after_use"]["ray_cpu_pct"] for r in use]),
            "first_batch_incl_start_s": h.summarize([r["first_batch_incl_start_s"] for r in use]),
            "first_epoch_s": h.summarize([r["first_epoch_s"] for r in use]),
            "per_task_wall_ms": h.summarize([r["per_task"]["wall_ms_per_task"] for r in use]),
            "per_task_cpu_us": {c: h.summarize([r["per_task"]["cpu_us_per_task"][c] for r in use])
                                for c in h.CLASSES},
            "checks_all_passed": all(
                all(v for k, v in r["checks"].items() if isinstance(v, bool)) for r in use),
            "outside_cpu_frac": h.summarize(
                [r["idle"]["outside_cpu_frac"] for r in fresh]
                + [r["idle_after_use"]["outside_cpu_frac"] for r in use]),
        }
        summary[name] = s
        cpu = s["per_task_cpu_us"]
        rows.append({
            "variant": name,
            "Ray PSS MiB (fresh)": h.fmt_range(s["fresh_ray_pss_bytes"], "{:.0f}", 2**-20),
            "procs (fresh)": h.fmt_range(s["fresh_ray_processes"], "{:.0f}"),
            "idle CPU % (fresh)": h.fmt_range(s["fresh_ray_cpu_pct"], "{:.1f}"),
            "Ray PSS MiB (after use)": h.fmt_range(s["used_ray_pss_bytes"], "{:.0f}", 2**-20),
            "procs (after use)": h.fmt_range(s["used_ray_processes"], "{:.0f}"),
            "idle CPU % (after use)": h.fmt_range(s["used_ray_cpu_pct"], "{:.1f}"),
            "init s": h.fmt_range(s["init_s"], "{:.2f}"),
            "1st batch s (incl. start)": h.fmt_range(s["first_batch_incl_start_s"], "{:.2f}"),
            "ms/task": h.fmt_range(s["per_task_wall_ms"], "{:.2f}"),
            "CPU µs/task driver": h.fmt_range(cpu["trainer"], "{:.0f}"),
            "workers": h.fmt_range(cpu["workers"], "{:.0f}"),
            "raylet": h.fmt_range(cpu["raylet"], "{:.0f}"),
            "gcs": h.fmt_range(cpu["gcs"], "{:.0f}"),
            "checks": "pass" if s["checks_all_passed"] else "FAIL",
            "outside CPU %": h.fmt_range(s["outside_cpu_frac"], "{:.0f}", 100),
        })
    f8 = {name: {"ray_pss_bytes": h.summarize([r["idle"]["ray_pss_bytes"] for r in rs]),
                 "ray_processes": h.summarize([r["idle"]["ray_processes"] for r in rs]),
                 "ray_cpu_pct": h.summarize([r["idle"]["ray_cpu_pct"] for r in rs])}
          for name, rs in fresh8.items()}
    last_use = [r for r in runs["shipped"] if r["kind"] == "use"][-1]
    noisy = max(v["outside_cpu_frac"]["median"] or 0.0 for v in summary.values())
    warn = ([f"**Disturbed run:** other processes took up to {100 * noisy:.0f}% of the CPU (median per "
             "variant, idle windows): wall times (init, first batch, ms/task) are not comparable; PSS, "
             "process counts and CPU seconds are much less affected.", ""] if noisy > 0.05 else [])
    md = [
        f"{args.rounds} interleaved rounds over the variants, each in fresh processes; median (min–max). "
        f"CPU % is of one core, over {args.idle_s:.0f} s idle after {args.settle_s:.0f} s to settle. "
        "`fresh`: right after `sbloader.init()`, before any pipeline; `after use`: after a first "
        "pipeline ran. Ray PSS and processes leave out the driver. `1st batch`: the lazy path, "
        "`sbloader.range(4000).map_batches(f).iter_batches(256)` in a new process that has imported torch (Ray starts inside). "
        "Per task: 1000 one-block tasks (`rows_per_partition=4`).",
        "",
        *warn,
        "`before` is Ray's defaults with sbloader's environment (loopback, usage stats off, and the "
        "settings that are not about daemons: "
        + ", ".join(f"`{k}={v}`" for k, v in shipped_env.items() if k not in BEFORE_ENV)
        + ", kept in every variant); each other row adds one group of `_system_config` keys; `shipped` "
        "is `sbloader.init()` as committed (all of them).",
        "",
        f"Embedded Ray with `num_cpus` = {args.num_cpus or 'default (nproc)'}:",
        "",
        h.markdown_table(rows),
        "",
        "Checks (every variant, every round): the sanity pipeline; a worker's stderr forwarded to the "
        "driver (log monitor); a user error re-raised in the driver with its message; a task whose "
        "worker died (`os._exit`) retried to completion; token authentication on; GCS on 127.0.0.1.",
        "",
    ]
    if f8:
        md += [
            "Fresh embedded Ray with `num_cpus=8` (as the test suite starts it):",
            "",
            h.markdown_table([{"variant": k, "Ray PSS MiB": h.fmt_range(v["ray_pss_bytes"], "{:.0f}", 2**-20),
                               "processes": h.fmt_range(v["ray_processes"], "{:.0f}"),
                               "idle CPU %": h.fmt_range(v["ray_cpu_pct"], "{:.1f}")} for k, v in f8.items()],
                             ["variant", "Ray PSS MiB", "processes", "idle CPU %"]),
            "",
        ]
    md += [
        "Ray processes after use, `shipped` (last round):",
        "",
        h.markdown_table([{"class": p["class"], "PSS MiB": p["pss_mib"], "process": p["cmd"][:70]}
                          for p in last_use["idle_after_use"]["processes"]], ["class", "PSS MiB", "process"]),
        "",
        "Shipped settings (`sbloader/_runtime.py`): environment "
        + ", ".join(f"`{k}={v}`" for k, v in shipped_env.items())
        + "; `_system_config` " + ", ".join(f"`{k}={v}`" for k, v in shipped_cfg.items()) + ".",
        NOTES,
    ]
    payload = {"args": vars(args), "variants": VARIANTS, "shipped_env": shipped_env,
               "shipped_system_config": shipped_cfg, "summary": summary, "fresh_num_cpus_8": f8,
               "runs": runs, "fresh_num_cpus_8_runs": fresh8}
    return payload, "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round, short windows")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--idle-s", type=float, default=None)
    p.add_argument("--settle-s", type=float, default=3.0)
    p.add_argument("--num-cpus", type=int, default=None)
    p.add_argument("--no-cpus-8", action="store_true", help="skip the num_cpus=8 fresh runs")
    p.add_argument("--out", default="embedded_ray")
    p.add_argument("--from-json", help="re-render the Markdown from a results JSON (no runs)")
    p.add_argument("--child", choices=("fresh", "use"), help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.idle_s = args.idle_s or (4.0 if args.quick else 10.0)
    if args.child:
        keep_env = {k: v for k, v in _shipped_settings()[0].items() if k not in BEFORE_ENV}
        res = child(args.child, VARIANTS[args.variant], keep_env, args)
        Path(args.result).write_text(json.dumps(res, default=str))
        return
    if args.from_json:
        prev = json.loads(Path(args.from_json).read_text())
        args = argparse.Namespace(**{**prev["args"], "out": args.out})
        payload, md = report(args, prev["runs"], prev["fresh_num_cpus_8_runs"])
        payload.update(machine=prev["machine"], command=prev["command"])
        jpath, mpath = h.write_results(args.out, payload, md, title=TITLE)
        print(f"re-rendered {mpath}")
        return
    machine = h.machine_info()
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    fresh8: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for name in VARIANTS:
            for kind in ("fresh", "use"):
                if not args.quick:
                    h.wait_quiet()
                res = run_child(kind, name, args)
                runs[name].append(res)
                brief = res.get("idle") or res.get("idle_after_use")
                print(f"round {r} {name:28s} {kind:5s} Ray PSS {h.mib(brief['ray_pss_bytes'])} MiB "
                      f"in {brief['ray_processes']} procs, idle CPU {brief['ray_cpu_pct']}%"
                      + (f", 1st batch {res['first_batch_incl_start_s']:.2f}s, checks {res['checks']}"
                         if kind == "use" else ""), flush=True)
        if not args.no_cpus_8 and args.num_cpus is None:
            a8 = argparse.Namespace(**{**vars(args), "num_cpus": 8})
            for name in ("before", "shipped"):
                fresh8.setdefault(name, []).append(run_child("fresh", name, a8))
                print(f"round {r} {name} num_cpus=8: {h.mib(fresh8[name][-1]['idle']['ray_pss_bytes'])} MiB "
                      f"in {fresh8[name][-1]['idle']['ray_processes']} procs", flush=True)
    payload, md = report(args, runs, fresh8)
    payload["machine"] = machine
    h.publish(args.out, payload, md, title=TITLE)


if __name__ == "__main__":
    main()
