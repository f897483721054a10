"""WebDataset shards for the tests, written by the ``webdataset`` package's own ``TarWriter``,
and the rows ``webdataset``'s own reader gives for them."""
from __future__ import annotations

import io
import os
from typing import Any, Optional

import numpy as np
from PIL import Image

from sbloader.datagen import jpeg_bytes, synthetic_image


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def write_shards(root: str, shards: int = 3, per_shard: int = 7, *, images: bool = True,
                 png_shard: Optional[int] = 1) -> list[str]:
    """``root/train-00000{i}.tar``: per sample ``jpg`` (``png`` in shard ``png_shard``), ``txt``,
    ``cls`` (a unique id: shard * 1000 + index) and ``json``; keys ``s<shard>_<index>``."""
    import webdataset as wds

    os.makedirs(root, exist_ok=True)
    paths = []
    for s in range(shards):
        path = os.path.join(root, f"train-{s:06d}.tar")
        with wds.TarWriter(path) as sink:
            for i in range(per_shard):
                uid = s * 1000 + i
                sample: dict[str, Any] = {"__key__": f"s{s}_{i:03d}", "txt": f"caption {uid}", "cls": uid,
                                          "json": {"id": uid, "tags": ["a", str(i)]}}
                if images:
                    img = synthetic_image(np.random.default_rng(uid), 24 + 4 * (i % 3), 20 + 2 * (i % 2))
                    if s == png_shard:
                        sample["png"] = png_bytes(img)
                    else:
                        sample["jpg"] = jpeg_bytes(img)
                sink.write(sample)
        paths.append(path)
    return paths


def wds_rows(urls: list, decode: bool) -> list[dict]:
    """What ``webdataset.WebDataset`` yields (``.decode("rgb8")`` when ``decode``), in order."""
    import webdataset as wds

    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    if decode:
        ds = ds.decode("rgb8")
    return [{k: v for k, v in row.items() if k != "__local_path__"} for row in ds]


def assert_rows_equal(ours: list[dict], theirs: list[dict]) -> None:
    """Row for row: the same keys, shards and members (``None`` where a sample lacks one)."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a["__key__"] == b["__key__"]
        assert os.path.abspath(a["__url__"]) == os.path.abspath(b["__url__"])
        exts = {k for k in a if not k.startswith("__")}
        assert {k for k in b if not k.startswith("__")} == {k for k in exts if a[k] is not None}
        for k in exts:
            if a[k] is None:
                continue
            if isinstance(b[k], np.ndarray):
                assert a[k].dtype == np.uint8 and a[k].shape == b[k].shape and np.array_equal(a[k], b[k]), \
                    f"{a['__key__']}.{k}"
            else:
                # an int column is int64: its values are NumPy integers
                same_type = isinstance(a[k], type(b[k])) or (type(b[k]) is int and isinstance(a[k], np.integer))
                assert a[k] == b[k] and same_type, f"{a['__key__']}.{k}: {a[k]!r} != {b[k]!r}"


def rows_by_key(ds: Any) -> dict:
    """A WebDataset dataset's rows by ``__key__`` (deterministic order; a key delivered twice fails):
    (shard file name, txt, cls, image bytes)."""
    out = {}
    for r in ds.iter_rows(deterministic=True):
        assert r["__key__"] not in out, f"{r['__key__']} delivered twice"
        out[r["__key__"]] = (os.path.basename(str(r["__url__"])), bytes(r["txt"]), bytes(r["cls"]),
                             bytes(r.get("jpg") or r.get("png")))
    return out
