"""The WebDataset shard index and the pure parts of the source (no Ray): brace patterns, the key
rule, header offsets, ranges read by one seek, decoding, damaged shards."""
from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest

from sbloader.sources.tar_index import index_shard, read_members, split_key
from sbloader.sources.webdataset import (decode_value, expand_braces, group_samples, list_shards, open_shard,
                                         shard_ranges)
from wds_shards import write_shards

pytest.importorskip("webdataset")


@pytest.mark.parametrize("pattern", ["a/train-{000000..000011}.tar", "x{0..3}y{a,bc}.tar", "{5..2}.tar",
                                     "plain.tar", "s-{1,2}-{08..10}.tar"])
def test_brace_patterns_expand_as_webdataset_s(pattern):
    from braceexpand import braceexpand

    assert expand_braces(pattern) == list(braceexpand(pattern))


def test_a_brace_range_needs_integer_bounds():
    with pytest.raises(ValueError, match="integer bounds"):
        expand_braces("t-{a..c}.tar")


@pytest.mark.parametrize("name", ["000123.jpg", "a/b.seg.png", "dir.x/k.tar.gz", "noext", "k.JPG", "a/.hidden"])
def test_the_key_rule_is_webdataset_s(name):
    from webdataset.tariterators import base_plus_ext

    assert split_key(name) == base_plus_ext(name)


def test_the_index_has_every_sample_and_a_range_reads_only_its_samples(tmp_path):
    path = write_shards(str(tmp_path), shards=1, per_shard=9)[0]
    idx = index_shard(path, open_shard)
    assert idx.error == "" and idx.keys == tuple(f"s0_{i:03d}" for i in range(9))
    assert idx.extensions == ("cls", "jpg", "json", "txt")
    with tarfile.open(path) as tf:  # each sample starts at its first member's header
        first = {}
        for m in tf.getmembers():
            first.setdefault(m.name.split(".")[0], m.offset)
    assert list(idx.starts) == [first[k] for k in idx.keys]
    ranges = shard_ranges(idx, 4)
    assert [(r.first, r.stop) for r in ranges] == [(0, 4), (4, 8), (8, 9)]
    with open(path, "rb") as f:
        got = group_samples(read_members(f, ranges[1].start, ranges[1].end))
    assert [k for k, _ in got] == list(idx.keys[4:8])
    assert got[0][1]["txt"] == b"caption 4" and set(got[0][1]) == {"cls", "jpg", "json", "txt"}


def _truncate(src: str, dst: str, nbytes: int) -> None:
    with open(src, "rb") as f:
        data = f.read()
    with open(dst, "wb") as f:
        f.write(data[:nbytes])


def test_a_truncated_shard_keeps_the_samples_before_the_cut_but_the_last_and_says_why(tmp_path):
    path = write_shards(str(tmp_path / "w"), shards=1, per_shard=9)[0]
    whole = index_shard(path, open_shard)
    cut = str(tmp_path / "cut.tar")
    _truncate(path, cut, int(whole.starts[5]) + 700)  # inside sample 5
    idx = index_shard(cut, open_shard)
    # Sample 4 is whole, but nothing says it had no member after the cut: left out too.
    assert "truncated" in idx.error and idx.keys == whole.keys[:4]
    _truncate(path, cut, int(whole.starts[5]))  # between two samples: no end-of-archive marker
    idx = index_shard(cut, open_shard)
    assert "truncated" in idx.error and idx.keys == whole.keys[:4]
    assert shard_ranges(idx, None)[-1].error == idx.error


def test_a_corrupt_header_is_found(tmp_path):
    path = write_shards(str(tmp_path), shards=1, per_shard=6)[0]
    idx = index_shard(path, open_shard)
    with open(path, "r+b") as f:
        f.seek(int(idx.starts[3]))
        f.write(b"\x07garbage" * 64)
    bad = index_shard(path, open_shard)
    assert bad.error and bad.keys == idx.keys[:2]
    (tmp_path / "empty.tar").write_bytes(b"")
    assert index_shard(str(tmp_path / "empty.tar"), open_shard).error


def test_decoding_by_extension_matches_webdataset_s_decoders():
    from webdataset.autodecode import Decoder, basichandlers, imagehandler

    from sbloader.datagen import jpeg_bytes, synthetic_image

    img = synthetic_image(np.random.default_rng(0), 33, 21)
    sample = {"jpg": jpeg_bytes(img), "seg.jpeg": jpeg_bytes(img.convert("L")), "txt": "héllo".encode(),
              "cls": b"7", "cls2": b"12", "index": b"3", "json": json.dumps({"a": [1, 2]}).encode(),
              "bin": b"\x00\x01"}
    theirs = Decoder([imagehandler("rgb8"), basichandlers])(dict(sample))
    for ext, data in sample.items():
        ours = decode_value(ext, data)
        if isinstance(ours, np.ndarray):
            assert ours.shape == theirs[ext].shape and np.array_equal(ours, theirs[ext]), ext
        else:
            assert ours == theirs[ext] and type(ours) is type(theirs[ext]), ext
    assert decode_value("npy", b"raw") == b"raw"  # not in the list: stays bytes (webdataset would load it)


def test_grouping_leaves_out_meta_and_names_without_a_dot():
    members = [("__meta__", b"m"), ("a.txt", b"1"), ("a.JPG", b"2"), ("README", b"r"), ("b.txt", b"3"),
               ("a.cls", b"4")]
    assert group_samples(members) == [("a", {"txt": b"1", "jpg": b"2"}), ("b", {"txt": b"3"}), ("a", {"cls": b"4"})]


def test_shards_listed_from_a_directory_a_glob_a_brace_pattern_and_a_list(tmp_path):
    paths = write_shards(str(tmp_path / "d"), shards=3, per_shard=1, images=False)
    (tmp_path / "d" / "notes.txt").write_text("x")
    assert list_shards(str(tmp_path / "d"))[0] == paths
    assert list_shards(str(tmp_path / "d" / "*.tar"))[0] == paths
    assert list_shards(str(tmp_path / "d" / "train-{000000..000002}.tar"))[0] == paths
    assert list_shards([paths[2], paths[0]])[0] == [paths[2], paths[0]]
    with pytest.raises(FileNotFoundError):
        list_shards(str(tmp_path / "d" / "train-{000003..000004}.tar"))
    assert os.path.isabs(list_shards(os.path.relpath(paths[0]))[0][0])


def test_a_member_with_a_long_name_is_found_at_its_extended_header(tmp_path):
    path = str(tmp_path / "long.tar")
    long_key = "d/" + "k" * 150
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for key in ("short", long_key, "z"):
            for ext, data in (("txt", key.encode()), ("cls", b"1")):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    idx = index_shard(path, open_shard)
    assert idx.keys == ("short", long_key, "z") and idx.error == ""
    with open(path, "rb") as f:
        assert group_samples(read_members(f, int(idx.starts[1]), int(idx.stops[1])))[0][1]["txt"] == long_key.encode()


def _tar_bytes(fmt: int, entries: list) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            elif isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_fast_member_parser_gives_what_tarfile_gives(fmt, tmp_path):
    from sbloader.sources.tar_members import _parse, _with_tarfile, parse_members

    entries = [("d", None), ("d/a.txt", b"x" * 513), ("d/a.cls", b"1"), ("link.txt", "d/a.txt"),
               ("p/" * 60 + "long.jpg", b"\xff" * 1000), ("\u00e9t\u00e9.json", b"{}"), ("empty.bin", b"")]
    if fmt == tarfile.USTAR_FORMAT:  # no long names, no non-ASCII
        entries = [e for e in entries if len(e[0]) < 100 and e[0].isascii()]
    buf = _tar_bytes(fmt, entries)
    assert _parse(buf) == _with_tarfile(buf) and len(_parse(buf)) >= 3  # the fast path, not the fallback
    shard = write_shards(str(tmp_path), shards=1, per_shard=3)[0]  # webdataset's TarWriter
    data = open(shard, "rb").read()
    assert _parse(data) == _with_tarfile(data) and len(_parse(data)) == 12
    bad = bytearray(buf)
    bad[600] ^= 0xFF  # inside the second header: its checksum no longer matches
    with pytest.raises(tarfile.TarError):
        parse_members(bytes(bad[512:]) if fmt != tarfile.PAX_FORMAT else bytes(bad))


def test_a_header_the_fast_parser_does_not_know_goes_to_tarfile():
    from sbloader.sources.tar_members import Unusual, _parse, _with_tarfile, parse_members

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(2):
            info = tarfile.TarInfo(f"k{i}.txt")
            info.size, info.pax_headers = 2, {"SCHILY.xattr.user.x": "1"}
            tf.addfile(info, io.BytesIO(b"hi"))
    data = buf.getvalue()
    with pytest.raises(Unusual):
        _parse(data)
    assert parse_members(data) == _with_tarfile(data) == [("k0.txt", b"hi"), ("k1.txt", b"hi")]


def test_a_shard_indexed_through_ranged_reads_equals_the_local_index(tmp_path):
    from sbloader.sources.remote_shards import RangeFile

    (path,) = write_shards(str(tmp_path / "d"), shards=1, per_shard=9)
    data = open(path, "rb").read()
    asked = []

    def read_range(uri, start, end):
        asked.append((start, end))
        return data[start:end]

    files = []

    def opener(p):
        files.append(RangeFile(p, len(data), read_range, block=4096))
        return files[-1]

    local = index_shard(path, open_shard)
    remote = index_shard(path, opener)
    assert remote.keys == local.keys and not remote.error and remote.file_size == len(data)
    assert np.array_equal(remote.starts, local.starts) and np.array_equal(remote.stops, local.stops)
    # Blocks of 4 KiB, each asked for once while reading forward (the end-of-archive check may re-read one).
    assert len(asked) <= len(data) // 4096 + 2 and all(e - s >= 4096 or e == len(data) for s, e in asked)
    cut = data[:len(data) // 2 + 100]
    damaged = index_shard(path, lambda p: RangeFile(p, len(cut), lambda u, s, e: cut[s:e], block=4096))
    assert damaged.error.startswith("truncated") and 0 < damaged.num_samples < 9


def _both_ways(path: str, monkeypatch) -> tuple:
    """The shard's index by the header walk, whether the walk took it whole, and tarfile's index."""
    from sbloader.sources import tar_index

    whole = []
    real = tar_index._walk

    def walk(*a):
        end = real(*a)  # raises Unusual where it leaves the shard to tarfile
        whole.append(end)
        return end

    with monkeypatch.context() as m:
        m.setattr(tar_index, "_walk", walk)
        fast = index_shard(path, open_shard)
    return fast, _index_by_tarfile(path, monkeypatch), bool(whole)


def _index_by_tarfile(path: str, monkeypatch) -> tuple:
    from sbloader.sources import tar_index

    def off(*a):
        raise tar_index.Unusual("tarfile, for the comparison")

    with monkeypatch.context() as m:
        m.setattr(tar_index, "_walk", off)
        idx = index_shard(path, open_shard)
    return (idx.keys, idx.starts.tolist(), idx.stops.tolist(), idx.extensions, idx.error, idx.file_size)


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, "webdataset"])
def test_the_header_walk_indexes_a_shard_as_tarfile_does(fmt, tmp_path, monkeypatch):
    """The index reads each header with a few byte slices (about 3x faster than tarfile's objects: a
    shard's creation at 100 ms per request waited on it, #47), and gives tarfile's index: long names
    (pax, GNU), ustar prefixes, directories, links, empty members, a name without a dot; damaged shards
    (cut, a bad header, a repeated extension) go to tarfile and say what it says."""
    if fmt == "webdataset":
        (path,) = write_shards(str(tmp_path / "w"), shards=1, per_shard=5)  # pax headers (a float mtime)
    else:
        entries = [("d", None), ("d/a.txt", b"x" * 513), ("d/a.cls", b"1"), ("link.txt", "d/a.txt"),
                   ("p/" * 60 + "long.jpg", b"\xff" * 1000), ("q/" * 40 + "pre.txt", b"u"),
                   ("\u00e9t\u00e9.json", b"{}"), ("empty.bin", b""), ("nodot", b"z")]
        if fmt == tarfile.USTAR_FORMAT:  # no non-ASCII, names up to 255 through the prefix field
            entries = [e for e in entries if len(e[0]) < 250 and e[0].isascii()]
        path = str(tmp_path / "s.tar")
        with open(path, "wb") as f:
            f.write(_tar_bytes(fmt, entries))
    fast, slow, walked = _both_ways(path, monkeypatch)
    assert (fast.keys, fast.starts.tolist(), fast.stops.tolist(), fast.extensions, fast.error,
            fast.file_size) == slow and walked and fast.error == "" and len(fast.keys) >= 4
    data = open(path, "rb").read()
    at = int(fast.starts[2])  # the third sample's first header
    flipped = data[:at + 10] + bytes([data[at + 10] ^ 1]) + data[at + 11:]  # a header's checksum fails
    for name, damaged in (("cut", data[:at + 700]), ("bad", flipped), ("twice", None)):
        p = str(tmp_path / f"{name}.tar")
        if damaged is None:
            damaged = _tar_bytes(tarfile.GNU_FORMAT, [("k.txt", b"1"), ("k.txt", b"2")])
        with open(p, "wb") as f:
            f.write(damaged)
        idx = index_shard(p, open_shard)
        assert (idx.keys, idx.starts.tolist(), idx.stops.tolist(), idx.extensions, idx.error,
                idx.file_size) == _index_by_tarfile(p, monkeypatch) and idx.error, name
