"""100 drop-in loaders with remote workers created, iterated partly or fully and dropped in one process.

The full-size version of ``tests/ray/test_dataloader_contract.py::
test_hundred_loaders_created_iterated_and_dropped_leak_nothing`` (which gives four of its
100 loaders remote workers, to stay fast): here every loader has workers, with and
without ``persistent_workers``, and each is dropped unstarted, after one batch, after
one or two epochs, or after one batch with the loader dropped before its iterator. After
each loader it waits (at most ``--within`` seconds) for the live actors, threads, open
files and this process's shared-memory files to be back at the baseline, and prints one
JSON line per loader; the last line is the summary. Exit status 1 if anything stayed.

Usage: ``PYTHONPATH=.:tests/ray python3 tests/scripts/loader_leaks.py [--loaders 100] [--within 10]``
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ray"))

import sbloader  # noqa: E402
from test_dataloader_contract import Ids, back_to, flat_ids, held  # noqa: E402

CONFIGS = [(1, False), (1, True), (2, False), (2, True)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loaders", type=int, default=100)
    parser.add_argument("--within", type=float, default=10.0)
    args = parser.parse_args()
    sbloader.init(num_cpus=4)
    warm = sbloader.DataLoader(Ids(8), batch_size=2, num_workers=1)
    assert flat_ids(warm) == list(range(8))
    del warm
    gc.collect()
    baseline = back_to(held())
    print(json.dumps({"baseline": baseline}), flush=True)
    left, firsts = [], []
    for k in range(args.loaders + 1):
        workers, persistent = CONFIGS[k % len(CONFIGS)]
        fate = (k // len(CONFIGS)) % 5
        t0 = time.perf_counter()
        lo = sbloader.DataLoader(Ids(12), batch_size=2, num_workers=workers, persistent_workers=persistent)
        it_started = fate in (1, 4) or k == args.loaders  # the 101st loader's first batch is timed too
        it = iter(lo) if it_started else None
        if it is not None:
            next(it)
        first = time.perf_counter() - t0
        for _ in range(fate - 1 if fate in (2, 3) else 0):
            assert sorted(flat_ids(lo)) == list(range(12))
        if fate == 4:
            del lo
        lo = it = None
        t1 = time.perf_counter()
        now = back_to(baseline, args.within)
        row = {"loader": k, "workers": workers, "persistent": persistent, "fate": fate, "held": now,
               "back_s": round(time.perf_counter() - t1, 2), "first_batch_s": round(first, 2) if it_started else None}
        if it_started:
            firsts.append(round(first, 2))
        if any(now[k] > baseline[k] for k in baseline):
            left.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"summary": {"loaders": args.loaders + 1, "left_something": len(left), "baseline": baseline,
                                  "first_batch_s_first_and_last": [firsts[0], firsts[-1]],
                                  "loadavg": os.getloadavg()}}), flush=True)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
