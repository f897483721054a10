"""The mixing shuffle's pure parts (issue #17): the epoch's members, the cut plan, the
consumed ledger after k batches, the state's size, over grids of sizes, batch sizes,
world sizes, windows and seeds."""
from __future__ import annotations

import json

import numpy as np
import pytest

import sbloader
from sbloader.core.cut import Cutter, consumed_after, cut_plan, last_use, progress
from sbloader.core.plan import cut_counts, cut_members, make_epoch_plan, member_positions

CLASSES = 10
PER_CLASS = 128


# ----- pure: the epoch's members ------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 65, 1000])
@pytest.mark.parametrize("seed", [0, 1, 2**62 + 7])
def test_members_are_a_permutation_drawn_from_the_epoch_seed(n: int, seed: int) -> None:
    a = member_positions(n, seed, True)
    assert sorted(a.tolist()) == list(range(n))
    assert np.array_equal(a, member_positions(n, seed, True))
    assert np.array_equal(member_positions(n, seed, False), np.arange(n))
    if n >= 64:
        assert not np.array_equal(a, member_positions(n, seed + 1, True))
        assert not np.array_equal(a, np.arange(n))


@pytest.mark.parametrize("n,per", [(0, 1), (1, 1), (10, 3), (64, 64), (65, 64), (1000, 7)])
def test_cut_members_covers_every_place_once_in_runs(n: int, per: int) -> None:
    chunks = cut_members(member_positions(n, 5, True), per)
    assert [len(c) for c in chunks[:-1]] == [per] * (len(chunks) - 1) if chunks else n == 0
    assert sorted(np.concatenate(chunks).tolist() if chunks else []) == list(range(n))


def test_a_class_sorted_listing_is_mixed_in_every_partition() -> None:
    labels = np.repeat(np.arange(CLASSES), PER_CLASS)
    for seed in range(5):
        for chunk in cut_members(member_positions(len(labels), seed, True), 64):
            assert len(set(labels[chunk].tolist())) >= 7


# ----- pure: the cut --------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 3])
def test_cut_counts_draw_without_replacement_deterministically(seed: int) -> None:
    for remaining, rows in [([5, 0, 7], 12), ([100], 30), ([3, 3, 3, 3], 5), ([1, 1], 1)]:
        c = cut_counts(remaining, rows, seed, 4)
        assert c.sum() == rows and (c <= np.asarray(remaining)).all() and (c >= 0).all()
        assert np.array_equal(c, cut_counts(remaining, rows, seed, 4))
    with pytest.raises(ValueError, match="cannot take"):
        cut_counts([2, 2], 5, 0, 0)


def _rows_grid() -> list[list[int]]:
    return [[64] * 5, [256, 256, 1, 0, 100], [3], [10] * 37, [1000], [0, 0, 7], [5, 9, 2, 64, 64, 64, 13]]


@pytest.mark.parametrize("rows", _rows_grid())
@pytest.mark.parametrize("batch_size", [1, 7, 64])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("window", [1, 4, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_cut_plan_takes_every_row_once_with_equal_counts(rows, batch_size, world_size, window, drop_last) -> None:
    plan = cut_plan(rows, batch_size, world_size, drop_last, window, epoch_seed=11)
    taken = {i: [] for i in range(len(rows))}
    for b in plan.batches:
        assert b.rank == b.index % world_size
        assert b.rows <= batch_size
        for p in b.pieces:
            taken[p.key].append((p.start, p.stop))
    for i, n in enumerate(rows):
        ranges = sorted(taken[i])
        covered = sum(b - a for a, b in ranges)
        assert all(a == prev_b for (a, _), (_, prev_b) in zip(ranges[1:], ranges))  # a prefix, in order
        if not drop_last:
            assert covered == n
    assert sum(b.rows for b in plan.batches) + plan.dropped == sum(rows)
    counts = [len(plan.for_rank(r)) for r in range(world_size)]
    assert counts == [plan.per_rank] * world_size
    assert plan == cut_plan(rows, batch_size, world_size, drop_last, window, epoch_seed=11)


def test_a_window_draws_each_batch_from_every_open_partition() -> None:
    plan = cut_plan([256] * 5, 64, 1, False, 8, epoch_seed=1)
    assert all(len(b.pieces) == 5 for b in plan.batches[:-2])
    in_turn = cut_plan([256] * 5, 64, 1, False, 1, epoch_seed=1)
    assert all(len(b.pieces) == 1 for b in in_turn.batches)


@pytest.mark.parametrize("world_size,new_world_size", [(1, 1), (2, 2), (2, 3), (3, 1), (4, 2)])
@pytest.mark.parametrize("window", [1, 8])
def test_consumed_after_k_then_replanning_the_rest_takes_every_row_once(world_size, new_world_size, window) -> None:
    rows = [64, 64, 30, 100, 64, 7, 64, 64]
    plan = cut_plan(rows, 16, world_size, False, window, epoch_seed=3)
    for k in range(plan.per_rank + 1):
        done = consumed_after(plan, k)
        assert all(0 <= n <= rows[key] for key, n in done.items())
        left = [rows[i] - done.get(i, 0) for i in range(len(rows))]
        again = cut_plan(left, 16, new_world_size, False, window, epoch_seed=3, first_index=k * world_size)
        seen = {i: done.get(i, 0) for i in range(len(rows))}
        for b in again.batches:
            for p in b.pieces:
                seen[p.key] += p.rows
        assert seen == dict(enumerate(rows))


def test_a_resumed_cut_continues_the_uninterrupted_one() -> None:
    rows = [256] * 5
    whole = cut_plan(rows, 64, 1, False, 8, epoch_seed=9)
    k = 7
    done = consumed_after(whole, k)
    rest = cut_plan([rows[i] - done.get(i, 0) for i in range(5)], 64, 1, False, 8, epoch_seed=9, first_index=k)

    def absolute(plan, offsets):
        return [tuple((p.key, offsets.get(p.key, 0) + p.start, offsets.get(p.key, 0) + p.stop) for p in b.pieces)
                for b in plan.batches]

    assert absolute(rest, done) == absolute(whole, {})[k:]


@pytest.mark.parametrize("seed", range(40))
def test_the_rest_after_every_ranks_first_k_is_the_uninterrupted_plan_on_every_world_size(seed: int) -> None:
    """A native split epoch's local start (``loaders/native_split_start.py``): each rank cuts its first ``k``
    batches by itself, then the coordinator cuts what is left from there. At every ``k``, with windows of
    partitions and of rows, padding and ``drop_last``, that rest is the uninterrupted plan's rest."""
    import random

    from sbloader.core.window import Window

    rnd = random.Random(seed)
    rows = [rnd.randint(1, 40) for _ in range(rnd.randint(1, 12))]
    bs, world = rnd.randint(1, 16), rnd.randint(1, 4)
    window = rnd.choice([rnd.randint(1, 4), Window(cap=rnd.randint(20, 120), unit="rows")])
    drop_last = rnd.random() < 0.3
    whole = cut_plan(rows, bs, world, drop_last, window, epoch_seed=seed)
    for k in range(whole.per_rank + 1):
        done = consumed_after(whole, k)
        keys = [i for i in range(len(rows)) if rows[i] - done.get(i, 0) > 0]
        rest = cut_plan([rows[i] - done.get(i, 0) for i in keys], bs, world, drop_last, window, epoch_seed=seed,
                        first_index=k * world, weights=[rows[i] for i in keys])

        def absolute(b, key, off):
            return (tuple((key(p.key), off(p.key) + p.start, off(p.key) + p.stop) for p in b.pieces), b.pad)

        want = [absolute(b, lambda x: x, lambda x: 0) for b in whole.batches[k * world:]]
        got = [absolute(b, lambda x: keys[x], lambda x: done.get(keys[x], 0)) for b in rest.batches]
        assert got == want, (k, rows, bs, world, window)


def test_last_use_and_progress_release_a_partition_once_every_rank_is_past_it() -> None:
    plan = cut_plan([64] * 6, 32, 2, False, 2, epoch_seed=0)
    uses = last_use(plan)
    assert set(uses) == set(range(6))
    assert progress([0, 0]) == 0 and progress([1, 0]) == 1 and progress([1, 1]) == 2 and progress([3, 1]) == 3
    assert max(uses.values()) == len(plan.batches) - 1


def test_the_cutter_cuts_in_turn_with_a_window_of_one() -> None:
    c = Cutter(1, 0)
    c.add("a", 5)
    c.add("b", 5)
    assert [(p.key, p.start, p.stop) for p in c.cut(7)] == [("a", 0, 5), ("b", 0, 2)]
    assert [(p.key, p.start, p.stop) for p in c.cut(3)] == [("b", 2, 5)]


def test_the_plan_does_not_depend_on_the_world_size() -> None:
    """The epoch's members and order come from the epoch seed only (there is no world size to give)."""
    for seed in (0, 7):
        ids = [c.tolist() for c in cut_members(member_positions(500, seed, True), 64)]
        assert ids == [c.tolist() for c in cut_members(member_positions(500, seed, True), 64)]
        order = make_epoch_plan(range(len(ids)), 0, seed, True).order
        assert order == make_epoch_plan(range(len(ids)), 0, seed, True).order


# ----- state size ---------------------------------------------------------------------------


def test_the_state_of_a_million_sample_shuffled_epoch_stays_small() -> None:
    from sbloader.loaders.pipeline_run import PipelineRun
    from sbloader.loaders.pipeline_state import make_state

    ds = sbloader.range(1_000_000, rows_per_partition=64)
    loader = ds.to_dataloader(64, shuffle=True, seed=0)
    plan = ds.plan(epoch=0, seed=0, shuffle=True)
    rng = np.random.default_rng(0)
    half = len(plan.order) // 2
    # consumed roughly in plan order: the first half, with a few holes still in flight
    holes = set(rng.choice(half, 16, replace=False).tolist())
    run = PipelineRun(0, plan.epoch_seed, order=plan.order, batches=half)
    run.done = {plan.order[i] for i in range(half) if i not in holes}
    run.taken = {plan.order[i]: 10 for i in holes}
    state = make_state(loader._fingerprint(), 0, run)
    assert len(json.dumps(state)) <= 64 * 1024
    assert len(state["done"]) <= 17
