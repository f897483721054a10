"""Generated datasets for demos, tests and benchmarks (no downloads).

Images are smooth random gradients with noise, encoded as JPEG, so decode costs
what real photos of the same size cost.
"""
from __future__ import annotations

import io
import os
from typing import Optional

import numpy as np
from PIL import Image


def synthetic_image(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A photo-like RGB image: a random colour gradient plus noise."""
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :, None]
    c0, c1, c2 = (rng.uniform(0, 255, size=3).astype(np.float32) for _ in range(3))
    img = c0 * (1 - x) * (1 - y) + c1 * x + c2 * y * (1 - x)
    img = img + rng.normal(0, 12, size=(height, width, 3)).astype(np.float32)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def jpeg_bytes(img: Image.Image, quality: int = 90) -> bytes:
    """Encode an image as JPEG."""
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def write_jpeg_folder(root: str, n: int, *, seed: int = 0, num_classes: int = 10,
                      min_size: tuple[int, int] = (320, 240), max_size: tuple[int, int] = (640, 480)) -> list[str]:
    """Write ``n`` JPEGs in ``root/<class>/<i>.jpg`` (ImageFolder layout); return their paths.

    Existing files are kept, so a second call is cheap.
    """
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        label = i % num_classes
        d = os.path.join(root, f"class_{label:03d}")
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, f"{i:07d}.jpg")
        w = int(rng.integers(min_size[0], max_size[0] + 1))
        h = int(rng.integers(min_size[1], max_size[1] + 1))
        if not os.path.exists(path):
            synthetic_image(np.random.default_rng([seed, i]), w, h).save(path, quality=90)
        paths.append(path)
    return paths


def write_image_parquet(path: str, n: int, *, seed: int = 0, num_classes: int = 10,
                        rows_per_group: int = 64, captions: bool = False,
                        min_size: tuple[int, int] = (320, 240), max_size: tuple[int, int] = (640, 480)) -> str:
    """Write ``n`` JPEG-encoded images (column ``image``), labels and optional captions to Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    images, labels, texts = [], [], []
    words = ["red", "green", "blue", "cat", "dog", "tree", "house", "sky", "river", "stone", "small", "large"]
    for i in range(n):
        w = int(rng.integers(min_size[0], max_size[0] + 1))
        h = int(rng.integers(min_size[1], max_size[1] + 1))
        images.append(jpeg_bytes(synthetic_image(np.random.default_rng([seed, i]), w, h)))
        labels.append(i % num_classes)
        texts.append(" ".join(rng.choice(words, size=6)))
    cols = {"id": pa.array(np.arange(n, dtype=np.int64)), "image": pa.array(images, pa.binary()),
            "label": pa.array(labels, pa.int64())}
    if captions:
        cols["caption"] = pa.array(texts, pa.string())
    pq.write_table(pa.table(cols), path, row_group_size=rows_per_group)
    return path
