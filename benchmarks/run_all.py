"""Regenerate every benchmark: each ``benchmarks/bench_*.py`` in turn, under the shared lock.

    python benchmarks/run_all.py            # full sizes (tens of minutes each on 2 cores)
    python benchmarks/run_all.py --quick    # every script's --quick size
    python benchmarks/run_all.py --only sd,images

Each script runs as ``flock /tmp/sbloader_bench.lock python benchmarks/bench_<name>.py
[--quick]`` (other sessions' benchmark runs wait for the lock, and so does this), its
output streamed here. A failure is reported and the next script runs. At the end a
summary says, per script, its exit status, its time and the files it wrote under
``benchmarks/results/``; the exit status is 1 if any script failed.

With ``--quick``, a script that takes ``--out`` writes ``<name>_quick.*`` so the full
results stay as they are; the others have no such option and overwrite their
results with quick figures (the summary says which; their headers carry the
``--quick`` command).
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
LOCK = "/tmp/sbloader_bench.lock"


def scripts(only: str | None) -> list[Path]:
    found = sorted(HERE.glob("bench_*.py"))
    if only:
        keep = {x.strip().removeprefix("bench_").removesuffix(".py") for x in only.split(",") if x.strip()}
        found = [p for p in found if p.stem.removeprefix("bench_") in keep]
        missing = keep - {p.stem.removeprefix("bench_") for p in found}
        if missing:
            raise SystemExit(f"--only names no benchmarks/bench_<name>.py for {sorted(missing)}")
    return found


def results_state() -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in RESULTS.glob("*") if p.is_file()} if RESULTS.is_dir() else {}


def takes_out(script: Path) -> bool:
    """Whether the script's own options include ``--out`` (from its ``--help``)."""
    try:
        r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and "--out" in r.stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="pass --quick to every script")
    p.add_argument("--only", default=None, help="comma-separated names (sd, images, ...) instead of all")
    p.add_argument("--timeout", type=float, default=None, help="seconds per script, lock wait included (default none)")
    p.add_argument("--lock", default=LOCK, help="the lock file every benchmark run takes")
    args = p.parse_args()
    todo = scripts(args.only)
    env = dict(os.environ)
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    summary = []
    t_all = time.monotonic()
    for script in todo:
        name = script.stem.removeprefix("bench_")
        cmd = ["flock", args.lock, sys.executable, str(script.relative_to(HERE.parent))]
        note = ""
        if args.quick:
            cmd.append("--quick")
            if takes_out(script):
                cmd += ["--out", f"{name}_quick"]
            else:
                note = "no --out: quick figures replace its results"
        print(f"\n=== {name}: {shlex.join(cmd)}", flush=True)
        before = results_state()
        t0 = time.monotonic()
        try:
            rc = subprocess.run(cmd, cwd=HERE.parent, env=env, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc, note = "timeout", f"stopped after {args.timeout:.0f}s"
        except OSError as e:
            rc, note = "error", str(e)
        after = results_state()
        wrote = sorted(f for f, m in after.items() if before.get(f) != m)
        summary.append((name, rc, time.monotonic() - t0, wrote, note))
    print(f"\n=== summary ({'--quick' if args.quick else 'full'}, {time.monotonic() - t_all:.0f}s)")
    failed = 0
    for name, rc, secs, wrote, note in summary:
        ok = rc == 0 and bool(wrote)
        failed += not ok
        status = "ok" if ok else ("FAILED" if rc != 0 else "FAILED (wrote no results)")
        print(f"{status:<26} {name:<14} rc={rc!s:<8} {secs:6.0f}s  wrote: {', '.join(wrote) or '-'}"
              + (f"  [{note}]" if note else ""))
    print(f"{len(summary) - failed} of {len(summary)} wrote results" + (f"; {failed} failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
