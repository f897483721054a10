"""Time from ``import sbloader`` to the first batch of a drop-in DataLoader, in a fresh process.

    python3 benchmarks/first_batch.py

Prints one line (the README's first-run figure). Run it with no RAY_ADDRESS: it
measures the embedded Ray's start, as a new user meets it.
"""
import time

t0 = time.perf_counter()
import sbloader  # noqa: E402

t1 = time.perf_counter()
loader = sbloader.DataLoader(list(range(1000)), batch_size=32, shuffle=True, num_workers=2)
next(iter(loader))
t2 = time.perf_counter()
print(f"import {t1 - t0:.2f}s, import->first batch {t2 - t0:.2f}s")
