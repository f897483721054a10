"""The shuffle window as a memory budget (issue #39), pure: parsing, resolution, the ramp,
and the cut plan under a budget window over label-sorted layouts (the mix against a
uniform shuffle's, every row once, the cap on what the open partitions hold, resumes)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from sbloader.core.cut import Cutter, consumed_after, cut_plan
from sbloader.core.plan import make_epoch_plan
from sbloader.core.window import (DEFAULT_SHARE, FIRST_PARTITIONS, Window, WindowSpec, parse_window,
                                  ramp_partitions, ramp_rows, resolve)

BATCH = 64


# ----- parsing and resolution -------------------------------------------------------------


@pytest.mark.parametrize("value,spec", [
    (None, WindowSpec(share=DEFAULT_SHARE)), (1, WindowSpec(partitions=1)), (8, WindowSpec(partitions=8)),
    (np.int64(3), WindowSpec(partitions=3)), ("500 rows", WindowSpec(rows=500)), ("1row", WindowSpec(rows=1)),
    ("2 MiB", WindowSpec(bytes=2 * 2**20)), ("1.5GB", WindowSpec(bytes=1_500_000_000)), ("300 b", WindowSpec(bytes=300)),
])
def test_a_window_is_partitions_rows_or_bytes(value, spec) -> None:
    assert parse_window(value) == spec


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, 2.0, "0 rows", "1.5 rows", "ten rows", "5 parsecs", "", [8]])
def test_a_bad_window_says_what_is_accepted(bad) -> None:
    with pytest.raises(ValueError, match="shuffle_window must be .*found"):
        parse_window(bad)


def test_resolution_follows_the_budget_and_the_unit() -> None:
    assert resolve(WindowSpec(partitions=3), 10**9, "bytes") == Window(partitions=3)
    assert resolve(WindowSpec(rows=700), 10**9, "bytes") == Window(cap=700, unit="rows", ramp=True)
    assert resolve(WindowSpec(share=0.5), 1000, "bytes") == Window(cap=500, unit="bytes", ramp=True)
    assert resolve(WindowSpec(bytes=4096), 1000, "bytes") == Window(cap=4096, unit="bytes", ramp=True)
    # a plan made before any block exists weighs rows: bytes over the bytes of a row
    assert resolve(WindowSpec(share=0.5), 1000, "rows", row_bytes=10.0) == Window(cap=50, unit="rows", ramp=True)
    assert resolve(WindowSpec(share=0.5), 1000, "rows", row_bytes=None) == Window(partitions=FIRST_PARTITIONS)


def test_the_ramp_doubles_from_the_first_partitions() -> None:
    assert [ramp_partitions(b) for b in range(4)] == [FIRST_PARTITIONS * 2**b for b in range(4)]
    assert ramp_partitions(10**6) > 10**12


# ----- the cut under a budget window --------------------------------------------------------


def _layout(groups: int, rows: int, labels: int) -> tuple[list[int], np.ndarray]:
    """Label-sorted row groups: ``groups`` of ``rows`` rows, labels in runs over the groups."""
    per = np.repeat(np.arange(labels), groups // labels)
    return [rows] * groups, per


def _batch_labels(plan, order_labels: np.ndarray) -> list[int]:
    return [len({int(order_labels[p.key]) for p in b.pieces}) for b in plan.batches]


def _uniform_distinct(labels_per_row: np.ndarray, seed: int) -> float:
    perm = np.random.default_rng(seed).permutation(labels_per_row)
    return float(np.mean([len(set(perm[i:i + BATCH].tolist())) for i in range(0, len(perm), BATCH)]))


@pytest.mark.parametrize("groups,rows,labels", [(10, 256, 10), (100, 64, 10), (100, 64, 100), (1000, 32, 100)])
@pytest.mark.parametrize("world_size", [1, 2])
def test_data_that_fits_the_window_mixes_like_a_uniform_shuffle(groups, rows, labels, world_size) -> None:
    sizes, group_label = _layout(groups, rows, labels)
    window = Window(cap=groups * rows, unit="rows", ramp=True)  # fits exactly
    row_labels = np.repeat(group_label, rows)
    for seed in range(3):
        plan_order = make_epoch_plan(list(range(groups)), 0, seed, True).order
        order_labels = group_label[list(plan_order)]
        plan = cut_plan(sizes, BATCH, world_size, False, window, seed)
        got = np.mean(_batch_labels(plan, order_labels))
        want = np.mean([_uniform_distinct(row_labels, s) for s in range(3)])
        assert got >= 0.95 * want, (got, want)
        assert not plan.narrowed and plan.widest == groups
        taken = consumed_after(plan, plan.per_rank)
        assert all(taken[i] == rows for i in range(groups))  # every row once


def test_the_fixed_count_of_eight_did_not_mix_the_issue_s_file() -> None:
    sizes, group_label = _layout(10, 256, 10)
    plan = cut_plan(sizes, BATCH, 1, False, 8, 0)
    assert np.mean(_batch_labels(plan, group_label)) < 8  # the issue's 6.8 against torch's 9.97
    assert plan.narrowed and plan.widest == 8


@pytest.mark.parametrize("cap_groups", [1, 3, 8, 20])
def test_a_window_smaller_than_the_data_holds_no_more_than_its_cap(cap_groups) -> None:
    rows, groups = 64, 100
    cap = cap_groups * rows
    cutter = Cutter(Window(cap=cap, unit="rows", ramp=True), epoch_seed=7)
    places = iter(range(groups))
    nxt = next(places)
    seen = 0
    widest = 0
    while nxt is not None or cutter.open_rows:
        while nxt is not None and cutter.wants(BATCH, rows):
            cutter.add(nxt, rows)
            nxt = next(places, None)
        assert cutter.held <= max(cap, rows) or cutter.held - rows < cap  # the block a short batch needs
        widest = max(widest, cutter.open_count)
        seen += sum(p.rows for p in cutter.cut(min(BATCH, cutter.open_rows)))
    assert seen == rows * groups
    assert cutter.narrowed == (cap_groups < groups) and widest == min(max(cap_groups, 1), FIRST_PARTITIONS * 4)


def test_a_window_of_one_partition_cuts_in_turn_and_never_says_narrowed() -> None:
    plan = cut_plan([64] * 5, BATCH, 1, False, 1, 0)
    assert [[(p.key, p.start, p.stop) for p in b.pieces] for b in plan.batches] == [[(i, 0, 64)] for i in range(5)]
    assert not plan.narrowed


@pytest.mark.parametrize("world_size,new_world_size", [(1, 1), (2, 2), (2, 1), (1, 3)])
@pytest.mark.parametrize("cap", [10 * 256, 3 * 256, 700])
def test_a_resumed_budget_window_cuts_what_the_uninterrupted_one_would(world_size, new_world_size, cap) -> None:
    """Resumed after ``k`` batches per rank: every row once; on the same world size, the same batches."""
    sizes = [256] * 9 + [100]
    window = Window(cap=cap, unit="rows", ramp=True)
    whole = cut_plan(sizes, BATCH, world_size, False, window, 11)
    for k in (1, 3, whole.per_rank // 2):
        taken = consumed_after(whole, k)
        left = [n - taken.get(i, 0) for i, n in enumerate(sizes)]
        again = cut_plan(left, BATCH, new_world_size, False, window, 11, k * world_size, weights=sizes)
        rows = {i: taken.get(i, 0) for i in range(len(sizes))}
        for b in again.batches:
            for p in b.pieces:
                assert p.start == rows[p.key] - taken.get(p.key, 0)  # a prefix: the ledger stays a count
                rows[p.key] += p.rows
        assert rows == dict(enumerate(sizes))
        if new_world_size == world_size:
            rest = [[(p.key, taken.get(p.key, 0) + p.start, taken.get(p.key, 0) + p.stop) for p in b.pieces]
                    for b in again.batches]
            assert rest == [[(p.key, p.start, p.stop) for p in b.pieces] for b in whole.batches[k * world_size:]]


def test_bytes_weights_cap_what_the_open_blocks_hold() -> None:
    """Weighed in bytes (one consumer), blocks of different sizes: the cap holds whatever their rows."""
    rng = np.random.default_rng(0)
    sizes = rng.integers(20, 200, 60).tolist()
    nbytes = [n * int(rng.integers(100, 5000)) for n in sizes]
    cap = 4 * max(nbytes)
    cutter = Cutter(Window(cap=cap, unit="bytes", ramp=True), epoch_seed=1)
    i, seen = 0, 0
    while i < len(sizes) or cutter.open_rows:
        while i < len(sizes) and cutter.wants(BATCH, nbytes[i]):
            cutter.add(i, sizes[i], nbytes[i])
            i += 1
        # past the cap only by the block a batch needs when the open ones ran short of rows
        assert cutter.held <= cap or cutter.held - nbytes[i - 1] < cap
        seen += sum(p.rows for p in cutter.cut(min(BATCH, cutter.open_rows)))
    assert seen == sum(sizes) and cutter.narrowed


def test_the_first_batch_waits_for_a_few_partitions_not_the_whole_window() -> None:
    plan = cut_plan([32] * 1000, BATCH, 1, False, Window(cap=32 * 1000, unit="rows", ramp=True), 3)
    first = {p.key for p in plan.batches[0].pieces}
    assert max(first) < max(FIRST_PARTITIONS, ramp_rows(0, BATCH) // 32)  # 16 of 1000 partitions
    assert max(p.key for b in plan.batches[:3] for p in b.pieces) < ramp_rows(2, BATCH) // 32 + 4  # + rows taken
    # large partitions: the first batch waits for FIRST_PARTITIONS of them
    plan = cut_plan([4096] * 100, BATCH, 1, False, Window(cap=4096 * 100, unit="rows", ramp=True), 3)
    assert max(p.key for p in plan.batches[0].pieces) < FIRST_PARTITIONS


def test_the_state_of_a_window_over_the_whole_epoch_stays_under_64_kib_per_million_samples() -> None:
    """The worst case of a budget window: every partition of the epoch partly consumed."""
    from sbloader.loaders.pipeline_run import PipelineRun
    from sbloader.loaders.pipeline_state import FORMAT, make_state, run_from_state

    rng = np.random.default_rng(0)
    for rows in (64, 32):
        groups = 10**6 // rows
        order = tuple(rng.permutation(groups).tolist())
        taken = {pid: int(rng.integers(1, rows)) for pid in order[10:]}
        run = PipelineRun(0, 5, done=set(order[:10]), taken=taken, order=order, batches=7000,
                          window=[2**31, "bytes"])
        state = json.loads(json.dumps(make_state({"pipeline": "x"}, 0, run)))
        assert len(json.dumps(state)) <= 64 * 1024, (rows, len(json.dumps(state)))
        back = run_from_state(FORMAT.check(state, {"pipeline": "x"}, True), order)
        assert back.taken == taken and back.done == set(order[:10]) and back.window == [2**31, "bytes"]
