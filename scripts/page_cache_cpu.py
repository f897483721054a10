"""The CPU a process spends putting new bytes into the page cache, by the size of each write
(issue #47: why the node-local cache writes a pack in pieces, ``cache_packs.WRITE_CHUNK``).

    python scripts/page_cache_cpu.py [directory=<tmp>] [chunk bytes ...]

Writes packs of 60 objects of 61,000 bytes (the crop workload's JPEGs' size) into new files
that are kept (new page-cache memory, as a cold cache takes), each pack with writes of the
given sizes (default: 64 KiB, 256 KiB, 1 MiB, 4 MiB, the whole pack), and prints the
process's CPU per object. Found with it (2026-12-04, the project's Firecracker VM, kernel
6.18, ext4, free page reporting on): 0.12-0.26 ms an object when a pack is one write (the
page cache takes 2 MiB folios, from memory the host had taken back) against 0.017-0.033 ms
in pieces of 64 KiB to 1 MiB; on tmpfs 0.025 ms whatever the size. The next day, with the
free memory split otherwise (``/proc/buddyinfo``: few free blocks of 256 KiB-2 MiB), pieces of
256 KiB cost 0.29-0.40 ms and of 16-128 KiB 0.018-0.034 ms. Nothing is checked.
"""
from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile
import time

OBJECTS, SIZE, PACKS = 60, 61_000, 30


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def per_object_ms(folder: str, blob: bytes, chunk: int) -> float:
    """CPU milliseconds per object to write :data:`PACKS` new packs in writes of ``chunk`` bytes."""
    view = memoryview(blob)
    c0 = _cpu()
    for _ in range(PACKS):
        fd = os.open(os.path.join(folder, str(time.time_ns())), os.O_WRONLY | os.O_CREAT, 0o644)
        for i in range(0, len(blob), chunk):
            os.write(fd, view[i:i + chunk])
        os.close(fd)
    return 1000 * (_cpu() - c0) / (PACKS * OBJECTS)


def main() -> None:
    """Print one line per write size."""
    where = sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir()
    blob = os.urandom(OBJECTS * SIZE)
    chunks = [int(a) for a in sys.argv[2:]] or [64 << 10, 256 << 10, 1 << 20, 4 << 20, len(blob)]
    folder = tempfile.mkdtemp(prefix="sbl-page-cache-", dir=where)
    try:
        for chunk in chunks + chunks:  # twice: the VM's speed drifts
            print(f"{where}: writes of {chunk:>9,} bytes: {per_object_ms(folder, blob, chunk):.3f} ms CPU per "
                  f"{SIZE:,}-byte object", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
