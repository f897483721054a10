"""The split coordinator under real torchrun jobs (tests/scripts/split_job.py, run by ``_split_jobs.py``).

Every test reads the per-rank JSON logs of a job: the ids of every batch (rows
marked by ``sbloader_padding`` flagged), arrival times, the coordinator's actor
ids and, for the memory test, the coordinator's RSS. Each scenario runs once per module
and several tests check it; the scenarios run in four torchrun jobs (``JOB_GROUPS``: a
job's start, torchrun and its rank processes importing torch, costs more than most
scenarios), two jobs at a time (no check depends on timing: the slow rank and the
straggler wait on the other ranks' progress, not on sleeps).

Every job joins one ``ray start`` cluster of the module with ``RAY_ADDRESS`` (as
docs/torchrun.md says for several machines): one Ray start instead of one per job.
Jobs side by side on it each see only their own coordinators (their namespace). A
job on its own embedded Ray is run by the other torchrun e2e tests
(``_jobs.run_standalone``: coordinator loss, rank restart, the quiet split).
"""
from __future__ import annotations

import collections
import json

import pytest

from _cluster import Cluster
from _split_jobs import (BATCH, Job, JobFailed, check_epoch, check_one_coordinator_per_loader, compositions,
                         padded_ids, planned_compositions, real_ids, run_jobs)
from sbloader.core.split import split_epoch


@pytest.fixture(scope="module")
def cluster():
    """The module's ``ray start`` cluster (one head of 6 CPUs: two jobs' pools side by side, with room)."""
    c = Cluster(head_cpus=6, nodes=())
    try:
        yield c
    finally:
        c.stop()


# ----- the jobs run two at a time: none of their checks depends on timing

PACE_WAIT_S = 60  # a wait this long means the fast rank never came: it was waiting for the slow one
STRAGGLER = 55  # mid-epoch with shuffle=0: batch 5 of 12, after the block sizes are known
STRAGGLER_RELEASE_AFTER = 8  # of the 11 other batches
STRAGGLER_HOLD_S = 60
MEM_ROWS, MEM_PAYLOAD = 200, 5 * 2**20 // 4  # 200 samples of 5 MiB of float32: 1000 MiB per epoch
# 92 rows, 3 ranks, batch 10: 90 in full batches, 2 rows for 3 ranks -> one padded row.
IN_ORDER_ARGS = ("--rows", 92, "--seed", 7, "--in-order", 1)
UNTIMED_JOBS = {  # name: (ranks, *split_job.py arguments)
    # The two in-order runs go side by side: different timing, the same assignment expected.
    "in_order_0": (3, *IN_ORDER_ARGS),
    "in_order_1": (3, *IN_ORDER_ARGS),
    # 4 worker actors in all on a 2-CPU machine: half a CPU each, or the second
    # loader's pool would wait forever for the CPUs the first one keeps.
    "two_loaders": (2, "--two-loaders", 1, "--worker-cpus", 0.5),
    "memory": (2, "--rows", MEM_ROWS, "--payload", MEM_PAYLOAD, "--epochs", 1, "--rss", 1),
    "dist_sampler": (2, "--distributed-sampler", 1, "--seed", 3),
    "dist_sampler_drop_last": (3, "--distributed-sampler", 1, "--seed", 3, "--sampler-drop-last", 1),
    "break_early": (2, "--break-after", 2),
    # rank 0 kills the coordinator actor after 4 batches; a new one is rebuilt from the ranks' logs
    "coordinator_killed": (2, "--rows", 200, "--kill-coordinator-at", 4, "--step-s", 0.05,
                           "--after-kill-s", 2.0),
    # an IterableDataset split by the coordinator (FilteredIds: 88 ids of 103), sequential
    "iterable_split": (3, "--iterable", 1, "--shuffle", 0, "--epochs", 2),
    # rank 1 paced by rank 0's progress (see test_slow_rank_does_not_starve_the_fast_one)
    "slow_rank": (2, "--slow-rank", 1, "--pace-slow-rank", 1, "--slow-s", PACE_WAIT_S),
    # the straggler sample held until 8 other batches arrived (see test_straggler_does_not_block_other_batches)
    "straggler": (2, "--shuffle", 0, "--straggler", STRAGGLER, "--straggler-s", STRAGGLER_HOLD_S,
                  "--straggler-release-after", STRAGGLER_RELEASE_AFTER, "--epochs", 1),
}


# The scenarios run in four torchrun jobs (one torchrun and its rank processes for several scenarios, each
# later one a job of its own to sbloader): the two in-order runs in different jobs, side by side.
JOB_GROUPS = [["in_order_0", "dist_sampler_drop_last"], ["in_order_1", "iterable_split"],
              ["two_loaders", "memory", "dist_sampler", "break_early"], ["coordinator_killed", "slow_rank", "straggler"]]


@pytest.fixture(scope="module")
def untimed_jobs(cluster, tmp_path_factory):
    return run_jobs(cluster, tmp_path_factory, UNTIMED_JOBS, JOB_GROUPS, parallel=2)


def _job(jobs: dict, name: str) -> Job:
    result = jobs[name]
    if isinstance(result, JobFailed):
        pytest.fail(str(result))
    return result


@pytest.fixture
def two_loaders(untimed_jobs):
    return _job(untimed_jobs, "two_loaders")


@pytest.fixture
def in_order_runs(untimed_jobs):
    return [_job(untimed_jobs, "in_order_0"), _job(untimed_jobs, "in_order_1")]


@pytest.fixture
def memory_run(untimed_jobs):
    return _job(untimed_jobs, "memory")


@pytest.fixture
def dist_sampler(untimed_jobs):
    return _job(untimed_jobs, "dist_sampler")


@pytest.fixture
def dist_sampler_drop_last(untimed_jobs):
    return _job(untimed_jobs, "dist_sampler_drop_last")


@pytest.fixture
def break_early(untimed_jobs):
    return _job(untimed_jobs, "break_early")


def test_killed_coordinator_is_rebuilt_and_the_epoch_completes_exactly_once(untimed_jobs):
    job = _job(untimed_jobs, "coordinator_killed")
    killed = job.ranks[0].get("killed_coordinator")
    assert killed, "rank 0 did not kill the coordinator: the test proves nothing"
    assert job.ranks[0]["coordinator_ids"] != [killed], "the coordinator in use at the end is the killed one"
    for epoch in range(2):
        check_epoch(job, epoch, range(200))


# ----- (a) exactly once, equal counts, one coordinator per loader, fresh order per epoch


def test_two_ranks_exactly_once_with_two_loaders(two_loaders):
    for epoch in range(2):
        for loader in range(2):
            check_epoch(two_loaders, epoch, range(103), loader)


def test_two_loaders_two_coordinators(two_loaders):
    check_one_coordinator_per_loader(two_loaders, 2)
    for lg in two_loaders.ranks:
        assert lg["held_epochs"] == [], f"rank {lg['rank']}: the coordinator still holds epochs {lg['held_epochs']}"


def test_leaving_an_epoch_early(break_early):
    """Every rank stops after 2 batches of epoch 0 (a step limit): the next epoch is whole, nothing leaks."""
    job = break_early
    assert [len(job.batches(r, 0)) for r in range(2)] == [2, 2]
    ids = [i for b in job.all_batches(0) for i in real_ids(b)]
    assert len(ids) == len(set(ids)), f"a sample twice in the partial epoch 0: {sorted(ids)}"
    check_epoch(job, 1, range(103))
    for lg in job.ranks:
        assert lg["held_epochs"] == [], \
            f"rank {lg['rank']}: the coordinator still holds epochs {lg['held_epochs']} that every rank left"


def test_shuffled_order_differs_per_epoch_sequential_does_not(two_loaders):
    assert compositions(two_loaders, 0, 0) != compositions(two_loaders, 1, 0), \
        "the shuffled loader cut the same batches in both epochs"
    for epoch in range(2):  # shuffle=False: the plan's consecutive chunks of 0..102
        assert compositions(two_loaders, epoch, 1) == planned_compositions(list(range(103)), 2), \
            f"epoch {epoch}: the sequential loader's batches are not the plan's chunks"


def test_three_ranks_exactly_once_with_padding(in_order_runs):
    job = in_order_runs[0]
    for epoch in range(2):
        check_epoch(job, epoch, range(92))
        pads = [i for b in job.all_batches(epoch) for i in padded_ids(b)]
        assert len(pads) == 1, f"epoch {epoch}: expected exactly one padded row, found {pads}"
    check_one_coordinator_per_loader(job, 1)
    assert compositions(job, 0) != compositions(job, 1), "same batches in both epochs"


def test_in_order_follows_the_plan_per_rank(in_order_runs):
    job = in_order_runs[0]
    plan = split_epoch(92, BATCH, 3, False)
    for epoch in range(2):
        for r in range(3):
            sizes = [len(b["ids"]) for b in job.batches(r, epoch)]
            pads = [sum(b["pad"]) for b in job.batches(r, epoch)]
            assert sizes == [b.rows + b.pad for b in plan.for_rank(r)], f"epoch {epoch} rank {r}: sizes {sizes}"
            assert pads == [b.pad for b in plan.for_rank(r)], f"epoch {epoch} rank {r}: padding {pads}"


# ----- (e) fixed seed + in_order: the same global assignment in two runs

def test_fixed_seed_in_order_same_assignment_across_runs(in_order_runs):
    a, b = in_order_runs
    for epoch in range(2):
        for r in range(3):
            ours = [(x["ids"], x["pad"]) for x in a.batches(r, epoch)]
            theirs = [(x["ids"], x["pad"]) for x in b.batches(r, epoch)]
            assert ours == theirs, f"epoch {epoch} rank {r}: run 1 got {ours[:2]}..., run 2 got {theirs[:2]}..."
    check_epoch(b, 0, range(92))


# ----- (b) a slow rank starves nobody: it takes its next batch only once the other took two more (paced
# by the other rank's progress, not by sleeps), so a fast rank that waited for it would hang the job

@pytest.fixture
def slow_rank(untimed_jobs):
    return _job(untimed_jobs, "slow_rank")


def test_slow_rank_does_not_starve_the_fast_one(slow_rank):
    """Rank 1 takes its batch k+1 only once rank 0 took 2(k+1) batches (its epochs' total at most): each
    of those waits ended by rank 0's progress, none by the timeout, so rank 0 took both epochs while rank 1
    was still in epoch 0 (what was measured with a rank 10x slower by sleeps, now an order of events)."""
    job = slow_rank
    for epoch in range(2):
        check_epoch(job, epoch, range(103))
    pace = job.ranks[1]["pace"]
    assert len(pace) == 2 * len(job.batches(1, 0)), f"the slow rank waited {len(pace)} times"
    stuck = [w for w in pace if w["released_by"] != "count"]
    assert not stuck, f"the fast rank stopped while the slow one waited for it (starved): {stuck}"
    fast_end = max(b["t"] for e in range(2) for b in job.batches(0, e))
    slow_epoch0_end = max(b["t"] for b in job.batches(1, 0))
    assert fast_end < slow_epoch0_end, "the fast rank did not finish both epochs before the slow rank's epoch 0"


# ----- (c) a straggler partition blocks nothing before the end of the epoch (in_order=0): its sample is
# held until 8 of the epoch's 11 other batches reached the ranks (2/3 of them), or 60 s

@pytest.fixture
def straggler(untimed_jobs):
    return _job(untimed_jobs, "straggler")


def test_straggler_does_not_block_other_batches(straggler):
    """While the straggler's sample is held, 8 of the 11 other batches reach the ranks (the hold ends by
    that count, not by its 60 s timeout), and they come before the straggler's batch."""
    job = straggler
    check_epoch(job, 0, range(103))
    hold = json.loads((job.out / "straggler.json").read_text())
    assert hold["released_by"] == "count", f"the other batches waited for the straggler: {hold}"
    [(_, s_batch)] = [(r, b) for r in range(2) for b in job.batches(r, 0) if STRAGGLER in b["ids"]]
    others = [b for b in job.all_batches(0) if b is not s_batch]
    before = sum(1 for b in others if b["t"] < s_batch["t"])
    assert before >= STRAGGLER_RELEASE_AFTER, \
        f"only {before} of {len(others)} batches arrived before the straggler's: it blocked the others"


# ----- (d) the coordinator's memory stays flat while > 1 GB of batches flows

def test_coordinator_memory_flat_over_a_gigabyte(memory_run):
    job = memory_run
    assert MEM_ROWS * MEM_PAYLOAD * 4 > 10**9
    check_epoch(job, 0, range(MEM_ROWS))
    infos = [i for lg in job.ranks for i in lg["coordinator_info"]]
    assert len({i["pid"] for i in infos}) == 1, f"more than one coordinator process: {infos}"
    rss = [i["rss"] for i in infos]
    assert min(rss) > 0, f"no RSS reported: {infos}"
    for lg in job.ranks:
        start, end = (i["rss"] for i in lg["coordinator_info"])
        assert end - start < 100 * 2**20, \
            f"rank {lg['rank']}: coordinator RSS grew {(end - start) / 2**20:.0f} MiB ({start} -> {end} bytes)"
    assert max(rss) - min(rss) < 100 * 2**20, f"coordinator RSS varied by {(max(rss) - min(rss)) / 2**20:.0f} MiB"


# ----- (f) an unchanged DDP-style script: DistributedSampler + set_epoch

def _sampler_order(n: int, seed: int, epoch: int) -> list:
    import torch

    g = torch.Generator()
    g.manual_seed(seed + epoch)  # what DistributedSampler draws
    return torch.randperm(n, generator=g).tolist()


def test_distributed_sampler_exactly_once_balanced(dist_sampler):
    job = dist_sampler
    for epoch in range(2):
        check_epoch(job, epoch, range(103))
        order = _sampler_order(103, 3, epoch)
        assert compositions(job, epoch) == planned_compositions(order, 2), \
            f"epoch {epoch}: batches are not the plan's chunks of the sampler's permutation"
    assert compositions(job, 0) != compositions(job, 1), "set_epoch did not change the order"
    check_one_coordinator_per_loader(job, 1)


def test_distributed_sampler_drop_last(dist_sampler_drop_last):
    job = dist_sampler_drop_last
    for epoch in range(2):
        order = _sampler_order(103, 3, epoch)
        kept = order[: (103 // 3) * 3]  # torch drops the cross-rank tail: 102 samples
        check_epoch(job, epoch, kept)
        assert order[-1] not in {i for b in job.all_batches(epoch) for i in b["ids"]}, \
            f"epoch {epoch}: sample {order[-1]}, dropped by the sampler, was delivered"
        assert compositions(job, epoch) == planned_compositions(kept, 3), \
            f"epoch {epoch}: batches are not the plan's chunks of the sampler's permutation"
    assert compositions(job, 0) != compositions(job, 1), "set_epoch did not change the order"


# ----- an IterableDataset split by the coordinator, a real torchrun job ---------------------------------------------------------------------------


def test_torchrun_three_ranks_iterable_split(untimed_jobs):
    """3 ranks, 88 ids kept of 103 (2 worker shards of 44), batches of 10: 10 batches (8 full, 2 of 4
    rows) per epoch; 3 whole batches per rank, the shortest left over cut as 2 + 1 + 1 rows."""
    job = _job(untimed_jobs, "iterable_split")
    expected = [i for i in range(103) if i % 7]
    for lg in job.ranks:
        assert lg["len"] is None, f"rank {lg['rank']}: len(loader) = {lg['len']}, expected TypeError"
    for epoch in range(2):
        counts = [len(job.batches(r, epoch)) for r in range(3)]
        assert counts == [4, 4, 4], f"epoch {epoch}: batches per rank {counts}"
        batches = job.all_batches(epoch)
        real = sorted(i for b in batches for i in real_ids(b))
        assert real == expected, f"epoch {epoch}: {collections.Counter(real).most_common(3)}"
        assert not [i for b in batches for i in padded_ids(b)], f"epoch {epoch}: padding with 4 rows for 3 ranks"
        assert sorted(len(job.batches(r, epoch)[-1]["ids"]) for r in range(3)) == [1, 1, 2]
    assert job.ranks[0]["held_epochs"] == [], f"the coordinator still holds epochs {job.ranks[0]['held_epochs']}"
