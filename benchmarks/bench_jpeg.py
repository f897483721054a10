"""``read_images``' JPEG decode: libjpeg-turbo straight into the array against Pillow.

``read_images(decode=True)`` hands on each image as an ``HxWx3`` ``uint8`` array.
Through Pillow that is a decode into Pillow's image memory (RGB stored as 4 bytes per
pixel) and ``np.asarray``, which packs it into a second buffer. sbloader decodes
most JPEGs with simplejpeg instead (``sbloader/_jpeg.py``): the same libjpeg-turbo
with the same settings, straight into the array, with the same pixels. This times
both on the generated JPEGs of ``bench_images.py`` (2,048 of 320x240 to 640x480,
quality 90) in this process (no Ray, one thread), interleaved per round, and checks
that every image decodes to the same pixels. ``Pillow`` is what ``read_images`` did
before (``Image.open(path)``, ``load``, ``np.asarray``); ``sbloader`` is its decode
now (``sbloader.sources.images._decode``). For scale, the row ``Pillow, decode only`` stops
before the array, and the last column adds the rest of ``bench_images``' workload
(random-resized-crop 224 + flip + CHW on the array, ``_image_workload.crop_flip``).

Run: ``python benchmarks/bench_jpeg.py [--rounds 7] [--images 2048]``.
Writes ``benchmarks/results/jpeg.json`` and ``jpeg.md``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _harness as h  # noqa: E402

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

import _image_workload as w  # noqa: E402


def pillow_array(path: str) -> np.ndarray:
    """``read_images``' decode before the fast path: Pillow, then ``np.asarray``."""
    with Image.open(path) as img:
        img.load()
        return np.asarray(img if img.mode == "RGB" else img.convert("RGB"))


def pillow_decode_only(path: str) -> Any:
    """Pillow's decode alone, no array (the floor of the Pillow path)."""
    with Image.open(path) as img:
        img.load()
        return img.size


def cpu_us_per_image(fn: Callable[[str], Any], paths: list[str]) -> float:
    """Thread CPU µs per image of ``fn`` over ``paths``."""
    t = time.thread_time()
    for p in paths:
        fn(p)
    return (time.thread_time() - t) * 1e6 / len(paths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--out", default="jpeg", help="results name under benchmarks/results/")
    args = ap.parse_args()
    from bench_images import make_data

    from sbloader.sources import jpeg as _jpeg
    from sbloader.sources.images import _decode

    if not _jpeg.available():
        raise SystemExit("simplejpeg is not installed: pip install simplejpeg (a dependency of sbloader)")
    paths, _, _ = make_data(Path("/tmp/sbloader_bench_images"), args.images)
    paths = paths[: args.images]

    def sbl(p: str) -> np.ndarray:
        return _decode(p, None, "RGB")

    same = sum(np.array_equal(sbl(p), pillow_array(p)) for p in paths)  # also warms the page cache
    rng = np.random.default_rng(0)
    contenders: dict[str, Callable[[str], Any]] = {
        "Pillow (decode + np.asarray)": pillow_array,
        "sbloader (simplejpeg)": sbl,
        "Pillow, decode only": pillow_decode_only,
        "Pillow + crop/flip": lambda p: w.crop_flip(pillow_array(p), rng),
        "sbloader + crop/flip": lambda p: w.crop_flip(sbl(p), rng),
    }
    runs: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(args.rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            runs[name].append(cpu_us_per_image(contenders[name], paths))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in runs.items()), flush=True)

    def med(name: str) -> float:
        return statistics.median(runs[name])

    ratios = [a / b for a, b in zip(runs["Pillow (decode + np.asarray)"], runs["sbloader (simplejpeg)"])]
    ratios_full = [a / b for a, b in zip(runs["Pillow + crop/flip"], runs["sbloader + crop/flip"])]
    rows = []
    for name in ("Pillow (decode + np.asarray)", "sbloader (simplejpeg)", "Pillow, decode only"):
        full = {"Pillow (decode + np.asarray)": "Pillow + crop/flip", "sbloader (simplejpeg)": "sbloader + crop/flip"}.get(name)
        rows.append({
            "decode to": name,
            "µs/image": h.fmt_range(h.summarize(runs[name]), "{:.0f}"),
            "with crop/flip µs/image": h.fmt_range(h.summarize(runs[full]), "{:.0f}") if full else "–",
        })
    md = [
        f"{len(paths)} generated JPEGs (320x240 to 640x480, quality 90), decoded to `HxWx3` uint8 in this process, "
        f"one thread; {args.rounds} interleaved rounds, thread CPU µs per image, median (min–max). "
        f"Same pixels: {same} of {len(paths)} images.",
        "",
        h.markdown_table(rows, ["decode to", "µs/image", "with crop/flip µs/image"]),
        "",
        f"Pillow / sbloader, same round: decode {h.fmt_range(h.summarize(ratios), '{:.2f}')}x, "
        f"with the crop/flip {h.fmt_range(h.summarize(ratios_full), '{:.2f}')}x; "
        f"{med('Pillow (decode + np.asarray)') - med('sbloader (simplejpeg)'):.0f} µs less per image (medians).",
    ]
    payload = {
        "images": len(paths), "rounds": args.rounds, "same_pixels": same,
        "cpu_us_per_image": runs, "ratio_decode": ratios, "ratio_with_crop_flip": ratios_full,
    }
    jpath, mpath = h.write_results(args.out, payload, "\n".join(md) + "\n",
                                   title="read_images' JPEG decode: simplejpeg against Pillow")
    print(mpath.read_text())


if __name__ == "__main__":
    main()
