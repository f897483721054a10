"""Listing time per 1,000 objects (ported from ``bench_listing.py``): ``list_uris`` of one
prefix (50 sub-prefixes) over moto's S3 server on 127.0.0.1 (in this process, keys put
straight into its backend) behind the fault proxy of ``tests/s3_server.py``, with 0 and
20 ms added to every request. moto (Python) answers every page of 1,000 keys on the
same cores, so most of the time is its own XML generation."""
from __future__ import annotations

import os
import sys
from typing import Any

from benchmarks.harness import ROOT, Outcome, Plan, run_interleaved

from ._common import missing_peers

ORDER = 210
REPORT = False
TITLE = "Listing an S3 prefix (moto on 127.0.0.1)"
PARAMS = {"keys": [1000, 10000], "latencies_ms": [0, 20], "rounds": 3}
QUICK = {"keys": [1000], "rounds": 3}
NEEDS = {"moto server": "moto"}


def _names(p: dict) -> list[str]:
    return [f"{n} objects, {ms:g} ms" for ms in p["latencies_ms"] for n in p["keys"]]


def plan(**p: Any) -> Plan:
    """One contender per (latency, object count)."""
    return Plan(_names(p), p["rounds"], missing_peers(NEEDS))


def run(**p: Any) -> Outcome:
    """Fill moto once, then list each prefix at each latency per round."""
    sys.path.insert(0, str(ROOT / "tests"))
    from s3_server import S3Server, s3_environment

    srv = S3Server.start()
    os.environ.update(s3_environment(srv.endpoint))
    srv.client().create_bucket(Bucket="listing")
    for n in p["keys"]:
        srv.put_many("listing", {f"p{n}/{i % 50:02d}/{i:07d}.jpg": b"x" for i in range(n)})
    from sbloader.sources.filesystems import LAST_LISTING, list_uris

    def one(n: int, ms: float):
        def go() -> dict:
            srv.proxy.latency_s = ms / 1000
            srv.proxy.reset_counts()
            found = len(list_uris([f"s3://listing/p{n}/"], (".jpg",), "image"))
            if found != n:
                raise AssertionError(f"listed {found} of {n} objects")
            return {"s_per_1000": LAST_LISTING.seconds_per_1000, "seconds": LAST_LISTING.seconds,
                    "list_requests": srv.proxy.counts[("GET", "list")]}
        return go

    try:
        trials = run_interleaved({f"{n} objects, {ms:g} ms": one(n, ms) for ms in p["latencies_ms"]
                                  for n in p["keys"]}, p["rounds"])
    finally:
        srv.stop()
    return Outcome(trials, "s_per_1000", "s per 1,000 objects", higher_is_better=False,
                   extra=("list_requests", "seconds"),
                   notes=["moto runs in this process: its CPU counts as the run's own"])
