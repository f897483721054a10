"""Images from a bucket at 0, 20 and 100 ms per request (the lean asyncio S3 server of
``benchmarks/_lean_s3.py`` on 127.0.0.1, one bucket per latency on one endpoint, its CPU
per request reported) against the same files on local disk: sbloader's
``read_images("s3://...")`` with credentials and endpoint from the environment (obstore,
one GET per object, the node-local cache), the same through ``filesystem=S3FileSystem``
(pyarrow's client: HEAD + GET), and torch's DataLoader over a Dataset that gets each
object with boto3 (2 workers). Two epochs per run (a fresh cache directory each run):
the first from the store (the dataset's creation, so the listing, included), the second
from sbloader's cache; the iterator's start-up included; the decode is sbloader's window
crop for every contender."""
from __future__ import annotations

import gc
import os
import tempfile
import time
from typing import Any

from benchmarks.harness import RESULTS_DIR, Outcome, Plan, paired_ratios, run_interleaved

from ._common import DATA, batch_len, jpeg_paths, missing_peers, time_epoch

ORDER = 50
TITLE = "A bucket at 0/20/100 ms per request vs local disk"
PARAMS = {"images": 2000, "latencies_ms": [0, 20, 100], "pyarrow_latencies_ms": [0, 20, 100], "num_workers": 2,
          "rounds": 3}
QUICK = {"images": 384, "latencies_ms": [0, 20], "pyarrow_latencies_ms": [20], "rounds": 3}  # 100 ms: the full run


def _names(p: dict) -> list[str]:
    lats = [f"{float(x):g}" for x in p["latencies_ms"]]
    out = ["sbloader local"] + [f"{c} {ms} ms" for ms in lats for c in ("sbloader s3", "torch+boto3")]
    return out + [f"sbloader s3 pyarrow {float(ms):g} ms" for ms in p["pyarrow_latencies_ms"]]


def plan(**p: Any) -> Plan:
    """Local, per-latency sbloader (obstore and pyarrow clients) and torch+boto3."""
    skipped = missing_peers({"torch+boto3": "boto3"})
    return Plan([n for n in _names(p) if not any(n.startswith(s) for s in skipped)], p["rounds"], skipped,
                f"{p['images']} JPEGs per epoch, 2 epochs per sbloader run")


def run(**p: Any) -> Outcome:
    """Start the server (a child of this process: its CPU counts as ours, and is reported), then interleave."""
    import pyarrow.fs as pafs
    import torch

    import sbloader
    from benchmarks import _image_workload as w

    from ._bucket import Boto3Images, Server, bucket_folder, plot_in_flight, store_metrics

    folder, keys = bucket_folder(jpeg_paths(p["images"]), str(DATA / "jpeg"), DATA / f"bucket{p['images']}")
    lats = sorted({f"{float(x):g}" for x in list(p["latencies_ms"]) + list(p["pyarrow_latencies_ms"])}, key=float)
    srv = Server(folder, lats)
    os.environ.update({"AWS_ENDPOINT_URL": srv.endpoint, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    sbloader.init(num_cpus=2)  # after the environment: Ray's workers inherit the endpoint
    timelines: dict = {}

    def sbl(src: Any, bucket: str = "", fs: Any = None, label: str = ""):
        def go() -> dict:
            cache = tempfile.mkdtemp(prefix="sbl-bucket-cache-")
            before = srv.stats(bucket, reset=True) if bucket else None
            t0 = time.perf_counter()  # the first epoch includes the listing, as a user's does
            loader = (sbloader.read_images(src, decode=False, cache_dir=cache, **({"filesystem": fs} if fs else {}))
                      .map_batches(w.sbl_decode_files_window_batch).to_dataloader(w.BATCH, shuffle=True))
            listed = time.perf_counter() - t0
            r1 = time_epoch(lambda: iter(loader), batch_len)
            after = srv.stats(bucket) if bucket else None
            r2 = time_epoch(lambda: iter(loader), batch_len)
            out = {"images_per_s": r1["items"] / (listed + r1["epoch_s"]), "first_batch_s": listed + r1["first_batch_s"],
                   "cached_images_per_s": r2["items"] / r2["epoch_s"], "listing_s": listed}
            if bucket:
                out.update(store_metrics(before, after), epoch2_gets=srv.stats(bucket)["object_gets"]
                           - after["object_gets"])
                timelines[label] = after["timeline"]
            del loader
            gc.collect()
            __import__("shutil").rmtree(cache, ignore_errors=True)
            return out
        return go

    def tl(ds: Any, bucket: str, label: str):
        def go() -> dict:
            before = srv.stats(bucket, reset=True)
            r = time_epoch(lambda: iter(torch.utils.data.DataLoader(
                ds, batch_size=w.BATCH, shuffle=True, num_workers=p["num_workers"])), batch_len)
            after = srv.stats(bucket)
            timelines[label] = after["timeline"]
            return dict({"images_per_s": r["items"] / r["epoch_s"], "first_batch_s": r["first_batch_s"]},
                        **store_metrics(before, after))
        return go

    contenders = {"sbloader local": sbl(str(folder))}
    skipped = missing_peers({"torch+boto3": "boto3"})
    for ms in lats:
        b = srv.buckets[ms]
        if float(ms) in [float(x) for x in p["latencies_ms"]]:
            contenders[f"sbloader s3 {ms} ms"] = sbl(f"s3://{b}/", b, label=f"sbloader s3 {ms} ms")
            if not skipped:
                contenders[f"torch+boto3 {ms} ms"] = tl(Boto3Images(srv.endpoint, b, keys), b, f"torch+boto3 {ms} ms")
        if float(ms) in [float(x) for x in p["pyarrow_latencies_ms"]]:
            fs = pafs.S3FileSystem(endpoint_override=srv.endpoint, access_key="x", secret_key="x",
                                   region="us-east-1", scheme="http")
            contenders[f"sbloader s3 pyarrow {ms} ms"] = sbl(f"s3://{b}/", b, fs, f"sbloader s3 pyarrow {ms} ms")
    try:
        sbl(str(folder))()  # warm-up: Ray's workers, imports, the page cache
        trials = run_interleaved(contenders, p["rounds"])
    finally:
        srv.stop()
    notes = []
    for name in contenders:
        if name == "sbloader local":
            continue
        for metric, base in (("images_per_s", "sbloader local"), ("cached_images_per_s", "sbloader local")):
            rs = sorted(paired_ratios(trials, metric, name, base))
            if rs and (metric == "images_per_s" or name.startswith("sbloader")):
                notes.append(f"{name} / {base}, {'first' if metric == 'images_per_s' else 'cached'} epoch: median "
                             f"{rs[len(rs) // 2]:.2f}x (min {rs[0]:.2f}, max {rs[-1]:.2f}), paired per round")
    png = plot_in_flight({k: v for k, v in timelines.items() if " 20 ms" in k},
                         RESULTS_DIR / "report" / "bucket_latency_inflight.png",
                         f"requests in flight at the store, 20 ms per request, last round ({p['images']} objects)")
    if png:
        notes.append(f"requests in flight over time (20 ms): {png.relative_to(RESULTS_DIR)}")
    notes.append("the server runs on the same 2 cores (a child of the benchmark: its CPU counts as the run's own; "
                 "column store_cpu_ms_per_req)")
    return Outcome(trials, "images_per_s", "images/s", baseline="sbloader local",
                   extra=("cached_images_per_s", "first_batch_s", "listing_s", "store_cpu_ms_per_req", "store_gets", "store_heads",
                          "store_peak_in_flight", "epoch2_gets"), skipped=skipped, notes=notes)
