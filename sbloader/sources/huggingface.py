"""A Hugging Face ``datasets.Dataset`` as a source (``from_huggingface``): row ranges of its Arrow table.

The dataset object is the read tasks' shared argument, pickled by ``datasets`` itself:
a table memory-mapped from its cache files (``load_dataset``, ``load_from_disk``,
``Dataset.from_file``, anything after ``map``/``filter`` written to the cache) travels
as the files' paths and the operations replayed on them, and every read process
memory-maps the files again; no row passes through the driver. A dataset held in
memory (``Dataset.from_dict``, ``from_pandas`` without a cache) travels once, as its
Arrow table, into Ray's object store.

A partition is a range of the dataset's rows (under ``shuffle=True``, a run of a
permutation of them drawn from the epoch seed, since rows are random access), read
with ``dataset[rows]``, so the dataset's format, feature decoding and ``select`` /
``shuffle`` indices apply exactly as iterating it does. Images decoded by an
``Image`` feature (PIL images) become ``HxWxC`` ``uint8`` arrays.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from sbloader.core.block import Block, to_column
from sbloader.core.plan import cut_members, member_positions, split_rows
from sbloader.sources.base import Partition


class StreamingDatasetError(TypeError):
    """``from_huggingface`` was given a streaming ``IterableDataset``."""


def check_dataset(dataset: Any) -> None:
    """Raise a clear error unless ``dataset`` is a map-style ``datasets.Dataset`` (or alike).

    Raises:
        StreamingDatasetError: an ``IterableDataset`` (``streaming=True``).
        TypeError: a ``DatasetDict``, or anything without ``__getitem__``/``__len__``.
    """
    kind = type(dataset).__name__
    if kind in ("IterableDataset", "IterableDatasetDict"):
        raise StreamingDatasetError(
            f"from_huggingface needs a map-style datasets.Dataset, found a streaming {kind}: it has no random "
            f"access, so its rows cannot be cut into partitions that replay exactly after a resume. Load it "
            f"without streaming=True (load_dataset downloads it once and memory-maps it), or write it to "
            f"Parquet or WebDataset shards and use read_parquet / read_webdataset")
    if kind == "DatasetDict" or (isinstance(dataset, dict) and not hasattr(dataset, "__len__")):
        splits = list(dataset.keys()) if hasattr(dataset, "keys") else []
        raise TypeError(f"from_huggingface needs one split, found a {kind} with splits {splits}; "
                        f"pass one of them, e.g. from_huggingface(ds[{(splits or ['train'])[0]!r}])")
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(f"from_huggingface needs a datasets.Dataset (Arrow-backed, random access), found {kind}")


def _as_value(v: Any) -> Any:
    """A PIL image (an ``Image`` feature's decoding) as an ``HxWxC`` ``uint8`` array; anything else as is."""
    if hasattr(v, "getbands") and hasattr(v, "size") and hasattr(v, "mode"):  # PIL.Image.Image
        arr = np.asarray(v)
        return np.ascontiguousarray(arr[:, :, None] if arr.ndim == 2 else arr)
    return v


def _column(values: Any) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values
    if hasattr(values, "detach") and hasattr(values, "numpy"):  # torch format
        return values.detach().cpu().numpy()
    return to_column([_as_value(v) for v in values])


def _read_rows(shared: Any, partition: Partition) -> Block:
    """Rows of one partition, read with ``dataset[rows]`` (the dataset's format and decoding)."""
    rows = partition.payload
    key = slice(*rows) if isinstance(rows, tuple) else [int(i) for i in rows]
    batch = shared[key]
    return {name: _column(values) for name, values in batch.items()}


class HuggingFaceSource:
    """Rows of a ``datasets.Dataset`` (``from_huggingface``).

    Args:
        dataset: the map-style dataset (one split).
        rows_per_partition: rows per partition.
    """

    name = "HuggingFace"
    shuffle_window = 1  # rows are random access: under shuffle every partition is a uniform sample

    def __init__(self, dataset: Any, rows_per_partition: int) -> None:
        self._ds = dataset
        self._n = len(dataset)
        self._rpp = int(rows_per_partition)
        self._ranges = split_rows(self._n, self._rpp)

    def shared(self) -> Any:
        """The dataset: memory-mapped tables pickle as their cache files' paths."""
        return self._ds

    def partitions(self, epoch: int, epoch_seed: int, shuffle: bool = False) -> list[Partition]:
        """Row ranges (the same every epoch), or under ``shuffle`` runs of a permutation of the rows."""
        if not shuffle:
            return [Partition(i, b - a, (a, b), f"rows [{a}, {b})") for i, (a, b) in enumerate(self._ranges)]
        chunks = cut_members(member_positions(self._n, epoch_seed, True), self._rpp)
        return [Partition(i, len(c), c, f"rows at shuffled places [{i * self._rpp}, {i * self._rpp + len(c)}) "
                          f"of epoch seed {epoch_seed}") for i, c in enumerate(chunks)]

    def reader(self) -> Callable[[Any, Partition], Block]:
        """The module-level read function."""
        return _read_rows

    def num_rows(self) -> Optional[int]:
        """Rows of the dataset."""
        return self._n

    def fingerprint(self) -> dict:
        """Type, rows, partitions, columns and cache files (not ``datasets``' own fingerprint: it is
        random for a dataset built in memory, so a rebuilt one could never resume)."""
        return {"type": self.name, "num_rows": self._n, "num_partitions": len(self._ranges),
                "columns": list(getattr(self._ds, "column_names", None) or []),
                "cache_files": [c.get("filename", "") for c in (getattr(self._ds, "cache_files", None) or [])]}
