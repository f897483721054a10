"""Listing one flat prefix of many keys (#47): what ``read_images("s3://bucket/prefix/")``
lists before its plan, against a listing one page after the other as boto3's paginator (what
a torch ``Dataset`` over a bucket lists with) and obstore's own ``list`` do. S3 answers 1,000
keys a request and each page's request needs the last page's continuation token; sbloader
lists the rest of the key space by ranges side by side once the first page is in
(``sbloader/sources/key_ranges.py``). The lean S3 server (``benchmarks/_lean_s3.py``, a
process of its own on the same cores) serves numbered keys (``img_000000.jpg``, ...) at 0,
20 and 100 ms per request. Reported: keys listed per second, the client's CPU per 1,000 keys
(this process), the requests and the store's CPU."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.harness import Outcome, Plan, run_interleaved

from ._common import DATA, missing_peers

ORDER = 215
REPORT = False  # a component figure (the listing before the plan), not a first contact: `report --all`
TITLE = "Listing a flat prefix of 100,000 keys (lean S3 at 0/20/100 ms)"
PARAMS = {"keys": 100_000, "latencies_ms": [0, 20, 100], "rounds": 3}
QUICK = {"keys": 20_000, "latencies_ms": [20]}
LISTERS = ("sbloader", "obstore one stream", "boto3 paginator")
NEEDS = {"obstore": "obstore", "boto3": "boto3"}


def plan(**p: Any) -> Plan:
    """Each lister at each latency."""
    skipped = missing_peers(NEEDS)
    names = [f"{n} {float(ms):g} ms" for ms in p["latencies_ms"] for n in LISTERS
             if not any(n.startswith(s) for s in skipped)]
    return Plan(names, p["rounds"], skipped, f"{p['keys']:,} keys under one prefix")


def _folder(n: int) -> Path:
    """``n`` files of 10 bytes, one folder (written once, then reused)."""
    folder = DATA / f"flat{n}"
    if not (folder / f"img_{n - 1:06d}.jpg").exists():
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            (folder / f"img_{i:06d}.jpg").write_bytes(b"0123456789")
    return folder


def _listers(endpoint: str, bucket: str) -> dict[str, Callable[[], int]]:
    """Each lister: a call that lists the bucket's keys and returns how many."""
    from sbloader.sources.filesystems import list_uris
    from sbloader.sources.listing_pages import PageStream

    out: dict[str, Callable[[], int]] = {
        "sbloader": lambda: len(list_uris([f"s3://{bucket}/"], (".jpg",), "image", on_page=PageStream()))}
    skipped = missing_peers(NEEDS)
    if "obstore" not in skipped:
        import obstore
        from obstore.store import S3Store

        st = S3Store(bucket, endpoint=endpoint, access_key_id="x", secret_access_key="x", region="us-east-1",
                     client_options={"allow_http": True})
        out["obstore one stream"] = lambda: sum(len(page) for page in obstore.list(st, None, chunk_size=1000))
    if "boto3" not in skipped:
        import boto3

        c = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="x", aws_secret_access_key="x",
                         region_name="us-east-1")
        out["boto3 paginator"] = lambda: sum(len(page.get("Contents", ())) for page in
                                             c.get_paginator("list_objects_v2").paginate(Bucket=bucket))
    return out


def run(**p: Any) -> Outcome:
    """Start the server, then list the prefix with each lister in turn, each round."""
    import os

    from ._bucket import Server

    n = int(p["keys"])
    lats = [f"{float(x):g}" for x in p["latencies_ms"]]
    srv = Server(_folder(n), lats)
    os.environ.update({"AWS_ENDPOINT_URL": srv.endpoint, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    contenders = {}
    for ms in lats:
        b = srv.buckets[ms]
        for name, list_all in _listers(srv.endpoint, b).items():
            def go(list_all: Callable = list_all, b: str = b) -> dict:
                before = srv.stats(b, reset=True)
                c0, t0 = time.process_time(), time.perf_counter()
                got = list_all()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                after = srv.stats(b)
                assert got == n, f"listed {got} keys of {n}"
                return {"keys_per_s": n / wall, "listing_s": wall, "client_cpu_ms_per_1000": 1e6 * cpu / n,
                        "requests": after["requests"], "store_cpu_s": after["server_cpu_s"] - before["server_cpu_s"],
                        "store_peak_in_flight": after["peak_in_flight"]}
            contenders[f"{name} {ms} ms"] = go
    try:
        trials = run_interleaved(contenders, p["rounds"])
    finally:
        srv.stop()
    return Outcome(trials, "keys_per_s", "keys/s", extra=("listing_s", "client_cpu_ms_per_1000", "requests",
                                                        "store_cpu_s", "store_peak_in_flight"),
                   skipped=missing_peers(NEEDS),
                   notes=["client CPU is this process's alone; the server runs in a process of its own on the "
                          "same 2 cores", "sbloader: `list_uris` as `read_images(..., cache=False)` lists (the "
                          "names kept as objects, sorted); the peers only count what each page holds"])
