"""WebDataset shards in a bucket at 0, 20 and 100 ms per request (the lean S3 server of
``benchmarks/_lean_s3.py``, one bucket per latency) against the same shards on local
disk: ``read_webdataset("s3://bucket/{00000..00007}.tar", decode=False)`` and a
``map_batches`` decoding the JPEGs with a random crop, fed to ``to_dataloader(64,
shuffle=True)``. With the cache (the default: each shard fetched whole into the node's
cache while it is indexed, a later epoch reads nothing from the store) and, at 20 ms,
without it (index by ranged GETs, one ranged GET per partition every epoch). Two
epochs per run; the first includes the dataset's creation (listing and indexing)."""
from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from typing import Any

from benchmarks.harness import Outcome, Plan, paired_ratios, run_interleaved

from ._common import DATA, batch_len, time_epoch

ORDER = 52
TITLE = "WebDataset shards in a bucket at 0/20/100 ms per request vs local disk"
PARAMS = {"samples": 2000, "per_shard": 250, "latencies_ms": [0, 20, 100], "rounds": 3}
QUICK = {"samples": 512, "per_shard": 64, "latencies_ms": [20]}


def plan(**p: Any) -> Plan:
    """Local, per-latency with the cache, and 20 ms without it."""
    lats = [f"{float(x):g}" for x in p["latencies_ms"]]
    names = ["sbloader local"] + [f"sbloader s3 {ms} ms" for ms in lats] + ["sbloader s3 no cache 20 ms"]
    return Plan(names, p["rounds"], {}, f"{p['samples']} samples in shards of {p['per_shard']}")


def decode_jpg_batch(batch: dict) -> dict:
    """The JPEG of each sample decoded with a random crop 224 and flip."""
    import numpy as np

    import sbloader
    from benchmarks import _image_workload as w

    rng = sbloader.get_context().rng
    return {"image": np.stack([w.T.decode_crop_flip(b, w.SIZE, rng) for b in batch["jpg"]])}


def run(**p: Any) -> Outcome:
    """Write the shards once, serve them, interleave."""
    import sbloader
    from sbloader.datagen import write_webdataset_shards

    from ._bucket import Server, store_metrics

    root = DATA / f"wds-{p['samples']}-{p['per_shard']}"
    shards = write_webdataset_shards(str(root), p["samples"], samples_per_shard=p["per_shard"],
                                     min_size=(256, 256), max_size=(320, 320))
    folder = DATA / f"wds-bucket-{p['samples']}-{p['per_shard']}"
    folder.mkdir(parents=True, exist_ok=True)
    for s in shards:
        if not (folder / os.path.basename(s)).exists():
            os.link(s, folder / os.path.basename(s))
    braces = f"{{00000..{len(shards) - 1:05d}}}.tar"
    lats = sorted({f"{float(x):g}" for x in list(p["latencies_ms"]) + [20]}, key=float)
    srv = Server(folder, lats)
    os.environ.update({"AWS_ENDPOINT_URL": srv.endpoint, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    sbloader.init(num_cpus=2)

    def sbl(src: Any, bucket: str = "", cache: bool = True):
        def go() -> dict:
            cache_dir = tempfile.mkdtemp(prefix="sbl-wds-cache-")
            from sbloader.sources import tar_index
            tar_index._INDEXES.clear()  # index again each run, as a new process would
            before = srv.stats(bucket, reset=True) if bucket else None
            t0 = time.perf_counter()
            loader = (sbloader.read_webdataset(src, decode=False, cache=cache, cache_dir=cache_dir)
                      .map_batches(decode_jpg_batch).to_dataloader(64, shuffle=True))
            made = time.perf_counter() - t0
            r1 = time_epoch(lambda: iter(loader), batch_len)
            after = srv.stats(bucket) if bucket else None
            r2 = time_epoch(lambda: iter(loader), batch_len)
            out = {"samples_per_s": r1["items"] / (made + r1["epoch_s"]), "first_batch_s": made + r1["first_batch_s"],
                   "cached_samples_per_s": r2["items"] / r2["epoch_s"], "create_s": made}
            if bucket:
                out.update(store_metrics(before, after), epoch2_gets=srv.stats(bucket)["object_gets"]
                           - after["object_gets"])
            del loader
            gc.collect()
            shutil.rmtree(cache_dir, ignore_errors=True)
            return out
        return go

    contenders = {"sbloader local": sbl(os.path.join(str(folder), braces))}
    for ms in lats:
        if float(ms) in [float(x) for x in p["latencies_ms"]]:
            contenders[f"sbloader s3 {ms} ms"] = sbl(f"s3://{srv.buckets[ms]}/{braces}", srv.buckets[ms])
    contenders["sbloader s3 no cache 20 ms"] = sbl(f"s3://{srv.buckets['20']}/{braces}", srv.buckets["20"], False)
    try:
        sbl(os.path.join(str(folder), braces))()  # warm-up
        trials = run_interleaved(contenders, p["rounds"])
    finally:
        srv.stop()
    notes = []
    for name in list(contenders)[1:]:
        for metric in ("samples_per_s", "cached_samples_per_s"):
            rs = sorted(paired_ratios(trials, metric, name, "sbloader local"))
            if rs:
                notes.append(f"{name} / sbloader local, {'first' if metric == 'samples_per_s' else 'second'} epoch: "
                             f"median {rs[len(rs) // 2]:.2f}x (min {rs[0]:.2f}, max {rs[-1]:.2f}), paired per round")
    notes.append("the server runs on the same 2 cores (its CPU counts as the run's own; store_cpu_ms_per_req)")
    return Outcome(trials, "samples_per_s", "samples/s", baseline="sbloader local",
                   extra=("cached_samples_per_s", "first_batch_s", "create_s", "store_requests", "store_gets",
                          "store_heads", "store_cpu_ms_per_req", "store_peak_in_flight", "epoch2_gets"), notes=notes)
