"""A native pipeline's epoch split across ranks starts on local processes (issue #44,
``sbloader/loaders/native_split_start.py``): each rank's first ``k`` batches are cut from partitions
made by worker processes forked here, then the coordinator's epoch resumed after them; the batches,
rows, seeded draws and states of a run without the local start, wherever ``k`` falls."""
from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

import sbloader
from harness import check_resume_everywhere, free_coordinators, in_rank_threads, stall_locally_at
from sbloader.loaders import local_start
from sbloader.loaders.split_start import SPLIT_LOCAL_ENV

ROWS, PARTS, BATCH = 60, 6, 4
_NAMES = itertools.count()


def noisy(batch: dict) -> dict:
    """A seeded draw per row (the task context seeds NumPy per partition) and the maker's parent pid."""
    out = dict(batch)
    out["draw"] = np.random.randint(0, 10**6, len(batch["x"]))
    out["ppid"] = np.full(len(batch["x"]), os.getppid())
    return out


def make(rank: int, world_size: int, name: str, fn=noisy):
    ds = sbloader.from_items([{"x": i, "id": i} for i in range(ROWS)], num_partitions=PARTS).map_batches(fn)
    return ds.to_dataloader(BATCH, shuffle=True, seed=5, deterministic=True, shuffle_window=3, rank=rank,
                            world_size=world_size, name=name)


def local_batches(monkeypatch, k):
    """Each rank's first ``k`` batches made locally (None: none, the coordinator's only)."""
    if k is None:
        monkeypatch.setenv(SPLIT_LOCAL_ENV, "0")
        monkeypatch.setenv(local_start.LOCAL_START_ENV, "0")
    else:
        monkeypatch.setenv(SPLIT_LOCAL_ENV, str(k))
        monkeypatch.delenv(local_start.LOCAL_START_ENV, raising=False)


def epoch(world_size: int, take=None, state=None, fn=noisy) -> tuple[list, list]:
    """Every rank's batches (columns as lists) of one epoch, each rank's loader in a thread; and the
    state rank 0 takes after ``take`` batches (None: the whole epoch, no state). ``fn``: the map."""
    name = f"nss{next(_NAMES)}"
    out: list = [None] * world_size
    states: list = [None]

    def rank_loop(rank: int) -> None:
        loader = make(rank, world_size, name, fn)
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))
        got = []
        for b in itertools.islice(loader, take) if take is not None else loader:
            got.append({c: np.asarray(v).tolist() for c, v in b.items()})
        if rank == 0 and take is not None:
            states[0] = json.loads(json.dumps(loader.state_dict()))
        out[rank] = got

    try:
        in_rank_threads(rank_loop, world_size)
    finally:
        free_coordinators(name)
    return out, states[0]


def _cols(batches, *names):
    return [[b.get(n) for n in names] for b in batches]


@pytest.fixture(scope="module")
def reference(ray_session):
    """Every rank's batches of the split epoch from the coordinator alone (no local start): one run,
    the reference of both tests that compare a local start with it."""
    with pytest.MonkeyPatch.context() as env:
        local_batches(env, None)
        return epoch(2)[0]


def test_each_ranks_first_k_batches_are_made_here_and_the_epoch_is_the_coordinators(reference, monkeypatch):
    assert sorted(x for r in reference for b in r for x, p in zip(b["x"], b.get("sbloader_padding") or
                                                                    [False] * len(b["x"])) if not p) == \
        list(range(ROWS))
    assert not any(p == os.getpid() for r in reference for b in r for p in b["ppid"])
    per_rank = len(reference[0])
    for k in (1, 3, per_rank):
        local_batches(monkeypatch, k)
        got, _ = epoch(2)
        for rank in range(2):
            # the same batches, rows, padding and seeded draws as the coordinator's alone
            assert _cols(got[rank], "x", "draw", "sbloader_padding") == \
                _cols(reference[rank], "x", "draw", "sbloader_padding"), (k, rank)
            # its first k batches from processes forked here (their parent: this process)
            assert all(p == os.getpid() for b in got[rank][:k] for p in b["ppid"]), (k, rank)


def test_states_before_at_and_after_the_kth_batch_resume_exactly_once_on_one_two_and_three_ranks(
        ray_session, monkeypatch):
    local_batches(monkeypatch, 2)
    check_resume_everywhere(make, list(range(ROWS)), key="id", world_size=2, resume_world_sizes=(1, 3),
                            same_order=True, steps=[0, 1, 2, 3, 8], rotate_sizes=True, states_in_one_run=True)


def test_an_unseeded_epoch_waits_for_the_coordinators_seed(ray_session, monkeypatch):
    """Without the loader's ``seed`` only rank 0's draw (at the coordinator) is the job's: no local start."""
    from sbloader.loaders import native_split_start
    from sbloader.loaders.pipeline_run import PipelineRun

    loader = make(0, 2, "nss-unseeded")
    base = PipelineRun(0, 1, order=[0, 1])
    assert native_split_start.enabled(loader.dataset, loader.settings, base, True, False)
    assert not native_split_start.enabled(loader.dataset, loader.settings, base, False, False)
    resumed = PipelineRun(0, 1, order=[0, 1], batches=2)
    assert native_split_start.enabled(loader.dataset, loader.settings, resumed, False, False)
    monkeypatch.setenv(SPLIT_LOCAL_ENV, "0")
    assert not native_split_start.enabled(loader.dataset, loader.settings, base, True, False)


@pytest.mark.parametrize("k", [2])
def test_a_state_taken_in_the_local_phase_resumes_the_rest_exactly(reference, monkeypatch, k):
    local_batches(monkeypatch, k + 2)
    head, state = epoch(2, take=k, state=None)
    assert state is not None
    rest, _ = epoch(2, state=state)
    for rank in range(2):
        assert _cols(head[rank] + rest[rank], "x", "draw") == _cols(reference[rank], "x", "draw"), rank


def stuck_at_a_local_workers_second_partition(batch: dict) -> dict:
    """Waits for good, using no CPU, at the second partition a local worker forked by the test's process makes
    (never on Ray's workers)."""
    stall_locally_at(2)
    return noisy(batch)


@pytest.mark.timeout(180)
def test_a_local_worker_that_stalls_leaves_the_ranks_partitions_to_ray(reference, monkeypatch):
    """A local worker that uses no CPU for a whole wait (``SBLOADER_LOCAL_STALL_S``) no longer keeps its rank
    (and the job with it) waiting for good: the partitions its rank's first batches still need are made on
    Ray; the batches, rows and draws of the coordinator's run alone."""
    from sbloader.loaders import stalled_workers

    local_batches(monkeypatch, 6)
    monkeypatch.setenv("STUCK_PARENT", str(os.getpid()))
    monkeypatch.setenv(stalled_workers.STALL_ENV, "1")
    got, _ = epoch(2, fn=stuck_at_a_local_workers_second_partition)
    for rank in range(2):
        assert _cols(got[rank], "x", "draw", "sbloader_padding") == \
            _cols(reference[rank], "x", "draw", "sbloader_padding"), rank
    makers = {p == os.getpid() for r in got for b in r[:6] for p in b["ppid"]}
    assert makers == {True, False}  # the first 6 batches' rows: some from local workers, some from Ray's
