"""Image transforms in Pillow/NumPy (no torchvision needed), seeded for replay.

Every random choice draws from the ``rng`` passed in — inside a pipeline, pass
``sbloader.get_context().rng`` so a replayed partition reproduces its
augmentations bit for bit.
"""
from __future__ import annotations

import io
import math
from typing import Optional, Union

import numpy as np
from PIL import Image


def decode(data: Union[bytes, np.ndarray], mode: str = "RGB", draft: Optional[tuple[int, int]] = None) -> Image.Image:
    """Decode encoded image bytes with Pillow.

    Args:
        data: the file's bytes.
        mode: the output mode (``"RGB"``...).
        draft: a size hint for JPEG: decode at a reduced scale no smaller than this.
    """
    img = Image.open(io.BytesIO(bytes(data)))
    if draft is not None and img.format == "JPEG":
        img.draft(mode, draft)
    return img.convert(mode) if img.mode != mode else img


def decode_array(data: Union[bytes, np.ndarray], mode: Optional[str] = "RGB") -> np.ndarray:
    """Decode encoded image bytes to an ``HxWxC`` ``uint8`` array, as ``read_images``
    does (``HxWx1`` for ``"L"``): for a Parquet column of encoded images whose
    augmentation works on arrays.

    Most JPEGs are decoded by libjpeg-turbo straight into the array, with the same
    pixels as ``np.asarray(decode(data, mode))`` and less CPU
    (figures: ``benchmarks/results/jpeg.md``); other files with Pillow, where ``"RGB"`` also
    scales 16-bit images to 0..255 instead of clipping them. When the augmentation
    starts from a Pillow image (a crop, a resize), :func:`decode` skips the array.

    Args:
        data: the encoded bytes.
        mode: ``"RGB"``, ``"RGBA"``, ``"L"``, or None to keep the decoded data as is
            (then not always ``uint8``: 16-bit images stay ``uint16``).

    Raises:
        ValueError: another ``mode``.
        PIL.UnidentifiedImageError, OSError: not an image, or a truncated or corrupt one.
        PIL.Image.DecompressionBombError: an image far above Pillow's pixel limit.
    """
    from sbloader.sources.images import _decode_bytes, check_mode

    check_mode(mode)
    return _decode_bytes(data if isinstance(data, bytes) else bytes(data), None, mode)


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator,
                            scale: tuple[float, float] = (0.08, 1.0),
                            ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """The crop box ``(left, top, right, bottom)`` of torchvision's RandomResizedCrop."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            left = int(rng.integers(0, width - w + 1))
            top = int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    # fallback: a centre crop at the clamped aspect ratio
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def random_resized_crop(img: Image.Image, size: int, rng: np.random.Generator,
                        scale: tuple[float, float] = (0.08, 1.0)) -> Image.Image:
    """Crop a random area and aspect ratio, then resize to ``size x size`` (bilinear)."""
    box = random_resized_crop_box(img.width, img.height, rng, scale)
    return img.resize((size, size), Image.BILINEAR, box=box)


def random_flip(arr: np.ndarray, rng: np.random.Generator, p: float = 0.5) -> np.ndarray:
    """Flip an HWC array left-right with probability ``p``."""
    return arr[:, ::-1] if rng.random() < p else arr


def to_chw(arr: np.ndarray) -> np.ndarray:
    """HWC uint8 to contiguous CHW uint8."""
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def decode_crop_flip(data: Union[bytes, np.ndarray], size: int, rng: np.random.Generator) -> np.ndarray:
    """The standard training augmentation: decode, random-resized-crop, flip, CHW uint8."""
    img = decode(data)
    arr = np.asarray(random_resized_crop(img, size, rng))
    return to_chw(random_flip(arr, rng))
