"""The lean S3 server's state and wire helpers (``benchmarks/_lean_s3.py`` is the server):
a port's latency, faults and counts, the in-memory objects, S3's XML errors and the
aws-chunked body encoding."""
from __future__ import annotations

import bisect
import resource
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from urllib.parse import quote

#: A GET of this path answers the port's counts as JSON (``?reset=1`` also forgets them).
STATS_PATH = "/__sbloader_proxy_stats"
_REGION = "us-east-1"
_MTIME = time.time()


@dataclass
class PortState:
    """One listening port: its latency, the faults still to inject, what it counted."""

    latency_s: float = 0.0
    faults: deque = field(default_factory=deque)
    counts: Counter = field(default_factory=Counter)
    object_get_bytes: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    timeline: list = field(default_factory=list)  # (seconds since start, requests in flight)
    t0: float = field(default_factory=time.perf_counter)

    def inject(self, kind: str, times: int = 1) -> None:
        """Make the next ``times`` object GETs fail with ``kind`` (``"503"``, ``"403"`` or ``"drop"``)."""
        if kind not in ("503", "403", "drop"):
            raise ValueError(f"kind must be '503', '403' or 'drop', found {kind!r}")
        self.faults.extend([kind] * times)

    def as_dict(self) -> dict:
        cpu = resource.getrusage(resource.RUSAGE_SELF)
        return {"object_gets": self.counts[("GET", "object")], "object_heads": self.counts[("HEAD", "object")],
                "lists": self.counts[("GET", "list")], "requests": sum(self.counts.values()),
                "object_get_bytes": self.object_get_bytes, "peak_in_flight": self.peak_in_flight,
                "latency_s": self.latency_s, "server_cpu_s": cpu.ru_utime + cpu.ru_stime,
                "timeline": self.timeline[-20000:]}

    def reset(self) -> None:
        self.counts.clear()
        self.object_get_bytes = self.peak_in_flight = 0
        self.timeline = []
        self.t0 = time.perf_counter()


def _xml(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class _Store:
    def __init__(self) -> None:
        self.buckets: dict[str, dict[str, bytes]] = {}
        self.mtimes: dict[tuple[str, str], float] = {}
        self._sorted: dict[str, list[str]] = {}  # a bucket's keys in order, until it changes

    def changed(self, bucket: str) -> None:
        """Keys were added to or taken from ``bucket``: its sorted keys are built again when listed
        (sorting 100,000 keys on every listing request cost the server ~40 ms a page)."""
        self._sorted.pop(bucket, None)

    def touch(self, bucket: str) -> None:
        """Give every object of ``bucket`` a new modification time (a later second): new versions
        of the same bytes, as if written again (nothing a client remembers of them applies)."""
        now = time.time()
        for k in self.buckets.get(bucket, {}):
            self.mtimes[(bucket, k)] = max(now, self.mtimes[(bucket, k)] + 1.0)

    def list_v2(self, bucket: str, q: dict) -> bytes:
        objs = self.buckets[bucket]
        prefix = q.get("prefix", "")
        delim = q.get("delimiter", "")
        max_keys = int(q.get("max-keys", "1000") or 1000)
        after = q.get("continuation-token") or q.get("start-after") or ""
        enc = (lambda s: quote(s, safe="/")) if q.get("encoding-type") == "url" else (lambda s: s)
        entries: list[tuple[str, bool]] = []  # (key or common prefix, is_prefix)
        seen_prefixes: set = set()
        keys = self._sorted.get(bucket)
        if keys is None:
            keys = self._sorted[bucket] = sorted(objs)
        start = bisect.bisect_right(keys, after) if after >= prefix else bisect.bisect_left(keys, prefix)
        for i in range(start, len(keys)):
            k = keys[i]
            if not k.startswith(prefix):
                if k > prefix:
                    break
                continue
            if delim:
                cut = k.find(delim, len(prefix))
                if cut >= 0:
                    cp = k[:cut + len(delim)]
                    if cp in seen_prefixes or cp <= after:
                        continue
                    seen_prefixes.add(cp)
                    entries.append((cp, True))
                    if len(entries) > max_keys:
                        break
                    continue
            entries.append((k, False))
            if len(entries) > max_keys:
                break
        truncated = len(entries) > max_keys
        entries = entries[:max_keys]
        parts = [f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/'
                 f'2006-03-01/"><Name>{bucket}</Name><Prefix>{_xml(enc(prefix))}</Prefix>'
                 f"<KeyCount>{len(entries)}</KeyCount><MaxKeys>{max_keys}</MaxKeys>"
                 f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"]
        if delim:
            parts.append(f"<Delimiter>{_xml(delim)}</Delimiter>")
        if q.get("encoding-type") == "url":
            parts.append("<EncodingType>url</EncodingType>")
        if truncated:
            parts.append(f"<NextContinuationToken>{_xml(entries[-1][0])}</NextContinuationToken>")
        for name, is_prefix in entries:
            if is_prefix:
                parts.append(f"<CommonPrefixes><Prefix>{_xml(enc(name))}</Prefix></CommonPrefixes>")
            else:
                mt = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(self.mtimes[(bucket, name)]))
                parts.append(f"<Contents><Key>{_xml(enc(name))}</Key><LastModified>{mt}</LastModified>"
                             f"<ETag>&quot;{len(objs[name]):x}&quot;</ETag><Size>{len(objs[name])}</Size>"
                             f"<StorageClass>STANDARD</StorageClass></Contents>")
        parts.append("</ListBucketResult>")
        return "".join(parts).encode()


def _error(code: str, status: int, msg: str) -> tuple[int, dict, bytes]:
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{_xml(msg)}</Message>'
            f"</Error>").encode()
    return status, {"Content-Type": "application/xml"}, body


def _decode_aws_chunked(body: bytes) -> bytes:
    out, pos = bytearray(), 0
    while pos < len(body):
        eol = body.index(b"\r\n", pos)
        n = int(body[pos:eol].split(b";", 1)[0], 16)
        if n == 0:
            break
        out += body[eol + 2:eol + 2 + n]
        pos = eol + 2 + n + 2
    return bytes(out)
