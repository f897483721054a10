"""Decode only the part of a JPEG that a crop keeps, scaled in the DCT domain where it can be.

``sbloader.transforms``' random-resized crops call this. libjpeg-turbo (the system's,
through the small C extension ``_jpegwindow``) decodes only the iMCU columns that hold
the window (``jpeg_crop_scanline``), skips the rows above it without their IDCT
(``jpeg_skip_scanlines``; their Huffman data is still read, and a progressive file's
whole coefficient buffer still is) and stops after its last row. When the window is at
least twice the output size in both directions, the IDCT also scales by 1/2, 1/4 or
1/8: the smallest scale that keeps the window at least the output size.

Without DCT scaling (most crops of photos up to twice the output size) the window is
the crop box and one more column each side (libjpeg's smooth chroma upsampling differs
from a whole decode in the first and last column of a cropped row), and torch's
vectorised antialiased bilinear resize (``interpolate(..., antialias=True)`` on
``uint8``, several times faster than Pillow's, within 1 level of it) scales the box's
pixels. With DCT scaling, and for CMYK files, Pillow resizes the (fractional) box out of
the window widened by its filter's support, as after a whole decode. Either way the
pixels differ slightly from the whole decode's: ``tests/unit/test_crop_decode.py`` and
``benchmarks/bench_crop_decode.py`` bound the PSNR.

Every file this cannot take returns None, and the caller decodes it whole with Pillow:
not a JPEG, the extension not built, an image above Pillow's decompression-bomb limit,
and anything libjpeg-turbo rejects or warns about (corrupt, truncated, 12-bit,
arithmetic-coded where unsupported): Pillow then decodes it or raises its own error.
Each such fallback is counted, by reason: :func:`counters` in this process, and in the
pipeline's ``stats()`` (``OperatorStats.full_decodes``) through the task context.
EXIF orientation is not applied, as with the whole decode (and torchvision's ImageFolder).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from PIL import Image

try:  # built by scripts/setup.sh (setup.py build_ext --inplace); optional
    from sbloader.sources import _jpegwindow as _native
except ImportError:  # pragma: no cover - no compiler or no libjpeg headers where it was installed
    _native = None

_SOI = b"\xff\xd8\xff"
#: libjpeg-turbo's fast IDCT scales (1/denom) used here.
SCALES = (8, 4, 2, 1)

_COUNTS: Counter = Counter()


@dataclass(frozen=True)
class JpegHeader:
    """What the window decode needs to know of a JPEG before choosing its crop.

    Attributes:
        width: image width in pixels.
        height: image height in pixels.
        components: 1 (grayscale), 3 (YCbCr or RGB) or 4 (CMYK or YCCK).
    """

    width: int
    height: int
    components: int


def available() -> bool:
    """Whether the window decode can run here (the C extension was built)."""
    return _native is not None


def count(reason: str) -> None:
    """Count one image decoded whole instead of by window, under ``reason``; also in the
    current task's context, so the pipeline's ``stats()`` reports it."""
    _COUNTS[reason] += 1
    from sbloader.core.context import get_context

    ctx = get_context()
    if ctx is not None:
        ctx.full_decodes += 1


def counters() -> dict[str, int]:
    """This process's counts since it started (or :func:`reset_counters`): ``"window"``
    (decoded by window, no DCT scaling), ``"window_scaled"`` (by window with DCT scaling),
    and one ``"full:<reason>"`` entry per reason an image was decoded whole
    (``full:not_jpeg``, ``full:no_extension``, ``full:too_large``, ``full:libjpeg``)."""
    return dict(_COUNTS)


def reset_counters() -> None:
    """Zero this process's :func:`counters`."""
    _COUNTS.clear()


def read_header(data: bytes) -> Optional[JpegHeader]:
    """The header of a JPEG the window decode can take, or None (counted) when the file
    must be decoded whole: not a JPEG, no extension, too large, or a header libjpeg rejects."""
    if data[:3] != _SOI:
        count("full:not_jpeg")
        return None
    if _native is None:
        count("full:no_extension")
        return None
    try:
        width, height, components, _ = _native.header(data)
    except ValueError:
        count("full:libjpeg")
        return None
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and width * height > limit:
        count("full:too_large")  # Pillow warns, or refuses a decompression bomb
        return None
    if components not in (1, 3, 4):
        count("full:libjpeg")
        return None
    return JpegHeader(width, height, components)


def scale_denom(box_w: float, box_h: float, out_w: int, out_h: int) -> int:
    """The DCT scale 1/denom to decode a ``box_w x box_h`` crop resized to ``out_w x out_h``:
    the largest ``denom`` of 1, 2, 4, 8 that keeps the scaled box at least the output size."""
    for d in SCALES:
        if box_w / d >= out_w and box_h / d >= out_h:
            return d
    return 1


def _span(lo: float, hi: float, out: int, limit: int) -> tuple[int, int]:
    """The pixels ``[a, b)`` a bilinear resize of ``[lo, hi)`` to ``out`` pixels reads
    (Pillow's support: the scale, at least 1), plus one pixel each side, in ``[0, limit)``."""
    support = max((hi - lo) / out, 1.0)
    a = max(int(math.floor(lo - support)) - 1, 0)
    b = min(int(math.ceil(hi + support)) + 1, limit)
    return a, b


def _torch_resize() -> Optional[Callable[[np.ndarray, int, int], np.ndarray]]:
    """torch's antialiased bilinear resize of ``uint8`` images (vectorised for channels-last
    RGB: several times faster than Pillow's, within 1 level of it), or None without torch."""
    if not _RESIZE:
        try:
            import torch
            from torch.nn.functional import interpolate
        except Exception:  # pragma: no cover - torch is a dependency; Pillow resizes without it
            _RESIZE.append(None)
        else:
            def resize(arr: np.ndarray, out_w: int, out_h: int) -> np.ndarray:
                x = torch.from_numpy(arr).permute(2, 0, 1).unsqueeze(0)  # NCHW view, channels-last memory
                y = interpolate(x, size=(out_h, out_w), mode="bilinear", antialias=True, align_corners=False)
                return y[0].permute(1, 2, 0).numpy()

            _RESIZE.append(resize)
    return _RESIZE[0]


_RESIZE: list = []


def crop_resize(data: bytes, header: JpegHeader, box: tuple[int, int, int, int],
                out_size: tuple[int, int]) -> Optional[np.ndarray]:
    """The crop ``box`` (``left, top, right, bottom`` in the image) of ``data`` resized to
    ``out_size`` (``(width, height)``, bilinear, antialiased) as an ``HxWx3`` uint8 RGB array,
    decoding only the window around the box; None (counted) if libjpeg rejects the file.

    Without DCT scaling, a colour or grayscale window is cropped to the box and resized by
    torch (the box's own pixels, clamped at its edges); with DCT scaling (a box in fractions
    of the scaled pixels) and for CMYK, Pillow resizes the box out of the window widened by
    its filter's support, as after a whole decode."""
    left, top, right, bottom = box
    out_w, out_h = out_size
    d = scale_denom(right - left, bottom - top, out_w, out_h)
    cmyk = header.components == 4
    resize = _torch_resize() if d == 1 and not cmyk else None
    sw, sh = -(-header.width // d), -(-header.height // d)  # libjpeg's scaled size (rounded up)
    fl, ft, fr, fb = left / d, top / d, right / d, bottom / d
    if resize is not None:  # the box and one more pixel: libjpeg's cropped edge columns
        x0, x1, y0, y1 = max(left - 1, 0), min(right + 1, sw), top, bottom
    else:
        x0, x1 = _span(fl, fr, out_w, sw)
        y0, y1 = _span(ft, fb, out_h, sh)
    try:
        pixels, wx, wy, ww, wh, _ = _native.decode_window(data, x0, y0, x1, y1, d, cmyk)
    except ValueError:
        count("full:libjpeg")
        return None
    _COUNTS["window_scaled" if d > 1 else "window"] += 1
    if resize is not None:
        arr = np.frombuffer(pixels, np.uint8).reshape(wh, ww, 3)
        # a contiguous, writable copy of the box: torch's vectorised path wants channels-last memory
        return resize(np.array(arr[top - wy:bottom - wy, left - wx:right - wx]), out_w, out_h)
    if cmyk:  # Pillow's reading of a CMYK JPEG: Adobe's inverted polarity, then its RGB conversion
        img = Image.frombuffer("CMYK", (ww, wh), pixels, "raw", "CMYK;I", 0, 1).convert("RGB")
    else:
        img = Image.frombuffer("RGB", (ww, wh), pixels, "raw", "RGB", 0, 1)
    return np.asarray(img.resize(out_size, Image.BILINEAR, box=(fl - wx, ft - wy, fr - wx, fb - wy)))
