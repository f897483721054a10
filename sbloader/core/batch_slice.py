"""Cutting and joining collated batches along their rows (the split stream's short tail).

A collated batch keeps one row per sample along dimension 0 of every tensor or
array, nested in dicts, lists, tuples and namedtuples. A list or tuple of plain
values (strings, numbers: what ``default_collate`` makes of them) is itself a
column of rows. Anything else cannot be cut: a clear ``TypeError`` names it.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from sbloader.core.block import PADDING_KEY
from sbloader.core.wire import _rebuild

_SCALARS = (str, bytes, int, float, bool, complex, type(None))


def _is_column(x: Any) -> bool:
    """A list or tuple of plain values: one value per row."""
    return isinstance(x, (list, tuple)) and not hasattr(x, "_fields") and all(isinstance(v, _SCALARS) for v in x)


def _refuse(x: Any) -> TypeError:
    return TypeError(
        f"the split of an IterableDataset cannot cut a batch holding a {type(x).__name__} into rows for the "
        "short last batches; collate to tensors, arrays, dicts, lists or tuples, or pass drop_last=True"
    )


def slice_rows(batch: Any, start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` of a collated batch."""
    import torch

    if isinstance(batch, (torch.Tensor, np.ndarray)):
        if batch.ndim == 0:
            raise _refuse(batch)
        return batch[start:stop]
    if isinstance(batch, dict):
        return _rebuild_dict(batch, {k: slice_rows(v, start, stop) for k, v in batch.items()})
    if _is_column(batch):
        return _rebuild(batch, list(batch[start:stop]))
    if isinstance(batch, (list, tuple)):
        return _rebuild(batch, [slice_rows(v, start, stop) for v in batch])
    raise _refuse(batch)


def concat_rows(parts: Sequence[Any]) -> Any:
    """The rows of several batches of one structure, joined in order (always a new batch)."""
    import torch

    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(parts), dim=0)
    if isinstance(first, np.ndarray):
        return np.concatenate(list(parts), axis=0)
    if isinstance(first, dict):
        return _rebuild_dict(first, {k: concat_rows([p[k] for p in parts]) for k in first})
    if _is_column(first):
        return _rebuild(first, [v for p in parts for v in p])
    if isinstance(first, (list, tuple)):
        return _rebuild(first, [concat_rows([p[i] for p in parts]) for i in range(len(first))])
    raise _refuse(first)


def _rebuild_dict(x: dict, out: dict) -> dict:
    try:
        return type(x)(out)
    except TypeError:
        return out


def mark_padding(batch: Any, rows: int, pad: int) -> Any:
    """Add the padding mask (True = repeated row: the last ``pad`` of ``rows``) to a dict batch."""
    import torch

    if not pad or not isinstance(batch, dict):
        return batch
    mask = torch.zeros(rows, dtype=torch.bool)
    mask[rows - pad:] = True
    out = dict(batch)
    out[PADDING_KEY] = mask
    return _rebuild_dict(batch, out)
