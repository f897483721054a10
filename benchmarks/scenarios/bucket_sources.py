"""WebDataset shards, Parquet files and videos in a bucket at 0, 20 and 100 ms per request
(the lean S3 server of ``benchmarks/_lean_s3.py``, one bucket per latency) against the
same files on local disk: ``read_webdataset("s3://bucket/{00000..00007}.tar",
decode=False)`` and ``read_parquet("s3://bucket/")`` (row groups by ranged GETs), each
with a ``map_batches`` decoding the JPEGs with a random crop, and ``read_videos(
"s3://bucket/", clip_len=8)``, fed to ``to_dataloader(64, shuffle=True)``. With the
cache (the default: a later epoch reads nothing from the store) and, at 20 ms, without
it. Two epochs per run; the first includes the dataset's creation (listing, indexing,
probing)."""
from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.harness import Outcome, Plan, paired_ratios, run_interleaved

from ._common import DATA, batch_len, time_epoch

ORDER = 52
TITLE = "WebDataset shards, Parquet files and videos in a bucket at 0/20/100 ms per request vs local disk"
PARAMS = {"sources": ["webdataset", "parquet", "videos"], "samples": 2000, "per_file": 250, "videos": 64,
          "latencies_ms": [0, 20, 100], "rounds": 3}
QUICK = {"samples": 512, "per_file": 64, "videos": 24, "latencies_ms": [20], "rounds": 2}


def _names(p: dict) -> list[str]:
    lats = [f"{float(x):g}" for x in p["latencies_ms"]]
    return [n for src in p["sources"] for n in [f"{src} local"] + [f"{src} s3 {ms} ms" for ms in lats]
            + [f"{src} s3 no cache 20 ms"]]


def plan(**p: Any) -> Plan:
    """Per source: local, per-latency with the cache, and 20 ms without it."""
    return Plan(_names(p), p["rounds"], {}, f"{p['samples']} samples in files of {p['per_file']}, "
                f"{p['videos']} videos of 48 frames")


def decode_jpg_batch(batch: dict) -> dict:
    """The JPEG of each sample (column ``jpg`` or ``image``) decoded with a random crop 224 and flip."""
    import numpy as np

    import sbloader
    from benchmarks import _image_workload as w

    rng = sbloader.get_context().rng
    col = batch["jpg"] if "jpg" in batch else batch["image"]
    return {"image": np.stack([w.T.decode_crop_flip(b, w.SIZE, rng) for b in col])}


def _files(src: str, folder: Path, p: dict) -> tuple[str, Callable]:
    """A source's files written once under ``folder`` (served as the buckets): its path under the folder
    and its reader (``uri, **cache arguments -> Dataset``)."""
    import sbloader
    from sbloader import datagen

    n, per = p["samples"], p["per_file"]
    folder.mkdir(parents=True, exist_ok=True)
    if src == "webdataset":
        shards = datagen.write_webdataset_shards(str(DATA / f"wds-{n}-{per}"), n, samples_per_shard=per,
                                                 min_size=(256, 256), max_size=(320, 320))
        for s in shards:
            if not (folder / os.path.basename(s)).exists():
                os.link(s, folder / os.path.basename(s))
        return (f"webdataset/{{00000..{len(shards) - 1:05d}}}.tar",
                lambda u, **c: sbloader.read_webdataset(u, decode=False, **c).map_batches(decode_jpg_batch))
    if src == "parquet":
        for k in range(-(-n // per)):
            if not (folder / f"part-{k:03d}.parquet").exists():
                datagen.write_image_parquet(str(folder / f"part-{k:03d}.parquet"), min(per, n - k * per), seed=k,
                                            min_size=(256, 256), max_size=(320, 320))
        return "parquet/", lambda u, **c: sbloader.read_parquet(u, **c).map_batches(decode_jpg_batch)
    datagen.write_video_folder(str(folder), p["videos"])
    return "videos/", lambda u, **c: sbloader.read_videos(u, clip_len=8, **c)


def run(**p: Any) -> Outcome:
    """Write each source's files once, serve them (one folder, a subfolder per source), interleave."""
    import sbloader

    from ._bucket import Server, store_metrics

    root = DATA / f"bucket-sources-{p['samples']}-{p['per_file']}-{p['videos']}"
    sources = {src: _files(src, root / src, p) for src in p["sources"]}
    lats = sorted({f"{float(x):g}" for x in list(p["latencies_ms"]) + [20]}, key=float)
    srv = Server(root, lats)
    os.environ.update({"AWS_ENDPOINT_URL": srv.endpoint, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    sbloader.init(num_cpus=2)

    def sbl(read: Callable, uri: str, bucket: str = "", cache: bool = True):
        def go() -> dict:
            cache_dir = tempfile.mkdtemp(prefix="sbl-bucket-cache-")
            from sbloader.sources import tar_index
            tar_index._INDEXES.clear()  # index again each run, as a new process would
            # New versions of the objects each run: an index or footer a Ray worker remembers from an
            # earlier run (by URI and version) does not apply, as in a new user's process.
            before = srv.stats(bucket, reset=True, touch=True) if bucket else None
            t0 = time.perf_counter()
            loader = read(uri, cache=cache, cache_dir=cache_dir).to_dataloader(64, shuffle=True)
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

    contenders = {}
    for src, (path, read) in sources.items():
        contenders[f"{src} local"] = sbl(read, str(root / path))
        for ms in lats:
            if float(ms) in [float(x) for x in p["latencies_ms"]]:
                contenders[f"{src} s3 {ms} ms"] = sbl(read, f"s3://{srv.buckets[ms]}/{path}", srv.buckets[ms])
        contenders[f"{src} s3 no cache 20 ms"] = sbl(read, f"s3://{srv.buckets['20']}/{path}", srv.buckets["20"], False)
    try:
        for path, read in sources.values():
            sbl(read, str(root / path))()  # warm-up
        trials = run_interleaved(contenders, p["rounds"])
    finally:
        srv.stop()
    notes = []
    for name in contenders:
        base = name.split(" ")[0] + " local"
        for metric in ("samples_per_s", "cached_samples_per_s") if name != base else ():
            rs = sorted(paired_ratios(trials, metric, name, base))
            if rs:
                notes.append(f"{name} / {base}, {'first' if metric == 'samples_per_s' else 'second'} epoch: "
                             f"median {rs[len(rs) // 2]:.2f}x (min {rs[0]:.2f}, max {rs[-1]:.2f}), paired per round")
    notes.append("the server runs on the same 2 cores (its CPU counts as the run's own; store_cpu_ms_per_req); "
                 "vs: each source against its own local run")
    base = f"{p['sources'][0]} local" if len(p["sources"]) == 1 else None  # else each source's own, in the notes
    return Outcome(trials, "samples_per_s", "samples/s", baseline=base,
                   extra=("cached_samples_per_s", "first_batch_s", "create_s", "store_requests", "store_gets",
                          "store_heads", "store_cpu_ms_per_req", "store_peak_in_flight", "epoch2_gets"), notes=notes)
