"""The CPU a process spends per object on the remote read path, without Ray (issue #47).

    python scripts/fetch_cpu.py [objects=600] [latency_ms=20] [rounds=3]

Serves the crop workload's JPEGs from the lean S3 server (``benchmarks/_lean_s3.py``) at
the given latency and reads them as read tasks would: partitions of 60 through
:meth:`RemoteFiles.read_many <sbloader.sources.fetch.RemoteFiles.read_many>`, each naming the
next partition to fetch ahead. Per round and mode it prints the process's CPU per object,
user and system apart: ``obstore`` (bare ``obstore.get`` from 128 threads: the client's own
floor), ``nocache`` (``cache=False``), ``cache`` (a fresh cache directory: GETs, packs
written, fetched-ahead objects read back) and ``cached`` (every object a hit). The store's
own CPU is in its process and not counted. Found with it (2026-12-04, Firecracker VM, quiet):
obstore 0.25-0.35 ms, nocache 0.32-0.42, cache 0.58-0.82 (system time 0.25-0.45 of it),
cached 0.04: the cache's writes and read-backs cost more than the GET. Run it under
``strace -f -c`` for the system calls behind the difference.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_as_tasks(rf, parts: list, pause_s: float = 0.0) -> int:
    """Read ``parts`` (lists of URIs) through ``rf`` as read tasks do, each naming the next part to
    fetch ahead (:meth:`RemoteFiles.read_many <sbloader.sources.fetch.RemoteFiles.read_many>`), and
    ``pause_s`` after each object (a decode's time, the GIL let go); the bytes read."""
    total = 0
    for i, part in enumerate(parts):
        for _, data in rf.read_many(part, parts[i + 1] if i + 1 < len(parts) else []):
            if pause_s:
                time.sleep(pause_s)
            total += len(data)
    return total


def main() -> None:
    """Print one line per round and mode."""
    n, lat, rounds = (int(a) for a in (sys.argv[1:] + ["600", "20", "3"][len(sys.argv) - 1:])[:3])
    from benchmarks.scenarios._bucket import Server, bucket_folder
    from benchmarks.scenarios._common import DATA, jpeg_paths

    folder, keys = bucket_folder(jpeg_paths(n), str(DATA / "jpeg"), DATA / f"bucket{n}")
    srv = Server(folder, [str(lat)])
    os.environ.update({"AWS_ENDPOINT_URL": srv.endpoint, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    import obstore

    from sbloader.sources.cache import CacheConfig
    from sbloader.sources.fetch import RemoteFiles
    from sbloader.sources.object_client import client_for

    bucket = srv.buckets[f"{float(lat):g}"]
    uris = [f"s3://{bucket}/{k}" for k in keys]
    versions = {u: (os.path.getsize(os.path.join(folder, k)), 1) for u, k in zip(uris, keys)}
    parts = [uris[i:i + 60] for i in range(0, n, 60)]

    def bare() -> int:
        store, _ = client_for(uris[0], None)._store(uris[0])
        with ThreadPoolExecutor(128) as ex:
            return sum(ex.map(lambda k: len(obstore.get(store, k).bytes().to_bytes()), keys))

    def read(cache: CacheConfig) -> int:
        return read_as_tasks(RemoteFiles(cache=cache, versions=versions), parts)

    try:
        for r in range(rounds):
            warm, cold = (tempfile.mkdtemp(prefix="sbl-fetch-cpu-") for _ in range(2))
            read(CacheConfig(True, warm))
            modes = {"obstore": bare, "nocache": lambda: read(CacheConfig(False)),
                     "cache": lambda: read(CacheConfig(True, cold)), "cached": lambda: read(CacheConfig(True, warm))}
            for mode, fn in modes.items():
                t0, w0 = os.times(), time.perf_counter()
                size = fn()
                t1, wall = os.times(), time.perf_counter() - w0
                user, system = 1000 * (t1.user - t0.user) / n, 1000 * (t1.system - t0.system) / n
                print(f"round {r} {mode:8s} {size / 2**20:5.1f} MiB in {wall:5.2f} s: {user + system:5.3f} ms CPU "
                      f"per object (user {user:5.3f}, system {system:5.3f})", flush=True)
            for d in (warm, cold):  # each holds every object: left behind, they fill the page cache
                shutil.rmtree(d, ignore_errors=True)
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
