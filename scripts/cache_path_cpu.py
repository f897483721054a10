"""The CPU the node-local cache's path costs per object, with no store at all (issue #47).

    python scripts/cache_path_cpu.py [objects=2400] [rounds=3] [get_wait_ms=0] [decode_ms=0.5]

Reads objects as read tasks do (partitions of 60 through :meth:`RemoteFiles.read_many
<sbloader.sources.fetch.RemoteFiles.read_many>`, each naming the next partition to fetch ahead),
but each GET is replaced by a copy of 61,000 bytes from memory (after ``get_wait_ms`` of sleep,
as a round trip would hold the fetch thread) and the reader pauses ``decode_ms`` after each object
(as a decode would, the GIL let go: the next partition's fetch ahead is then done before its read,
as in an epoch), so what is left is the client's own path: ``nocache``
(``cache=False``: the fetch pool, the budgets, the hand-offs) and ``cache`` (a fresh cache
directory: the entries' looks and locks, the packs written and linked, the objects fetched ahead
read back). Prints the process's CPU per object, user and system apart. Found with it
(2026-12-05, the project's Firecracker VM, quiet): nocache 0.033-0.037 ms, cache 0.17-0.18 ms;
with no pause (each read finds the next partition's objects still being fetched ahead) 0.025 and
0.21-0.28 ms (~11 system calls an object, ``strace -f -c``: 4 ``stat``, 2 ``fcntl``, 1.5
``pread``, 1 ``flock``, 1 ``link``, 1 ``writev``, 0.5 ``pwrite``), while writing 61 KB into new
page-cache pages cost 0.018 ms (``scripts/page_cache_cpu.py``) and obstore's GET 0.18-0.26 ms
(``scripts/fetch_cpu.py``). Run it under ``strace -f -c`` for the system calls. Nothing is checked.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SIZE = 61_000


def main() -> None:
    """Print one line per round and mode."""
    args = (sys.argv[1:] + ["2400", "3", "0", "0.5"][len(sys.argv) - 1:])[:4]
    n, rounds, wait_s, pause_s = int(args[0]), int(args[1]), float(args[2]) / 1000, float(args[3]) / 1000
    from fetch_cpu import read_as_tasks

    from sbloader.sources import fetch
    from sbloader.sources.cache import CacheConfig
    from sbloader.sources.fetch import RemoteFiles

    data = os.urandom(SIZE)

    def download(self, uri, size, got) -> bytes:  # a GET's answer: new bytes, after the round trip
        if wait_s:
            time.sleep(wait_s)
        return bytes(data)

    fetch.RemoteFiles._download = download
    uris = [f"s3://bucket/k{i:07d}.jpg" for i in range(n)]
    versions = {u: (SIZE, 1) for u in uris}
    parts = [uris[i:i + 60] for i in range(0, n, 60)]

    for r in range(rounds):
        for mode in ("nocache", "cache"):
            with tempfile.TemporaryDirectory(prefix="sbl-cache-cpu-") as d:
                t0, w0 = os.times(), time.perf_counter()
                size = read_as_tasks(RemoteFiles(cache=CacheConfig(mode == "cache", d), versions=versions), parts,
                                     pause_s)
                t1, wall = os.times(), time.perf_counter() - w0
            user, system = 1000 * (t1.user - t0.user) / n, 1000 * (t1.system - t0.system) / n
            print(f"round {r} {mode:8s} {size / 2**20:6.1f} MiB in {wall:5.2f} s: {user + system:5.3f} ms CPU "
                  f"per object (user {user:5.3f}, system {system:5.3f})", flush=True)


if __name__ == "__main__":
    main()
