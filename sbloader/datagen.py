"""Generated datasets for demos, tests and benchmarks (no downloads).

Images are smooth random gradients with noise, encoded as JPEG, so decode costs
what real photos of the same size cost. Videos are drifting gradients with a
moving square, encoded with PyAV, so every frame differs from the last. Ids tagged
with the Ray node that made them show where a pipeline ran (node-loss tests).
"""
from __future__ import annotations

import io
import os
import time
from typing import Any, Iterator, Optional

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


_WORDS = ["red", "green", "blue", "cat", "dog", "tree", "house", "sky", "river", "stone", "small", "large"]


def _captioned_images(n: int, seed: int, min_size: tuple[int, int],
                      max_size: tuple[int, int]) -> Iterator[tuple[bytes, str, int, int]]:
    """``(jpeg, caption, width, height)`` per row: the rows :func:`write_image_parquet` and
    :func:`write_webdataset_shards` write (the same for the same arguments)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        w = int(rng.integers(min_size[0], max_size[0] + 1))
        h = int(rng.integers(min_size[1], max_size[1] + 1))
        data = jpeg_bytes(synthetic_image(np.random.default_rng([seed, i]), w, h))
        yield data, " ".join(rng.choice(_WORDS, size=6)), w, h


def write_image_parquet(path: str, n: int, *, seed: int = 0, num_classes: int = 10,
                        rows_per_group: int = 64, captions: bool = False,
                        min_size: tuple[int, int] = (320, 240), max_size: tuple[int, int] = (640, 480)) -> str:
    """Write ``n`` JPEG-encoded images (column ``image``), labels and optional captions to Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    images, texts = [], []
    for data, text, _, _ in _captioned_images(n, seed, min_size, max_size):
        images.append(data)
        texts.append(text)
    cols = {"id": pa.array(np.arange(n, dtype=np.int64)), "image": pa.array(images, pa.binary()),
            "label": pa.array([i % num_classes for i in range(n)], pa.int64())}
    if captions:
        cols["caption"] = pa.array(texts, pa.string())
    pq.write_table(pa.table(cols), path, row_group_size=rows_per_group)
    return path


def img2dataset_key(shard: int, index: int, samples_per_shard: int) -> str:
    """img2dataset's sample key: the shard number in 5 digits, then the index in the shard in
    as many digits as ``samples_per_shard - 1`` needs (``000000000`` with its default 10,000)."""
    digits = len(str(max(1, samples_per_shard - 1)))
    return f"{shard:05d}{index:0{digits}d}"


def img2dataset_row(key: str, samples_per_shard: int) -> int:
    """The row number behind an :func:`img2dataset_key`: shard * ``samples_per_shard`` + place in the shard."""
    digits = len(str(max(1, samples_per_shard - 1)))
    return int(key[:-digits]) * samples_per_shard + int(key[-digits:])


def write_webdataset_shards(root: str, n: int, *, samples_per_shard: int = 10000, seed: int = 0,
                            min_size: tuple[int, int] = (320, 240),
                            max_size: tuple[int, int] = (640, 480)) -> list[str]:
    """Write ``n`` captioned JPEGs as WebDataset shards laid out as img2dataset writes them.

    ``root/00000.tar`` ... each holding per sample ``<key>.jpg``, ``<key>.txt`` (the
    caption) and ``<key>.json`` (img2dataset's metadata: ``key``, ``caption``, ``status``,
    ``width``, ``height``, ``original_width``, ``original_height``, ``url``, ``sha256``...),
    beside it ``00000.parquet`` (the same metadata, one row per sample) and
    ``00000_stats.json``. Keys follow :func:`img2dataset_key`. The images and captions
    are :func:`write_image_parquet`'s for the same ``seed``, sizes and ``n``. Existing
    shards are kept (a second call is cheap: give every set of parameters its own root).

    Returns:
        The shards' paths, in order.
    """
    import hashlib
    import json
    import tarfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(root, exist_ok=True)
    paths: list[str] = []
    rows = _captioned_images(n, seed, min_size, max_size)
    for shard in range(-(-n // samples_per_shard)):
        path = os.path.join(root, f"{shard:05d}.tar")
        count = min(samples_per_shard, n - shard * samples_per_shard)
        paths.append(path)
        if os.path.exists(path):
            for _ in range(count):
                next(rows)
            continue
        metas = []
        tmp = os.path.join(root, f".tmp_{shard:05d}.tar")
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tf:
            for i in range(count):
                data, caption, w, h = next(rows)
                key = img2dataset_key(shard, i, samples_per_shard)
                meta = {"url": f"https://example.invalid/{key}.jpg", "caption": caption, "key": key,
                        "status": "success", "error_message": None, "width": w, "height": h,
                        "original_width": w, "original_height": h, "exif": "{}",
                        "sha256": hashlib.sha256(data).hexdigest()}
                metas.append(meta)
                for ext, payload in (("jpg", data), ("txt", caption.encode()), ("json", json.dumps(meta).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size, info.mtime, info.mode = len(payload), 0, 0o444
                    tf.addfile(info, io.BytesIO(payload))
        pq.write_table(pa.Table.from_pylist(metas), os.path.join(root, f"{shard:05d}.parquet"))
        with open(os.path.join(root, f"{shard:05d}_stats.json"), "w", encoding="utf-8") as f:
            json.dump({"count": count, "successes": count, "failed_to_download": 0, "failed_to_resize": 0,
                       "status_dict": {"success": count}}, f)
        os.replace(tmp, path)
    return paths


def _video_codec(codec: str) -> str:
    import av

    if codec not in av.codecs_available:
        usable = [c for c in ("mpeg4", "libx264", "libopenh264", "mjpeg") if c in av.codecs_available]
        raise ValueError(f"codec {codec!r} is not available in this PyAV build; use one of {usable}")
    return codec


def synthetic_video_frames(frames: int, width: int, height: int, seed: int = 0) -> Iterator[np.ndarray]:
    """The frames :func:`write_video` encodes: ``HxWx3`` ``uint8`` RGB arrays.

    A colour gradient (colours from ``seed``) drifting in a seed-chosen direction,
    a bright square crossing the picture and a fixed low-amplitude texture, so
    every frame differs from the previous one and encodes like real footage.

    Args:
        frames: how many frames.
        width: frame width in pixels.
        height: frame height in pixels.
        seed: picks the colours, the direction of motion and the texture.
    """
    rng = np.random.default_rng(seed)
    colours = rng.uniform(30, 225, size=(3, 3)).astype(np.float32)
    vx, vy = rng.uniform(-4, 4, size=2)
    texture = rng.normal(0, 6, size=(height, width, 1)).astype(np.float32)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    side = max(2, min(width, height) // 4)
    for t in range(frames):
        u = ((xx + vx * t) % width) / width
        v = ((yy + vy * t) % height) / height
        img = (colours[0] * (1 - u)[..., None] * (1 - v)[..., None] + colours[1] * u[..., None]
               + colours[2] * (v * (1 - u))[..., None] + texture)
        x0 = int((t * 3) % max(1, width - side))
        y0 = int((t * 2) % max(1, height - side))
        img[y0:y0 + side, x0:x0 + side] = 240.0
        yield np.clip(img, 0, 255).astype(np.uint8)


def write_video(path: str, frames: int = 48, width: int = 128, height: int = 96, fps: int = 24, seed: int = 0,
                codec: str = "mpeg4", *, gop_size: int = 12, max_b_frames: Optional[int] = None) -> str:
    """Write a small synthetic video with PyAV (see :func:`synthetic_video_frames`).

    The container is picked from the extension (``.mp4``, ``.mkv``, ``.avi``...).

    Args:
        path: the file to write (overwritten).
        frames: how many frames.
        width: frame width (even, for 4:2:0 chroma).
        height: frame height (even).
        fps: frames per second.
        seed: picks the picture (colours, motion, texture).
        codec: an encoder of PyAV's FFmpeg: ``"mpeg4"`` (always there) or
            ``"libx264"`` (when the build has it).
        gop_size: frames between keyframes (small values make seeking matter).
        max_b_frames: B-frames between references (None: the encoder's default;
            B-frames make decode order differ from presentation order).

    Returns:
        ``path``.

    Raises:
        ValueError: an invalid size, frame count or unavailable codec.
    """
    import av

    if frames < 1:
        raise ValueError(f"frames must be >= 1, found {frames!r}")
    if width < 2 or height < 2 or width % 2 or height % 2:
        raise ValueError(f"width and height must be even and >= 2 (4:2:0 chroma), found {width}x{height}")
    if gop_size < 1:
        raise ValueError(f"gop_size must be >= 1, found {gop_size!r}")
    codec = _video_codec(codec)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with av.open(path, "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = gop_size
        if max_b_frames is not None:
            stream.codec_context.max_b_frames = max_b_frames
        if codec == "mpeg4":
            # The encoder's 200 kb/s default smears larger pictures; ~0.2 bit per pixel.
            stream.codec_context.bit_rate = max(200_000, int(0.2 * width * height * fps))
        if codec == "libx264":
            # Keyframes exactly every gop_size frames, so seeking is exercised.
            stream.codec_context.options = {"preset": "veryfast", "sc_threshold": "0",
                                            "keyint_min": str(gop_size)}
        for arr in synthetic_video_frames(frames, width, height, seed):
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_video_folder(root: str, n: int, *, seed: int = 0, **kwargs: Any) -> list[str]:
    """Write ``n`` videos ``root/video_<i>.<ext>`` with :func:`write_video`.

    Existing files are kept, so a second call is cheap: give every set of
    parameters its own ``root``.

    Args:
        root: the folder.
        n: how many videos.
        seed: base seed; video ``i`` gets ``seed * 1_000_003 + i``.
        **kwargs: :func:`write_video`'s arguments (and ``ext``, default ``".mp4"``).

    Returns:
        The paths, in index order.
    """
    ext = kwargs.pop("ext", ".mp4")
    os.makedirs(root, exist_ok=True)
    paths = []
    for i in range(n):
        path = os.path.join(root, f"video_{i:05d}{ext}")
        if not os.path.exists(path):
            tmp = os.path.join(root, f".tmp_video_{i:05d}{ext}")
            write_video(tmp, seed=seed * 1_000_003 + i, **kwargs)
            os.replace(tmp, path)
        paths.append(path)
    return paths


def _ray_node() -> str:
    """The Ray node id of this process, or ``"local"`` in a process that is no Ray worker (the
    trainer's own local worker processes: a drop-in epoch's local start).

    Ray is never imported here: a local worker is forked while the trainer's background
    thread may be importing Ray, and an ``import ray`` in the child then waits for good on
    that module's lock (the fault soak's ``dropin-map-np`` runs: no batch in 300 s)."""
    import sys

    ray = sys.modules.get("ray")
    worker_module = getattr(getattr(ray, "_private", None), "worker", None)
    worker = getattr(worker_module, "global_worker", None)
    if worker is None or getattr(worker, "mode", None) != getattr(worker_module, "WORKER_MODE", 1):
        return "local"
    return ray.get_runtime_context().get_node_id()


class NodeTaggedIds:
    """A map-style dataset that tells where each sample was made, for node-loss tests and benchmarks.

    Sample ``i`` is ``{"id": i, "node": the Ray node id of the process that made it, "x": payload}``
    after ``delay`` seconds. The payload (``payload`` float32 zeros; 4096 by default: 16 KiB) puts a
    batch of 8 over Ray's 100 KiB inline limit, so it lives in its node's object store and is
    lost with that node; ``payload=0`` leaves ``x`` out.
    """

    def __init__(self, n: int, delay: float, payload: int = 4096) -> None:
        self.n, self.delay, self.payload = n, delay, payload

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        time.sleep(self.delay)
        out = {"id": i, "node": _ray_node()}
        if self.payload:
            out["x"] = np.zeros(self.payload, np.float32)
        return out


def node_tag(batch: dict, delay: float, payload: int = 4096) -> dict:
    """The same as a pipeline's map over a batch of ``id``: the making node per row, after ``delay``
    seconds per row, ``payload`` float32 zeros per row as ``x`` (none with ``payload=0``)."""
    n = len(batch["id"])
    time.sleep(delay * n)
    out = {"id": np.asarray(batch["id"]), "node": np.array([_ray_node()] * n)}
    if payload:
        out["x"] = np.zeros((n, payload), np.float32)
    return out
