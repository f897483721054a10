"""The split coordinator at 8 to 1,024 simulated ranks, before and after issue #22.

Every figure comes from ``sbloader.distributed.simulate``: simulated ranks (threads
in 1-4 Ray actors) speak the ranks' protocol to the real ``SplitCoordinator`` actor
and each consumes one tiny batch every 0.2 s (5 batches/s per rank, no bytes fetched,
no trainer work); the epoch's executor is the task-free stand-in of
``sbloader.distributed.sim_epoch``. Per run, in a fresh embedded Ray
(``_coord_scale_job.py``):

- coordinator CPU per batch = utime+stime of the coordinator's process
  (``/proc/<pid>/stat``) over the epoch / batches taken by all ranks; ``above
  idle`` subtracts the actor's own idle rate, measured over the 2 s before the
  ranks start;
- request latency = from ``next_batches.remote(...)`` in the rank to the arrival
  of the reply (a future callback), p50 and p99 over every request of the epoch;
- ledger bytes = the per-rank delivery logs as compact JSON (what the coordinator
  holds per rank; ``process_info()["ledger_bytes"]``), at the epoch's end, also
  scaled to 1M samples consumed; state bytes = the consumed ranges ``cut`` returns
  after every rank's last batch, as JSON;
- rebuild (``--kill``): the coordinator is killed 3 s into the epoch at 256 ranks
  and a new one started; the rebuild time runs from the kill to the last rank's
  first reply from the new coordinator; the check is that every rank took its count
  and every batch was taken once.

``before`` is the revision given by ``--before`` (default: the simulation's
commit, before the change), extracted with ``git archive``; ``after`` is this
tree. The two run interleaved per scale and round (before, after, after, before,
...). This machine has 2 cores shared with other sessions: the load average and
the share of CPU other processes took are recorded with every run. At 1,024 ranks
the simulated ranks' own processes need more CPU than the machine has, so the
latency there is mostly the ranks' own queueing (see docs/scaling.md).

Run: ``python benchmarks/bench_coordinator_scale.py [--quick]``. Writes
``benchmarks/results/coordinator_scale.json``, ``.md`` and (with Pillow) ``.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import _harness as h  # noqa: E402

NAME = "coordinator_scale"
BEFORE = "2d1ed7d"  # the simulation, before the change (#22)
HOSTS = {8: 1, 32: 1, 64: 1, 256: 2, 1024: 4}
TITLE = "Split coordinator at 8 to 1,024 simulated ranks (issue #22)"


def extract(rev: str, into: Path) -> Path:
    """The tree of ``rev`` under ``into`` (git archive)."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_one(tree: Path, world: int, per_rank: int, kill: Optional[float], timeout: float,
            rebuild_timeout: float) -> dict:
    """One simulated epoch with ``tree`` first on PYTHONPATH; its JSON (or the failure)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = {**os.environ, "PYTHONPATH": str(tree), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    cmd = [sys.executable, str(HERE / "_coord_scale_job.py"), "--world", str(world), "--per-rank", str(per_rank),
           "--hosts", str(HOSTS.get(world, 4)), "--out", out, "--rebuild-timeout", str(rebuild_timeout)]
    if kill is not None:
        cmd += ["--kill", str(kill)]
    try:
        # cwd: Ray puts the driver's working directory on its workers' sys.path, ahead of
        # PYTHONPATH; run anywhere else and the actors would import another tree's sbloader
        p = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            return {"failed": f"exit {p.returncode}: {p.stderr[-600:]}"}
        return json.loads(Path(out).read_text())
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {timeout:.0f} s"}
    finally:
        Path(out).unlink(missing_ok=True)


def _med(runs: list, *path: str) -> Optional[float]:
    vals = []
    for r in runs:
        v: Any = r
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if isinstance(v, (int, float)):
            vals.append(float(v))
    return statistics.median(vals) if vals else None


def summarize(runs: dict) -> list[dict]:
    """One row per (variant, ranks): medians over rounds."""
    rows = []
    for (variant, world), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0] != "before")):
        ok = [r for r in rs if "failed" not in r]
        samples = _med(ok, "samples") or 0
        ledger = _med(ok, "ledger_bytes")
        rows.append({
            "variant": variant, "ranks": world, "runs": f"{len(ok)} of {len(rs)}",
            "cpu_ms_per_batch": _med(ok, "cpu_ms_per_batch"),
            "cpu_ms_per_batch_above_idle": _med(ok, "cpu_ms_per_batch_above_idle"),
            "batches_per_request": (_med(ok, "batches") or 0) / max(1.0, _med(ok, "requests") or 1.0),
            "p50_ms": _med(ok, "latency_ms", "p50"), "p99_ms": _med(ok, "latency_ms", "p99"),
            "ledger_bytes": ledger,
            "ledger_kib_per_1M_samples": None if ledger is None or not samples else ledger / 1024 * 1e6 / samples,
            "state_bytes": _med(ok, "state_bytes"), "cut_ms": _med(ok, "cut_ms"),
            "batches_per_s": (_med(ok, "batches") or 0) / max(1e-9, _med(ok, "wall_s") or 1.0),
            "exactly_once": all(r["check"]["exactly_once"] and r["check"]["equal_counts"] for r in ok) if ok else None,
            "loadavg": statistics.median([r["loadavg_before"][0] for r in ok]) if ok else None,
            "others_busy": _med(ok, "machine_busy_frac"),
        })
    return rows


def _fmt(v: Any, f: str = "{:.3g}") -> str:
    return "–" if v is None else (f.format(v) if isinstance(v, float) else str(v))


def plot_png(rows: list, path: Path) -> Optional[Path]:
    """CPU per batch and p99 latency against ranks (log-log), drawn with Pillow (no matplotlib here)."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return None
    import math

    W, H, pad = 900, 380, 60
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    panels = [("coordinator CPU ms / batch", "cpu_ms_per_batch", 0.3), ("p99 request latency ms", "p99_ms", 10.0)]
    colors = {"before": (200, 60, 60), "after": (40, 90, 200)}
    ranks = sorted({r["ranks"] for r in rows})
    for i, (title, key, target) in enumerate(panels):
        x0, x1 = pad + i * W // 2, (i + 1) * W // 2 - 20
        y0, y1 = 40, H - pad
        vals = [r[key] for r in rows if r[key]] + [target]
        lo, hi = math.log10(min(vals)) - 0.2, math.log10(max(vals)) + 0.2
        lx0, lx1 = math.log2(ranks[0]), math.log2(ranks[-1]) if len(ranks) > 1 else math.log2(ranks[0]) + 1

        def xy(n: float, v: float) -> tuple[float, float]:
            return (x0 + (math.log2(n) - lx0) / max(1e-9, lx1 - lx0) * (x1 - x0),
                    y1 - (math.log10(v) - lo) / (hi - lo) * (y1 - y0))
        d.rectangle([x0, y0, x1, y1], outline="black")
        d.text((x0, 15), title + " (log scale)", fill="black")
        for n in ranks:
            x, _ = xy(n, 10 ** lo)
            d.text((x - 8, y1 + 6), str(n), fill="black")
        d.text(((x0 + x1) // 2 - 20, y1 + 22), "ranks", fill="black")
        for e in range(math.floor(lo), math.ceil(hi) + 1):
            if lo <= e <= hi:
                _, y = xy(ranks[0], 10 ** e)
                d.line([x0, y, x0 + 5, y], fill="black")
                d.text((x0 - 45, y - 6), f"{10 ** e:g}", fill="black")
        _, ty = xy(ranks[0], target)
        d.line([x0, ty, x1, ty], fill=(120, 120, 120))
        d.text((x1 - 90, ty - 14), f"target {target:g}", fill=(120, 120, 120))
        for variant, c in colors.items():
            pts = [xy(r["ranks"], r[key]) for r in rows if r["variant"] == variant and r[key]]
            if len(pts) > 1:
                d.line(pts, fill=c, width=2)
            for x, y in pts:
                d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=c)
        for j, (variant, c) in enumerate(colors.items()):
            d.text((x0 + 10, y0 + 8 + 14 * j), variant, fill=c)
    img.save(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default=BEFORE)
    ap.add_argument("--scales", default="8,64,256,1024")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=8.0, help="epoch length at 5 batches/s per rank")
    ap.add_argument("--no-rebuild", action="store_true")
    ap.add_argument("--quick", action="store_true", help="8, 64, 256 ranks, one round, 6 s epochs")
    a = ap.parse_args()
    scales = [8, 64, 256] if a.quick else [int(x) for x in a.scales.split(",")]
    rounds = 1 if a.quick else a.rounds
    per_rank = int(5 * (6.0 if a.quick else a.seconds))
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": extract(a.before, Path(tmp) / "before"), "after": ROOT}
        runs: dict = {}
        for rnd in range(rounds):
            for world in scales:
                order = ["before", "after"] if (rnd + scales.index(world)) % 2 == 0 else ["after", "before"]
                for variant in order:
                    r = run_one(trees[variant], world, per_rank, None, 600, 30.0)
                    runs.setdefault((variant, world), []).append(r)
                    print(f"round {rnd} {variant:6s} {world:5d} ranks: "
                          + (r.get("failed") or f"cpu {r['cpu_ms_per_batch']:.3f} ms/batch, p99 "
                             f"{r['latency_ms']['p99']:.1f} ms, load {r['loadavg_before'][0]:.1f}"), flush=True)
        rebuild = {}
        if not a.no_rebuild:
            for variant in ("after", "before"):
                # the old rebuild waits inside the coordinator: bounded at 10 s per wave of 64 ranks
                rebuild[variant] = run_one(trees[variant], 256, 60, 3.0, 600, 30.0 if variant == "after" else 10.0)
                r = rebuild[variant]
                print(f"rebuild {variant}: " + (r.get("failed") or f"{r.get('rebuild_s')} s, errors {r['errors'][:1]}, "
                                                f"check {r['check']}"), flush=True)
    rows = summarize(runs)
    md = [f"Simulated ranks at 5 batches/s each, {per_rank} batches per rank, {rounds} round(s), before "
          f"(`{a.before}`) and after interleaved; medians over rounds. Method: see the docstring of "
          "`benchmarks/bench_coordinator_scale.py` and docs/scaling.md.", "",
          "| variant | ranks | runs | coord CPU ms/batch | above idle | batches/request | p50 ms | p99 ms | "
          "ledger bytes | ledger KiB per 1M samples | state bytes | cut ms | batches/s | equal + exactly once | "
          "load avg | machine busy |",
          "|" + "---|" * 16]
    for r in rows:
        md.append("| " + " | ".join(_fmt(r[k]) for k in (
            "variant", "ranks", "runs", "cpu_ms_per_batch", "cpu_ms_per_batch_above_idle", "batches_per_request",
            "p50_ms", "p99_ms", "ledger_bytes", "ledger_kib_per_1M_samples", "state_bytes", "cut_ms",
            "batches_per_s", "exactly_once", "loadavg", "others_busy")) + " |")
    if rebuild:
        md += ["", "## Coordinator killed 3 s into the epoch, 256 ranks", "",
               "| variant | rebuild s (kill to the last rank's first reply) | ranks noticed by (s) | reported by (s) "
               "| equal counts | exactly once | errors |", "|---|---|---|---|---|---|---|"]
        for variant, r in rebuild.items():
            if "failed" in r:
                md.append(f"| {variant} | failed: {r['failed'][:120]} | | | | | |")
                continue
            ph = r.get("rebuild_phases_s", {})
            md.append(f"| {variant} | {_fmt(r.get('rebuild_s'))} | {_fmt(ph.get('noticed_at'))} | "
                      f"{_fmt(ph.get('reported_at'))} | {r['check']['equal_counts']} | {r['check']['exactly_once']} | "
                      f"{len(r['errors'])} {('(' + r['errors'][0][:100] + ')') if r['errors'] else ''} |")
    png = plot_png(rows, h.RESULTS_DIR / f"{NAME}.png")
    note = "" if png else " (no PNG: Pillow missing)"
    payload = {"rows": rows, "runs": {f"{v}/{w}": rs for (v, w), rs in runs.items()}, "rebuild": rebuild,
               "before": a.before, "per_rank": per_rank, "rounds": rounds}
    h.publish(NAME, payload, "\n".join(md), title=TITLE, png=png, note=note)


if __name__ == "__main__":
    main()
