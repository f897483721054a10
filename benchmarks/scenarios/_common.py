"""What several scenarios share: data written once per machine, peers found without
importing them, epochs timed as a user runs them. Not a scenario (leading underscore)."""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

DATA = Path(os.environ.get("SBLOADER_BENCH_DATA", "/tmp/sbloader_bench_data"))


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_peers(peers: dict[str, str]) -> dict[str, str]:
    """Of ``{contender: module}``, those whose module is not installed -> why, with how to install it."""
    extra = {"ray.data": "pip install 'ray[data]' (the bench extra)", "spdl.io": "pip install spdl (the bench extra) and FFmpeg's libraries: apt-get install libavformat59 libavfilter8 libavdevice59",
             "nvidia.dali": "pip install .[bench-dali]", "tensorflow": "pip install tensorflow-cpu (the bench-tf extra)", "boto3": "pip install boto3 (the bench extra)",
             "moto": "pip install 'moto[server]' (the test extra)"}
    return {name: f"{mod} is not installed ({extra.get(mod, 'pip install ' + mod)})"
            for name, mod in peers.items() if not installed(mod)}


def jpeg_paths(n: int) -> list[str]:
    """``n`` JPEGs of 320x240 to 640x480 in ImageFolder layout (written once, then reused)."""
    from sbloader.datagen import write_jpeg_folder

    return write_jpeg_folder(str(DATA / "jpeg"), n, seed=0)


def time_epoch(make_iter: Callable[[], Iterable[Any]], count: Callable[[Any], int],
               consume: Optional[Callable[[Any], None]] = None) -> dict[str, float]:
    """One epoch as a user runs it: iterator created, first batch, all batches.

    Returns ``first_batch_s`` (iterator creation to first batch), ``epoch_s`` and ``items``.
    """
    t0 = time.perf_counter()
    first, items = None, 0
    for batch in make_iter():
        if first is None:
            first = time.perf_counter() - t0
        items += count(batch)
        if consume is not None:
            consume(batch)
    return {"first_batch_s": first if first is not None else float("nan"),
            "epoch_s": time.perf_counter() - t0, "items": items}


def why(e: BaseException) -> str:
    """An exception in one line for the report: its type and last line (200 characters)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1][:200] if lines else ''}"


def start_peers(makers: dict[str, Callable[..., Any]], skipped: dict[str, str], *args: Any) -> dict[str, Any]:
    """``{name: make(*args)}`` of the makers not in ``skipped``; one that raises (installed but does
    not start here) goes to ``skipped`` with why, as the report says."""
    out = {}
    for name, make in makers.items():
        if name not in skipped:
            try:
                out[name] = make(*args)
            except Exception as e:  # noqa: BLE001 - said in the report
                skipped[name] = why(e)
    return out


def epoch_contenders(epochs: dict[str, Callable[[], Iterable[Any]]], skipped: dict[str, str]) -> dict[str, Any]:
    """A contender per epoch factory, after one warm-up epoch each (start-up, workers, imports; one
    that fails goes to ``skipped``): a run is one epoch, ``images_per_s``, ``first_batch_s``, ``images``."""
    out = {}
    for name, make in epochs.items():
        try:
            time_epoch(make, batch_len)
        except Exception as e:  # noqa: BLE001
            skipped[name] = "warm-up epoch failed: " + why(e)
            continue

        def one(make: Callable[[], Iterable[Any]] = make) -> dict[str, float]:
            r = time_epoch(make, batch_len)
            return {"images_per_s": r["items"] / r["epoch_s"], "first_batch_s": r["first_batch_s"],
                    "images": r["items"]}

        out[name] = one
    return out


def built_epoch(build: Callable[[], Any], count: Callable[[Any], int]) -> dict[str, float]:
    """:func:`time_epoch` of ``iter(build())`` with the build counted (a listing, footers read):
    ``images_per_s`` and ``first_batch_s`` from the build's start, ``build_s`` apart."""
    t0 = time.perf_counter()
    loader = build()
    b = time.perf_counter() - t0
    r = time_epoch(lambda: iter(loader), count)
    del loader
    total = time.perf_counter() - t0
    return {"images_per_s": r["items"] / total, "first_batch_s": b + r["first_batch_s"], "build_s": b,
            "epoch_s": total}


def epochs(make_iter: Callable[[], Iterable[Any]], count: Callable[[Any], int], n: int) -> dict[str, float]:
    """``n`` epochs: the first one's time to first batch apart from the later ones' median,
    and items/s over all epochs."""
    runs = [time_epoch(make_iter, count) for _ in range(n)]
    later = sorted(r["first_batch_s"] for r in runs[1:]) or [float("nan")]
    total = sum(r["epoch_s"] for r in runs)
    return {"items_per_s": sum(r["items"] for r in runs) / total, "first_batch_epoch1_s": runs[0]["first_batch_s"],
            "first_batch_later_s": later[len(later) // 2], "epochs": n}


def batch_len(batch: Any) -> int:
    """Samples in a batch: a dict's first column, a tuple/list's first element, or the batch itself."""
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    elif isinstance(batch, (tuple, list)):
        batch = batch[0]
    return len(batch)
