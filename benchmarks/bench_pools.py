"""Actor pools that never starve the stages around them (issue #24), side by side in one run.

The same random-crop-and-flip (``_image_workload.crop_flip``, batches of 64) behind
``read_images`` on generated JPEGs of 320x240 to 640x480, on this machine's CPUs:

- ``function``: ``read_images(folder).map_batches(crop_fn, batch_size=64)`` (the crop
  fuses into the read tasks);
- ``class/default``: ``.map_batches(Crop, batch_size=64)``: the crop in a callable class
  (as a model would be) whose constructor takes ``--build-s`` seconds, default
  concurrency;
- ``class/hand-set``: the same with ``concurrency=1``, what a user had to write;
- ``raydata/function`` and ``raydata/class``: Ray Data's ``read_images`` and
  ``map_batches`` on the same Ray (its class with its default concurrency).

Each round runs every contender in turn (A B C D E, then the next round rotated): a new
loader (``to_dataloader(64, persistent_workers=True)``) for the first epoch (the pools
built), then ``--epochs - 1`` warm epochs on it (the pools kept); then the loader goes
and the next contender starts on a free machine. Ray Data builds its pipeline, actors
included, each epoch (there is no keeping them). The consumer only counts.

Then the cold-start case: 400 rows through ``from_items(...).map_batches(Tagger,
concurrency=(1, 2))`` (``Tagger`` takes 0.5 s to build) on a fresh 2-CPU Ray, against
``(1, 1)``: each in a process of its own, interleaved; wall seconds and actors built.

Targets: class/default >= 0.95x function on warm epochs; its first epoch within the
class's construction time of the function's first epoch; the (1, 2) pipeline
constructing at most 2 actors.

Run: ``python benchmarks/bench_pools.py [--images 2000] [--rounds 3] [--epochs 4]
[--quick]``. Writes ``benchmarks/results/pools.json`` and ``pools.md``.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _harness as h  # noqa: E402

h.ray_worker_env()
import numpy as np  # noqa: E402

import _image_workload as w  # noqa: E402

NAME = "pools"
BATCH = 64
SBL = ("function", "class/default", "class/hand-set")
RAYDATA = ("raydata/function", "raydata/class")


def crop_fn(batch: dict) -> dict:
    """The crop as a function (fused into the read tasks)."""
    return w.sbl_crop_flip_batch(batch)


class Crop:
    """The crop in a callable class whose constructor takes ``build_s`` seconds."""

    def __init__(self, build_s: float = 0.0) -> None:
        time.sleep(build_s)

    def __call__(self, batch: dict) -> dict:
        return w.sbl_crop_flip_batch(batch)


class RdCrop:
    """Ray Data's form of :class:`Crop`."""

    def __init__(self, build_s: float = 0.0) -> None:
        time.sleep(build_s)

    def __call__(self, batch: dict) -> dict:
        return w.rd_crop_flip_batch(batch)


def _pool_stats(stats: Any) -> Optional[dict]:
    if stats is None:
        return None
    for o in stats.operators:
        if o.actors_created or getattr(o, "pool_limit", 0):
            return {k: getattr(o, k, None) for k in ("actors_created", "actors_retired", "actors_lost",
                                                      "pool_limit", "construction_s", "resource_wait_s")}
    return None


def _epoch(make_iter: Any, n: int) -> dict:
    t0 = time.perf_counter()
    first = None
    rows = 0
    for batch in make_iter():
        if first is None:
            first = time.perf_counter() - t0
        rows += len(batch["label"])
    wall = time.perf_counter() - t0
    assert rows == n, f"an epoch gave {rows} rows, not {n}"
    return {"wall_s": wall, "first_batch_s": first, "images_per_s": n / wall}


def run_sbloader(name: str, folder: str, n: int, epochs: int, build_s: float) -> dict:
    import sbloader

    ds = sbloader.read_images(folder)
    if name == "function":
        ds = ds.map_batches(crop_fn, batch_size=BATCH)
    elif name == "class/default":
        ds = ds.map_batches(Crop, batch_size=BATCH, fn_constructor_args=(build_s,))
    else:
        ds = ds.map_batches(Crop, batch_size=BATCH, concurrency=1, fn_constructor_args=(build_s,))
    loader = ds.to_dataloader(BATCH, persistent_workers=True)
    out = {"epochs": []}
    for e in range(epochs):
        rec = _epoch(loader.__iter__, n)
        rec["pool"] = _pool_stats(loader.stats())
        out["epochs"].append(rec)
    del loader
    h.wait_quiet(timeout_s=10)
    return out


def run_raydata(name: str, folder: str, n: int, epochs: int, build_s: float) -> dict:
    import ray

    ds = ray.data.read_images(folder, include_paths=True, mode="RGB")
    if name == "raydata/function":
        ds = ds.map_batches(w.rd_crop_flip_batch, batch_size=BATCH)
    else:
        ds = ds.map_batches(RdCrop, batch_size=BATCH, fn_constructor_args=(build_s,))
    out = {"epochs": []}
    for _ in range(epochs):
        out["epochs"].append(_epoch(lambda: ds.iter_batches(batch_size=BATCH), n))
    h.wait_quiet(timeout_s=10)
    return out


# ----- the cold-start case: one fresh Ray per run ----------------------------------------

class Tagger:
    """A class that takes 0.5 s to build (a tokenizer, a small model)."""

    def __init__(self, built_dir: str) -> None:
        time.sleep(0.5)
        import uuid

        open(os.path.join(built_dir, uuid.uuid4().hex), "w").close()

    def __call__(self, batch: dict) -> dict:
        time.sleep(0.002 * len(batch["id"]))
        batch["tag"] = np.asarray(batch["id"]) * 2
        return batch


def cold_child(bounds: str) -> None:
    """(A process of its own) 400 rows through ``Tagger`` with ``concurrency=bounds`` on a
    fresh 2-CPU Ray; prints one JSON line."""
    import sbloader

    lo, hi = (int(x) for x in bounds.split(","))
    built = tempfile.mkdtemp(prefix="pools-built-")
    t0 = time.perf_counter()
    sbloader.init(num_cpus=2)
    init_s = time.perf_counter() - t0
    ds = sbloader.from_items([{"id": i} for i in range(400)]).map_batches(
        Tagger, batch_size=20, concurrency=(lo, hi), fn_constructor_args=(built,))
    t1 = time.perf_counter()
    ids = sorted(int(r["id"]) for r in ds.iter_rows())
    wall = time.perf_counter() - t1
    assert ids == list(range(400))
    print(json.dumps({"bounds": bounds, "init_s": init_s, "pipeline_s": wall, "built": len(os.listdir(built)),
                      "pool": _pool_stats(ds.stats())}), flush=True)
    sbloader.shutdown()


def run_cold(bounds: str) -> dict:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    proc = subprocess.run([sys.executable, __file__, "--cold-child", bounds], capture_output=True, text=True,
                          timeout=300, env=env)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if not lines:
        raise RuntimeError(f"cold run {bounds} failed:\n{proc.stderr[-2000:]}")
    return lines[0]


def _warm(rec: dict) -> float:
    return float(np.median([e["images_per_s"] for e in rec["epochs"][1:]]))


def summarize(runs: dict, cold: dict, build_s: float) -> tuple[dict, str]:
    rows = []
    summary: dict[str, Any] = {}
    fn_warm = h.median(_warm(r) for r in runs["function"])
    fn_first = h.median(r["epochs"][0]["wall_s"] for r in runs["function"])
    for name, recs in runs.items():
        warm = [_warm(r) for r in recs]
        first = [r["epochs"][0]["wall_s"] for r in recs]
        pools = [r["epochs"][0].get("pool") for r in recs]
        built = [p["actors_created"] for p in pools if p]
        retired = [sum((e.get("pool") or {}).get("actors_retired") or 0 for e in r["epochs"]) for r in recs]
        construction = [p["construction_s"] / max(1, p["actors_created"]) for p in pools
                        if p and p.get("construction_s") is not None]
        s = {"warm_images_per_s": h.summarize(warm), "first_epoch_s": h.summarize(first),
             "warm_x_function": h.median(warm) / fn_warm if fn_warm else None,
             "first_minus_function_s": h.median(first) - fn_first if fn_first else None,
             "actors_built_first_epoch": built, "actors_retired": retired,
             "construction_s_each": h.median(construction) if construction else None}
        summary[name] = s
        rows.append({"contender": name, "warm images/s": h.fmt_range(s["warm_images_per_s"], "{:.0f}"),
                     "x function (warm)": f"{s['warm_x_function']:.3f}" if s["warm_x_function"] else "",
                     "first epoch s": h.fmt_range(s["first_epoch_s"], "{:.2f}"),
                     "first - function's s": f"{s['first_minus_function_s']:+.2f}",
                     "actors built (epoch 1)": ",".join(map(str, built)) or "-",
                     "retired": ",".join(map(str, retired)) if built else "-"})
    cold_rows = []
    for bounds, recs in cold.items():
        s = {"pipeline_s": h.summarize([r["pipeline_s"] for r in recs]), "built": [r["built"] for r in recs],
             "retired": [(r["pool"] or {}).get("actors_retired") for r in recs]}
        summary[f"cold/{bounds}"] = s
        cold_rows.append({"concurrency": f"({bounds})", "pipeline s (fresh Ray)": h.fmt_range(s["pipeline_s"], "{:.2f}"),
                          "actors built": ",".join(map(str, s["built"])),
                          "retired": ",".join(map(str, s["retired"]))})
    md = (h.markdown_table(rows) + "\n\nWarm: the median over epochs 2.. of each run, then the range over runs (median"
          f" [min-max]). The class's constructor sleeps {build_s:g} s (a model's load).\n\n"
          "Cold start: `from_items(400 rows).map_batches(Tagger, batch_size=20, concurrency=...)` on a fresh "
          "2-CPU Ray, a process per run (`Tagger` builds in 0.5 s, 2 ms a row).\n\n" + h.markdown_table(cold_rows))
    dflt = summary["class/default"]
    targets = {
        "class/default warm >= 0.95x function": (dflt["warm_x_function"] or 0) >= 0.95,
        "class/default first epoch within construction time of function's":
            (dflt["first_minus_function_s"] or 0) <= max(build_s, dflt["construction_s_each"] or 0) + 0.05,
        "(1, 2) constructs at most 2 actors": all(b <= 2 for b in summary.get("cold/1,2", {}).get("built", [3])),
    }
    summary["targets"] = targets
    md += "\n\n" + "\n".join(f"- {'met' if ok else 'NOT met'}: {t}" for t, ok in targets.items())
    return summary, md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--build-s", type=float, default=1.0)
    ap.add_argument("--no-raydata", action="store_true")
    ap.add_argument("--quick", action="store_true", help="600 images, 2 rounds, 3 epochs")
    ap.add_argument("--cold-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cold_child:
        cold_child(args.cold_child)
        return
    if args.quick:
        args.images, args.rounds, args.epochs = 600, 2, 3
    import sbloader
    from sbloader.datagen import write_jpeg_folder

    tmp = tempfile.mkdtemp(prefix="bench-pools-")
    folder = os.path.join(tmp, "jpegs")
    write_jpeg_folder(folder, args.images)
    sbloader.init()  # this machine's CPUs: the pool and the reads compete for them
    contenders = {name: (lambda name=name: run_sbloader(name, folder, args.images, args.epochs, args.build_s))
                  for name in SBL}
    if not args.no_raydata:
        import ray.data  # noqa: F401

        contenders.update({name: (lambda name=name: run_raydata(name, folder, args.images, args.epochs,
                                                                 args.build_s)) for name in RAYDATA})
    runs: dict[str, list] = {name: [] for name in contenders}
    names = list(contenders)
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            rec = contenders[name]()
            runs[name].append(rec)
            print(f"round {r} {name}: first {rec['epochs'][0]['wall_s']:.2f}s, warm {_warm(rec):.0f} images/s",
                  flush=True)
    sbloader.shutdown()
    cold: dict[str, list] = {"1,2": [], "1,1": []}
    for r in range(args.rounds):
        for bounds in (("1,2", "1,1") if r % 2 == 0 else ("1,1", "1,2")):
            rec = run_cold(bounds)
            cold[bounds].append(rec)
            print(f"cold {bounds}: {rec['pipeline_s']:.2f}s, built {rec['built']}", flush=True)
    summary, md = summarize(runs, cold, args.build_s)
    load = {"before": load_before, "after": os.getloadavg()[0]}
    md += (f"\nMachine load (1-minute average, 2 cores) before/after: {load['before']:.1f} / {load['after']:.1f}; "
           "other work shared the machine when above ~1: ratios in one run hold better than absolute figures.\n")
    h.publish(NAME, {"args": vars(args), "runs": runs, "cold": cold, "summary": summary, "load": load}, md,
              title="Actor pools: a callable class against a function (issue #24)")


if __name__ == "__main__":
    main()
