"""``read_images``' JPEG decode (ported from ``bench_jpeg.py``): libjpeg-turbo through
simplejpeg straight into the ``HxWx3`` array (``sbloader.sources.images._decode``)
against Pillow's decode + ``np.asarray`` (what ``read_images`` did before), Pillow's
decode alone (its floor), and each followed by the crop workload's random-resized-crop
224 + flip. In this process, one thread, no Ray; thread CPU µs per image over the
generated JPEGs (320x240 to 640x480, quality 90); every image checked for the same pixels."""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from benchmarks.harness import Outcome, Plan, run_interleaved

from ._common import jpeg_paths

ORDER = 200
REPORT = False  # a component figure, not a first contact: `report --all` includes it
TITLE = "read_images' JPEG decode: simplejpeg against Pillow"
PARAMS = {"images": 2048, "rounds": 7}
QUICK = {"images": 256, "rounds": 3}
NAMES = ("Pillow (decode + np.asarray)", "sbloader (simplejpeg)", "Pillow, decode only", "Pillow + crop/flip",
         "sbloader + crop/flip")


def plan(**p: Any) -> Plan:
    """Five decoders, each over every image per round."""
    return Plan(list(NAMES), p["rounds"], notes=f"{p['images']} JPEGs, one thread")


def pillow_array(path: str) -> np.ndarray:
    """``read_images``' decode before the fast path: Pillow, then ``np.asarray``."""
    from PIL import Image

    with Image.open(path) as img:
        img.load()
        return np.asarray(img if img.mode == "RGB" else img.convert("RGB"))


def pillow_decode_only(path: str) -> Any:
    """Pillow's decode alone, no array (the floor of the Pillow path)."""
    from PIL import Image

    with Image.open(path) as img:
        img.load()
        return img.size


def run(**p: Any) -> Outcome:
    """Check the pixels, then time each decoder over all images per round."""
    from benchmarks import _image_workload as w
    from sbloader.sources import jpeg as _jpeg
    from sbloader.sources.images import _decode

    if not _jpeg.available():
        raise SystemExit("simplejpeg is not installed: pip install simplejpeg (a dependency of sbloader)")
    paths = jpeg_paths(p["images"])

    def sbl(path: str) -> np.ndarray:
        return _decode(path, None, "RGB")

    same = sum(np.array_equal(sbl(x), pillow_array(x)) for x in paths)  # also warms the page cache
    rng = np.random.default_rng(0)
    fns: dict[str, Callable[[str], Any]] = dict(zip(NAMES, (
        pillow_array, sbl, pillow_decode_only, lambda x: w.crop_flip(pillow_array(x), rng),
        lambda x: w.crop_flip(sbl(x), rng))))

    def timed(fn: Callable[[str], Any]):
        def go() -> dict:
            t = time.thread_time()
            for x in paths:
                fn(x)
            return {"cpu_us_per_image": (time.thread_time() - t) * 1e6 / len(paths)}
        return go

    trials = run_interleaved({k: timed(f) for k, f in fns.items()}, p["rounds"])
    return Outcome(trials, "cpu_us_per_image", "µs CPU", higher_is_better=False,
                   baseline="Pillow (decode + np.asarray)",
                   notes=[f"same pixels: {same} of {len(paths)} images",
                          "thread CPU time: the machine's load disturbs it less than wall time"],
                   raw={"same_pixels": same, "images": len(paths)})
