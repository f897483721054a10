"""A wire batch through Ray's object store keeps its tensors' dtype, shape and bytes."""
from __future__ import annotations


import torch

from sbloader.core.wire import from_wire, to_wire


def test_roundtrip_through_ray_object_store(ray_session):
    import ray

    x = torch.randn(256, 256)  # large enough to live in plasma, not inline
    ref = ray.put(to_wire({"x": x, "y": torch.arange(3)}))
    got = ray.get(ref)
    arr = got["x"].array
    assert not arr.flags.writeable  # the object store's buffer
    zc = from_wire(got, copy=False)
    assert zc["x"].data_ptr() == arr.__array_interface__["data"][0]
    assert torch.equal(zc["x"], x)
    cp = from_wire(got)
    assert cp["x"].data_ptr() != arr.__array_interface__["data"][0]
    cp["x"].add_(1)
    assert torch.equal(cp["x"], x + 1) and torch.equal(zc["x"], x)
