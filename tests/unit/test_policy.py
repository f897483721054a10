"""Tests of the executor's pure scheduling policy (no Ray)."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pytest

from sbloader.executor.policy import (
    Decision,
    PoolView,
    StageView,
    min_budget_bytes,
    next_in_order,
    pool_delta,
    runnable,
    select_stage,
)

# (queued, inflight, free_slots, est_out_bytes) of one stage.
QUEUED = [0, 1, 3]
INFLIGHT = [0, 1, 2]
FREE = [0, 1, 2]
ESTS: list[Optional[float]] = [None, 0.0, 100.0]
STAGE_STATES = list(itertools.product(QUEUED, INFLIGHT, FREE, ESTS))


def view(index: int, queued: int, inflight: int, free: int, est: Optional[float], head: int = 0) -> StageView:
    return StageView(index, queued, head if queued else None, inflight, free, est)


def fits(s: StageView, budget: float, held: float) -> bool:
    return held + (s.est_out_bytes or 0.0) <= budget


def check_decision(
    stages: list[StageView], budget: float, held: float, d: Decision, consumer_ready: bool = False
) -> None:
    """Every property a scheduling decision must have."""
    run = [s for s in stages if runnable(s)]
    fitting = [s for s in run if fits(s, budget, held)]
    # Nothing in flight and nothing the consumer can free: only a launch can progress.
    idle = all(s.inflight == 0 for s in stages) and not consumer_ready
    by_index = {s.index: s for s in stages}
    if d.launch is not None:
        s = by_index[d.launch]
        # Never a stage with nothing queued or no free slot.
        assert s.queued > 0 and s.free_slots > 0
        # A stage with no size estimate runs one task at a time.
        assert s.est_out_bytes is not None or s.inflight == 0
        assert d.launch not in d.throttled
    if fitting:
        # The most downstream stage that fits.
        assert d.launch == max(s.index for s in fitting)
    elif run and idle:
        # Liveness: nothing in flight, nothing for the consumer to take, something
        # runnable -> launch, the earliest plan position first (the most
        # downstream on a tie).
        assert d.launch is not None
        chosen = by_index[d.launch]
        assert chosen.head_seq == min(s.head_seq for s in run)
        assert chosen.index == max(s.index for s in run if s.head_seq == chosen.head_seq)
    else:
        # Over budget with work in flight or a block for the consumer, or
        # nothing to do: wait.
        assert d.launch is None
    # Over budget only through the liveness rule.
    if d.launch is not None and not fits(by_index[d.launch], budget, held):
        assert idle and not fitting
    # Throttled: runnable stages held back by the budget, more downstream than the launch.
    for i in d.throttled:
        assert runnable(by_index[i]) and not fits(by_index[i], budget, held)
        if d.launch is not None and fits(by_index[d.launch], budget, held):
            assert i > d.launch
    assert len(set(d.throttled)) == len(d.throttled)
    if d.launch is None:
        assert set(d.throttled) == {s.index for s in run}


# ----- StageView / runnable ------------------------------------------------------


@pytest.mark.parametrize("queued, inflight, free, est", STAGE_STATES)
def test_runnable_grid(queued: int, inflight: int, free: int, est: Optional[float]) -> None:
    s = view(0, queued, inflight, free, est)
    expected = queued > 0 and free > 0 and (est is not None or inflight == 0)
    assert runnable(s) is expected


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(queued=-1, head_seq=None, inflight=0, free_slots=1),
        dict(queued=1, head_seq=0, inflight=-1, free_slots=1),
        dict(queued=1, head_seq=0, inflight=0, free_slots=-2),
        dict(queued=2, head_seq=None, inflight=0, free_slots=1),
        dict(queued=0, head_seq=3, inflight=0, free_slots=1),
    ],
)
def test_stage_view_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        StageView(index=0, est_out_bytes=None, **kwargs)


def test_stage_view_valid_extremes() -> None:
    StageView(0, 0, None, 0, 0, None)
    StageView(5, 10**6, 0, 10**6, 10**6, 1e12)


# ----- select_stage ------------------------------------------------------------


def test_select_nothing_runnable() -> None:
    stages = [view(0, 0, 0, 2, None), view(1, 3, 0, 0, 10.0, head=1), view(2, 1, 1, 1, None, head=0)]
    assert select_stage(stages, 10**9, 0).launch is None
    assert select_stage([], 100, 0) == Decision(None)


@pytest.mark.parametrize(
    "budget, held, consumer_ready",
    itertools.product([0, 50, 150, 10**6], [0, 40, 120], [False, True]),
)
def test_select_two_stage_exhaustive(budget: int, held: int, consumer_ready: bool) -> None:
    for a, b in itertools.product(STAGE_STATES, repeat=2):
        for heads in ((0, 1), (1, 0)):  # ties: test_select_random_pipelines
            stages = [view(0, *a, head=heads[0]), view(1, *b, head=heads[1])]
            d = select_stage(stages, budget, held, consumer_ready)
            check_decision(stages, budget, held, d, consumer_ready)


def test_select_random_pipelines() -> None:
    rng = np.random.default_rng(0)
    for _ in range(8000):
        n = int(rng.integers(1, 6))
        stages = []
        for i in range(n):
            queued, inflight, free = (int(x) for x in rng.integers(0, 4, size=3))
            est = [None, 0.0, 1.0, 10.0, 99.0, 100.0, 250.0][int(rng.integers(7))]
            stages.append(view(i, queued, inflight, free, est, head=int(rng.integers(0, 6))))
        budget = float(rng.choice([0, 10, 99, 100, 250, 1e9]))
        held = float(rng.choice([0, 5, 90, 100, 500]))
        ready = bool(rng.integers(2))
        check_decision(stages, budget, held, select_stage(stages, budget, held, ready), ready)


def test_select_prefers_downstream() -> None:
    stages = [view(i, 2, 1, 1, 10.0, head=i) for i in range(4)]
    assert select_stage(stages, 1000, 0).launch == 3
    # The downstream stage does not fit; the next one does.
    stages[3] = view(3, 2, 1, 1, 500.0, head=3)
    d = select_stage(stages, 1000, 600)
    assert d.launch == 2 and d.throttled == (3,)


def test_select_waits_over_budget_while_work_runs() -> None:
    stages = [view(0, 5, 1, 1, 100.0, head=3), view(1, 1, 0, 2, 100.0, head=1)]
    d = select_stage(stages, 150, 100)
    assert d.launch is None and set(d.throttled) == {0, 1}


def test_select_liveness_picks_earliest_position() -> None:
    stages = [view(0, 5, 0, 1, 100.0, head=3), view(1, 1, 0, 2, 100.0, head=1), view(2, 1, 0, 1, 900.0, head=2)]
    d = select_stage(stages, 10, 1000)
    assert d.launch == 1 and set(d.throttled) == {0, 2}
    # The default is "the consumer has nothing to take".
    assert select_stage(stages, 10, 1000, consumer_ready=False) == d


def test_select_no_liveness_while_the_consumer_can_free_memory() -> None:
    # Over budget, nothing in flight, but a ready block awaits the consumer:
    # taking it frees memory, so no task starts beyond the budget.
    stages = [view(0, 5, 0, 1, 100.0, head=3), view(1, 1, 0, 2, 100.0, head=1)]
    d = select_stage(stages, 10, 1000, consumer_ready=True)
    assert d.launch is None and set(d.throttled) == {0, 1}
    # Within the budget the consumer's state does not matter.
    assert select_stage(stages, 10**6, 0, consumer_ready=True).launch == 1


def test_select_unknown_size_runs_alone() -> None:
    # No estimate yet: one task at a time even with a huge budget and free slots.
    assert select_stage([view(0, 10, 1, 7, None, head=0)], 10**12, 0).launch is None
    assert select_stage([view(0, 10, 0, 7, None, head=0)], 10**12, 0).launch == 0


# ----- min_budget_bytes -----------------------------------------------------------


@pytest.mark.parametrize(
    "ests, final, prefetch",
    itertools.product([(), (0.0,), (1.0, 2.0), (100.5, 7.25, 3.0), (1e9, 1.0)], [0.0, 1.0, 3.3, 1e6], [0, 1, 2, 8]),
)
def test_min_budget_grid(ests: tuple, final: float, prefetch: int) -> None:
    need = min_budget_bytes(list(ests), final, prefetch)
    assert isinstance(need, int)
    exact = sum(ests) + prefetch * final
    assert exact <= need < exact + 1
    assert min_budget_bytes(list(ests), final, prefetch + 1) >= need


# ----- pool_delta -------------------------------------------------------------------


@pytest.mark.parametrize(
    "min_size, max_size", [(lo, hi) for lo in range(1, 5) for hi in range(lo, 6)]
)
def test_pool_delta_grid(min_size: int, max_size: int) -> None:
    for size in range(0, max_size + 1):
        for pending, queued, free, idle, budget_ok, upstream, built, lost, reads in itertools.product(
            range(0, size + 1), range(0, 5), range(0, 4), range(0, 3), (True, False), (True, False),
            range(0, max_size + 2), range(0, 2), (False, True)
        ):
            if idle > size - pending:
                continue
            pool = PoolView(size, pending, min_size, max_size, queued, free, idle, upstream, built, lost, reads)
            d = pool_delta(pool, budget_ok)
            if size < min_size:
                assert d == min_size - size  # to min at once
                continue
            assert min_size <= size + d <= max_size
            may_build = max_size + lost - built
            if d > 0:
                assert budget_ok and queued > free
                assert d <= may_build  # never more constructions in an execution than its max (+ lost)
            if reads:
                # a pool that reads: as many as the queued partitions keep busy, at once, starting or not
                want = min(queued - free, max_size - size, may_build) if budget_ok else 0
                assert d == max(0, want) or (d == -1 and want <= 0)
            else:
                assert d in (-1, 0, 1)
                grow = pending == 0 and queued > free and size < max_size and budget_ok and may_build > 0
                assert (d == 1) is grow
                if pending > 0:
                    assert d == 0  # never grows (or shrinks) while an actor starts
            if d == -1:
                assert queued == 0 and idle > 0 and size > min_size and not upstream
                assert pending == 0 or reads
            if pending == 0 and not (reads and d > 0):
                assert (d == -1) is (queued == 0 and idle > 0 and size > min_size and not upstream)
            if upstream:
                assert d != -1  # never retired while input that will feed it is still coming


def test_pool_delta_default_budget_ok() -> None:
    assert pool_delta(PoolView(1, 0, 1, 4, queued=3, free_slots=0, idle_actors=0)) == 1


@pytest.mark.parametrize("min_size, max_size", [(0, 1), (-1, 3), (3, 2), (0, 0), (5, 1)])
def test_pool_view_validation(min_size: int, max_size: int) -> None:
    with pytest.raises(ValueError, match="min_size"):
        PoolView(1, 0, min_size, max_size, 0, 0, 0)


def test_next_in_order() -> None:
    assert next_in_order({0, 2}, 0) == 0
    assert next_in_order({1, 2}, 0) is None
    assert next_in_order(set(), 5) is None


# ----- simulation ----------------------------------------------------------------------


@dataclass
class _Task:
    stage: int
    seq: int
    input_bytes: float
    est_bytes: float


@dataclass
class _Sim:
    """A fake 3-stage pipeline driven by ``select_stage``, as the executor drives it."""

    sizes: tuple[int, ...]
    slots: tuple[int, ...]
    budget: int
    num_partitions: int
    rng: np.random.Generator
    queues: list = field(default_factory=list)
    est: list = field(default_factory=list)
    tasks: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    delivered: list = field(default_factory=list)
    peak: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.sizes)
        self.queues = [[(seq, 0) for seq in range(self.num_partitions)]] + [[] for _ in range(n - 1)]
        self.est = [None] * n

    def held(self) -> float:
        queued = sum(b for q in self.queues for _, b in q)
        running = sum(t.input_bytes + t.est_bytes for t in self.tasks)
        return queued + sum(b for _, b in self.outputs) + running

    def views(self) -> list[StageView]:
        out = []
        for i, q in enumerate(self.queues):
            inflight = sum(1 for t in self.tasks if t.stage == i)
            out.append(StageView(i, len(q), q[0][0] if q else None, inflight,
                                 max(0, self.slots[i] - inflight), self.est[i]))
        return out

    def launch(self) -> None:
        while True:
            views = self.views()
            ready = bool(self.outputs)
            d = select_stage(views, self.budget, self.held(), ready)
            check_decision(views, self.budget, self.held(), d, ready)
            if d.launch is None:
                return
            i = d.launch
            seq, nbytes = self.queues[i].pop(0)
            self.tasks.append(_Task(i, seq, nbytes, self.est[i] or 0.0))
            self.peak = max(self.peak, self.held())

    def complete_one(self) -> None:
        t = self.tasks.pop(int(self.rng.integers(len(self.tasks))))
        out = self.sizes[t.stage]
        self.est[t.stage] = float(out)  # fixed sizes: the running mean is exact
        if t.stage + 1 < len(self.sizes):
            q = self.queues[t.stage + 1]
            q.append((t.seq, out))
            q.sort()
        else:
            self.outputs.append((t.seq, out))
        self.peak = max(self.peak, self.held())

    def consume(self) -> None:
        if self.outputs:
            self.delivered.append(self.outputs.pop(0)[0])

    def run(self, consumer_speed: float) -> int:
        """Run to the end; each step one task completes or the consumer takes a block."""
        steps = 0
        while len(self.delivered) < self.num_partitions:
            steps += 1
            self.launch()
            if not self.tasks and not self.outputs:
                stuck = [len(q) for q in self.queues]
                raise AssertionError(f"deadlock: nothing in flight, nothing to consume, queues {stuck}")
            if self.outputs and (not self.tasks or self.rng.random() < consumer_speed):
                self.consume()
            else:
                self.complete_one()
        return steps


SIM_SIZES = [(100, 100, 100), (10, 1000, 10), (1000, 10, 500), (1, 1, 1), (0, 50, 0)]
SIM_SLOTS = [(1, 1, 1), (3, 2, 1), (2, 4, 3)]


@pytest.mark.parametrize("sizes, slots", itertools.product(SIM_SIZES, SIM_SLOTS))
def test_simulation_finishes_within_budget(sizes: tuple, slots: tuple) -> None:
    block = max(sizes)
    for factor, partitions, speed, seed in itertools.product([1, 1.5, 3, 20], [1, 2, 7, 25], [0.0, 0.3, 1.0], [0, 1]):
        # Budgets the executor accepts: at least one block per stage plus prefetch.
        budget = int(math.ceil(factor * max(1, min_budget_bytes(list(sizes), sizes[-1], 2))))
        sim = _Sim(sizes, slots, budget, partitions, np.random.default_rng(seed))
        steps = sim.run(consumer_speed=speed)
        assert sorted(sim.delivered) == list(range(partitions))
        assert steps == (len(sizes) + 1) * partitions  # every step made progress
        # Over the budget by at most one block (first unmeasured output, or liveness).
        assert sim.peak <= budget + block, (sim.peak, budget, block)


@pytest.mark.parametrize("sizes, slots", itertools.product(SIM_SIZES, SIM_SLOTS))
def test_simulation_never_deadlocks_on_tiny_budgets(sizes: tuple, slots: tuple) -> None:
    for budget, partitions, speed, seed in itertools.product([0, 1, 50, 99], [1, 3, 12], [0.0, 0.5], [0, 1]):
        sim = _Sim(sizes, slots, budget, partitions, np.random.default_rng(seed))
        sim.run(consumer_speed=speed)
        assert sorted(sim.delivered) == list(range(partitions))


def test_simulation_slow_consumer_bounds_memory() -> None:
    # A consumer that only takes a block when nothing else can happen: the
    # pipeline must wait for it rather than produce the whole dataset.
    sim = _Sim((100, 100, 100), (2, 2, 2), 700, 50, np.random.default_rng(0))
    sim.run(consumer_speed=0.0)
    assert sorted(sim.delivered) == list(range(50))
    assert sim.peak <= 800


def test_simulation_overlaps_stages_with_room() -> None:
    # With a generous budget the pipeline runs several tasks at once.
    sim = _Sim((10, 10, 10), (3, 3, 3), 10**6, 20, np.random.default_rng(0))
    concurrency = []
    orig = sim.complete_one

    def spy() -> None:
        concurrency.append(len(sim.tasks))
        orig()

    sim.complete_one = spy  # type: ignore[method-assign]
    sim.run(consumer_speed=0.5)
    assert max(concurrency) >= 4


# ----- blocks ahead of the consumer ------------------------------------------------


@pytest.mark.parametrize("prefetch,slots", [(1, 1), (2, 2), (4, 16), (0, 0)])
def test_blocks_ahead_cap_covers_every_slot_and_the_prefetch(prefetch: int, slots: int) -> None:
    from sbloader.executor.policy import blocks_ahead_cap

    cap = blocks_ahead_cap(prefetch, slots)
    assert cap >= max(1, prefetch) + max(1, slots), "a cap below the slots would idle workers"
    assert cap == max(1, prefetch) + 2 * max(1, slots)


def test_source_blocked_stops_only_the_source_stage() -> None:
    stages = [StageView(0, 5, 3, 1, 1, 10.0), StageView(1, 2, 1, 0, 1, 10.0)]
    assert select_stage(stages, 10**9, 0, source_blocked=True).launch == 1
    only_source = [StageView(0, 5, 3, 1, 1, 10.0), StageView(1, 0, None, 0, 1, 10.0)]
    assert select_stage(only_source, 10**9, 0, source_blocked=True).launch is None
    assert select_stage(only_source, 10**9, 0, source_blocked=False).launch == 0


@pytest.mark.parametrize("prefetch,slots,per_task", [(2, 3, 1), (2, 3, 4), (1, 16, 16)])
def test_blocks_ahead_cap_scales_with_blocks_per_task(prefetch: int, slots: int, per_task: int) -> None:
    from sbloader.executor.policy import blocks_ahead_cap

    assert blocks_ahead_cap(prefetch, slots * per_task) == prefetch + 2 * slots * per_task


# ----- partitions per read task -----------------------------------------------------


def test_partitions_per_task_one_while_the_time_is_unknown() -> None:
    from sbloader.executor.policy import partitions_per_task

    assert partitions_per_task(None, 100, 3) == 1
    assert partitions_per_task(0.01, 1, 3) == 1
    assert partitions_per_task(0.01, 0, 3) == 1


@pytest.mark.parametrize("est_s", [0.001, 0.02, 0.08, 0.2, 0.5, 3.0])
@pytest.mark.parametrize("queued", [2, 7, 31, 200])
@pytest.mark.parametrize("slots", [1, 3, 17])
def test_partitions_per_task_grid(est_s: float, queued: int, slots: int) -> None:
    from sbloader.executor.policy import MAX_PARTITIONS_PER_TASK, TARGET_TASK_S, partitions_per_task

    k = partitions_per_task(est_s, queued, slots)

    def fits(n: int) -> bool:
        """One partition always fits; more only within the cap, the target's worth of
        work, and so that every slot still gets a task while partitions remain."""
        return n == 1 or (n <= MAX_PARTITIONS_PER_TASK and n * est_s <= TARGET_TASK_S + 1e-9
                          and n * slots <= queued)

    # the largest group that fits
    assert fits(k) and not fits(k + 1), k


def test_partitions_per_task_bounded_by_bytes() -> None:
    from sbloader.executor.policy import partitions_per_task

    assert partitions_per_task(0.01, 1000, 2, est_block_bytes=10e6, max_task_bytes=35e6) == 3
    assert partitions_per_task(0.01, 1000, 2, est_block_bytes=10e6, max_task_bytes=5e6) == 1
    assert partitions_per_task(0.01, 1000, 2, est_block_bytes=None, max_task_bytes=5e6) == 16


@pytest.mark.parametrize("ahead,slots,expected", [(0, 3, 1), (2, 3, 1), (3, 3, 2), (8, 3, 3), (100, 3, 4), (5, 1, 4)])
def test_partitions_per_task_grows_with_the_blocks_ahead(ahead: int, slots: int, expected: int) -> None:
    """A consumer that keeps up is never left waiting for a big first task: the group
    grows only as blocks pile up ahead of it (here the target allows 4)."""
    from sbloader.executor.policy import partitions_per_task

    assert partitions_per_task(0.08, 1000, slots, blocks_ahead=ahead) == expected


@pytest.mark.parametrize("consumer_s,expected", [(None, 4), (0.001, 4), (0.039, 4), (0.04, 1), (0.06, 1)])
def test_partitions_per_task_only_while_the_pipeline_is_the_bottleneck(consumer_s, expected) -> None:
    """Two workers make a 0.08 s partition every 0.04 s: a consumer that needs at least
    that per block (a training step) gets one partition per task."""
    from sbloader.executor.policy import partitions_per_task

    assert partitions_per_task(0.08, 1000, 3, consumer_block_s=consumer_s, workers=2) == expected
