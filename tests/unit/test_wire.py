"""Ready batches on the wire (sbloader/wire.py): structure, dtypes, copies, buffers."""
from __future__ import annotations

import collections
import pickle
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from sbloader.core.wire import WireTensor, from_wire, tensors, to_device, to_wire


class Pair(NamedTuple):
    image: Any
    label: Any


class Custom:
    """A user batch class that the wire passes through untouched."""

    def __init__(self, x: torch.Tensor, tag: str) -> None:
        self.x, self.tag = x, tag


class TupleWithArgs(tuple):
    """A tuple subclass whose constructor takes two arguments (not an iterable)."""

    def __new__(cls, a, b):
        return super().__new__(cls, (a, b))


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, Custom):
        _assert_same(a.x, b.x)
        assert a.tag == b.tag
    else:
        assert a == b


def _roundtrip(obj: Any, **kw: Any) -> Any:
    """to_wire, pickle with out-of-band buffers (as Ray does), from_wire."""
    bufs: list = []
    data = pickle.dumps(to_wire(obj), protocol=5, buffer_callback=bufs.append)
    return from_wire(pickle.loads(data, buffers=bufs), **kw)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_roundtrip_keeps_dtype_shape_and_values(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 2, generator=g) * 10).to(dtype)
    w = to_wire(x)
    assert isinstance(w, WireTensor)
    assert w.dtype == str(dtype) and w.nbytes == x.numel() * x.element_size()
    _assert_same(from_wire(w), x)
    _assert_same(_roundtrip(x), x)


def test_bfloat16_is_sent_as_a_tensor():
    x = torch.randn(4, 3).to(torch.bfloat16)
    w = to_wire(x)
    assert isinstance(w, torch.Tensor)  # NumPy has no bfloat16
    _assert_same(_roundtrip(x), x)


@pytest.mark.parametrize("make", [
    lambda: torch.arange(24.0).reshape(4, 6).t(),                      # transposed
    lambda: torch.arange(40.0).reshape(8, 5)[1::2, 1:4],               # strided slice with offset
    lambda: torch.arange(3.0).expand(4, 3),                            # stride 0
    lambda: torch.tensor(7.5),                                         # 0-d
    lambda: torch.empty(0, 3),                                         # empty
    lambda: torch.randn(3, requires_grad=True) * 2,                    # needs grad
    lambda: torch.randn(3, dtype=torch.complex64).conj(),              # conjugate bit
    lambda: -torch.randn(3, dtype=torch.complex64).conj().imag,         # negative bit
], ids=["transposed", "slice", "expanded", "scalar", "empty", "grad", "conj", "neg"])
def test_unusual_tensor_layouts_roundtrip(make):
    x = make()
    out = _roundtrip(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out, x.detach().resolve_conj().resolve_neg())
    assert not out.requires_grad


def test_sparse_tensor_passes_through():
    x = torch.tensor([[0.0, 2.0], [3.0, 0.0]]).to_sparse()
    out = _roundtrip({"s": x})
    assert out["s"].is_sparse
    assert torch.equal(out["s"].to_dense(), x.to_dense())


def test_nested_structures_keep_their_types():
    od = collections.OrderedDict(b=torch.ones(2), a=torch.zeros(1, dtype=torch.int64))
    batch = {
        "pair": Pair(torch.arange(6).reshape(2, 3), torch.tensor([1, 0])),
        "tuple": (torch.ones(2), "text", 3),
        "list": [torch.full((2,), 2.0), [torch.tensor(1), None]],
        "ordered": od,
        "custom": Custom(torch.arange(3), "t"),
        "meta": {"paths": ["a.jpg", "b.jpg"], "n": 2, "scale": 0.5},
        "array": np.arange(4),
    }
    out = _roundtrip(batch)
    _assert_same(out, batch)
    assert list(out["ordered"]) == ["b", "a"]


def test_container_subclass_with_other_constructor_degrades_to_plain_tuple():
    x = TupleWithArgs(torch.ones(1), torch.zeros(1))
    out = _roundtrip(x)
    assert isinstance(out, tuple) and len(out) == 2
    assert torch.equal(out[0], x[0]) and torch.equal(out[1], x[1])


def test_tensors_travel_out_of_band():
    x = torch.randn(64, 64)
    bufs: list = []
    data = pickle.dumps(to_wire({"x": x, "y": Pair(x[:2], torch.arange(5))}), protocol=5,
                        buffer_callback=bufs.append)
    assert len(bufs) == 3
    assert sum(memoryview(b).nbytes for b in bufs) == x.nbytes + x[:2].nbytes + 5 * 8
    assert len(data) < 2000  # only the structure is pickled in-band


def test_copy_gives_writable_independent_tensors():
    src = np.arange(12, dtype=np.float32).reshape(3, 4)
    src.flags.writeable = False  # as Ray returns object-store buffers
    out = from_wire({"x": WireTensor(src, "torch.float32")})
    t = out["x"]
    assert not np.shares_memory(t.numpy(), src)
    t.add_(1)  # writable
    assert t.numpy().flags.writeable
    assert src[0, 0] == 0


def test_zero_copy_wraps_the_buffer_without_copying():
    src = np.arange(12, dtype=np.int64).reshape(3, 4)
    src.flags.writeable = False
    t = from_wire(WireTensor(src, "torch.int64"), copy=False)
    assert t.data_ptr() == src.__array_interface__["data"][0]
    assert torch.equal(t, torch.arange(12).reshape(3, 4))


def test_numpy_arrays_come_back_writable_unless_zero_copy():
    src = np.arange(6.0)
    src.flags.writeable = False  # what ray.get gives for an array in a collated batch
    out = from_wire({"a": src, "l": [src]})
    assert out["a"].flags.writeable and out["l"][0].flags.writeable
    np.testing.assert_array_equal(out["a"], src)
    kept = from_wire({"a": src}, copy=False)
    assert kept["a"] is src


def test_tensors_and_to_device_walk_every_container():
    batch = {"a": torch.ones(2), "b": [torch.zeros(1), (torch.arange(3), "s")], "p": Pair(torch.ones(1), 3)}
    found = tensors(batch)
    assert len(found) == 4
    moved = to_device(batch, "cpu", non_blocking=False)
    _assert_same(moved, batch)
    assert isinstance(moved["p"], Pair)
