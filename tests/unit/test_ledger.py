"""The consumed ledger (sbloader.core.ledger): pure functions over position ranges.

Every property is checked against a set-of-positions reference over big random
grids (seeded, so a failure reproduces): ranges of every shape (empty, reversed,
overlapping, touching, nested, partly outside ``[0, total)``), in any order.
"""
from __future__ import annotations

import numpy as np
import pytest

from sbloader.core import ledger

GRID = 400  # random cases per property


def _rng(salt: int) -> np.random.Generator:
    return np.random.default_rng(20240600 + salt)


def _random_ranges(rng: np.random.Generator, total: int, outside: bool = False) -> list:
    """Up to 30 ranges of every shape; with ``outside``, some reach past ``[0, total)``."""
    lo, hi = (-total // 4 - 3, total + total // 4 + 3) if outside else (0, total)
    out = []
    for _ in range(int(rng.integers(0, 31))):
        a = int(rng.integers(lo, hi + 1))
        kind = rng.random()
        if kind < 0.1:
            b = a  # empty
        elif kind < 0.2:
            b = a - int(rng.integers(1, 5))  # reversed: empty too
        elif kind < 0.7:
            b = a + int(rng.integers(1, 6))  # short: many touch or overlap
        else:
            b = a + int(rng.integers(1, max(2, total // 3)))
        if not outside:
            a, b = min(a, total), min(b, total)
        out.append((a, b) if rng.random() < 0.5 else [a, b])  # tuples or JSON-style lists
    return out


def _covered(ranges) -> set:
    return {p for a, b in ranges for p in range(int(a), int(b))}


def _check_canonical(merged) -> None:
    """Sorted, non-empty, disjoint and not touching: one range per run of positions."""
    assert all(isinstance(r, tuple) and len(r) == 2 for r in merged), merged
    assert all(isinstance(v, int) for r in merged for v in r), merged
    assert all(a < b for a, b in merged), merged
    assert all(b0 < a1 for (_, b0), (a1, _) in zip(merged, merged[1:])), merged


# ----- merge ------------------------------------------------------------------------

def test_merge_covers_exactly_the_union_canonically():
    rng = _rng(1)
    for case in range(GRID):
        total = int(rng.integers(1, 300))
        ranges = _random_ranges(rng, total, outside=case % 2 == 0)
        merged = ledger.merge(ranges)
        _check_canonical(merged)
        assert _covered(merged) == _covered(ranges), (ranges, merged)


def test_merge_is_idempotent_and_order_free():
    rng = _rng(2)
    for _ in range(GRID):
        ranges = _random_ranges(rng, int(rng.integers(1, 300)))
        merged = ledger.merge(ranges)
        assert ledger.merge(merged) == merged
        shuffled = [ranges[i] for i in rng.permutation(len(ranges))]
        assert ledger.merge(shuffled) == merged
        # merging in pieces is merging at once (how a ledger grows step by step)
        cut = int(rng.integers(0, len(ranges) + 1))
        assert ledger.merge(ledger.merge(ranges[:cut]) + ledger.merge(ranges[cut:])) == merged


def test_merge_edges():
    assert ledger.merge([]) == []
    assert ledger.merge([(3, 3), (5, 2)]) == []
    assert ledger.merge([(0, 2), (2, 4)]) == [(0, 4)]  # touching ranges join
    assert ledger.merge([(0, 2), (3, 4)]) == [(0, 2), (3, 4)]  # a gap of one stays
    assert ledger.merge([(0, 10), (2, 3), (4, 12)]) == [(0, 12)]
    assert ledger.merge(np.array([[5, 7], [1, 2]])) == [(1, 2), (5, 7)]


# ----- positions <-> ranges ------------------------------------------------------------

def test_from_positions_and_to_positions_round_trip():
    rng = _rng(3)
    for _ in range(GRID):
        total = int(rng.integers(1, 500))
        density = rng.random()
        chosen = np.nonzero(rng.random(total) < density)[0]
        positions = np.concatenate([chosen, rng.choice(chosen, size=len(chosen) // 3)]) if len(chosen) else chosen
        rng.shuffle(positions)  # unsorted, with duplicates
        ranges = ledger.from_positions(positions.tolist())
        _check_canonical(ranges)
        back = ledger.to_positions(ranges)
        assert back.dtype == np.int64
        assert back.tolist() == sorted(set(chosen.tolist()))
        assert ledger.from_positions(back) == ranges  # and back again
        assert ledger.count(ranges) == len(set(chosen.tolist()))


def test_to_positions_then_from_positions_is_merge():
    rng = _rng(4)
    for _ in range(GRID):
        ranges = ledger.merge(_random_ranges(rng, int(rng.integers(1, 300))))
        positions = ledger.to_positions(ranges)
        assert positions.tolist() == sorted(_covered(ranges))
        assert ledger.from_positions(positions) == ranges
        assert ledger.from_positions(iter(positions.tolist())) == ranges  # any iterable


def test_positions_edges():
    assert ledger.from_positions([]) == []
    assert ledger.to_positions([]).tolist() == []
    assert ledger.from_positions([7]) == [(7, 8)]
    assert ledger.from_positions([3, 1, 2, 2, 9]) == [(1, 4), (9, 10)]
    big = ledger.from_positions(np.arange(1_000_000))
    assert big == [(0, 1_000_000)]


# ----- count -----------------------------------------------------------------------

def test_count_is_positions_covered():
    rng = _rng(5)
    for case in range(GRID):
        total = int(rng.integers(1, 300))
        ranges = _random_ranges(rng, total, outside=case % 3 == 0)
        merged = ledger.merge(ranges)
        assert ledger.count(merged) == len(_covered(ranges))
        # the docstring's contract holds for raw (overlapping, empty, reversed) ranges too
        assert ledger.count(ranges) == len(_covered(ranges)), ranges


def test_count_edges():
    assert ledger.count([]) == 0
    assert ledger.count([(0, 5), (10, 12)]) == 7
    assert ledger.count([[0, 5], [3, 8]]) == 8  # overlap counted once
    assert ledger.count([(4, 2)]) == 0


# ----- complement ------------------------------------------------------------------

def test_complement_is_the_rest_of_the_epoch():
    rng = _rng(6)
    for case in range(GRID):
        total = int(rng.integers(0, 300))
        ranges = _random_ranges(rng, max(total, 1), outside=case % 2 == 0)
        rest = ledger.complement(ranges, total)
        _check_canonical(rest)
        assert all(0 <= a and b <= total for a, b in rest), (ranges, total, rest)
        assert _covered(rest) == set(range(total)) - _covered(ranges), (ranges, total, rest)
        # the consumed part and the rest tile the epoch, once each
        inside = ledger.merge((max(0, a), min(total, b)) for a, b in ranges)
        assert ledger.merge(inside + rest) == ([(0, total)] if total else [])
        assert ledger.count(inside) + ledger.count(rest) == total
        # the complement of the complement is what was consumed (inside the epoch)
        assert ledger.complement(rest, total) == inside


def test_complement_edges():
    assert ledger.complement([], 10) == [(0, 10)]
    assert ledger.complement([], 0) == []
    assert ledger.complement([(0, 10)], 10) == []
    assert ledger.complement([(2, 4), (6, 8)], 10) == [(0, 2), (4, 6), (8, 10)]
    assert ledger.complement([(-5, 3)], 10) == [(3, 10)]
    assert ledger.complement([(8, 50)], 10) == [(0, 8)]
    # a ledger of a longer epoch (a state loaded with strict=False): nothing past the end
    assert ledger.complement([(300, 310)], 240) == [(0, 240)]
    assert ledger.complement([(0, 4), (250, 260)], 240) == [(4, 240)]


# ----- cut -------------------------------------------------------------------------

def _random_epoch(rng: np.random.Generator):
    """An epoch cut into batches (each a few position ranges), delivered to ranks in any order.

    Returns (logs, batch_ranges, prior): ``prior`` is consumed before the run, the
    batches cover the rest; ranks' logs hold batch ids in delivery order, some
    longer than others (prefetched ahead).
    """
    total = int(rng.integers(1, 400))
    prior = ledger.merge(_random_ranges(rng, total))
    remaining = ledger.to_positions(ledger.complement(prior, total))
    batch = int(rng.integers(1, 9))
    batch_ranges = [ledger.from_positions(remaining[i:i + batch]) for i in range(0, len(remaining), batch)]
    world = int(rng.integers(1, 5))
    ids = rng.permutation(len(batch_ranges)).tolist()  # out-of-order delivery
    logs = [[] for _ in range(world)]
    for b in ids:
        logs[int(rng.integers(0, world))].append(b)
    return total, logs, batch_ranges, prior


def test_cut_is_the_first_k_batches_of_every_rank_plus_prior():
    rng = _rng(7)
    for _ in range(GRID):
        total, logs, batch_ranges, prior = _random_epoch(rng)
        k = int(rng.integers(0, min(len(log) for log in logs) + 1))
        before = [list(log) for log in logs], [list(r) for r in batch_ranges], list(prior)
        got = ledger.cut(logs, k, batch_ranges, prior)
        _check_canonical(got)
        expected = _covered(prior) | {p for log in logs for b in log[:k] for p in _covered(batch_ranges[b])}
        assert _covered(got) == expected
        assert (logs, batch_ranges, prior) == before  # inputs untouched
        # what the cut leaves is exactly the undelivered-or-later batches
        later = {p for log in logs for b in log[k:] for p in _covered(batch_ranges[b])}
        assert _covered(ledger.complement(got, total)) == later
        # cuts grow with k
        if k:
            assert _covered(ledger.cut(logs, k - 1, batch_ranges, prior)) <= _covered(got)


def test_cut_of_everything_is_the_whole_epoch():
    rng = _rng(8)
    for _ in range(GRID // 4):
        total, logs, batch_ranges, prior = _random_epoch(rng)
        # equal per-rank counts, as the split plan makes them
        flat = [b for log in logs for b in log]
        world = len(logs)
        per = -(-len(flat) // world)
        flat += [flat[i % len(flat)] for i in range(per * world - len(flat))]  # repeats (padding) are harmless
        logs = [flat[r::world] for r in range(world)]
        assert ledger.cut(logs, per, batch_ranges, prior) == [(0, total)]


def test_cut_with_k_zero_is_prior():
    assert ledger.cut([[0, 1], [2]], 0, [[(0, 2)], [(2, 4)], [(4, 6)]], [(10, 12), (12, 13)]) == [(10, 13)]
    assert ledger.cut([[], []], 0, [], []) == []


def test_cut_names_the_short_ranks():
    batch_ranges = [[(4 * i, 4 * i + 4)] for i in range(10)]
    logs = [[0, 3, 5], [1], [2, 4, 6], []]
    with pytest.raises(ValueError, match=r"ranks \[1, 3\] have fewer than 2 batches delivered"):
        ledger.cut(logs, 2, batch_ranges)
    with pytest.raises(ValueError, match=r"ranks \[0, 1, 2, 3\] have fewer than 4"):
        ledger.cut(logs, 4, batch_ranges)
    assert ledger.cut(logs[:1] + logs[2:3], 3, batch_ranges) == [(0, 4), (8, 28)]


def test_cut_names_short_ranks_on_random_grids():
    rng = _rng(9)
    for _ in range(GRID // 2):
        _, logs, batch_ranges, prior = _random_epoch(rng)
        k = max(len(log) for log in logs) + int(rng.integers(0, 2))
        short = [r for r, log in enumerate(logs) if len(log) < k]
        if not short:
            continue
        with pytest.raises(ValueError) as e:
            ledger.cut(logs, k, batch_ranges, prior)
        assert f"ranks {short} have fewer than {k} batches" in str(e.value)
