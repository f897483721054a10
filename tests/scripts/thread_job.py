"""Jobs whose first use of sbloader happens on a thread that then ends (``tests/e2e/test_threads.py``).

Usage: ``thread_job.py SCENARIO``; prints one JSON line.

- ``repro``: the issue's repro, a 2-epoch drop-in whose every epoch runs on a new
  thread, and 4 threads starting their first loader at once (one Ray only).
- ``hold``: starts the embedded Ray from a thread that ends, prints the process's
  descendants, then waits to be killed (the test sends SIGKILL or SIGTERM).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time


def descendants(pid: int) -> dict[int, str]:
    """Every live process below ``pid``: pid -> command name (read from /proc)."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
        names[int(entry)] = name
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out[child] = names[child]
            todo.append(child)
    return out


def in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # reported by the caller
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class Squares:
    """A map-style dataset of 64 items."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        return i * i


def repro() -> dict:
    import sbloader

    def pipeline() -> int:
        ds = sbloader.from_items([{"x": i} for i in range(100)]).map_batches(lambda b: b)
        return sum(len(b["x"]) for b in ds.iter_batches(batch_size=10))

    out: dict = {"thread_rows": in_thread(pipeline)}
    time.sleep(1.0)  # the starting thread is gone; its children got their parent-death signal by now
    out["main_rows"] = pipeline()
    loader = sbloader.DataLoader(Squares(), batch_size=8, shuffle=True, num_workers=2)
    out["epochs"] = [sorted(int(v) for b in in_thread(lambda: list(loader)) for v in b) for _ in range(2)]
    out["gcs_before_threads"] = sum(1 for n in descendants(os.getpid()).values() if n.startswith("gcs_server"))
    return out


def concurrent_first_use() -> dict:
    import sbloader

    results: list = []
    barrier = threading.Barrier(4)

    def first_loader(k: int) -> None:
        barrier.wait()
        ds = sbloader.range(40, num_partitions=4).map_batches(lambda b: {"id": b["id"] + k})
        results.append(sorted(int(v) - k for b in ds.iter_batches(batch_size=8) for v in b["id"]))

    threads = [threading.Thread(target=first_loader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gcs = sum(1 for n in descendants(os.getpid()).values() if n.startswith("gcs_server"))
    return {"results": results, "gcs_servers": gcs}


def hold() -> None:
    import sbloader

    in_thread(lambda: list(sbloader.range(8, num_partitions=2).iter_batches(batch_size=4)))
    time.sleep(0.5)
    print(json.dumps({"pid": os.getpid(), "descendants": descendants(os.getpid())}), flush=True)
    time.sleep(600)


def main() -> None:
    scenario = sys.argv[1]
    if scenario == "hold":
        hold()
        return
    out = {"repro": repro, "concurrent": concurrent_first_use}[scenario]()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
