"""Listing time per 1,000 objects: ``list_uris`` over moto's S3 server on 127.0.0.1 (in this
process, keys put straight into its backend) behind the fault proxy, with 0 and 20 ms
added to every request.

    python3 benchmarks/bench_listing.py --keys 1000,10000
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import _harness as h

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from s3_server import S3Server, s3_environment  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", default="1000,10000")
    ap.add_argument("--latencies", default="0,20")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    counts = [int(x) for x in args.keys.split(",")]
    srv = S3Server.start()
    os.environ.update(s3_environment(srv.endpoint))
    srv.client().create_bucket(Bucket="listing")
    for n in counts:
        srv.put_many("listing", {f"p{n}/{i % 50:02d}/{i:07d}.jpg": b"x" for i in range(n)})
    from sbloader.sources.filesystems import LAST_LISTING, list_uris

    rows = []
    for rnd in range(args.rounds):
        for lat in args.latencies.split(","):
            srv.proxy.latency_s = float(lat) / 1000
            for n in counts:
                load = os.getloadavg()[0]
                srv.proxy.reset_counts()
                assert len(list_uris([f"s3://listing/p{n}/"], (".jpg",), "image")) == n
                rows.append({"round": rnd, "latency_ms": lat, "objects": n, "seconds": LAST_LISTING.seconds,
                             "s_per_1000": LAST_LISTING.seconds_per_1000,
                             "list_requests": srv.proxy.counts[("GET", "list")], "loadavg1": load})
    srv.stop()
    table = []
    for lat in args.latencies.split(","):
        for n in counts:
            rs = [r for r in rows if r["latency_ms"] == lat and r["objects"] == n]
            table.append({"latency ms": lat, "objects": n, "list requests": rs[0]["list_requests"],
                          "s per 1,000 objects": h.fmt_range(h.summarize([r["s_per_1000"] for r in rs]), "{:.3f}")})
    loads = [r["loadavg1"] for r in rows]
    md = (f"`list_uris` of one prefix (50 sub-prefixes) in the driver, {args.rounds} rounds (median (min–max)). "
          f"moto (Python) answers every page of 1,000 keys on the same 2 cores, so most of the time is its own "
          f"XML generation.\n\n" + h.markdown_table(table)
          + f"\n\nMachine load (1-min loadavg): median {h.median(loads):.1f}, max {max(loads):.1f}.\n")
    h.publish("listing", {"rows": rows}, md, title="Listing an S3 prefix (moto on 127.0.0.1)")


if __name__ == "__main__":
    main()
