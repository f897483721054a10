"""The members of a range of tar bytes, parsed without ``tarfile``'s per-header objects.

A partition of a WebDataset shard is read as one run of bytes (``tar_index.read_members``);
parsing its headers with ``tarfile`` in stream mode cost about a third of a read task's
CPU beside the JPEG decode. This parser reads only what a sample needs from each
512-byte header (name, ustar prefix, size, type, checksum) and the ``path``/``size``
records of pax and GNU long-name headers; anything else it does not know (base-256
sizes, sparse files, pax records it would have to apply) hands the whole range to
``tarfile``, so the result is always ``tarfile``'s.
"""
from __future__ import annotations

import io
import tarfile
from typing import Optional

_BLOCK = tarfile.BLOCKSIZE
_ZERO = bytes(_BLOCK)
_REGULAR = (b"0", b"\0", b"7")
_SKIPPED = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, directories, fifos: no sample data
_PAX_KEYS_USED = frozenset({b"path", b"size"})
_PAX_KEYS_HARMLESS = frozenset({b"mtime", b"atime", b"ctime", b"uid", b"gid", b"uname", b"gname", b"comment"})


class Unusual(Exception):
    """A header this parser does not handle: ``tarfile`` parses the range instead."""


def octal(field: bytes) -> int:
    """A tar header's octal number field (``Unusual`` for GNU's base-256)."""
    if field[:1] and field[0] & 0x80:  # GNU base-256
        raise Unusual("base-256 number")
    digits = field.replace(b"\0", b" ").strip()
    return int(digits, 8) if digits else 0


def checksum_ok(h: bytes) -> bool:
    """Whether a 512-byte tar header's checksum holds (the unsigned sum, as tar writes it)."""
    stored = octal(h[148:156])
    return stored == sum(h[:148]) + 256 + sum(h[156:])


def pax_records(data: bytes) -> dict:
    """A pax header's records (``Unusual`` for one a sample would need applied: see the keys above)."""
    out = {}
    pos = 0
    while pos < len(data):
        sp = data.index(b" ", pos)
        length = int(data[pos:sp])
        key, _, value = data[sp + 1:pos + length - 1].partition(b"=")
        if key not in _PAX_KEYS_USED and key not in _PAX_KEYS_HARMLESS:
            raise Unusual(f"pax record {key!r}")
        out[key] = value
        pos += length
    return out


def member_name(h: bytes, pax: dict, long_name: Optional[bytes]) -> str:
    """A member's name as ``tarfile`` gives it: its pax ``path``, else its GNU long name, else the
    header's name under its ustar prefix (``Unusual`` for a prefix field outside ustar)."""
    if b"path" in pax:
        name = pax[b"path"]
    elif long_name is not None:
        name = long_name
    else:
        name, prefix = h[0:100].split(b"\0", 1)[0], h[345:500].split(b"\0", 1)[0]
        if prefix:
            if h[257:262] != b"ustar":
                raise Unusual("a prefix field outside ustar")
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def _parse(buf: bytes) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    pos, long_name, pax = 0, None, {}
    while pos + _BLOCK <= len(buf):
        h = buf[pos:pos + _BLOCK]
        if h == _ZERO:
            break
        if not checksum_ok(h):
            raise tarfile.ReadError(f"bad header checksum at offset {pos} of the range")
        kind = h[156:157]
        size = int(pax[b"size"]) if b"size" in pax else octal(h[124:136])
        start = pos + _BLOCK
        data = buf[start:start + size]
        if len(data) != size:
            raise tarfile.ReadError(f"a member at offset {pos} of the range runs past its end")
        pos = start + (size + _BLOCK - 1) // _BLOCK * _BLOCK
        if kind == b"x":
            pax = pax_records(data)
            continue
        if kind == b"L":
            long_name = data.rstrip(b"\0")
            continue
        if kind == b"g":  # a global pax header: nothing a sample uses
            continue
        if kind in _REGULAR:
            out.append((member_name(h, pax, long_name), data))
        elif kind not in _SKIPPED:
            raise Unusual(f"member type {kind!r}")
        long_name, pax = None, {}
    return out


def _with_tarfile(buf: bytes) -> list[tuple[str, bytes]]:
    out = []
    with tarfile.open(fileobj=io.BytesIO(buf), mode="r|") as tf:
        for info in tf:
            if info.isreg():
                member = tf.extractfile(info)
                out.append((info.name, member.read() if member is not None else b""))
    return out


def parse_members(buf: bytes) -> list[tuple[str, bytes]]:
    """``(name, data)`` of every regular member in ``buf`` (whole tar headers and data), in order;
    what ``tarfile`` gives, faster.

    Raises:
        tarfile.TarError: the bytes are not tar members (a bad checksum, a member cut short).
    """
    try:
        return _parse(buf)
    except Unusual:
        return _with_tarfile(buf)
