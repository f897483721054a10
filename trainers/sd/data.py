"""The data both loaders share: the generated Parquet file, the tokenizer, the augmentation,
the pipeline's CPU stage (:func:`preprocess`) and the torch baseline's Dataset and sampler."""
from __future__ import annotations

import argparse
import os
import tempfile
import zlib
from collections import OrderedDict
from typing import Any, Iterator, Sequence

import numpy as np
import torch

#: Token id of padding (0) and of the start token every caption begins with (1).
PAD, BOS = 0, 1


def dataset_path(args: argparse.Namespace) -> str:
    """The Parquet file, or the folder of WebDataset shards, for these parameters (under ``--data``)."""
    root = args.data or os.path.join(tempfile.gettempdir(), "sbloader-sd-data")
    if getattr(args, "format", "parquet") == "webdataset":
        return os.path.join(root, f"sd-{args.images}-s{args.size}-n{args.samples_per_shard}-seed{args.seed}-wds")
    return os.path.join(root, f"sd-{args.images}-s{args.size}-g{args.rows_per_group}-seed{args.seed}.parquet")


def write_dataset(path: str, args: argparse.Namespace) -> str:
    """Write the generated images + captions once (atomically); later calls reuse the file (or shards).

    Both formats hold the same rows: WebDataset shards as img2dataset lays them out
    (``00000.tar`` with ``<key>.jpg``, ``.txt``, ``.json``), row ``i`` under the key of
    its shard and place in it (:func:`webdataset_id` gives ``i`` back)."""
    from sbloader.datagen import write_image_parquet, write_webdataset_shards

    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    s = args.size
    sizes = dict(min_size=(s * 3 // 2, s * 5 // 4), max_size=(s * 5 // 2, s * 2))
    if getattr(args, "format", "parquet") == "webdataset":
        write_webdataset_shards(tmp, args.images, samples_per_shard=args.samples_per_shard, seed=args.seed, **sizes)
    else:
        write_image_parquet(tmp, args.images, seed=args.seed, captions=True, rows_per_group=args.rows_per_group,
                            **sizes)
    os.replace(tmp, path)
    return path


def webdataset_id(key: str, samples_per_shard: int) -> int:
    """The row number of an img2dataset key (:func:`sbloader.datagen.img2dataset_key`): the
    shard's number times ``samples_per_shard`` plus the place in the shard."""
    from sbloader.datagen import img2dataset_row

    return img2dataset_row(key, samples_per_shard)


def preprocess_webdataset(batch: dict[str, np.ndarray], *, samples_per_shard: int, **kwargs: Any
                          ) -> dict[str, np.ndarray]:
    """:func:`preprocess` for rows of ``read_webdataset(decode=False)``: ``jpg`` bytes are the image,
    ``txt`` the caption, the key gives the row's id."""
    return preprocess({"id": np.array([webdataset_id(str(k), samples_per_shard) for k in batch["__key__"]],
                                      dtype=np.int64),
                       "image": batch["jpg"], "caption": [bytes(t).decode("utf-8") for t in batch["txt"]]},
                      **kwargs)


def tokenize(captions: Sequence[str], max_tokens: int, vocab: int) -> np.ndarray:
    """A hashed word tokenizer: ``[BOS, crc32(word) % (vocab - 2) + 2, ..., PAD...]``.

    Args:
        captions: the texts.
        max_tokens: tokens per caption (longer captions are truncated).
        vocab: vocabulary size (ids ``0..vocab-1``; 0 pads, 1 starts).

    Returns:
        ``(len(captions), max_tokens)`` int64 ids.
    """
    out = np.full((len(captions), max_tokens), PAD, dtype=np.int64)
    for i, text in enumerate(captions):
        words = str(text).lower().split()[: max_tokens - 1]
        out[i, 0] = BOS
        for j, w in enumerate(words, start=1):
            out[i, j] = 2 + zlib.crc32(w.encode("utf-8")) % (vocab - 2)
    return out


def resize_crop_flip(data: bytes, size: int, rng: np.random.Generator) -> np.ndarray:
    """Decode a JPEG, resize its shorter side to ``size``, random-crop ``size x size``, flip; CHW uint8."""
    from PIL import Image

    from sbloader.transforms import decode, random_flip, to_chw

    img = decode(data, draft=(size, size))
    w, h = img.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    img = img.resize((nw, nh), Image.BILINEAR)
    left, top = int(rng.integers(0, nw - size + 1)), int(rng.integers(0, nh - size + 1))
    arr = np.asarray(img)[top:top + size, left:left + size]
    return to_chw(random_flip(arr, rng))


def preprocess(batch: dict[str, np.ndarray], *, size: int, max_tokens: int, vocab: int) -> dict[str, np.ndarray]:
    """The pipeline's CPU stage: decode/resize/crop/flip every image and tokenize every caption.

    Randomness comes from ``sbloader.get_context().rng`` (seeded per epoch and
    partition), so a replayed partition gives the same crops.
    """
    import sbloader

    rng = sbloader.get_context().rng
    images = [resize_crop_flip(b, size, rng) for b in batch["image"]]
    return {"id": np.asarray(batch["id"], dtype=np.int64),
            "image": np.stack(images) if images else np.empty((0, 3, size, size), np.uint8),
            "tokens": tokenize(batch["caption"], max_tokens, vocab)}


class ParquetCaptionDataset(torch.utils.data.Dataset):
    """The baseline's map-style dataset: one Parquet row -> augmented image, tokens and id.

    Keys are ``(epoch, index)`` pairs (see :class:`EpochSampler`), so the augmentation of
    a row depends only on ``(seed, epoch, index)``, never on which worker loads it.
    Row groups are read on demand and the last few kept per worker process.

    Args:
        path: the Parquet file.
        size: output side.
        max_tokens: tokens per caption.
        vocab: tokenizer vocabulary.
        seed: augmentation seed.
        cache_row_groups: row groups kept in memory per worker.
    """

    def __init__(self, path: str, size: int, max_tokens: int, vocab: int, seed: int,
                 cache_row_groups: int = 8) -> None:
        import pyarrow.parquet as pq

        md = pq.read_metadata(path)
        sizes = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        self.starts = np.cumsum([0] + sizes)
        self.path, self.size, self.max_tokens, self.vocab, self.seed = path, size, max_tokens, vocab, seed
        self.cache_row_groups = cache_row_groups
        self._file: Any = None
        self._cache: OrderedDict[int, tuple[list, list, list]] = OrderedDict()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _row_group(self, rg: int) -> tuple[list, list, list]:
        if rg in self._cache:
            self._cache.move_to_end(rg)
            return self._cache[rg]
        import pyarrow.parquet as pq

        if self._file is None:  # opened in the process that reads (each worker its own)
            self._file = pq.ParquetFile(self.path)
        t = self._file.read_row_group(rg, columns=["id", "image", "caption"])
        rows = (t.column("id").to_pylist(), t.column("image").to_pylist(), t.column("caption").to_pylist())
        self._cache[rg] = rows
        while len(self._cache) > self.cache_row_groups:
            self._cache.popitem(last=False)
        return rows

    def __getitem__(self, key: Any) -> dict[str, Any]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} rows of {self.path!r}")
        rg = int(np.searchsorted(self.starts, index, side="right") - 1)
        ids, images, captions = self._row_group(rg)
        i = index - int(self.starts[rg])
        rng = np.random.default_rng([self.seed, epoch, index])
        return {"id": int(ids[i]),
                "image": torch.from_numpy(resize_crop_flip(images[i], self.size, rng)),
                "tokens": torch.from_numpy(tokenize([captions[i]], self.max_tokens, self.vocab)[0])}


class EpochSampler(torch.utils.data.Sampler):
    """``DistributedSampler(shuffle=True, drop_last=True)``'s split, yielding ``(epoch, index)`` keys.

    The permutation derives from ``(seed, epoch)``; ``skip`` leaves out the first
    samples of this rank's share (a resumed epoch).

    Args:
        n: dataset length.
        rank: this rank.
        world: number of ranks.
        seed: shuffle seed.
    """

    def __init__(self, n: int, rank: int, world: int, seed: int) -> None:
        self.n, self.rank, self.world, self.seed = n, rank, world, seed
        self.per_rank = n // world
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """The epoch the next iteration yields, leaving out its first ``skip`` samples."""
        self.epoch, self.skip = epoch, skip

    def __iter__(self) -> Iterator[tuple[int, int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=g)[: self.per_rank * self.world].tolist()
        for index in order[self.rank::self.world][self.skip:]:
            yield self.epoch, index

    def __len__(self) -> int:
        return max(0, self.per_rank - self.skip)
