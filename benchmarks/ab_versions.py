"""Two versions of sbloader through the same benchmark, whole runs interleaved (old, new, new, old, ...).

Each version is a git worktree of its revision; a run is ``python benchmarks/bench_<name>.py
[args]`` inside it, with that worktree first on ``PYTHONPATH`` (the driver, its children and
their Ray workers import that version). Each run measures its own in-run anchors (the
ceiling, torch), so a ratio such as ``x_ceiling`` is comparable across runs taken minutes
apart; absolute rates drift with the machine. The comparison reports, for every numeric
median of the benchmark's ``summary`` whose path matches ``--metric``, the median over the
runs of each version and new/old.

Run: ``python benchmarks/ab_versions.py --old REV --new REV --bench split --rounds 2 -- --quick``.
Writes ``benchmarks/results/ab_<bench>.json`` and ``.md`` (and keeps each run's JSON beside them,
under ``benchmarks/results/ab/``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import _harness as h  # noqa: E402


def medians(node: Any, path: str = "") -> dict[str, float]:
    """Every ``{"median": x}`` leaf of a summary, by its path (``2/warm/x_ceiling``)."""
    out: dict[str, float] = {}
    if isinstance(node, dict):
        if isinstance(node.get("median"), (int, float)):
            out[path] = float(node["median"])
        for k, v in node.items():
            if k != "median":
                out.update(medians(v, f"{path}/{k}" if path else str(k)))
    return out


def checkout(rev: str, where: Path) -> Path:
    """A worktree of ``rev`` at ``where`` sharing the generated benchmark data."""
    subprocess.run(["git", "worktree", "add", "--detach", str(where), rev], cwd=ROOT, check=True,
                   capture_output=True)
    data = HERE / "results" / "tmp"
    if data.exists():
        (where / "benchmarks" / "results").mkdir(parents=True, exist_ok=True)
        target = where / "benchmarks" / "results" / "tmp"
        if not target.exists():
            target.symlink_to(data)
    return where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="git revision of the old version")
    ap.add_argument("--new", default="HEAD", help="git revision of the new version")
    ap.add_argument("--bench", required=True, help="the benchmark's name: bench_<name>.py, results/<name>.json")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each version")
    ap.add_argument("--metric", default="x_ceiling|images_per_s|ratio|resume_worst|first_batch",
                    help="regex over the summary's median paths to report")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the benchmark (after --)")
    args = ap.parse_args()
    bench_args = [a for a in args.args if a != "--"]
    tmp = Path(tempfile.mkdtemp(prefix="ab-versions-"))
    trees = {"old": checkout(args.old, tmp / "old"), "new": checkout(args.new, tmp / "new")}
    keep = HERE / "results" / "ab"
    keep.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    try:
        for r in range(args.rounds):
            for version in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
                tree = trees[version]
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
                t0 = time.time()
                proc = subprocess.run([sys.executable, str(tree / "benchmarks" / f"bench_{args.bench}.py"),
                                       *bench_args], cwd=tree, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise SystemExit(f"{version} run {r} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                result = json.loads((tree / "benchmarks" / "results" / f"{args.bench}.json").read_text())
                shutil.copy(tree / "benchmarks" / "results" / f"{args.bench}.json",
                            keep / f"{args.bench}-{version}-{r}.json")
                runs[version].append(result)
                print(f"round {r} {version}: {time.time() - t0:.0f} s", flush=True)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    pattern = re.compile(args.metric)
    per = {v: [medians(res.get("summary", {})) for res in rs] for v, rs in runs.items()}
    paths = sorted(p for p in set().union(*per["old"], *per["new"]) if pattern.search(p))
    rows, table = [], {}
    for p in paths:
        old = [m[p] for m in per["old"] if p in m]
        new = [m[p] for m in per["new"] if p in m]
        if not old or not new:
            continue
        o, n = statistics.median(old), statistics.median(new)
        table[p] = {"old": old, "new": new, "old_median": o, "new_median": n, "new_over_old": n / o if o else None}
        rows.append({"metric": p, "old (median of runs)": f"{o:.4g}", "new": f"{n:.4g}",
                     "new / old": f"{n / o:.3f}" if o else "–", "old runs": ", ".join(f"{x:.4g}" for x in old),
                     "new runs": ", ".join(f"{x:.4g}" for x in new)})
    payload = {"old": args.old, "new": args.new, "bench": args.bench, "bench_args": bench_args,
               "rounds": args.rounds, "metrics": table,
               "commits": {v: subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True,
                                             text=True).stdout.strip() for v, rev in (("old", args.old),
                                                                                      ("new", args.new))}}
    md = [f"`bench_{args.bench}.py {' '.join(bench_args)}`, {args.rounds} runs of each version interleaved "
          f"(old = `{args.old}`, new = `{args.new}`); medians of each run's summary, then the median over runs.",
          "", h.markdown_table(rows) if rows else "(no metric matched)"]
    h.write_results(f"ab_{args.bench}", payload, "\n".join(md) + "\n", title=f"bench_{args.bench}: old against new")


if __name__ == "__main__":
    main()
