"""Batches as the training loop receives them: writable (or pinned) tensors, on its device.

One rule for both loaders. A batch arrives as NumPy columns (a native pipeline's
:class:`~sbloader.core.block.Batch`) or as a collated batch whose tensors travel
as NumPy buffers (the drop-in's wire format, :mod:`sbloader.core.wire`). Each
tensor costs at most one copy: a read-only buffer (Ray's object store) is copied
into a writable tensor (into page-locked memory with ``pin``); a writable one (a
shared-memory slot that is this batch's alone, or an array made here) is wrapped
as it is. :class:`DeviceCopy` then moves the batch to the loop's device: on a CUDA
device on a side stream the loop's stream waits for, elsewhere with ``.to``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import numpy as np

from sbloader.core.block import Batch
from sbloader.core.wire import from_wire, tensor_of, tensors, to_device, to_wire


def columns_to_torch(batch: Mapping[str, Any], dtypes: Optional[Mapping[str, Any]] = None,
                     device: Optional[str] = None, zero_copy: bool = False) -> dict[str, Any]:
    """NumPy columns as torch tensors (object and string columns stay as they are).

    Args:
        batch: a batch of NumPy columns.
        dtypes: optional torch dtype per column.
        device: move tensors to this device.
        zero_copy: wrap the (read-only) buffers without copying; otherwise every
            tensor is writable, as torch's DataLoader gives (:func:`~sbloader.core.wire.tensor_of`).
    """
    out: dict[str, Any] = Batch() if isinstance(batch, Batch) else {}
    for k, v in batch.items():
        if isinstance(v, np.ndarray) and v.dtype != object and v.dtype.kind not in "USV":
            t = tensor_of(v, copy=not zero_copy)
            if dtypes and k in dtypes:
                t = t.to(dtypes[k])
            if device is not None:
                t = t.to(device)
            out[k] = t
        else:
            out[k] = v
    if isinstance(batch, Batch):
        out.provenance = batch.provenance
        out.parts = batch.parts
    return out


@dataclass(frozen=True)
class TensorOptions:
    """How a batch becomes the loop's tensors.

    Attributes:
        pin: copy into page-locked memory (the one copy), for a fast device copy.
        zero_copy: wrap read-only buffers without copying (read-only tensors).
        dtypes: (NumPy columns) torch dtype per column.
        collate_fn: (NumPy columns) applied instead of the tensor conversion.
    """

    pin: bool = False
    zero_copy: bool = False
    dtypes: Optional[Mapping[str, Any]] = None
    collate_fn: Optional[Callable[[Any], Any]] = None


def columns_as_tensors(batch: Batch, options: TensorOptions) -> Any:
    """A native pipeline's NumPy batch as the loop receives it (provenance kept)."""
    if options.collate_fn is not None:
        return options.collate_fn(batch)
    out = columns_to_torch(batch, options.dtypes, None, zero_copy=options.zero_copy or options.pin)
    if options.pin:
        prov, parts = batch.provenance, batch.parts
        out = from_wire(to_wire(out), pin=True)
        out.provenance, out.parts = prov, parts
    return out


def wire_as_tensors(wire: Any, options: TensorOptions) -> Any:
    """A drop-in batch from its wire form: writable (or pinned) tensors, its structure kept."""
    return from_wire(wire, pin=options.pin, copy=not options.zero_copy)


def pin_batch(batch: Any) -> Any:
    """A collated batch made in this process, copied into page-locked memory."""
    return from_wire(to_wire(batch), pin=True)


class DeviceCopy:
    """Moves each batch to the loop's device.

    On a CUDA device the copy runs on a side stream and the loop's current stream
    waits for it (each tensor recorded on that stream, so its memory is not reused
    early); on any other device each tensor is moved with ``.to(device)``
    (``non_blocking`` when the batch is pinned).

    Args:
        device: the device, e.g. ``"cuda"`` or ``"cuda:1"``.
        pinned: the batches come in page-locked memory.
    """

    def __init__(self, device: Any, pinned: bool = False) -> None:
        import torch

        self.device = device
        self.pinned = pinned
        cuda = str(device).startswith("cuda") and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(device=device) if cuda else None

    def __call__(self, batch: Any) -> Any:
        import torch

        if self._stream is None:
            out = to_device(batch, self.device, non_blocking=self.pinned)
            if isinstance(batch, Batch) and isinstance(out, dict) and not isinstance(out, Batch):
                out = Batch(out)
            if isinstance(batch, Batch):
                out.provenance, out.parts = batch.provenance, batch.parts
            return out
        with torch.cuda.stream(self._stream):
            moved = to_device(batch, self.device, non_blocking=True)
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._stream)
        for t in tensors(moved):
            t.record_stream(current)
        return moved
