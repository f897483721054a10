"""The coordinator's compact delivery logs (core/runs.py) and the lease arithmetic (core/lease.py)."""
from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from sbloader.core import ledger
from sbloader.core.lease import RateMeter, lease_size
from sbloader.core.runs import RunLog


def _patterns(n: int, world: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    rank = rng.randrange(world)
    shuffled = list(range(n))
    rng.shuffle(shuffled)
    return {
        "in_order": list(range(rank, n * world, world))[:n],
        "rising_with_gaps": sorted(rng.sample(range(4 * n + 1), n)),
        "shuffled": shuffled,
        "repeats": [rng.randrange(3) for _ in range(n)],
        "empty": [],
    }


@pytest.mark.parametrize("n,world,seed", list(itertools.product([0, 1, 2, 3, 17, 200], [1, 3, 64], [0, 1])))
def test_a_runlog_reads_as_its_list(n: int, world: int, seed: int) -> None:
    for name, values in _patterns(n, world, seed).items():
        log = RunLog(values)
        assert len(log) == len(values), name
        assert list(log) == values, name
        assert log == values, name
        for i in range(len(values)):
            assert log[i] == values[i] and log[-1 - i] == values[-1 - i], (name, i)
        for a, b in [(0, n), (1, n - 1), (n // 2, n), (3, 2), (0, 0), (n, n + 5)]:
            assert log[a:b] == values[a:b], (name, a, b)
        assert log[::3] == values[::3], name


def test_a_runlog_index_out_of_range_says_so() -> None:
    with pytest.raises(IndexError, match="out of range for 2 values"):
        RunLog([1, 2])[2]


@pytest.mark.parametrize("world", [1, 8, 256, 1024])
def test_an_in_order_log_is_one_run_whatever_its_length(world: int) -> None:
    log = RunLog(range(5, 5 + world * 10_000, world))
    assert len(log.runs()) == 1
    assert len(json.dumps(log.runs())) < 40


@pytest.mark.parametrize("world,k", list(itertools.product([1, 2, 5, 32], [0, 1, 7, 20])))
def test_the_incremental_cut_reads_runlogs_as_lists(world: int, k: int) -> None:
    per_rank, bs = 20, 4
    ranges = [((i * bs, (i + 1) * bs),) for i in range(world * per_rank)]
    order = list(range(world * per_rank))
    random.Random(world * 31 + k).shuffle(order)  # the shared pool: any rank takes any batch
    lists = [order[r::world] for r in range(world)]
    logs = [RunLog(x) for x in lists]
    cutter = ledger.IncrementalCut(ranges)
    for kk in sorted({0, k // 2, k}):
        assert cutter.after(kk, logs) == ledger.cut(lists, kk, ranges)
    assert ledger.count(cutter.after(k, logs)) == world * k * bs


@pytest.mark.parametrize("rate,ask,interval,cap", list(itertools.product(
    [0.0, -1.0, 0.5, 1.0, 4.99, 5.0, 7.3, 40.0, math.inf, math.nan], [1, 2, 4], [0.0, 0.25, 1.0, 3.0], [1, 4, 8, 64])))
def test_a_lease_lasts_the_interval_within_its_bounds(rate: float, ask: int, interval: float, cap: int) -> None:
    n = lease_size(rate, ask, interval, cap)
    assert isinstance(n, int) and ask <= n <= max(ask, cap)
    if rate > 0 and math.isfinite(rate):
        want = math.ceil(rate * interval - 1e-9)
        assert n == min(max(ask, cap), max(ask, want))
        # it lasts the interval unless capped
        assert n * 1.0 / rate >= interval - 1e-9 or n == max(ask, cap)
    elif rate == math.inf:
        assert n == max(ask, cap)
    else:  # unknown pace: the prefetch only
        assert n == ask


def test_a_lease_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="ask must be at least 1"):
        lease_size(5.0, 0)
    with pytest.raises(ValueError, match="interval_s must be >= 0"):
        lease_size(5.0, 2, -1.0)


@pytest.mark.parametrize("rate", [0.5, 5.0, 200.0])
def test_the_rate_meter_converges_to_the_pace(rate: float) -> None:
    m = RateMeter()
    assert m.took(10.0) == 0.0  # one batch: no rate yet
    t = 10.0
    for _ in range(60):
        t += 1.0 / rate
        m.took(t)
    assert m.rate == pytest.approx(rate, rel=1e-6)
    for _ in range(60):  # the pace halves: the estimate follows
        t += 2.0 / rate
        m.took(t)
    assert m.rate == pytest.approx(rate / 2, rel=0.01)
