"""A read task over a bucket decodes its first objects as they come, not once its whole set
is in: against the S3 test server (tests/s3_server.py), whose proxy holds back the answer
to the partition's last object until the test sees a decode, and records the order of the
GETs' answers and the decodes (counted, not timed)."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from sbloader.core.context import task_context
from sbloader.sources import images
from sbloader.sources.base import Partition
from sbloader.sources.fetch import remote_files
from sbloader.sources.filesystems import list_uris

BUCKET = "sbloader-decode"


def _png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((4, 5, 3), i, dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pngs(s3_server):
    pytest.importorskip("obstore")
    s3_server.ensure_bucket(BUCKET)
    s3_server.put_many(BUCKET, {f"p/{i:02d}.png": _png(i) for i in range(6)})
    return s3_server


@pytest.mark.parametrize("cache", [True, False])
def test_a_read_task_decodes_its_first_objects_before_its_last_object_is_answered(pngs, tmp_path, monkeypatch,
                                                                                  cache):
    listed = list_uris([f"s3://{BUCKET}/p/"], (".png",), "image")
    uris = [o.uri for o in listed]
    remote = remote_files({o.uri: (o.size, o.mtime_ns) for o in listed}, None, cache, str(tmp_path / "c"), None)
    proxy = pngs.proxy
    gate = proxy.hold("p/05.png")  # the last object's answer waits for the first decode
    decode = images._decode_bytes

    def decoding(data, *a, **kw):
        proxy.note(("decode", kw.get("name")))
        gate.set()
        return decode(data, *a, **kw)

    monkeypatch.setattr(images, "_decode_bytes", decoding)
    proxy.record()
    try:
        with task_context(0, 0, 0, "read", -1):
            block = images._read_image_files(None, Partition(0, len(uris), tuple(uris)), size=None, mode="RGB",
                                             on_error="raise", remote=remote)
        order = list(proxy.order)
    finally:
        gate.set()
        proxy.order = None
        proxy.held.clear()
    assert [int(a[0, 0, 0]) for a in block["image"]] == list(range(6))  # every image, in the partition's order
    decodes = [i for i, e in enumerate(order) if e[0] == "decode"]
    answered = {e[2]: i for i, e in enumerate(order) if e[:2] == ("get", "out")}
    assert len(decodes) == 6 and sorted(answered) == [f"p/{i:02d}.png" for i in range(6)], order
    # The first image is decoded while the last GET is still unanswered (a read that waited for
    # its whole set would only decode once the proxy gave up holding it, 20 s later).
    assert decodes[0] < answered["p/05.png"], order
    assert order[decodes[0]] == ("decode", uris[0])
