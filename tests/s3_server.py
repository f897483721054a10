"""An S3-compatible server on 127.0.0.1 for tests and benchmarks: moto's server mode,
behind a threaded HTTP proxy that injects latency and faults and counts requests.

    server = S3Server.start()          # moto on a free port, the proxy in front
    server.endpoint                    # http://127.0.0.1:<proxy port>: what clients use
    server.proxy.latency_s = 0.02      # every request waits 20 ms
    server.proxy.inject("503", 2)      # the next 2 object GETs answer 503 SlowDown
    server.proxy.inject("drop", 1)     # the next object GET loses its connection
    server.proxy.object_gets           # object GETs that reached moto (listings excluded)
    gate = server.proxy.hold("k.png")  # the answer to a GET of a key ending so waits for gate.set()

No test talks to a real cloud: the AWS variables point every client at the proxy
(:func:`s3_environment`).
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

#: A GET of this path answers the proxy's counts as JSON (never forwarded).
STATS_PATH = "/__sbloader_proxy_stats"

_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_environment(endpoint: str) -> dict:
    """The AWS variables that point pyarrow, boto3 and s3fs at ``endpoint`` with dummy credentials."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@dataclass
class FaultProxy:
    """What the proxy does to requests, and what it counted.

    Attributes:
        upstream_port: moto's port.
        latency_s: seconds every request waits before it is forwarded.
        faults: injected faults still to happen, oldest first: ``"503"`` (answer
            ``503 SlowDown``), ``"403"`` (answer ``403 AccessDenied``) or ``"drop"``
            (close the connection without an answer); each applies to the next object GET.
        counts: requests by ``(method, kind)``, kind ``"object"`` or ``"list"``.
        object_get_bytes: body bytes of object GETs passed back.
        faults_done: faults injected so far.
        order: while recording (:meth:`record`), the requests in the order the proxy saw
            them: ``("get", "in")`` when an object GET arrives, ``("get", "out", key)`` when
            its answer starts to be sent, ``("list", "in", "page")`` when a listing request arrives
            (``"top"``: a listing of the top level only, with a delimiter), ``("list", "out")`` when
            it has been answered;
            a test may add its own events (:meth:`note`).
        held: key suffix -> the event an object GET of such a key waits for before it is
            answered (:meth:`hold`).
        in_flight, peak_in_flight: object GETs the proxy is serving now, and the most at once
            since the last :meth:`reset_counts`, by ``"bucket/first-folder"`` and in all (``"all"``).
    """

    upstream_port: int
    latency_s: float = 0.0
    faults: deque = field(default_factory=deque)
    counts: Counter = field(default_factory=Counter)
    object_get_bytes: int = 0
    faults_done: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    order: Optional[list] = field(default=None, repr=False)
    in_flight: Counter = field(default_factory=Counter)
    peak_in_flight: Counter = field(default_factory=Counter)
    held: dict = field(default_factory=dict)

    def hold(self, key_suffix: str) -> threading.Event:
        """Hold back the answers to object GETs of keys ending with ``key_suffix`` until the
        returned event is set (or 20 s pass: a test that never sets it fails, not hangs)."""
        gate = threading.Event()
        with self.lock:
            self.held[key_suffix] = gate
        return gate

    def note(self, event: tuple) -> None:
        """Add ``event`` to :attr:`order` (while recording): what a test saw, among the requests."""
        self._note(event)

    def record(self) -> None:
        """Start (again) recording the order of object GETs and listing pages in ``order``."""
        with self.lock:
            self.order = []

    def _note(self, event: tuple) -> None:
        with self.lock:
            if self.order is not None:
                self.order.append(event)

    def inject(self, kind: str, times: int = 1) -> None:
        """Make the next ``times`` object GETs fail with ``kind`` (``"503"``, ``"403"`` or ``"drop"``)."""
        if kind not in ("503", "403", "drop"):
            raise ValueError(f"kind must be '503', '403' or 'drop', found {kind!r}")
        with self.lock:
            self.faults.extend([kind] * times)

    def reset_counts(self) -> None:
        """Forget the counts (not the faults still to happen)."""
        with self.lock:
            self.counts.clear()
            self.object_get_bytes = 0
            self.peak_in_flight = Counter(self.in_flight)

    def _serving(self, group: str, delta: int) -> None:
        with self.lock:
            for g in (group, "all"):
                self.in_flight[g] += delta
                self.peak_in_flight[g] = max(self.peak_in_flight[g], self.in_flight[g])

    @property
    def object_gets(self) -> int:
        """Object GETs forwarded to moto (listings excluded)."""
        return self.counts[("GET", "object")]


def _handler(proxy: FaultProxy) -> type:
    local = threading.local()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _upstream(self) -> http.client.HTTPConnection:
            conn = getattr(local, "conn", None)
            if conn is None:
                conn = local.conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
            return conn

        def _forward(self) -> None:
            bucket_and_key = self.path.split("?", 1)[0].strip("/")
            if self.command != "GET" or "/" not in bucket_and_key:
                return self._serve()
            self._group = "/".join(bucket_and_key.split("/")[:2])
            proxy._serving(self._group, 1)
            try:
                self._serve()
            finally:
                self._served()

        def _served(self) -> None:
            """Count this GET out of ``in_flight`` (once), before the client can have any of its
            response: counted after it, the client's next request could start first, and a
            client holding 2 in flight was seen with 3 at the proxy."""
            group, self._group = getattr(self, "_group", None), None
            if group is not None:
                proxy._serving(group, -1)

        def _serve(self) -> None:
            if self.path == STATS_PATH:  # the counts, for a benchmark running the proxy in another process
                with proxy.lock:
                    body = json.dumps({"object_gets": proxy.object_gets, "object_get_bytes": proxy.object_get_bytes,
                                       "latency_s": proxy.latency_s}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if proxy.latency_s:
                time.sleep(proxy.latency_s)
            path = self.path
            bucket_and_key = path.split("?", 1)[0].strip("/")
            kind = "object" if "/" in bucket_and_key else "list"
            fault = None
            if kind == "object" and self.command == "GET":
                proxy._note(("get", "in"))
            elif kind == "list" and self.command == "GET":
                proxy._note(("list", "in", "top" if "delimiter=" in path else "page"))
            with proxy.lock:
                if kind == "object" and self.command == "GET" and proxy.faults:
                    fault = proxy.faults.popleft()
                    proxy.faults_done += 1
                else:
                    proxy.counts[(self.command, kind)] += 1
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else None
            if fault == "drop":
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            if fault in ("503", "403"):
                msg = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
                       b"<Message>Please reduce your request rate.</Message></Error>") if fault == "503" else (
                    b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>AccessDenied</Code>"
                    b"<Message>Access Denied</Message></Error>")
                self.send_response(int(fault))
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)
                return
            key = bucket_and_key.split("/", 1)[-1]
            gate = next((g for k, g in list(proxy.held.items()) if key.endswith(k)), None) \
                if kind == "object" and self.command == "GET" else None
            if gate is not None:
                gate.wait(20)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            for attempt in range(2):
                conn = self._upstream()
                try:
                    conn.request(self.command, path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    break
                except (http.client.HTTPException, OSError):
                    conn.close()
                    local.conn = None
                    if attempt:
                        raise
            if kind == "object" and self.command == "GET":
                proxy._note(("get", "out", key))  # before the client can have any of it
            self._served()
            self.send_response(resp.status, resp.reason)
            head = self.command == "HEAD"  # its Content-Length is the object's, not the empty body's
            for k, v in resp.getheaders():
                if k.lower() not in _HOP and (head or k.lower() != "content-length"):
                    self.send_header(k, v)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
                if kind == "list" and self.command == "GET":
                    self.wfile.flush()
                    proxy._note(("list", "out"))
                if kind == "object" and self.command == "GET":
                    with proxy.lock:
                        proxy.object_get_bytes += len(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    return Handler


def start_proxy(upstream_port: int, port: Optional[int] = None,
                latency_s: float = 0.0) -> tuple[ThreadingHTTPServer, FaultProxy]:
    """A fault proxy on 127.0.0.1 (``port``, or a free one) in front of ``upstream_port``,
    serving in a daemon thread."""
    proxy = FaultProxy(upstream_port, latency_s=latency_s)
    httpd = ThreadingHTTPServer(("127.0.0.1", port or 0), _handler(proxy))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="s3-fault-proxy", daemon=True).start()
    return httpd, proxy


class S3Server:
    """moto's S3 server and the fault proxy in front, both on 127.0.0.1, in threads."""

    def __init__(self, moto_server: object, http_server: ThreadingHTTPServer, proxy: FaultProxy) -> None:
        self._moto = moto_server
        self.moto_port = moto_server.get_host_and_port()[1]
        self._http = http_server
        self.proxy = proxy
        self.endpoint = f"http://127.0.0.1:{http_server.server_address[1]}"

    @classmethod
    def start(cls, proxy_port: Optional[int] = None) -> "S3Server":
        """Start moto on a free port and the proxy on ``proxy_port`` (None: a free one)."""
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        moto_port = free_port()
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=moto_port, verbose=False)
        moto.start()
        httpd, proxy = start_proxy(moto_port, proxy_port)
        return cls(moto, httpd, proxy)

    def client(self):
        """A boto3 S3 client on the proxy."""
        import boto3

        env = s3_environment(self.endpoint)
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])

    def ensure_bucket(self, bucket: str) -> None:
        """Create ``bucket`` unless it exists (test modules share the session's server)."""
        client = self.client()
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass

    def put_many(self, bucket: str, objects: dict) -> None:
        """Store ``{key: bytes}`` straight into moto's in-process backend (no HTTP: thousands
        of keys in a fraction of a second). The bucket must exist."""
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
        for key, data in objects.items():
            backend.put_object(bucket, key, data)

    def stop(self) -> None:
        """Stop the proxy and moto."""
        self._http.shutdown()
        self._http.server_close()
        self._moto.stop()
