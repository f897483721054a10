"""A lean S3-compatible server: one bucket served from a local folder, every request
delayed by a fixed latency, object GETs counted. Enough of S3 for pyarrow's
S3FileSystem and boto3 (HEAD/GET object with ranges, ListObjectsV2, HEAD bucket); no
authentication, no writes. Far less CPU per request than moto, so the store takes
little from the loaders on the same cores.

    python benchmarks/_lean_s3.py <folder> <bucket> <latency ms> [<latency ms> ...]

prints one JSON line ``{"<latency ms>": "http://127.0.0.1:<port>", ...}`` (one server per
latency) and serves until its standard input closes. ``GET /__stats`` answers
``{"object_gets": n, "requests": n}``.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlparse
from xml.sax.saxutils import escape


def list_keys(root: str) -> list[str]:
    """Every file under ``root`` as a key (``/``-separated), sorted."""
    out = []
    for d, _, fs in os.walk(root):
        out += [os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for f in fs]
    return sorted(out)


def list_xml(bucket: str, keys: list[str], sizes: dict, prefix: str, delimiter: str, start: str, max_keys: int) -> str:
    """A ListObjectsV2 answer (continuation tokens are the last key)."""
    sel = [k for k in keys if k.startswith(prefix) and k > start]
    contents, prefixes = [], []
    for k in sel:
        if delimiter and delimiter in k[len(prefix):]:
            p = prefix + k[len(prefix):].split(delimiter, 1)[0] + delimiter
            if p not in prefixes:
                prefixes.append(p)
        else:
            contents.append(k)
        if len(contents) + len(prefixes) >= max_keys:
            break
    last = (contents + prefixes)[-1] if contents or prefixes else ""
    truncated = bool(sel) and last != sel[-1] and len(contents) + len(prefixes) >= max_keys
    body = "".join(f"<Contents><Key>{escape(k)}</Key><Size>{sizes[k]}</Size><ETag>\"{sizes[k]:x}\"</ETag>"
                   "<LastModified>2020-01-01T00:00:00.000Z</LastModified><StorageClass>STANDARD</StorageClass>"
                   "</Contents>" for k in contents)
    body += "".join(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>" for p in prefixes)
    tok = f"<NextContinuationToken>{escape(quote(last))}</NextContinuationToken>" if truncated else ""
    return ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{bucket}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(contents) + len(prefixes)}</KeyCount>"
            f"<MaxKeys>{max_keys}</MaxKeys><IsTruncated>{str(truncated).lower()}</IsTruncated>{tok}{body}"
            "</ListBucketResult>")


def serve(root: str, bucket: str, latency_s: float) -> ThreadingHTTPServer:
    """Start one server (a daemon thread) on a free port of 127.0.0.1."""
    keys = list_keys(root)
    sizes = {k: os.path.getsize(os.path.join(root, k)) for k in keys}
    stats = {"object_gets": 0, "requests": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _send(self, code: int, body: bytes = b"", headers: dict = {}, head: bool = False) -> None:  # noqa: B006
            self.send_response(code)
            for k, v in {"Content-Length": str(len(body)), "Date": formatdate(usegmt=True), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _handle(self, head: bool) -> None:
            time.sleep(latency_s)
            u = urlparse(self.path)
            with lock:
                stats["requests"] += 1
            if u.path == "/__stats":
                return self._send(200, json.dumps(stats).encode())
            parts = unquote(u.path).lstrip("/").split("/", 1)
            if parts[0] != bucket:
                return self._send(404, b"<Error><Code>NoSuchBucket</Code></Error>")
            key = parts[1] if len(parts) > 1 else ""
            if not key:
                q = {k: v[0] for k, v in parse_qs(u.query).items()}
                if "location" in q:
                    return self._send(200, b'<LocationConstraint xmlns="http://s3.amazonaws.com/doc/2006-03-01/"/>')
                if head:
                    return self._send(200, head=True)
                start = unquote(q.get("continuation-token", q.get("start-after", "")))
                xml = list_xml(bucket, keys, sizes, q.get("prefix", ""), q.get("delimiter", ""), start,
                               int(q.get("max-keys", 1000)))
                return self._send(200, xml.encode(), {"Content-Type": "application/xml"})
            if key not in sizes:
                return self._send(404, b"<Error><Code>NoSuchKey</Code></Error>", head=head)
            meta = {"ETag": f'"{sizes[key]:x}"', "Last-Modified": "Wed, 01 Jan 2020 00:00:00 GMT",
                    "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
            if head:
                self.send_response(200)
                for k, v in {"Content-Length": str(sizes[key]), **meta}.items():
                    self.send_header(k, v)
                return self.end_headers()
            with open(os.path.join(root, key), "rb") as f:
                data = f.read()
            with lock:
                stats["object_gets"] += 1
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                a, _, b = rng[6:].partition("-")
                lo = int(a) if a else max(0, len(data) - int(b))
                hi = min(int(b), len(data) - 1) if (a and b) else len(data) - 1
                meta["Content-Range"] = f"bytes {lo}-{hi}/{len(data)}"
                return self._send(206, data[lo:hi + 1], meta)
            return self._send(200, data, meta)

        def do_GET(self) -> None:  # noqa: N802
            self._handle(False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._handle(True)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def main() -> None:
    root, bucket = sys.argv[1], sys.argv[2]
    servers = {f"{float(ms):g}": serve(root, bucket, float(ms) / 1000) for ms in sys.argv[3:] or ["0"]}
    print(json.dumps({k: f"http://127.0.0.1:{s.server_address[1]}" for k, s in servers.items()}), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
