"""The split arithmetic (pure, no Ray): equal per-rank batch counts, exactly-once
coverage, full batches first, a balanced tail, marked padding only when needed.
Also the coordinator's ledger switch (``SBLOADER_NO_LEDGER``): pure over a fake
executor, and once end to end over two in-process ranks (the session's Ray)."""
from __future__ import annotations

import itertools
import random
import time

import pytest

from sbloader.core.split import BatchSpec, SplitPlan, batch_positions, pick_local, split_epoch
from sbloader.core.block import BlockMeta
from sbloader.distributed.specs import EpochSpec
from sbloader.distributed.epoch import Epoch
from sbloader.core.errors import SbloaderError
from sbloader.core.plan import EpochPlan

NUM_ROWS = range(0, 301)
BATCH_SIZES = (1, 2, 3, 7, 10, 64)
WORLD_SIZES = range(1, 8)


def _grid():
    return itertools.product(NUM_ROWS, BATCH_SIZES, WORLD_SIZES)


def _check_plan(plan: SplitPlan, n: int, bs: int, ws: int, drop_last: bool) -> None:
    """Every invariant of a plan; the message names the case."""
    case = f"split_epoch(num_rows={n}, batch_size={bs}, world_size={ws}, drop_last={drop_last})"
    batches = plan.batches
    assert plan.world_size == ws, case
    assert [b.index for b in batches] == list(range(len(batches))), f"{case}: indices not 0..len-1"

    # Every rank gets exactly per_rank batches.
    assert len(batches) == plan.per_rank * ws, f"{case}: {len(batches)} batches for {ws} x {plan.per_rank}"
    for r in range(ws):
        mine = plan.for_rank(r)
        assert len(mine) == plan.per_rank, f"{case}: rank {r} gets {len(mine)}, expected {plan.per_rank}"
        assert [b.index for b in mine] == sorted(b.index for b in mine), f"{case}: rank {r} out of plan order"
    assert all(0 <= b.rank < ws for b in batches), case

    # Positions: contiguous, each exactly once, in plan order.
    covered = [p for b in batches for p in range(b.start, b.stop)]
    kept = n - plan.dropped
    assert covered == list(range(kept)), f"{case}: positions not covered exactly once in order"
    if drop_last:
        assert plan.dropped == n % (bs * ws), f"{case}: dropped {plan.dropped}"
        assert plan.dropped < bs * ws, case
        assert all(b.rows == bs and b.pad == 0 for b in batches), f"{case}: drop_last left a short batch"
        assert plan.per_rank == n // (bs * ws), case
    else:
        assert plan.dropped == 0, f"{case}: dropped {plan.dropped} without drop_last"
        assert plan.per_rank == -(-n // (bs * ws)), f"{case}: per_rank {plan.per_rank}"

    # Full batches first (rows never grow along the plan), then one tail batch per rank.
    rows = [b.rows for b in batches]
    assert rows == sorted(rows, reverse=True), f"{case}: a longer batch after a shorter one: {rows}"
    n_full = (n // (bs * ws)) * ws
    assert all(b.rows == bs and b.pad == 0 for b in batches[:n_full]), f"{case}: short batch among full rounds"
    for i, b in enumerate(batches[:n_full]):
        assert b.rank == i % ws, f"{case}: full batch {i} on rank {b.rank}"
    tail = batches[n_full:]
    assert len(tail) == (0 if drop_last or n == n_full * bs else ws), f"{case}: tail of {len(tail)} batches"
    assert sorted(b.rank for b in tail) == list(range(len(tail))), f"{case}: tail not one per rank"
    assert all(b.rows + b.pad <= bs for b in tail), f"{case}: tail batch larger than batch_size"
    if tail:
        real = [b.rows for b in tail]
        total = [b.rows + b.pad for b in tail]
        assert max(real) - min(real) <= 1, f"{case}: tail rows {real}"
        assert max(total) - min(total) <= 1, f"{case}: tail sizes with padding {total}"
        assert all(s >= 1 for s in total), f"{case}: an empty batch {total}"

    # Padding: only when fewer rows remain than ranks, one row per empty rank.
    rem = n - (n // (bs * ws)) * bs * ws
    padded = [b for b in batches if b.pad]
    if drop_last or rem >= ws or rem == 0:
        assert not padded, f"{case}: padding although {rem} remaining rows >= {ws} ranks (or none)"
    else:
        assert len(padded) == ws - rem, f"{case}: {len(padded)} padded batches for {ws - rem} empty ranks"
        assert all(b.pad == 1 and b.rows == 0 for b in padded), f"{case}: {padded}"
    assert sum(b.pad for b in batches) == len(padded), case


@pytest.mark.parametrize("drop_last", [False, True])
def test_split_epoch_grid(drop_last):
    for n, bs, ws in _grid():
        _check_plan(split_epoch(n, bs, ws, drop_last), n, bs, ws, drop_last)


def test_split_epoch_examples():
    # 103 rows, batch 10, 2 ranks: 5 full rounds, then 3 rows as 2 + 1.
    plan = split_epoch(103, 10, 2, False)
    assert plan.per_rank == 6
    assert [(b.start, b.stop, b.pad, b.rank) for b in plan.batches[-2:]] == [(100, 102, 0, 0), (102, 103, 0, 1)]
    # 92 rows, batch 10, 3 ranks: 3 full rounds, 2 rows for 3 ranks: one padded batch.
    plan = split_epoch(92, 10, 3, False)
    assert plan.per_rank == 4
    assert [(b.start, b.stop, b.pad, b.rank) for b in plan.batches[-3:]] == [
        (90, 91, 0, 0), (91, 92, 0, 1), (92, 92, 1, 2)]
    # drop_last drops the rows that do not fill a batch on every rank.
    plan = split_epoch(92, 10, 3, True)
    assert (plan.per_rank, plan.dropped, len(plan.batches)) == (3, 2, 9)
    # Nothing to split.
    assert split_epoch(0, 4, 3, False) == SplitPlan((), 3, 0, 0)


def test_split_epoch_is_deterministic():
    assert split_epoch(257, 7, 5, False) == split_epoch(257, 7, 5, False)


@pytest.mark.parametrize("args", [(10, 0, 1, False), (10, 1, 0, False), (-1, 1, 1, False)])
def test_split_epoch_rejects_bad_arguments(args):
    with pytest.raises(ValueError, match="need batch_size >= 1, world_size >= 1, num_rows >= 0"):
        split_epoch(*args)


def test_batch_spec_validation():
    with pytest.raises(ValueError, match="invalid batch spec"):
        BatchSpec(0, 5, 4)
    with pytest.raises(ValueError, match="invalid batch spec"):
        BatchSpec(0, -1, 4)
    with pytest.raises(ValueError, match="invalid batch spec"):
        BatchSpec(0, 0, 4, pad=-1)
    assert BatchSpec(3, 4, 9).rows == 5


def test_batch_positions_grid():
    """Every batch of every plan: its real positions, then valid repeated positions."""
    for n, bs, ws in _grid():
        if n == 0:
            continue
        plan = split_epoch(n, bs, ws, False)
        for b in plan.batches:
            pos = batch_positions(b, n)
            case = f"{b} of split_epoch({n}, {bs}, {ws})"
            assert len(pos) == b.rows + b.pad, case
            assert pos[: b.rows] == list(range(b.start, b.stop)), case
            assert all(0 <= p < n for p in pos), f"{case}: positions {pos} outside [0, {n})"
            if b.pad:  # the repeated row is the last real row before the tail's end
                assert pos == [min(b.start, n) - 1], case


def test_batch_positions_examples():
    assert batch_positions(BatchSpec(0, 3, 6), 10) == [3, 4, 5]
    # A padded empty batch repeats the row just before it.
    assert batch_positions(BatchSpec(5, 92, 92, pad=1), 92) == [91]
    # Padding after real rows cycles from the batch's start, wrapping at the end.
    assert batch_positions(BatchSpec(0, 5, 7, pad=3), 8) == [5, 6, 5, 6, 7]
    assert batch_positions(BatchSpec(0, 6, 8, pad=3), 8) == [6, 7, 6, 7, 0]


def test_pick_local_prefers_oldest_on_the_ranks_node():
    assert pick_local(["a", "b", "a"], "a") == 0
    assert pick_local(["a", "b", "a"], "b") == 1
    assert pick_local(["b", "a", "a"], "a") == 1
    assert pick_local(["b", "b", "a"], "a") == 2


def test_pick_local_falls_back_to_oldest():
    assert pick_local(["a", "b"], "c") == 0
    assert pick_local(["a", "b"], None) == 0
    assert pick_local(["x"], "y") == 0


def test_pick_local_random_lists():
    rng = random.Random(0)
    for _ in range(2000):
        nodes = [rng.choice("abcd") for _ in range(rng.randint(1, 12))]
        me = rng.choice(["a", "b", "c", "d", "e", None])
        i = pick_local(nodes, me)
        expected = nodes.index(me) if me in nodes else 0
        assert i == expected, f"pick_local({nodes}, {me!r}) = {i}, expected {expected}"


def test_pick_local_empty_is_an_error():
    with pytest.raises(ValueError, match="at least one ready batch"):
        pick_local([], "a")
    with pytest.raises(ValueError, match="at least one ready batch"):
        pick_local([], None)


# ----- the coordinator's ledger switch -------------------------------------------------

class _FakeExecutor:
    def __init__(self) -> None:
        self.released: list[int] = []

    def release(self, nbytes: int) -> None:
        self.released.append(nbytes)


class _Item:
    def __init__(self, seq: int) -> None:
        self.ref = None
        self.meta = BlockMeta(epoch=0, partition_id=seq, seq=seq, num_rows=1, nbytes=100 + seq, row_range=(seq, seq + 1))


def _epoch_with_ready_batches(ledger: bool, n: int = 12, ws: int = 2) -> Epoch:
    spec = EpochSpec(0, 0, None, (), EpochPlan(0, 0, tuple(range(n)), False), None, n // ws,
                     assignment=tuple(i % ws for i in range(n)))
    ep = Epoch(spec, ws, {}, ledger=ledger)
    ep.executor = _FakeExecutor()
    for i in range(n):
        ep.queues[i % ws].append(_Item(i))
    return ep


@pytest.mark.parametrize("ledger", [True, False])
def test_epoch_counts_and_releases_the_same_with_and_without_ledger(ledger):
    ep = _epoch_with_ready_batches(ledger)
    got = {0: [], 1: []}
    for rank, take, consumed in [(0, 2, 0), (1, 3, 0), (0, 2, 1), (1, 5, 3), (0, 9, 4), (1, 1, 6), (0, 1, 6)]:
        ep.ack(rank, consumed)
        got[rank] += [i.meta.seq for i in ep.take(rank, take, None, 0.0, 60.0)]
    assert got == {0: [0, 2, 4, 6, 8, 10], 1: [1, 3, 5, 7, 9, 11]}
    assert [lg.count for lg in ep.logs] == [6, 6]
    assert ep.take(0, 1, None, 0.0, 60.0) == []  # quota reached
    assert ep.finished
    assert sorted(ep.executor.released) == sorted(100 + i for i in range(12))  # every batch's bytes once
    assert [lg.delivered for lg in ep.logs] == ([[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]] if ledger else [[], []])
    if not ledger:
        assert all(len(lg.nbytes) == 0 for lg in ep.logs)  # only the unacknowledged batches are kept


def test_no_ledger_switch_end_to_end(ray_session, monkeypatch):
    """Two ranks in one process (rank/world_size overrides): with SBLOADER_NO_LEDGER=1 every batch
    still arrives once and state_dict() says the ledger is off; without it state_dict() works."""
    import sbloader

    def ranks(name):
        return [sbloader.DataLoader(list(range(40)), batch_size=4, num_workers=1, rank=r, world_size=2,
                                    job_id="test-no-ledger", name=name) for r in range(2)]

    for off in (True, False):
        if off:
            monkeypatch.setenv("SBLOADER_NO_LEDGER", "1")
        else:
            monkeypatch.delenv("SBLOADER_NO_LEDGER", raising=False)
        loaders = ranks(f"ledger-{'off' if off else 'on'}")
        its = [iter(lo) for lo in loaders]
        seen = []
        for _ in range(2):
            for it in its:
                seen += next(it).tolist()
        if off:
            with pytest.raises(SbloaderError, match="SBLOADER_NO_LEDGER"):
                loaders[0].state_dict()
        else:
            assert loaders[0].state_dict()["consumed"]  # the cut of both ranks' first 2 batches
        for it in its:
            seen += [x for b in it for x in b.tolist()]
        assert sorted(seen) == list(range(40))


def test_epoch_cut_is_incremental_and_equals_the_ledger_cut():
    """Epoch.cut (the coordinator's, incremental across calls) against ledger.cut from scratch:
    random logs of out-of-order batches, random ranges per batch, a prior, k rising, repeating, falling."""
    from sbloader.core import ledger

    rng = random.Random(1)
    for case in range(60):
        ws = rng.randint(1, 5)
        n = rng.randint(0, 40) * ws
        pos = 0
        batch_ranges = []
        for _ in range(n):  # a batch: one or two ranges, sometimes touching the previous one
            a = pos + rng.choice([0, 0, 1, 3])
            b = a + rng.randint(0, 5)
            extra = ((b + 2, b + 2 + rng.randint(1, 3)),) if rng.random() < 0.2 else ()
            batch_ranges.append(((a, b),) + extra)
            pos = (extra[0][1] if extra else b)
        prior = ((pos + 10, pos + 20),) if rng.random() < 0.5 else ()
        order = list(range(n))
        rng.shuffle(order)
        logs = [order[r::ws] for r in range(ws)]
        per_rank = n // ws
        spec = EpochSpec(0, 0, None, (), EpochPlan(0, 0, tuple(range(n)), False), None, per_rank,
                         batch_ranges=tuple(batch_ranges), prior=prior)
        ep = Epoch(spec, ws, {})
        for r in range(ws):
            ep.logs[r].delivered = list(logs[r])
        ks = sorted(rng.randint(0, per_rank) for _ in range(6))
        ks = ks + [ks[-1]] + [rng.randint(0, per_rank) for _ in range(3)] + [per_rank]  # again, below, the end
        for k in ks:
            expected = ledger.cut(logs, k, batch_ranges, prior)
            assert ep.cut(k) == expected, f"case {case}: k={k}, ws={ws}, n={n}"


def test_local_cut_equals_the_ledger_cut_over_plans():
    """In order, state_dict() cuts from the plan alone (no coordinator call): over split plans of
    several sizes, world sizes, drop_last and a prior, at k rising, repeating and falling, the
    local cut equals ledger.cut over the delivery logs the coordinator would keep (plan order per rank)."""

    from sbloader.core import ledger
    from sbloader.core.split import split_epoch
    from sbloader.loaders.dropin_state import EpochRun

    rng = random.Random(3)
    for n, bs, w, drop in [(40, 4, 2, False), (37, 4, 3, False), (37, 4, 3, True), (5, 4, 4, False),
                           (101, 8, 2, False)]:
        offset = rng.randrange(0, 20)  # positions before the remaining ones: a resumed epoch's prior
        plan = split_epoch(n, bs, w, drop)
        ranges = [[(offset + s.start, offset + s.stop)] if s.stop > s.start else [] for s in plan.batches]
        ranks = [s.rank for s in plan.batches]
        prior = [(0, offset)] if offset else []
        logs = [[b for b, r in enumerate(ranks) if r == rank] for rank in range(w)]
        run = EpochRun(0, 0, None, None, prior, [], [], ranks, ranges, plan.per_rank)
        ks = sorted(rng.randrange(0, plan.per_rank + 1) for _ in range(4)) + [plan.per_rank, 1, 0]
        for k in ks:
            assert run.local_cut(k, w) == ledger.cut(logs, k, ranges, prior), (n, bs, w, drop, k)


def test_local_cut_matches_the_coordinator(ray_session):
    """Two ranks in one process, in order: every rank's state_dict() (local, no actor call) equals
    the coordinator's own cut of its delivery logs at the same k."""
    import ray

    import sbloader
    from sbloader.core import ledger

    loaders = [sbloader.DataLoader(list(range(60)), batch_size=4, shuffle=True, num_workers=1, rank=r,
                                   world_size=2, job_id="test-local-cut", name="local-cut",
                                   local_start=False)  # the coordinator's logs from the first batch
               for r in range(2)]
    its = [iter(lo) for lo in loaders]
    for k in range(1, 7):
        for it in its:
            next(it)
        coord = loaders[0]._carry.coordinator
        states = [lo.state_dict() for lo in loaders]
        theirs = ledger.merge(ray.get(coord.cut.remote(states[0]["epoch"], k)))
        assert [tuple(r) for r in states[0]["consumed"]] == [tuple(r) for r in theirs]
        assert states[0]["consumed"] == states[1]["consumed"]
        assert ledger.count(theirs) == 2 * 4 * k
    for it in its:
        list(it)


def test_a_restarted_job_retires_the_previous_restarts_coordinator(ray_session):
    """After torchrun restarts the workers (restart_count + 1), the first coordinator of the new
    restart kills the previous restart's (detached, so it outlived its ranks) and its pool."""
    import ray

    from sbloader.distributed.naming import NAMESPACE, coordinator_name, get_coordinator

    fp = {"dataset": "x"}
    old = get_coordinator("test-retire", "loader", 2, fp, restart_count=0)
    ray.get(old.hello.remote(2, fp))
    get_coordinator("test-retire", "loader", 2, fp, restart_count=1)

    def names() -> set:
        return {e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["namespace"].startswith(NAMESPACE)}

    deadline = time.monotonic() + 15  # the kill is asynchronous
    while coordinator_name("test-retire", "loader", 0) in names() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert coordinator_name("test-retire", "loader", 0) not in names()
    assert coordinator_name("test-retire", "loader", 1) in names()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(old.hello.remote(2, fp), timeout=30)


def test_an_idle_coordinator_retires_itself(ray_session, monkeypatch):
    """No rank called for SBLOADER_COORDINATOR_IDLE_EXIT_S: the job is over; the coordinator (detached,
    it would outlive the job on a kept cluster) kills its prestarted pool and itself. A call keeps it."""
    import ray

    from sbloader.executor.options import ExecutionOptions
    from sbloader.distributed.naming import NAMESPACE, coordinator_name, get_coordinator

    import sbloader

    monkeypatch.setenv("SBLOADER_COORDINATOR_IDLE_EXIT_S", "3")
    lo = sbloader.DataLoader(list(range(8)), batch_size=2, num_workers=1, rank=0, world_size=2,
                             job_id="test-idle", name="idle")
    fp = {"dataset": "x"}
    coord = get_coordinator("test-idle", "idle", 2, fp)
    # one actor started, still starting (its process and constructor take far longer than the call)
    assert ray.get(coord.prewarm.remote("Batches", (lo._settings().worker_op(),), ExecutionOptions())) == 1
    pool = ray.get(coord.__ray_call__.remote(lambda self: [a.handle for a in self._actor_cache[0]]))
    for _ in range(4):  # calls keep it alive past the idle time
        time.sleep(1.0)
        assert ray.get(coord.hello.remote(2, fp))["ok"]
    deadline = time.monotonic() + 30
    name = coordinator_name("test-idle", "idle")
    while time.monotonic() < deadline and name in {
            e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["namespace"].startswith(NAMESPACE)}:
        time.sleep(0.2)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(coord.hello.remote(2, fp), timeout=10)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(pool[0].ready.remote(), timeout=10)  # its pool went with it


@pytest.mark.parametrize("raised, closed", [("shutdown", True), ("error", False)])
def test_a_closed_epoch_answers_empty_and_a_failed_one_raises(raised, closed):
    """An epoch whose executor was shut down on purpose (every rank finished or left) answers a
    request still in flight with nothing, not an error nobody reads; a pipeline error still reaches
    every rank's next request."""
    from sbloader.core.errors import ExecutorShutdownError

    class _Stopping(_FakeExecutor):
        def get_next(self):
            if raised == "shutdown":
                raise ExecutorShutdownError("the execution was shut down; start a new iteration")
            raise RuntimeError("decode failed")

    spec = EpochSpec(0, 0, None, (), EpochPlan(0, 0, tuple(range(4)), False), None, 2,
                     assignment=(0, 1, 0, 1))
    ep = Epoch(spec, 2, {})
    ep.executor = _Stopping()
    ep._build_executor = lambda: True
    ep._pump()  # runs to the exception, in this thread
    assert ep.closed is closed
    if closed:
        assert ep.take(0, 1, None, 0.0, 60.0) == []
    else:
        with pytest.raises(RuntimeError, match="decode failed"):
            ep.take(0, 1, None, 0.0, 60.0)


@pytest.mark.parametrize("native", [False, True])
def test_a_coordinator_retires_once_every_ranks_loader_is_dropped(ray_session, native):
    """A loader built per epoch under torchrun gets a new name (its creation index), so a new coordinator:
    the last one's pool must not keep its CPUs for the coordinator's idle hour (the next pools would wait
    for them). Once every rank's loader of a coordinator is dropped, it releases its pool and exits; while
    one rank's lives, it stays."""
    import gc

    import ray

    from harness import in_rank_threads
    from sbloader.distributed.naming import NAMESPACE, coordinator_name

    import sbloader

    job, name, loaders = f"test-dropped-{native}", "dropped", [None, None]

    def make(rank):
        if native:
            return sbloader.from_items([{"x": i} for i in range(16)]).to_dataloader(
                batch_size=2, seed=1, rank=rank, world_size=2, job_id=job, name=name)
        return sbloader.DataLoader(list(range(16)), batch_size=2, num_workers=1, rank=rank, world_size=2,
                                   job_id=job, name=name, local_start=False)

    def rank_loop(rank):
        loaders[rank] = make(rank)
        assert len(list(loaders[rank])) == 4

    in_rank_threads(rank_loop, 2)

    def named():
        return {e["name"]: e["namespace"] for e in ray.util.list_named_actors(all_namespaces=True)
                if e["namespace"].startswith(NAMESPACE)}

    def alive():
        return coordinator_name(job, name) in named()

    coord = ray.get_actor(coordinator_name(job, name), namespace=named()[coordinator_name(job, name)])
    loaders[1] = None
    gc.collect()
    time.sleep(5)  # past the grace: one rank's loader lives
    assert alive(), "the coordinator retired while rank 0's loader still lives"
    loaders[0] = None
    gc.collect()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and alive():
        time.sleep(0.2)
    assert not alive(), "every rank dropped its loader, and the coordinator (with its pool) stays"
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(coord.hello.remote(2, {}), timeout=10)


def test_a_rank_asking_right_after_its_coordinator_was_killed_gets_a_live_one(ray_session, monkeypatch):
    """A rank reconnects at once after its coordinator died (killed: the torchrun job ``coordinator_killed``, CI
    once): the name may still name the dead actor for a moment (another process killed it), and the rank failed
    with ``ActorDiedError``; it asks again until the name names a live one."""
    import ray

    from sbloader.distributed import naming

    fp = {"dataset": "x"}
    dead = naming.get_coordinator("test-killed-name", "loader", 2, fp)
    ray.kill(dead)
    deadline = time.monotonic() + 30  # the kill is asynchronous: a call right after it may still be answered
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray.get(dead.hello.remote(2, fp), timeout=30)
            time.sleep(0.05)
    real, asks = naming.SplitCoordinator.options, []

    class NameNotFreedYet:
        def remote(self, *args, **kwargs):
            return dead  # what get_if_exists gave before the GCS had freed the dead actor's name

    def options(**kwargs):
        asks.append(kwargs["name"])
        return NameNotFreedYet() if len(asks) == 1 else real(**kwargs)

    monkeypatch.setattr(naming.SplitCoordinator, "options", options)
    coord = naming.get_coordinator("test-killed-name", "loader", 2, fp)
    assert ray.get(coord.hello.remote(2, fp))["ok"] and len(asks) == 2
