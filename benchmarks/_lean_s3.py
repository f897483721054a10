"""A lean S3-compatible server on 127.0.0.1 (asyncio, objects in memory) for benchmarks
and tests where moto's CPU per request (a few ms, on the same cores as the loader) would
hide what the loader does.

It answers what the readers use, path-style: ListObjectsV2 (prefix, delimiter, max-keys,
continuation-token, encoding-type=url), HEAD and GET of an object (``Range: bytes=a-b``,
``a-``, ``-n``), HEAD of a bucket (with its region), PUT and DELETE of an object, PUT of a
bucket. Signatures are not checked. Each listening port adds its own latency to every
request (``asyncio.sleep``: no CPU while waiting), can inject faults into object GETs
(``"503"`` SlowDown, ``"drop"`` the connection), and counts requests, object bytes,
requests in flight (now, peak, and a timeline) and the server's CPU seconds. A bucket
can have a latency and counts of its own (``bucket_latency``), so one endpoint (the
``AWS_ENDPOINT_URL`` every reader takes from the environment) serves every latency.

    server = LeanS3.start({"0": 0.0, "20": 0.02})   # a port per latency, in a thread
    server.put_many("bucket", {"a/x.jpg": b"..."})
    server.endpoints["20"]                          # http://127.0.0.1:<port>
    server.stats("20")                              # the counts of that port

As a process (what ``benchmarks/scenarios/bucket_latency.py`` starts)::

    python benchmarks/_lean_s3.py <folder> <latency ms> [<latency ms> ...]

serves the folder's files in one bucket per latency, ``lat<ms>`` (``lat20``), each
delayed by its latency, on one port; prints ``{"endpoint": ..., "buckets": {"20": "lat20"}}``
and serves until its standard input closes. ``GET /__sbloader_proxy_stats?bucket=lat20``
answers that bucket's counts (``&reset=1`` forgets them; ``&touch=1`` gives its objects new
versions: :meth:`_Store.touch`).
"""
from __future__ import annotations

import asyncio
import threading
import time
from email.utils import formatdate
from typing import Optional
from urllib.parse import parse_qs, unquote, urlsplit

if __package__:  # imported as benchmarks._lean_s3
    from ._lean_s3_store import _REGION, STATS_PATH, PortState, _decode_aws_chunked, _error, _Store
else:  # run as a script: python benchmarks/_lean_s3.py
    from _lean_s3_store import _REGION, STATS_PATH, PortState, _decode_aws_chunked, _error, _Store


class LeanS3:
    """The server: one asyncio loop in a daemon thread, a listening port per latency."""

    def __init__(self) -> None:
        self.store = _Store()
        self.ports: dict[str, PortState] = {}
        self.endpoints: dict[str, str] = {}
        self._loop = asyncio.new_event_loop()
        self._servers: list = []
        self.buckets: dict[str, PortState] = {}  # buckets with a latency and counts of their own

    def bucket_latency(self, bucket: str, latency_s: float) -> None:
        """Give ``bucket`` its own latency and counts (whichever port is asked)."""
        self.buckets[bucket] = PortState(float(latency_s))

    @classmethod
    def start(cls, latencies: Optional[dict] = None) -> "LeanS3":
        """Serve on 127.0.0.1, a free port for each ``{name: latency_s}`` (default ``{"0": 0.0}``)."""
        self = cls()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(latencies or {"0": 0.0}, ready), daemon=True,
                         name="lean-s3").start()
        ready.wait(30)
        return self

    def _run(self, latencies: dict, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        for name, lat in latencies.items():
            st = self.ports[name] = PortState(float(lat))
            srv = self._loop.run_until_complete(asyncio.start_server(
                lambda r, w, st=st: self._serve(r, w, st), "127.0.0.1", 0, limit=2 ** 20, backlog=1024))
            self._servers.append(srv)
            self.endpoints[name] = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        """Stop serving."""
        def _close() -> None:
            for s in self._servers:
                s.close()
            self._loop.stop()
        self._loop.call_soon_threadsafe(_close)

    def put_many(self, bucket: str, objects: dict) -> None:
        """Store ``{key: bytes}`` (creating the bucket)."""
        b = self.store.buckets.setdefault(bucket, {})
        self.store.changed(bucket)
        now = time.time()
        for k, v in objects.items():
            b[k] = bytes(v)
            self.store.mtimes[(bucket, k)] = now

    def stats(self, name: str) -> dict:
        """The counts of the port ``name``."""
        return self.ports[name].as_dict()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: PortState) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for ln in lines[1:]:
                    if ":" in ln:
                        k, v = ln.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                b = target.split("?", 1)[0].lstrip("/").split("/", 1)[0]
                if target.startswith(STATS_PATH) and "bucket=" in target:
                    b = target.split("bucket=", 1)[1].split("&", 1)[0]
                st = self.buckets.get(b, port)
                n = int(headers.get("content-length") or 0)
                body = await reader.readexactly(n) if n else b""
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    body = await self._read_chunked(reader)
                if "aws-chunked" in headers.get("content-encoding", "") or \
                        headers.get("x-amz-content-sha256", "").startswith("STREAMING"):
                    body = _decode_aws_chunked(body)
                st.in_flight += 1
                st.peak_in_flight = max(st.peak_in_flight, st.in_flight)
                st.timeline.append((round(time.perf_counter() - st.t0, 4), st.in_flight))
                try:
                    if st.latency_s and not target.startswith(STATS_PATH):
                        await asyncio.sleep(st.latency_s)
                    answer = self._answer(method, target, headers, body, st)
                finally:
                    st.in_flight -= 1
                    st.timeline.append((round(time.perf_counter() - st.t0, 4), st.in_flight))
                if answer is None:  # a dropped connection
                    writer.transport.abort()
                    return
                status, hdrs, payload = answer
                out = [f"HTTP/1.1 {status} {'OK' if status < 300 else 'Error'}",
                       f"Date: {formatdate(usegmt=True)}", "Server: lean-s3", "x-amz-request-id: 0"]
                if "Content-Length" not in hdrs:
                    hdrs["Content-Length"] = str(len(payload))
                out += [f"{k}: {v}" for k, v in hdrs.items()]
                writer.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1"))
                if method != "HEAD" and payload:
                    writer.write(payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _read_chunked(self, reader: asyncio.StreamReader) -> bytes:
        out = bytearray()
        while True:
            n = int((await reader.readline()).split(b";", 1)[0], 16)
            if n == 0:
                await reader.readline()
                return bytes(out)
            out += await reader.readexactly(n)
            await reader.readline()

    def _answer(self, method: str, target: str, headers: dict, body: bytes,
                st: PortState) -> Optional[tuple[int, dict, bytes]]:
        import json

        parts = urlsplit(target)
        if parts.path == STATS_PATH:
            out = json.dumps(st.as_dict()).encode()
            if "reset=1" in parts.query:
                st.reset()
            if "touch=1" in parts.query and "bucket=" in parts.query:
                self.store.touch(parts.query.split("bucket=", 1)[1].split("&", 1)[0])
            return 200, {"Content-Type": "application/json"}, out
        q = {k: v[0] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        path = unquote(parts.path).lstrip("/")
        bucket, _, key = path.partition("/")
        kind = "object" if key else "list"
        if kind == "object" and method == "GET" and st.faults:
            fault = st.faults.popleft()
            if fault == "drop":
                return None
            if fault == "403":
                return _error("AccessDenied", 403, "Access Denied")
            return _error("SlowDown", 503, "Please reduce your request rate.")
        st.counts[(method, kind)] += 1
        objs = self.store.buckets.get(bucket)
        if not key:
            if method == "PUT":
                self.store.buckets.setdefault(bucket, {})
                return 200, {}, b""
            if objs is None:
                return _error("NoSuchBucket", 404, f"no bucket {bucket}")
            if method == "HEAD":
                return 200, {"x-amz-bucket-region": _REGION}, b""
            if "location" in q:
                return 200, {"Content-Type": "application/xml"}, (
                    b'<?xml version="1.0" encoding="UTF-8"?><LocationConstraint xmlns="http://s3.amazonaws.com/doc/'
                    b'2006-03-01/"></LocationConstraint>')
            return 200, {"Content-Type": "application/xml"}, self.store.list_v2(bucket, q)
        if objs is None:
            return _error("NoSuchBucket", 404, f"no bucket {bucket}")
        if method == "PUT":
            src = headers.get("x-amz-copy-source")
            if src:
                sb, _, sk = unquote(src).lstrip("/").partition("/")
                body = self.store.buckets[sb][sk]
            self.put_many(bucket, {key: body})
            return 200, {"ETag": f'"{len(body):x}"'}, b"" if not src else b"<CopyObjectResult></CopyObjectResult>"
        if method == "DELETE":
            objs.pop(key, None)
            self.store.changed(bucket)
            return 204, {}, b""
        data = objs.get(key)
        if data is None:
            return _error("NoSuchKey", 404, f"no key {key}")
        hdrs = {"Last-Modified": formatdate(self.store.mtimes[(bucket, key)], usegmt=True),
                "ETag": f'"{len(data):x}"', "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if method == "HEAD":
            hdrs["Content-Length"] = str(len(data))
            return 200, hdrs, b""
        rng = headers.get("range", "")
        if rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            if a == "":
                start, end = max(0, len(data) - int(b)), len(data) - 1
            else:
                start, end = int(a), min(len(data) - 1, int(b)) if b else len(data) - 1
            if start >= len(data):
                return _error("InvalidRange", 416, rng)
            hdrs["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            payload = data[start:end + 1]
            st.object_get_bytes += len(payload)
            return 206, hdrs, payload
        st.object_get_bytes += len(data)
        return 200, hdrs, data


def main() -> None:
    """Serve a folder in one bucket per latency (see the module's docstring)."""
    import json
    import os
    import sys

    root, lats = sys.argv[1], [f"{float(x):g}" for x in sys.argv[2:]] or ["0"]
    server = LeanS3.start()
    files = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                files[os.path.relpath(p, root).replace(os.sep, "/")] = fh.read()
    buckets = {}
    for ms in lats:
        buckets[ms] = f"lat{ms.replace('.', '-')}"
        server.bucket_latency(buckets[ms], float(ms) / 1000.0)
        server.put_many(buckets[ms], files)
    print(json.dumps({"endpoint": server.endpoints["0"], "buckets": buckets, "pid": os.getpid()}), flush=True)
    sys.stdin.read()
    os._exit(0)  # the loop's thread is a daemon: nothing to flush


if __name__ == "__main__":
    main()
