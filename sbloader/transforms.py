"""Image transforms in Pillow/NumPy (no torchvision needed), seeded for replay.

Every random choice draws from the ``rng`` passed in — inside a pipeline, pass
``sbloader.get_context().rng`` so a replayed partition reproduces its
augmentations bit for bit.
"""
from __future__ import annotations

import io
import math
import os
from typing import Optional, Sequence, Union

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


def _out_size(size: Union[int, Sequence[int]]) -> tuple[int, int]:
    """``(width, height)`` of torchvision's ``size``: an int (square) or ``(height, width)``."""
    if isinstance(size, (int, np.integer)):
        dims = (int(size), int(size))
    else:
        dims = tuple(int(v) for v in size)
        if len(dims) == 1:
            dims = (dims[0], dims[0])
    if len(dims) != 2 or min(dims) < 1:
        raise ValueError(f"size must be a positive int or (height, width), found {size!r}")
    return dims[1], dims[0]


def decode_random_resized_crop(data: Union[bytes, np.ndarray, str, os.PathLike], size: Union[int, Sequence[int]],
                               rng: np.random.Generator, scale: tuple[float, float] = (0.08, 1.0),
                               ratio: tuple[float, float] = (3 / 4, 4 / 3), exact: bool = False) -> Image.Image:
    """Decode and random-resized-crop in one pass: an RGB image of ``size``.

    The crop is torchvision's ``RandomResizedCrop`` (:func:`random_resized_crop_box`,
    drawn from ``rng`` whatever the path, so a replay is bit-identical), resized
    bilinearly with antialiasing as :func:`random_resized_crop` does. A JPEG is
    decoded only around the crop window, and at 1/2, 1/4 or 1/8 scale in the DCT
    domain when the window is at least twice ``size`` in both directions
    (``sbloader/sources/jpeg_window.py``; without DCT scaling torch's vectorised
    antialiased resize does the resize); anything else (other formats, files
    libjpeg-turbo rejects) is decoded whole with Pillow, as is every file with
    ``exact=True``. The pixels differ slightly from the whole decode's
    (tests/unit/test_crop_decode.py bounds the PSNR).

    Args:
        data: the encoded bytes, or a path to read them from.
        size: the output size: an int (square) or ``(height, width)``.
        rng: the generator the crop is drawn from (``sbloader.get_context().rng``).
        scale: the range of the crop's area, as a fraction of the image's.
        ratio: the range of the crop's aspect ratio (width / height).
        exact: decode the whole image with Pillow (today's pixels, more CPU).

    Raises:
        PIL.UnidentifiedImageError, OSError: not an image, or a truncated or corrupt one.
    """
    return Image.fromarray(_crop_array(data, size, rng, scale, ratio, exact))


def _crop_array(data: Union[bytes, np.ndarray, str, os.PathLike], size: Union[int, Sequence[int]],
                rng: np.random.Generator, scale: tuple[float, float], ratio: tuple[float, float],
                exact: bool) -> np.ndarray:
    """:func:`decode_random_resized_crop` as an ``HxWx3`` uint8 array."""
    from sbloader.sources import jpeg_window

    if isinstance(data, (str, os.PathLike)):
        with open(data, "rb") as f:
            data = f.read()
    elif not isinstance(data, bytes):
        data = bytes(data)
    out = _out_size(size)
    header = None if exact else jpeg_window.read_header(data)
    if header is not None:
        box = random_resized_crop_box(header.width, header.height, rng, scale, ratio)
        arr = jpeg_window.crop_resize(data, header, box, out)
        if arr is not None:
            return arr
        full = decode(data)
    else:
        full = Image.open(io.BytesIO(data))  # the size, for the crop, before the pixels
        box = random_resized_crop_box(full.width, full.height, rng, scale, ratio)
        full = full.convert("RGB") if full.mode != "RGB" else full
    return np.asarray(full.resize(out, Image.BILINEAR, box=box))


class RandomResizedCropDecode:
    """torchvision's ``RandomResizedCrop`` fused with the decode, for a Dataset that
    holds paths or encoded bytes: ``__call__(path_or_bytes)`` returns the crop as an
    RGB ``PIL.Image`` (``to_array=True``: an ``HxWx3`` uint8 array), decoding only
    the window it keeps (see :func:`decode_random_resized_crop`).

    The randomness comes from, in order: the ``rng`` passed to the call; inside an
    sbloader pipeline, ``sbloader.get_context().rng``; else a generator seeded from
    NumPy's global RNG, which sbloader's drop-in seeds per partition and torch's
    DataLoader per worker, so a replay draws the same crops.

    Args:
        size: the output size: an int (square) or ``(height, width)``.
        scale: the range of the crop's area, as a fraction of the image's.
        ratio: the range of the crop's aspect ratio (width / height).
        exact: decode every image whole with Pillow (the pixels of
            ``Image.open(...).convert("RGB")`` cropped and resized; more CPU).
        to_array: return a NumPy array instead of a Pillow image.
    """

    def __init__(self, size: Union[int, Sequence[int]], scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), exact: bool = False, to_array: bool = False) -> None:
        _out_size(size)
        if not (0 < scale[0] <= scale[1]) or not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"scale and ratio must be (low, high) with 0 < low <= high, found {scale!r}, {ratio!r}")
        self.size, self.scale, self.ratio, self.exact, self.to_array = size, tuple(scale), tuple(ratio), exact, to_array

    def __call__(self, data: Union[bytes, np.ndarray, str, os.PathLike],
                 rng: Optional[np.random.Generator] = None) -> Union[Image.Image, np.ndarray]:
        """The random-resized crop of ``data`` (encoded bytes or a path)."""
        if rng is None:
            from sbloader.core.context import get_context

            ctx = get_context()
            rng = ctx.rng if ctx is not None else np.random.default_rng(np.random.randint(0, 2**63 - 1, dtype=np.int64))
        arr = _crop_array(data, self.size, rng, self.scale, self.ratio, self.exact)
        return arr if self.to_array else Image.fromarray(arr)

    def __repr__(self) -> str:
        return (f"RandomResizedCropDecode(size={self.size!r}, scale={self.scale!r}, ratio={self.ratio!r}, "
                f"exact={self.exact!r})")


def random_flip(arr: np.ndarray, rng: np.random.Generator, p: float = 0.5) -> np.ndarray:
    """Flip an HWC array left-right with probability ``p``."""
    return arr[:, ::-1] if rng.random() < p else arr


def to_chw(arr: np.ndarray) -> np.ndarray:
    """HWC uint8 to contiguous CHW uint8."""
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def decode_crop_flip(data: Union[bytes, np.ndarray], size: int, rng: np.random.Generator,
                     exact: bool = False) -> np.ndarray:
    """The standard training augmentation: decode, random-resized-crop, flip, CHW uint8.

    JPEGs are decoded only around the crop (:func:`decode_random_resized_crop`);
    ``exact=True`` decodes every image whole with Pillow, as before that existed. The
    random draws are the same either way: the crop, then the flip.
    """
    if exact:
        img = decode(data)
        arr = np.asarray(random_resized_crop(img, size, rng))
    else:
        arr = _crop_array(data, size, rng, (0.08, 1.0), (3 / 4, 4 / 3), False)
    return to_chw(random_flip(arr, rng))
