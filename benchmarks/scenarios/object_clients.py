"""The object clients sbloader could read a bucket with, side by side: ``obstore`` (what
``read_images("s3://...")`` uses when it is installed) from a thread pool and from its
asyncio interface, pyarrow's ``S3FileSystem`` (what ``filesystem=`` and the fallback
use: HEAD + GET per object) and boto3, each reading the same objects of ~110 KB from
the lean S3 server (``benchmarks/_lean_s3.py``, a process of its own) at 0, 20 and
100 ms per request with 64 requests in flight. Reported: objects/s, the client's CPU
per object (this process only), and the store's requests per object and CPU per
request."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from benchmarks.harness import Outcome, Plan, run_interleaved

from ._common import DATA, jpeg_paths, missing_peers

ORDER = 51
REPORT = False  # a component figure (which client the hot path uses), not a first contact: `report --all`
TITLE = "Object clients at 0/20/100 ms per request (the hot-path choice)"
PARAMS = {"objects": 1000, "latencies_ms": [0, 20, 100], "in_flight": 64, "rounds": 3}
QUICK = {"objects": 384, "latencies_ms": [20]}
CLIENTS = ("obstore threads", "obstore asyncio", "pyarrow", "boto3")


def plan(**p: Any) -> Plan:
    """Each client at each latency."""
    skipped = missing_peers({"obstore": "obstore", "boto3": "boto3"})
    names = [f"{c} {float(ms):g} ms" for ms in p["latencies_ms"] for c in CLIENTS
             if not any(c.startswith(s) for s in skipped)]
    return Plan(names, p["rounds"], skipped, f"{p['objects']} objects per run, {p['in_flight']} in flight")


def _readers(endpoint: str, bucket: str, n: int) -> dict[str, Callable[[list[str]], list]]:
    out: dict[str, Callable[[list[str]], list]] = {}
    installed = missing_peers({"obstore": "obstore", "boto3": "boto3"})
    if "obstore" not in installed:
        import obstore
        from obstore.store import S3Store

        st = S3Store(bucket, endpoint=endpoint, access_key_id="x", secret_access_key="x", region="us-east-1",
                     client_options={"allow_http": True, "pool_max_idle_per_host": "256"})
        out["obstore threads"] = lambda keys: _threads(lambda k: obstore.get(st, k).bytes().to_bytes(), keys, n)

        async def _gather(keys: list[str]) -> list:
            sem = asyncio.Semaphore(n)

            async def one(k: str) -> bytes:
                async with sem:
                    return (await (await obstore.get_async(st, k)).bytes_async()).to_bytes()
            return await asyncio.gather(*[one(k) for k in keys])
        out["obstore asyncio"] = lambda keys: asyncio.run(_gather(keys))
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(endpoint_override=endpoint, access_key="x", secret_key="x", region="us-east-1",
                           scheme="http")

    def pa(k: str) -> bytes:
        with fs.open_input_stream(f"{bucket}/{k}") as f:
            return f.read()
    out["pyarrow"] = lambda keys: _threads(pa, keys, n)
    if "boto3" not in installed:
        import boto3
        import botocore.config

        c = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="x", aws_secret_access_key="x",
                         region_name="us-east-1", config=botocore.config.Config(max_pool_connections=n))
        out["boto3"] = lambda keys: _threads(lambda k: c.get_object(Bucket=bucket, Key=k)["Body"].read(), keys, n)
    return out


def _threads(fn: Callable[[str], bytes], keys: list[str], n: int) -> list:
    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(fn, keys))


def run(**p: Any) -> Outcome:
    """Start the server, then read the objects with each client in turn."""
    from ._bucket import Server, bucket_folder

    folder, keys = bucket_folder(jpeg_paths(p["objects"]), str(DATA / "jpeg"), DATA / f"bucket{p['objects']}")
    lats = [f"{float(x):g}" for x in p["latencies_ms"]]
    srv = Server(folder, lats)
    contenders = {}
    for ms in lats:
        b = srv.buckets[ms]
        for name, read in _readers(srv.endpoint, b, p["in_flight"]).items():
            read(keys[:16])  # warm: connections, imports

            def go(read: Callable = read, b: str = b) -> dict:
                before = srv.stats(b, reset=True)
                c0, t0 = time.process_time(), time.perf_counter()
                got = read(keys)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                after = srv.stats(b)
                assert len(got) == len(keys) and all(got)
                return {"objects_per_s": len(keys) / wall, "client_cpu_ms_per_obj": 1000 * cpu / len(keys),
                        "requests_per_obj": after["requests"] / len(keys),
                        "store_cpu_ms_per_req": 1000 * (after["server_cpu_s"] - before["server_cpu_s"])
                        / max(1, after["requests"]), "store_peak_in_flight": after["peak_in_flight"]}
            contenders[f"{name} {ms} ms"] = go
    try:
        trials = run_interleaved(contenders, p["rounds"])
    finally:
        srv.stop()
    return Outcome(trials, "objects_per_s", "objects/s", extra=("client_cpu_ms_per_obj", "requests_per_obj",
                                                              "store_cpu_ms_per_req", "store_peak_in_flight"),
                   skipped=missing_peers({"obstore": "obstore", "boto3": "boto3"}),
                   notes=["client CPU is this process's alone; the server runs in a process of its own on the "
                          "same 2 cores"])
