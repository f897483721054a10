"""Tests of the epoch plan: pure functions over ids and seeds (no Ray)."""
from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from sbloader.core.plan import (
    EpochPlan,
    default_rows_per_partition,
    epoch_seed_from,
    make_epoch_plan,
    partition_seed,
    resolve_rows_per_partition,
    row_permutation,
    split_rows,
)

SEEDS = [0, 1, 2, 7, 42, 2**31 - 1, 2**32, 2**62 + 3, 2**63 - 1]
SIZES = [0, 1, 2, 3, 5, 10, 31, 100, 1000]
SEED_RANGE = 2**63


# ----- make_epoch_plan ----------------------------------------------------


@pytest.mark.parametrize("n, seed", itertools.product(SIZES, SEEDS))
def test_plan_is_a_deterministic_permutation(n: int, seed: int) -> None:
    ids = [3 * i + 11 for i in range(n)]  # ids that are not positions
    a = make_epoch_plan(ids, epoch=4, epoch_seed=seed, shuffle=True)
    b = make_epoch_plan(list(ids), epoch=4, epoch_seed=seed, shuffle=True)
    assert a.order == b.order
    assert sorted(a.order) == ids
    assert a.epoch == 4 and a.epoch_seed == seed and a.shuffle is True
    assert a.seq_of() == {pid: i for i, pid in enumerate(a.order)}


@pytest.mark.parametrize("n, seed", itertools.product(SIZES, SEEDS))
def test_plan_without_shuffle_is_identity(n: int, seed: int) -> None:
    ids = [5 * i - 7 for i in range(n)]
    plan = make_epoch_plan(ids, epoch=1, epoch_seed=seed, shuffle=False)
    assert plan.order == tuple(ids)
    assert plan.shuffle is False


@pytest.mark.parametrize("n", [10, 31, 100, 1000])
def test_plan_differs_across_seeds(n: int) -> None:
    orders = {make_epoch_plan(range(n), 0, seed, True).order for seed in SEEDS}
    assert len(orders) == len(SEEDS)
    # A shuffle that moves nothing would pass the test above for a broken RNG too.
    assert all(order != tuple(range(n)) for order in orders)


@pytest.mark.parametrize("seed", SEEDS)
def test_plan_depends_on_the_seed_only(seed: int) -> None:
    ids = list(range(50))
    ref = make_epoch_plan(ids, epoch=0, epoch_seed=seed, shuffle=True).order
    # Not the epoch number, not the global RNGs, not the type of the id sequence.
    random.seed(123)
    np.random.seed(123)
    assert make_epoch_plan(tuple(ids), epoch=9, epoch_seed=seed, shuffle=True).order == ref
    random.seed(999)
    np.random.seed(999)
    assert make_epoch_plan(np.arange(50).tolist(), epoch=3, epoch_seed=seed, shuffle=True).order == ref
    # The same permutation of positions whatever the id values are.
    other = [1000 + 2 * i for i in ids]
    moved = make_epoch_plan(other, epoch=0, epoch_seed=seed, shuffle=True).order
    assert moved == tuple(1000 + 2 * i for i in ref)


def test_plan_golden_order() -> None:
    # Pinned: a resumed job must rebuild the same plan from a checkpoint written
    # by an earlier version.
    assert make_epoch_plan(range(10), 0, 42, True).order == (2, 9, 4, 7, 1, 5, 8, 6, 0, 3)


def test_epoch_plan_rejects_duplicates() -> None:
    with pytest.raises(ValueError, match="once"):
        EpochPlan(epoch=0, epoch_seed=0, order=(1, 2, 1))
    with pytest.raises(ValueError, match="once"):
        make_epoch_plan([4, 4], epoch=0, epoch_seed=0, shuffle=True)


# ----- seeds ----------------------------------------------------------------


# Seeds below 2**32, negative and 63-bit ones. (-1 is the same seed as 2**63 - 1:
# seeds are taken modulo 2**63, as torch's are.)
DISTINCT_SEEDS = [0, 1, 2, 7, 42, 2**31 - 1, 2**32 - 1, 2**62 + 3, -1, -(2**40)]


def test_epoch_seed_from_grid() -> None:
    seen = {}
    for seed, epoch in itertools.product(DISTINCT_SEEDS, range(20)):
        s = epoch_seed_from(seed, epoch)
        assert isinstance(s, int) and 0 <= s < SEED_RANGE
        assert epoch_seed_from(seed, epoch) == s
        seen[(seed, epoch)] = s
    assert len(set(seen.values())) == len(seen)
    # Not symmetric in its arguments.
    assert epoch_seed_from(1, 2) != epoch_seed_from(2, 1)


def test_seed_golden_values() -> None:
    # Pinned: checkpoints store (seed, epoch); replay needs the same derivation.
    assert epoch_seed_from(0, 0) == 6569863346532939966
    assert epoch_seed_from(1234, 7) == 5870685384891924020
    assert partition_seed(6569863346532939966, 0, 0) == 1100486708620331763
    assert partition_seed(42, -3, 1) == 4473115167533760584
    assert partition_seed(42, 5, 100) == 9074197185056876691


@pytest.mark.parametrize("epoch_seed", SEEDS)
def test_partition_seed_distinct_and_stable(epoch_seed: int) -> None:
    pids = list(range(-20, 60)) + [2**40, -(2**40)]
    salts = [0, 1, 2, 100, 101, 150]
    seeds = {}
    for pid, salt in itertools.product(pids, salts):
        s = partition_seed(epoch_seed, pid, salt)
        assert isinstance(s, int) and 0 <= s < SEED_RANGE
        assert partition_seed(epoch_seed, pid, salt) == s
        seeds[(pid, salt)] = s
    assert len(set(seeds.values())) == len(seeds)


def test_partition_seed_distinct_across_epoch_seeds() -> None:
    epoch_seeds = [epoch_seed_from(s, e) for s in (0, 1, 42) for e in range(5)]
    values = {partition_seed(es, pid, salt) for es in epoch_seeds for pid in range(-3, 10) for salt in (0, 1, 100)}
    assert len(values) == len(epoch_seeds) * 13 * 3


def test_negative_seed_is_taken_modulo_2_64() -> None:
    assert epoch_seed_from(-1, 3) == epoch_seed_from(2**64 - 1, 3)
    assert partition_seed(-1, 3, 0) == partition_seed(2**64 - 1, 3, 0)
    assert epoch_seed_from(0, -1) == epoch_seed_from(0, 2**64 - 1)


def test_partition_seed_default_salt_is_zero() -> None:
    assert partition_seed(7, 3) == partition_seed(7, 3, 0)
    assert partition_seed(7, 3) != partition_seed(7, 3, 1)


# ----- row_permutation ------------------------------------------------------


@pytest.mark.parametrize("n, seed", itertools.product(SIZES, SEEDS[:5]))
def test_row_permutation_is_a_deterministic_permutation(n: int, seed: int) -> None:
    for pid in (-1, 0, 1, 17):
        p = row_permutation(n, seed, pid)
        assert p.shape == (n,)
        assert np.issubdtype(p.dtype, np.integer)
        assert np.array_equal(np.sort(p), np.arange(n))
        assert np.array_equal(row_permutation(n, seed, pid), p)


@pytest.mark.parametrize("n", [10, 100, 1000])
def test_row_permutation_differs_across_partitions_and_seeds(n: int) -> None:
    perms = {
        tuple(row_permutation(n, seed, pid).tolist()) for seed in SEEDS[:5] for pid in range(-2, 8)
    }
    assert len(perms) == 5 * 10
    assert tuple(range(n)) not in perms


def test_row_permutation_independent_of_global_rngs() -> None:
    np.random.seed(1)
    a = row_permutation(64, 5, 2)
    np.random.seed(2)
    np.random.random(10)
    assert np.array_equal(row_permutation(64, 5, 2), a)


def test_row_permutation_differs_from_plan_order() -> None:
    # The plan and the rows of each partition draw from different salts.
    for seed in SEEDS:
        plan = make_epoch_plan(range(40), 0, seed, True).order
        assert all(tuple(row_permutation(40, seed, pid).tolist()) != plan for pid in (-1, 0, 1))


# ----- split_rows -------------------------------------------------------------


@pytest.mark.parametrize(
    "n, rpp",
    itertools.product(list(range(0, 40)) + [97, 1000, 1023, 1024, 1025], [1, 2, 3, 4, 7, 10, 39, 64, 1024, 5000]),
)
def test_split_rows_covers_once(n: int, rpp: int) -> None:
    ranges = split_rows(n, rpp)
    assert len(ranges) == math.ceil(n / rpp)
    covered = [r for a, b in ranges for r in range(a, b)]
    assert covered == list(range(n))
    for k, (a, b) in enumerate(ranges):
        assert 0 < b - a <= rpp
        if k < len(ranges) - 1:
            assert b - a == rpp  # only the last range may be short
        if k:
            assert a == ranges[k - 1][1]


@pytest.mark.parametrize("rpp", [0, -1, -100])
def test_split_rows_rejects_non_positive(rpp: int) -> None:
    with pytest.raises(ValueError, match=str(rpp)):
        split_rows(10, rpp)


# ----- rows per partition -----------------------------------------------------


@pytest.mark.parametrize(
    "n, parallelism, bounds",
    itertools.product(
        [1, 2, 3, 7, 8, 9, 31, 100, 1000, 4096, 10**5, 10**7],
        [0, 1, 2, 3, 8, 64],
        [(1, 1024), (1, 1), (4, 16), (10, 10), (1, 10**9)],
    ),
)
def test_default_rows_per_partition_grid(n: int, parallelism: int, bounds: tuple[int, int]) -> None:
    lo, hi = bounds
    r = default_rows_per_partition(n, parallelism, max_rows=hi, min_rows=lo)
    assert isinstance(r, int)
    assert lo <= r <= hi
    cap = max(1, 4 * parallelism)  # about four partitions per worker
    target = math.ceil(n / cap)
    if lo <= target <= hi:
        # At most ``cap`` partitions, with the fewest rows that achieve it.
        assert len(split_rows(n, r)) <= cap
        assert r == 1 or len(split_rows(n, r - 1)) > cap or r - 1 < lo
    elif target > hi:
        assert r == hi
    else:
        assert r == lo


def test_default_rows_per_partition_defaults() -> None:
    assert default_rows_per_partition(10**9, 1) == 1024
    assert default_rows_per_partition(1, 64) == 1
    assert default_rows_per_partition(800, 2) == 100
    assert default_rows_per_partition(801, 2) == 101


@pytest.mark.parametrize("n", [0, -1, -100])
def test_default_rows_per_partition_empty(n: int) -> None:
    assert default_rows_per_partition(n, 4) == 1


@pytest.mark.parametrize(
    "n, num_partitions", itertools.product([0, 1, 2, 5, 10, 99, 100, 101, 1000, 12345], [1, 2, 3, 4, 7, 10, 100, 5000])
)
def test_resolve_by_num_partitions(n: int, num_partitions: int) -> None:
    r = resolve_rows_per_partition(n, parallelism=8, num_partitions=num_partitions)
    assert r >= 1
    # Never more partitions than asked for, with the fewest rows that achieve it.
    assert len(split_rows(n, r)) <= num_partitions
    assert r == 1 or len(split_rows(n, r - 1)) > num_partitions
    if n >= num_partitions and n % num_partitions == 0:
        assert len(split_rows(n, r)) == num_partitions


@pytest.mark.parametrize("n, rpp, parallelism", itertools.product([0, 1, 10, 1000], [1, 3, 1024, 10**6], [1, 8]))
def test_resolve_by_rows_per_partition(n: int, rpp: int, parallelism: int) -> None:
    assert resolve_rows_per_partition(n, parallelism, rows_per_partition=rpp) == rpp


@pytest.mark.parametrize("n, parallelism", itertools.product([0, 1, 10, 1000, 10**6], [1, 2, 8, 32]))
def test_resolve_defaults(n: int, parallelism: int) -> None:
    assert resolve_rows_per_partition(n, parallelism) == default_rows_per_partition(n, parallelism)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_partitions": 2, "rows_per_partition": 3}, "not both"),
        ({"num_partitions": 0}, "found 0"),
        ({"num_partitions": -3}, "found -3"),
        ({"rows_per_partition": 0}, "found 0"),
        ({"rows_per_partition": -5}, "found -5"),
    ],
)
def test_resolve_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_rows_per_partition(100, 4, **kwargs)
