"""The crop decode's whole-image fallbacks reach the pipeline's stats() (issue #29)."""
from __future__ import annotations

import numpy as np
from PIL import Image

import sbloader
from sbloader.datagen import synthetic_image


def test_full_decodes_counted_in_stats(ray_session, tmp_path):
    rng = np.random.default_rng(0)
    for i in range(3):
        synthetic_image(rng, 120, 90).save(tmp_path / f"a{i}.jpg", quality=90)
    for i in range(2):
        synthetic_image(rng, 80, 60).save(tmp_path / f"b{i}.png")
    Image.new("L", (64, 48), 128).save(tmp_path / "c_gray.jpg")

    def crop(batch: dict) -> dict:
        rng = sbloader.get_context().rng
        return {"image": np.stack([sbloader.transforms.decode_crop_flip(b, 32, rng) for b in batch["image"]])}

    ds = sbloader.read_images(tmp_path, decode=False, files_per_partition=2).map_batches(crop)
    first = np.concatenate([b["image"] for b in ds.iter_batches(batch_size=6, seed=3, deterministic=True)])
    stats = ds.stats()
    assert first.shape == (6, 3, 32, 32)
    assert stats.full_decodes == 2  # the PNGs (the JPEGs, grayscale included, by window)
    assert [o.full_decodes for o in stats.operators][-1] == 2
    assert stats.to_dict()["full_decodes"] == 2 and "decoded whole" in str(stats)
    again = np.concatenate([b["image"] for b in ds.iter_batches(batch_size=6, seed=3, deterministic=True)])
    assert np.array_equal(first, again)  # the same epoch seed: the same crops, bit for bit
