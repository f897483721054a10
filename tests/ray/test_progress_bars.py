"""Progress bars: one tqdm bar per executed stage, like the entries of ``stats()``.

The executor builds its bars with ``tqdm.auto.tqdm`` when the iteration starts; the
bars are swapped for a recording subclass that writes to a string buffer.
"""
from __future__ import annotations

import io
import sys

import pytest

import sbloader

tqdm_std = pytest.importorskip("tqdm.std")


class RecordingTqdm(tqdm_std.tqdm):
    """A real tqdm bar, written to a buffer, that remembers its count when closed."""

    made: list["RecordingTqdm"] = []

    def __init__(self, *args, **kwargs):
        self.created_with = dict(kwargs)
        kwargs["file"] = io.StringIO()
        super().__init__(*args, **kwargs)
        self.final_n = None
        RecordingTqdm.made.append(self)

    def close(self):
        if self.final_n is None:
            self.final_n = self.n
        super().close()


@pytest.fixture
def bars(monkeypatch):
    import tqdm.auto

    RecordingTqdm.made = []
    monkeypatch.setattr(tqdm.auto, "tqdm", RecordingTqdm)
    return RecordingTqdm.made


def _plus_one(row: dict) -> dict:
    return {"id": row["id"] + 1}


def _double(batch: dict) -> dict:
    return {"id": batch["id"] * 2}


def _multiple_of_four(row: dict) -> bool:
    return row["id"] % 4 == 0


class AddTen:
    def __call__(self, batch: dict) -> dict:
        return {"id": batch["id"] + 10}


def _three_stages():
    # read + map fuse; map_batches + filter (half a CPU each) fuse into a task stage;
    # the callable class gets an actor-pool stage
    return (sbloader.range(60, num_partitions=6)
            .map(_plus_one)
            .map_batches(_double, num_cpus=0.5)
            .filter(_multiple_of_four, num_cpus=0.5)
            .map_batches(AddTen, concurrency=1, num_cpus=0.5))


def test_one_bar_per_stage_with_the_right_total(ray_session, bars):
    ds = _three_stages()
    rows = sorted(int(r["id"]) for r in ds.iter_rows(progress=True))
    assert rows == [2 * (i + 1) + 10 for i in range(60) if (2 * (i + 1)) % 4 == 0]

    ops = ds.stats().operators
    assert [o.name for o in ops] == [
        "ReadRange->Map(_plus_one)", "MapBatches(_double)->Filter(_multiple_of_four)", "MapBatches(AddTen)"]
    assert len(bars) == len(ops) == 3, [b.desc for b in bars]
    assert [b.created_with["desc"] for b in bars] == [o.name[:30] for o in ops]
    assert len({b.created_with["position"] for b in bars}) == 3  # stacked, not drawn over each other
    # the read stage's total is the source's rows, and it ends there
    assert bars[0].total == 60 and bars[0].final_n == 60
    # each bar counted the rows its stage output, as stats() did
    assert [b.final_n for b in bars] == [o.rows for o in ops] == [60, 30, 30]
    for b in bars[1:]:
        assert b.total is None or b.total == b.final_n, (b.desc, b.total, b.final_n)
    assert all(b.disable or b.final_n is not None for b in bars)  # closed at the end of the epoch
    assert all(b.created_with.get("leave") is False for b in bars)


def test_fused_operators_share_one_bar_and_one_stats_entry(ray_session, bars):
    ds = sbloader.from_items([{"id": i} for i in range(20)], num_partitions=4).map(_plus_one).map(_plus_one)
    assert [int(r["id"]) for r in ds.iter_rows(progress=True, deterministic=True)] == list(range(2, 22))
    assert [o.name for o in ds.stats().operators] == ["ReadFromItems->Map(_plus_one)->Map(_plus_one)"]
    assert len(bars) == 1 and bars[0].total == 20 and bars[0].final_n == 20


class _FakeTTY:
    """sys.stderr, claiming to be a terminal."""

    def __init__(self, stream, tty: bool) -> None:
        self._stream, self._tty = stream, tty

    def isatty(self) -> bool:
        return self._tty

    def __getattr__(self, name):
        return getattr(self._stream, name)


@pytest.mark.parametrize("progress, tty, shown", [
    (None, True, True), (None, False, False), (False, True, False), (True, False, True)])
def test_bars_default_to_a_terminal_and_follow_the_option(ray_session, bars, monkeypatch, progress, tty, shown):
    monkeypatch.setattr(sys, "stderr", _FakeTTY(sys.stderr, tty))
    ds = sbloader.range(8, num_partitions=2).map(_plus_one)
    assert sorted(int(r["id"]) for r in ds.iter_rows(progress=progress)) == list(range(1, 9))
    assert len(bars) == (1 if shown else 0)


def test_a_bar_with_a_total_ends_at_it_when_a_fused_filter_drops_rows(ray_session, bars):
    ds = sbloader.range(60, num_partitions=6).filter(_multiple_of_four)
    assert len(list(ds.iter_rows(progress=True))) == 15
    assert len(bars) == 1
    assert bars[0].total is None or bars[0].final_n == bars[0].total, (bars[0].total, bars[0].final_n)
