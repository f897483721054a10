"""A GCS emulator on 127.0.0.1 for tests: ``gcp-storage-emulator`` (in memory), with what
obstore's GCS client needs and the emulator lacks, and a count of object GETs.

    server = GcsServer.start(port)     # the port STORAGE_EMULATOR_HOST names
    server.put_many("bkt", {"imgs/0.jpg": b"..."})
    server.gets                        # Counter: object GETs (whole or ranged) by object name

obstore's GCS client reads objects by the XML API (``GET /<bucket>/<object>``, which the
emulator serves) and expects ``Last-Modified`` and ``ETag`` on the answer, as GCS sends
them; it lists by the XML API's ListObjectsV2 (``GET /<bucket>?list-type=2``), which the
emulator does not serve. Both are added here from the emulator's own object records.
pyarrow's GCS client uses the JSON API, which the emulator serves as it is.
"""
from __future__ import annotations

import datetime
import threading
import urllib.request
from collections import Counter
from email.utils import format_datetime
from html import escape
from typing import Optional


class GcsServer:
    """The emulator, running in a thread of this process."""

    def __init__(self, server: object, port: int) -> None:
        self._server = server
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"
        self.gets: Counter = Counter()
        self._lock = threading.Lock()

    @classmethod
    def start(cls, port: int, bucket: str = "bkt") -> "GcsServer":
        """Start the emulator on ``port`` with an empty ``bucket``."""
        from gcp_storage_emulator import server as gsrv
        from gcp_storage_emulator.handlers import objects

        self = cls(None, port)

        def download(request, response, storage, *args, **kwargs):
            objects.download(request, response, storage, *args, **kwargs)
            name = request.params["object_id"]
            try:
                obj = storage.get_file_obj(request.params["bucket_name"], name)
            except Exception:
                return  # the emulator answered 404
            with self._lock:
                self.gets[name] += 1
            updated = datetime.datetime.fromisoformat(obj["updated"].replace("Z", "+00:00"))
            response["Last-Modified"] = format_datetime(updated, usegmt=True)
            response["ETag"] = f'"{obj["md5Hash"]}"'

        routes = [(rx, {m: download if fn is objects.download else fn for m, fn in h.items()})
                  for rx, h in gsrv.HANDLERS]
        gsrv.HANDLERS = ((r"^/(?P<bucket_name>[-.\w]+)$", {"GET": _list_v2}),) + tuple(routes)
        self._server = gsrv.create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
        self._server.start()
        return self

    def put_many(self, bucket: str, objects: dict) -> None:
        """Upload ``{name: bytes}`` (XML API PUTs)."""
        for name, data in objects.items():
            req = urllib.request.Request(f"{self.endpoint}/{bucket}/{name}", data=data, method="PUT")
            with urllib.request.urlopen(req) as r:
                assert r.status == 200, (name, r.status)

    def stop(self) -> None:
        """Stop the emulator."""
        self._server.stop()


def _list_v2(request, response, storage, *args, **kwargs) -> None:
    """ListObjectsV2 (XML API) over the emulator's records: keys after the continuation token,
    ``max-keys`` a page."""
    q = request.query

    def arg(name: str, default: str = "") -> str:
        return q.get(name, [default])[0]

    prefix = arg("prefix")
    files, _ = storage.get_file_list(request.params["bucket_name"], prefix or None, None, None)
    after = arg("continuation-token") or arg("start-after")
    files = sorted((f for f in files if f["name"] > after), key=lambda f: f["name"])
    n = int(arg("max-keys", "1000"))
    page, more = files[:n], len(files) > n
    token: Optional[str] = page[-1]["name"] if more else None
    body = ['<?xml version="1.0" encoding="UTF-8"?><ListBucketResult>',
            f"<Name>{escape(request.params['bucket_name'])}</Name><Prefix>{escape(prefix)}</Prefix>",
            f"<KeyCount>{len(page)}</KeyCount><MaxKeys>{n}</MaxKeys><IsTruncated>{str(more).lower()}</IsTruncated>"]
    if token is not None:
        body.append(f"<NextContinuationToken>{escape(token)}</NextContinuationToken>")
    body += [f"<Contents><Key>{escape(f['name'])}</Key><LastModified>{f['updated']}</LastModified>"
             f"<ETag>\"{f['md5Hash']}\"</ETag><Size>{f['size']}</Size></Contents>" for f in page]
    body.append("</ListBucketResult>")
    response.write_file("".join(body).encode(), content_type="application/xml")
