"""Scale-out emulated by CPU affinity on one host (issue #7 item 2).

There is one 2-core machine here, so "nodes" are emulated with ``taskset`` (see
BENCHMARKING.md): the trainer and the head Ray (``sbloader.init(num_cpus=1)``,
its daemons and workers inherit the pinning) run on core 0; each extra "CPU
node" is a Ray worker node with ``--num-cpus=1`` pinned to another core (core 1),
joined to the head over loopback with the head's auth token. On 2 cores that is
0 or 1 extra node; ``--node-cores 1,2,3`` on a bigger machine adds more.

Workload: the image workload (``_jpeg_workload.py``: JPEG decode,
random-resized-crop 224, flip; ``write_jpeg_folder``'s JPEGs; 1,024 of them, 256
with ``--quick``), consumer idle. Contenders in each job (``_scaleout_job.py``):

- ``pipeline``: ``read_images(paths).map_batches(crop_flip).to_dataloader(64,
  shuffle=True)``, Ray tasks with sbloader's default placement, which keeps
  preprocessing off the trainer's node when another node has CPUs
  (``sbloader/placement.py``);
- ``pipeline_allow``: the same pipeline with ``allow_trainer_node=True`` (every
  node's CPUs);
- ``dropin``: ``sbloader.DataLoader(ImageFolderDataset(paths), batch_size=64,
  shuffle=True, num_workers=<CPUs it may use>, persistent_workers=True)``,
  default placement;
- ``dropin_allow``: the same with ``allow_trainer_node=True`` and
  ``num_workers=<cluster CPUs>``.

(The ``*_allow`` contenders run when the installed sbloader has the option.) So
with one extra node the default placement moves the work from the trainer's core
to the node's core (1 worker core either way), and ``*_allow`` adds the node's
core to the trainer's (1 -> 2 worker cores): the scale-out figure.

One job (a fresh head, the extra nodes, a cold epoch and E warm epochs per
contender) per (round, cluster shape), shapes interleaved in each round (0
extra, 1 extra, ...). Figures: warm images/s, the ratio to the 0-extra job of the
same round, efficiency against linear = that ratio / the ratio of worker cores,
and the fraction of the ceiling of the worker cores (the function alone per core,
calibrated in each round, x worker cores). Load is measured per pinned core:
the time other processes took on core 0 and on the node's core.

Run: ``python benchmarks/bench_scaleout.py [--quick]``. Writes
``benchmarks/results/scaleout.json``, ``scaleout.md`` and ``scaleout.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _gitstate  # noqa: E402
import _harness as h  # noqa: E402
import _jobs  # noqa: E402
import _jpeg_workload as w  # noqa: E402

NAME = "scaleout"
CONTENDERS = ("pipeline", "pipeline_allow", "dropin", "dropin_allow")
DISPLAY = {"pipeline": "read_images(...).map_batches(...).to_dataloader(64), default placement",
           "pipeline_allow": "the same pipeline, allow_trainer_node=True",
           "dropin": "sbloader.DataLoader(Dataset, persistent), default placement",
           "dropin_allow": "the same drop-in, allow_trainer_node=True"}


def worker_cores(contender: str, k: int) -> int:
    """Cores the loader's workers may use: the default placement keeps them off the
    trainer's node (core 0) when an extra node has CPUs."""
    if contender.endswith("_allow") or k == 0:
        return 1 + k
    return k


def calibrate(paths: list[str], batches: int = 6) -> dict:
    """CPU ms per image of the function alone (one thread): the per-core ceiling."""
    cpu_ms = h.cpu_ms_per_item(w.preprocess_paths, paths, w.BATCH, batches)
    return {"cpu_ms_per_image": cpu_ms, "per_core_images_per_s": 1e3 / cpu_ms}


def run_job(k: int, args: argparse.Namespace, paths_file: str) -> dict:
    fd, out = tempfile.mkstemp(prefix=f"bench_scaleout_{k}_", suffix=".json")
    os.close(fd)
    cmd = ["taskset", "-c", args.trainer_cores, sys.executable, str(HERE / "_scaleout_job.py"),
           "--paths-file", paths_file, "--out", out, "--extra-nodes", str(k),
           "--extra-cores", args.node_cores, "--epochs", str(args.epochs)]
    env = _jobs.job_env()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.job_timeout,
                          cwd=str(HERE.parent))
    wall = time.perf_counter() - t0
    try:
        res = json.loads(Path(out).read_text())
    except (OSError, ValueError):
        res = None
    for f in [out] + [f"{out}.node{i}.log" for i in range(k)]:
        try:
            os.unlink(f)
        except OSError:
            pass
    if proc.returncode != 0 or res is None:
        raise RuntimeError(f"job with {k} extra node(s) failed (rc={proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    res["job_wall_s"] = wall
    res["cmd"] = " ".join(cmd[:4] + ["benchmarks/_scaleout_job.py"] + cmd[5:5] + ["--extra-nodes", str(k), "..."])
    return res


# ----- figures -------------------------------------------------------------------------------

def job_figures(job: dict, cal: dict) -> dict:
    out: dict[str, Any] = {}
    k = len(job["extra_cores"])
    for c in CONTENDERS:
        if c not in job:
            continue
        eps = job[c]
        warm = [e for e in eps if not e["extra"]["cold"]]
        cls: dict[str, float] = {}
        items = 0
        for e in warm:
            items += e["items"]
            for kk, v in e["cpu_s_by_class"].items():
                cls[kk] = cls.get(kk, 0.0) + v
        rate = statistics.median(e["items_per_s"] for e in warm)
        out[c] = {
            "images_per_s": rate,
            "worker_cores": worker_cores(c, k),
            "x_ceiling": rate / (worker_cores(c, k) * cal["per_core_images_per_s"]),
            "cold_first_batch_s": eps[0]["first_item_s"],
            "cold_images_per_s": eps[0]["items_per_s"],
            "warm_first_batch_s": statistics.median(e["first_item_s"] for e in warm),
            "cpu_us_per_image_by_class": {kk: 1e6 * v / items for kk, v in cls.items()},
            "peak_pss_bytes": max(e["peak_pss_bytes"] for e in warm),
            "outside_cpu_frac": statistics.median(e["outside_cpu_frac"] for e in warm),
            "outside_trainer_core": statistics.median(e["extra"]["outside_by_core"].get("trainer_cores", 0.0)
                                                      for e in warm),
            "outside_node_cores": (statistics.median(e["extra"]["outside_by_core"]["node_cores"] for e in warm)
                                   if k else None),
            "operators": [e["extra"].get("operators") for e in eps],
            "machine_cpu_frac": statistics.median(e["machine_cpu_frac"] for e in warm),
        }
    return out


def report(args: argparse.Namespace, ks: list[int], cals: list[dict], jobs: dict[int, list[dict]]) -> tuple[dict, str]:
    summary: dict[str, Any] = {}
    rows, rows_cpu = [], []
    present = [c for c in CONTENDERS if all(c in j["fig"] for k in ks for j in jobs[k])]
    for c in present:
        summary[c] = {}
        for k in ks:
            figs = [j["fig"][c] for j in jobs[k]]
            base = [j["fig"][c]["images_per_s"] for j in jobs[ks[0]]]
            ratio = [f["images_per_s"] / b for f, b in zip(figs, base)]
            cores_ratio = worker_cores(c, k) / worker_cores(c, ks[0])
            s = {
                "worker_cores": worker_cores(c, k),
                "images_per_s": h.summarize([f["images_per_s"] for f in figs]),
                "vs_0_extra": h.summarize(ratio),
                "efficiency_vs_linear": h.summarize([r / cores_ratio for r in ratio]),
                "x_ceiling": h.summarize([f["x_ceiling"] for f in figs]),
                "cold_first_batch_s": h.summarize([f["cold_first_batch_s"] for f in figs]),
                "warm_first_batch_s": h.summarize([f["warm_first_batch_s"] for f in figs]),
                "peak_pss_bytes": h.summarize([f["peak_pss_bytes"] for f in figs]),
                "outside_cpu_frac": h.summarize([f["outside_cpu_frac"] for f in figs]),
                "outside_trainer_core": h.summarize([f["outside_trainer_core"] for f in figs]),
                "outside_node_cores": h.summarize([f["outside_node_cores"] for f in figs]),
                "cpu_us_per_image_by_class": {
                    kk: h.summarize([f["cpu_us_per_image_by_class"].get(kk, 0.0) for f in figs])
                    for kk in sorted({kk for f in figs for kk in f["cpu_us_per_image_by_class"]})},
            }
            summary[c][k] = s
            rows.append({
                "contender": c, "extra nodes": k,
                "worker cores": f"{worker_cores(c, k)}" + (" (shared with the trainer)" if k == 0 else
                                                           " (incl. the trainer's)" if c.endswith("_allow") else ""),
                "warm images/s": h.fmt_range(s["images_per_s"], "{:.0f}"),
                "x 0 extra (same round)": h.fmt_range(s["vs_0_extra"], "{:.2f}"),
                "efficiency vs linear": h.fmt_range(s["efficiency_vs_linear"], "{:.2f}"),
                "x ceiling of its cores": h.fmt_range(s["x_ceiling"], "{:.2f}"),
                "cold first batch s": h.fmt_range(s["cold_first_batch_s"], "{:.1f}"),
                "warm first batch s": h.fmt_range(s["warm_first_batch_s"], "{:.2f}"),
                "peak PSS MiB": h.fmt_range(s["peak_pss_bytes"], "{:.0f}", 2**-20),
                "outside CPU % core 0": h.fmt_range(s["outside_trainer_core"], "{:.0f}", 100),
                "core 1": h.fmt_range(s["outside_node_cores"], "{:.0f}", 100) if k else "–",
            })
            cpu = s["cpu_us_per_image_by_class"]
            rows_cpu.append({"contender": c, "extra nodes": k,
                             **{kk: h.fmt_range(v, "{:.0f}") for kk, v in cpu.items() if (v["median"] or 0) >= 0.5}})
    cpu_cols = ["contender", "extra nodes"] + sorted({kk for r in rows_cpu for kk in r} - {"contender", "extra nodes"},
                                                     key=lambda x: (x.startswith("node2_"), x))
    per_core = h.summarize([c["per_core_images_per_s"] for c in cals])
    j0 = jobs[ks[-1]][0]
    md = [
        f"Workload: {args.images} generated JPEGs, decode + random-resized-crop 224 + flip, batches of 64, consumer idle. "
        f"{args.rounds} round(s), cluster shapes {', '.join(f'{k} extra' for k in ks)} interleaved in each; per job a "
        f"fresh head, a cold epoch and {args.epochs} warm epoch(s) per contender (the figure of a job is the median of "
        "its warm epochs); median (min–max) over rounds.",
        "",
        "**Emulated by CPU affinity on one 2-core host** (BENCHMARKING.md): the trainer and the head Ray "
        f"(`sbloader.init(num_cpus=1)`: its raylet, GCS, daemons and workers) pinned to core {args.trainer_cores} with "
        "`taskset`; each extra \"CPU node\" a Ray worker node (`--num-cpus=1`, its own raylet, object store and "
        f"agents) pinned to core(s) {args.node_cores}, joined over loopback with the head's auth token "
        f"(`_scaleout_node.py`; listening addresses checked: {', '.join(j0.get('node_listening', []))}).",
        "",
        h.markdown_table(rows),
        "",
        f"- Ceiling per core = the function alone, {h.fmt_range(per_core, '{:.0f}')} images/s "
        f"({h.fmt_range(h.summarize([c['cpu_ms_per_image'] for c in cals]), '{:.2f}')} ms of CPU per image), calibrated "
        "in each round; `x ceiling of its cores` = images/s / (worker cores x that).",
        "- Worker cores: with no extra node the workers share core 0 with the trainer; with one, the default "
        "placement (`sbloader/placement.py`) keeps them off the trainer's node, so they get the node's core only, "
        "and `allow_trainer_node=True` gives them both cores.",
        "- Efficiency vs linear = (images/s with K extra nodes / images/s with none, same round) / (worker cores "
        "with K / worker cores with none).",
        "- Outside CPU % per pinned core: the share of core 0 (trainer, head) and of core 1 (the extra node) "
        "taken by processes that are not this job's (ours are pinned, so the attribution is exact).",
        "",
        "## CPU µs per image by process (warm epochs)",
        "",
        h.markdown_table(rows_cpu, cpu_cols),
        "",
        "`trainer` = the trainer process (the harness's sampler taken out); `workers`, `raylet`, `gcs`, `ray_daemons` = "
        "the head's (core 0); `node2_*` = the extra node's processes (its `launcher` is `_scaleout_node.py`).",
        "",
        "## What this emulation can and cannot say",
        "",
        "- With 0 extra nodes the loader's one worker shares core 0 with the trainer, the head's raylet and GCS; "
        "with 1 extra node the node's worker has core 1 almost alone (only the node's raylet and agents beside it), "
        "while the head's raylet (core 0) now also pulls every batch from the node's object store. So a 1-core "
        "baseline is not a whole core for the workers, and efficiency against linear can exceed 1.0.",
        "- The nodes share one memory bus, one L3 cache and one page cache; the object transfer between the two "
        "object stores goes through each node's object manager over loopback (real copies and gRPC, but no "
        "network latency or bandwidth limit). A real second machine would add the network and remove the shared "
        "caches.",
        "- 2 cores give only two points (1 and 2 worker cores): no curve beyond. On a bigger machine "
        "`--node-cores 1,2,3` emulates more nodes the same way.",
        "- Other sessions' processes run on both cores (outside CPU % above); taskset pins our processes, "
        "not theirs.",
    ]
    payload = {"args": vars(args), "calibration": cals,
               "summary": {c: {str(k): v for k, v in d.items()} for c, d in summary.items()},
               "jobs": {str(k): v for k, v in jobs.items()}}
    return payload, "\n".join(md)


def plot(ks: list[int], summary: dict, cals: list[dict], path: Path) -> Optional[Path]:
    plt = h.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.8))
    per_core = statistics.median(c["per_core_images_per_s"] for c in cals)
    styles = {"pipeline": "o--", "pipeline_allow": "o-", "dropin": "s--", "dropin_allow": "s-"}
    for c, d in summary.items():
        med = [d[k]["images_per_s"]["median"] for k in ks]
        lo = [d[k]["images_per_s"]["min"] for k in ks]
        hi = [d[k]["images_per_s"]["max"] for k in ks]
        ax.errorbar(ks, med, yerr=[[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]],
                    fmt=styles.get(c, "x-"), capsize=3, label=f"{c} ({', '.join(str(worker_cores(c, k)) for k in ks)} "
                    "worker cores)")
        if c.endswith("_allow"):
            ax.plot(ks, [med[0] * worker_cores(c, k) / worker_cores(c, ks[0]) for k in ks], ":", color="grey",
                    alpha=0.7)
    ax.plot(ks, [per_core * (1 + k) for k in ks], color="black", lw=1, label="ceiling of 1 + K cores")
    ax.set_xticks(ks)
    ax.set_xticklabels([f"{k} extra node{'s' if k != 1 else ''}" for k in ks])
    ax.set_ylabel("images/s (warm epochs)")
    ax.set_title("scale-out emulated by taskset on one 2-core host (dotted: linear from 0 extra)", fontsize=9)
    ax.legend(fontsize=7)
    return h.save_figure(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="256 images, 1 round, 1 warm epoch (about 2 minutes)")
    p.add_argument("--images", type=int, default=None, help="images per epoch (default 1024; quick 256)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; quick 1)")
    p.add_argument("--epochs", type=int, default=None, help="warm epochs per contender (default 2; quick 1)")
    p.add_argument("--trainer-cores", default="0", help="taskset list of the trainer and the head")
    p.add_argument("--node-cores", default="1", help="one core per extra node, comma-separated")
    p.add_argument("--quiet-timeout", type=float, default=None, help="wait for a quiet machine, s (default 10; quick 3)")
    p.add_argument("--job-timeout", type=float, default=400.0)
    p.add_argument("--data", default=os.environ.get("SBLOADER_BENCH_DATA", "/tmp/sbloader_bench_images"))
    p.add_argument("--out", default=NAME)
    args = p.parse_args()
    args.images = args.images or (256 if args.quick else 1024)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.epochs = args.epochs or (1 if args.quick else 2)
    args.quiet_timeout = args.quiet_timeout if args.quiet_timeout is not None else (3.0 if args.quick else 10.0)
    avail = os.sched_getaffinity(0)
    node_cores = [int(c) for c in args.node_cores.split(",") if c]
    trainer = {int(c) for c in args.trainer_cores.split(",")}
    node_cores = [c for c in node_cores if c in avail and c not in trainer]
    args.node_cores = ",".join(str(c) for c in node_cores)
    ks = list(range(len(node_cores) + 1))
    machine = h.machine_info()
    git_state = _gitstate.git_state()
    t_begin = time.monotonic()

    from sbloader.datagen import write_jpeg_folder

    paths = write_jpeg_folder(str(Path(args.data) / "jpeg"), args.images, seed=0)
    paths_file = _jobs.write_paths_file(paths, prefix="bench_scaleout_paths_")
    cals: list[dict] = []
    jobs: dict[int, list[dict]] = {k: [] for k in ks}
    try:
        for rnd in range(args.rounds):
            cal = calibrate(paths)
            cals.append(cal)
            print(f"round {rnd}: {cal['cpu_ms_per_image']:.2f} ms/image ({cal['per_core_images_per_s']:.0f} images/s "
                  "per core)", flush=True)
            for k in ks:
                busy = h.wait_quiet(timeout_s=args.quiet_timeout)
                job = run_job(k, args, paths_file)
                job["busy_before"] = busy
                job["fig"] = job_figures(job, cal)
                jobs[k].append(job)
                print(f"  {k} extra: " + ", ".join(
                    f"{c} {job['fig'][c]['images_per_s']:.0f} images/s ({job['fig'][c]['x_ceiling']:.2f}x, outside "
                    f"{100 * job['fig'][c]['outside_trainer_core']:.0f}% of core 0)" for c in CONTENDERS
                    if c in job["fig"])
                    + f"; job {job['job_wall_s']:.0f}s", flush=True)
    finally:
        os.unlink(paths_file)
    payload, md = report(args, ks, cals, jobs)
    payload["machine"] = machine
    payload["total_wall_s"] = time.monotonic() - t_begin
    payload["git"] = git_state
    png = plot(ks, {c: {int(k): v for k, v in d.items()} for c, d in payload["summary"].items()}, cals,
               h.RESULTS_DIR / f"{args.out}.png")
    h.publish(args.out, payload, md, title="Scale-out emulated by CPU affinity (taskset)", png=png, alt="scaleout")


if __name__ == "__main__":
    main()
