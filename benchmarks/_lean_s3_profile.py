"""Where a remote epoch's CPU goes: ``read_images`` from the lean S3 server at a given
latency against the same folder on local disk (cold cache, then cached), with the CPU
seconds of every process of the run by class (driver, read/decode workers, raylet,
other Ray daemons, the store) per epoch, and the read stage's counters.

    python benchmarks/_lean_s3_profile.py 600 20 [rounds] [s3|local|both]

Prints one JSON line per epoch. Run it under ``py-spy record --subprocesses`` (or
``py-spy dump`` a worker mid-epoch) for the steps inside each process. It is a
diagnostic, not a scenario: the machine's load is read from ``/proc/stat`` and printed
with each line (``others_share``: the share of the cores taken by processes outside
this run), so a loaded figure says so.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tree_cpu() -> dict:
    """CPU seconds of this process and its descendants, by class."""
    import psutil

    me = psutil.Process()
    out: dict = {}
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if p.pid == me.pid:
            kind = "driver"
        elif "_lean_s3.py" in cmd:
            kind = "store"
        elif "raylet" in cmd:
            kind = "raylet"
        elif "default_worker.py" in cmd or cmd.startswith("ray::"):
            kind = "workers"
        else:
            kind = "ray daemons"
        out[kind] = out.get(kind, 0.0) + t.user + t.system
    return out


def _machine_busy() -> tuple[float, float]:
    with open("/proc/stat") as f:
        v = [float(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)


def main() -> None:
    """Run the epochs named on the command line and print their figures."""
    n, lat = int(sys.argv[1]), sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    which = sys.argv[4] if len(sys.argv) > 4 else "both"
    from benchmarks import _image_workload as w
    from benchmarks.scenarios._bucket import Server, bucket_folder, store_metrics
    from benchmarks.scenarios._common import DATA, batch_len, jpeg_paths, time_epoch

    folder, _ = bucket_folder(jpeg_paths(n), str(DATA / "jpeg"), DATA / f"bucket{n}")
    srv = Server(folder, [lat])
    os.environ.update({"AWS_ENDPOINT_URL": srv.endpoint, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    import sbloader

    sbloader.init(num_cpus=2)
    bucket = srv.buckets[f"{float(lat):g}"]
    try:
        for r in range(-1, rounds):  # round -1 warms Ray's workers up
            for name, src in (("local", str(folder)), ("s3", f"s3://{bucket}/")):
                if which not in ("both", name):
                    continue
                cache = tempfile.mkdtemp(prefix="sbl-profile-cache-")
                before = srv.stats(bucket, reset=True)
                c0, m0, t0 = _tree_cpu(), _machine_busy(), time.perf_counter()
                ds = sbloader.read_images(src, decode=False, cache_dir=cache)
                loader = ds.map_batches(w.sbl_decode_files_window_batch).to_dataloader(w.BATCH, shuffle=True)
                listed = time.perf_counter() - t0
                for epoch in ("first", "cached"):
                    e = time_epoch(lambda: iter(loader), batch_len)
                    c1, m1 = _tree_cpu(), _machine_busy()
                    wall = listed + e["epoch_s"]
                    ours = sum(c1.values()) - sum(c0.values())
                    busy = (m1[0] - m0[0]) / 100.0  # USER_HZ ticks
                    line = {"round": r, "source": name, "epoch": epoch, "images": e["items"],
                            "images_per_s": round(e["items"] / wall, 1), "first_batch_s": round(e["first_batch_s"], 3),
                            "listing_s": round(listed, 3),
                            "cpu_ms_per_image": {k: round(1000 * (c1.get(k, 0) - c0.get(k, 0)) / e["items"], 3)
                                                 for k in sorted(c1)},
                            "others_share": round(max(0.0, busy - ours) / (wall * os.cpu_count()), 2),
                            "counters": loader.stats().operators[0].counters if hasattr(loader, "stats") else {}}
                    if name == "s3":
                        line.update(store_metrics(before, srv.stats(bucket)))
                    if r >= 0:
                        print(json.dumps(line, default=str), flush=True)
                    c0, m0, t0, listed = c1, m1, time.perf_counter(), 0.0
                del loader, ds
                __import__("shutil").rmtree(cache, ignore_errors=True)  # a run's cache holds its whole dataset
    finally:
        srv.stop()
        sbloader.shutdown()


if __name__ == "__main__":
    main()
