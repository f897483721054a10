"""Ready batches on the wire: collated batches with tensors as NumPy buffers.

A worker's ``collate_fn`` output (tensors nested in dicts, lists, tuples,
namedtuples, or custom objects) is sent with every tensor replaced by a
:class:`WireTensor` wrapping its NumPy view, so Ray stores the bytes out of band
and the trainer maps them zero-copy. :func:`from_wire` rebuilds the structure in
the trainer with at most one copy of each tensor's bytes (into pinned memory when
asked, or a plain writable copy; or none for the read-only opt-in).
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np


class WireTensor:
    """A tensor in transit: its NumPy array and original torch dtype name."""

    __slots__ = ("array", "dtype")

    def __init__(self, array: np.ndarray, dtype: str) -> None:
        self.array = array
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return int(self.array.nbytes)

    def __reduce__(self):
        return (WireTensor, (self.array, self.dtype))


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _rebuild(x: Any, items: Any) -> Any:
    if _is_namedtuple(x):
        return type(x)(*items)
    try:
        return type(x)(items)
    except TypeError:  # a container subclass with another constructor
        return list(items) if isinstance(x, list) else tuple(items)


def to_wire(obj: Any) -> Any:
    """Replace every torch tensor in a (nested) batch by a :class:`WireTensor`."""
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.layout != torch.strided or t.is_nested:  # sparse, nested and other layouts: send the tensor as is
            return t
        try:
            arr = t.resolve_conj().resolve_neg().contiguous().numpy()
        except TypeError:  # a dtype NumPy cannot hold (bfloat16...): send the tensor
            return t
        return WireTensor(arr, str(t.dtype))
    if isinstance(obj, dict):
        out = {k: to_wire(v) for k, v in obj.items()}
        try:
            return type(obj)(out)
        except TypeError:
            return out
    if isinstance(obj, (list, tuple)):
        return _rebuild(obj, [to_wire(v) for v in obj])
    return obj


def from_wire(obj: Any, *, pin: bool = False, copy: bool = True) -> Any:
    """Rebuild a batch in the trainer, turning :class:`WireTensor` s into tensors.

    Args:
        obj: the batch as received.
        pin: copy each tensor into page-locked memory (the one copy).
        copy: give writable tensors: one copy of a read-only (object-store) buffer;
            a writable buffer (a shared-memory slot that is this batch's alone) is
            wrapped as it is. False wraps every buffer without copying.
    """
    import torch

    if isinstance(obj, WireTensor):
        arr = obj.array
        if pin:
            t = torch.empty(arr.shape, dtype=_torch_dtype(obj.dtype), pin_memory=True)
            t.numpy()[...] = arr
            return t
        return tensor_of(arr, copy=copy)
    if isinstance(obj, dict):
        out = {k: from_wire(v, pin=pin, copy=copy) for k, v in obj.items()}
        try:
            return type(obj)(out)
        except TypeError:
            return out
    if isinstance(obj, (list, tuple)):
        return _rebuild(obj, [from_wire(v, pin=pin, copy=copy) for v in obj])
    if pin and isinstance(obj, torch.Tensor):
        return obj.pin_memory()
    if copy and isinstance(obj, np.ndarray) and not obj.flags.writeable:
        return obj.copy()  # an array the collate_fn returned: writable, as torch gives it
    return obj


def tensor_of(arr: np.ndarray, *, copy: bool = True) -> Any:
    """A torch tensor over a NumPy array, as a batch hands it to the training loop.

    A writable array (made in this process, or a shared-memory slot's: this batch's
    alone) is wrapped as it is. A read-only one (Ray's object store) is copied once
    into a writable tensor, or wrapped read-only when ``copy`` is False. A
    non-contiguous array (negative strides) is made contiguous first.
    """
    import torch

    if copy and not arr.flags.writeable:
        return torch.from_numpy(np.array(arr, copy=True))
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    if arr.flags.writeable:  # the common case: no warning to silence
        return torch.from_numpy(arr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only only by the caller's choice
        return torch.from_numpy(arr)


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name.replace("torch.", ""))


def to_device(obj: Any, device: Any, non_blocking: bool = True) -> Any:
    """Move every tensor of a nested batch to ``device``."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        out = {k: to_device(v, device, non_blocking) for k, v in obj.items()}
        try:
            return type(obj)(out)
        except TypeError:
            return out
    if isinstance(obj, (list, tuple)):
        return _rebuild(obj, [to_device(v, device, non_blocking) for v in obj])
    return obj


def tensors(obj: Any) -> list:
    """Every tensor in a nested batch."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []
