"""Rows credited past a partition's prefix (issue #49: a mixture resumed on another world size while
its ranks were partway through their sources' batches): the pure ledger against a set of rows, the
split plan's credit of every rank's first rows, and the state that carries it."""
from __future__ import annotations

import json
import random

import pytest

from sbloader.core import ledger, row_ledger
from sbloader.core.errors import StateDictError
from sbloader.core.window import Window
from sbloader.loaders import pipeline_state
from sbloader.loaders.pipeline_run import PipelineRun, plan_split


def _ledger_rows(prefix: int, ahead: list) -> set:
    return set(range(prefix)) | {r for a, b in ahead for r in range(a, b)}


def _random_ledger(rng: random.Random, total: int) -> tuple[int, list]:
    prefix = rng.randrange(total + 1)
    ahead = []
    for _ in range(rng.randrange(4)):
        a = rng.randrange(total + 1)
        ahead.append((a, min(total, a + rng.randrange(1, 6))))
    return prefix, [(a, b) for a, b in ahead if b > a]


@pytest.mark.parametrize("seed", range(40))
def test_the_rows_left_map_to_the_rows_no_range_consumed_and_credit_adds_them(seed: int) -> None:
    rng = random.Random(seed)
    total = rng.randrange(1, 40)
    prefix, ahead = _random_ledger(rng, total)
    consumed = _ledger_rows(prefix, ahead)
    free = [r for r in range(total) if r not in consumed]  # the rows left, in order
    assert row_ledger.consumed(prefix, ahead) == len(consumed)
    assert ledger.to_positions(row_ledger.live(total, prefix, ahead)).tolist() == free
    start = rng.randrange(len(free) + 1)
    stop = rng.randrange(start, len(free) + 1)
    assert ledger.to_positions(row_ledger.absolute(prefix, ahead, start, stop)).tolist() == free[start:stop]
    p, rest = row_ledger.credit(prefix, ahead, [(start, stop)])
    assert _ledger_rows(p, rest) == consumed | set(free[start:stop])
    assert all(a > p for a, _ in rest)  # normal: nothing ahead touches the prefix
    assert rest == ledger.merge(rest)


def test_credit_edges() -> None:
    assert row_ledger.credit(0, [], [(0, 3)]) == (3, [])
    assert row_ledger.credit(2, [(5, 7)], [(0, 3)]) == (7, [])  # rows 2, 3, 4 join the range at 5
    assert row_ledger.credit(2, [], [(3, 5)]) == (2, [(5, 7)])
    assert row_ledger.absolute(3, [(5, 7), (9, 10)], 0, 6) == [(3, 5), (7, 9), (10, 12)]
    assert row_ledger.absolute(0, [], 4, 4) == []


GRID = [([23, 23, 23, 21], 8, 2, 3, 1, 2), ([23, 23, 23, 21], 8, 2, 3, 6, 3), ([30, 31], 7, 3, 1, 5, 1),
        ([5, 40, 9, 12], 4, 4, 2, 3, 2), ([64, 64, 64], 10, 2, 0, 9, 4), ([17], 3, 3, 2, 1, 1)]


@pytest.mark.parametrize("rows, batch, world, k, used, new_world", GRID)
@pytest.mark.parametrize("window", [1, 3])
def test_the_credit_of_every_ranks_first_rows_then_the_rest_on_any_world_size_is_every_row_once(
        rows: list, batch: int, world: int, k: int, used: int, new_world: int, window: int) -> None:
    """Every rank took ``k`` batches and ``used`` rows of its next; the credited state replanned on
    ``new_world`` ranks gives exactly the rows no rank had, and a state of the rest resumes again."""
    sizes = dict(enumerate(rows))
    base = PipelineRun(0, 7, order=tuple(range(len(rows))))
    run = plan_split(base, sizes, False, batch, world, 0, False, window)
    had: list = []  # (partition, row) the ranks took
    for b in run.plan.batches[:k * world]:
        had += [(run.pids[p.key], r) for p in b.pieces for r in range(p.start, p.stop)]
    for b in run.plan.batches[k * world:(k + 1) * world]:
        flat = [(run.pids[p.key], r) for p in b.pieces for r in range(p.start, p.stop)]
        had += flat[:used]
    credited = run.progress(k, used)
    state = json.loads(json.dumps(pipeline_state.make_state({}, 0, credited)))
    everything = [(pid, r) for pid, n in sizes.items() for r in range(n)]
    if state["epoch_seed"] is None:  # every row was had: the state is the next epoch's
        assert sorted(had) == everything and state["epoch"] == 1
        return
    again = pipeline_state.run_from_state(state, base.order)
    assert again.ahead == credited.ahead and again.taken == credited.taken and again.done == credited.done
    rest = plan_split(again, sizes, False, batch, new_world, 0, False, Window(partitions=window))
    got: list = []
    for b in rest.plan.batches:
        for p in b.pieces:
            pid = rest.pids[p.key]
            for a, z in row_ledger.absolute(again.taken.get(pid, 0), again.ahead.get(pid, []), p.start, p.stop):
                got += [(pid, r) for r in range(a, z)]
    assert sorted(had + got) == everything
    assert len(had) == len(set(had)) and len(got) == len(set(got))


def test_a_state_with_rows_ahead_round_trips_and_older_versions_load() -> None:
    run = PipelineRun(0, 7, taken={2: 4}, order=(2, 0, 1), ahead={2: [(6, 8)], 0: [(1, 3)]})
    state = pipeline_state.make_state({}, 0, run)
    assert state["version"] == 4 and state["ahead"] == {"0": [[6, 8]], "1": [[1, 3]]}  # keyed by place
    again = pipeline_state.run_from_state(state, run.order)
    assert again.ahead == run.ahead and again.consumed(2) == 6 and again.consumed(0) == 2
    old = {**pipeline_state.make_state({}, 0, PipelineRun(0, 7, taken={2: 4}, order=(2, 0, 1))), "version": 3}
    assert pipeline_state.FORMAT.check(old, {}, strict=False)["version"] == 4
    with pytest.raises(StateDictError, match="ahead"):
        pipeline_state.run_from_state({**state, "ahead": {"0": [[5, 2]]}}, run.order)
    with pytest.raises(StateDictError, match="ahead"):
        pipeline_state.run_from_state({**state, "ahead": [1, 2]}, run.order)


def test_a_partition_whose_rows_are_all_credited_is_done() -> None:
    run = PipelineRun(0, 7, order=(0,))
    run.see(0, 10)
    run.credit(0, [(4, 10)])
    assert run.ahead == {0: [(4, 10)]} and run.consumed(0) == 6
    run.consume(((0, 4),))
    assert 0 in run.done and not run.ahead and not run.taken
