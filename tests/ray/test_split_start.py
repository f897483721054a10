"""The local start of a split epoch (issue #44, torchrun): each rank's first ``k`` batches from its own
local worker processes by the plan alone, then the coordinator's epoch resumed after every rank's first
``k``; the same batches, draws and states as a split epoch without it, whatever ``k``.

Ranks run in threads of this process (``rank``/``world_size`` given to the loader), on the session's Ray.
"""
from __future__ import annotations

import os

import pytest

import sbloader
from harness import IdsLoader, Tagged, check_resume_everywhere, in_rank_threads
from sbloader.loaders import split_start
from sbloader.loaders.dropin_state import plan_run


def both_ranks(name, world_size=2, data=None, **kw):
    """Every rank's batches of one epoch (threads), and each rank's loader (over ``data``, else ``Tagged(30)``)."""
    out, loaders = [None] * world_size, [None] * world_size

    def rank_loop(rank):
        args = {"batch_size": 4, "shuffle": True, "seed": 7, "num_workers": 2, **kw}
        loaders[rank] = sbloader.DataLoader(data or Tagged(30), rank=rank, world_size=world_size, name=name,
                                            job_id="split-start", **args)
        out[rank] = list(loaders[rank])

    in_rank_threads(rank_loop, world_size)
    return out, loaders


def test_the_plans_rest_after_every_ranks_first_k_is_the_resumed_plan():
    """``EpochRun.after(k)`` is exactly the plan a state taken after every rank's first ``k`` batches
    resumes: the same batches, ranks, pads and ledger (pure arithmetic, every size and tail)."""
    import numpy as np

    for n in (0, 1, 5, 23, 24, 25, 31):
        for ws in (1, 2, 3):
            for drop_last in (False, True):
                run = plan_run(0, 9, np.random.default_rng(n).permutation(n), None, [], 4, ws, drop_last)
                for k in range(run.per_rank + 1):
                    rest = run.after(k, ws)
                    resumed = plan_run(0, 9, run.order, None, run.local_cut(k, ws), 4, ws, drop_last)
                    assert rest.prior == resumed.prior, (n, ws, k)
                    assert (rest.batches, rest.pads, rest.ranks, rest.per_rank, rest.batch_ranges) == \
                        (resumed.batches, resumed.pads, resumed.ranks, resumed.per_rank, resumed.batch_ranges), \
                        (n, ws, k)
                    # the seeds: the uninterrupted run's (a padding-only batch's id is past the order, by its index)
                    assert rest.ids == run.ids[k * ws:]
                    assert [i for i in rest.ids if i < n] == [i for i in resumed.ids if i < n]


@pytest.fixture(scope="module")
def reference(ray_session):
    """Every rank's batches of the split epoch from the coordinator's workers alone (no local start):
    one run, the reference of every ``k`` below."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(split_start.SPLIT_LOCAL_ENV, "0")
        return both_ranks("ref")[0]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_each_ranks_first_k_batches_are_local_and_the_epoch_is_the_split_one(reference, monkeypatch, k):
    ray_pids = {int(p) for batches in reference for b in batches for p in b[:, 2]}
    assert len(reference[0]) == len(reference[1]) == 4  # 30 rows, batch 4, 2 ranks: 3 full rounds and a tail
    monkeypatch.setenv(split_start.SPLIT_LOCAL_ENV, str(k))
    got, loaders = both_ranks(f"local{k}")
    for rank in range(2):
        # every rank's batches, draws and padding as without the local start
        assert [b[:, :2].tolist() for b in got[rank]] == [b[:, :2].tolist() for b in reference[rank]], (rank, k)
        made_here = [{int(p) for p in b[:, 4]} == {os.getpid()} for b in got[rank]]  # by a worker forked here
        assert made_here == [True] * k + [False] * (4 - k), (rank, k)
        local = {int(p) for b in got[rank][:k] for p in b[:, 2]}
        assert os.getpid() not in local and not (local & ray_pids), (rank, k)
        assert {int(w) for b in got[rank][:k] for w in b[:, 3]} <= {0, 1}


def test_off_with_local_start_false_and_out_of_order(ray_session, monkeypatch):
    monkeypatch.setenv(split_start.SPLIT_LOCAL_ENV, "4")
    for i, kw in enumerate(({"local_start": False}, {"in_order": False})):
        got, _ = both_ranks(f"off{i}", **kw)
        assert sorted(int(x) for batches in got for b in batches for x in b[:, 0]) == list(range(30)), kw
        assert not any(int(p) == os.getpid() for batches in got for b in batches for p in b[:, 4]), kw


@pytest.mark.parametrize("order, local", [({"shuffle": True, "seed": None}, False), ({"shuffle": False}, True)])
def test_only_an_order_every_rank_draws_alike_starts_locally(ray_session, monkeypatch, order, local):
    """An unseeded shuffle is drawn on each rank's own RNG: its ranks wait for the coordinator (rank 0's
    draw); a sequential order (or a seeded one, above) starts locally."""
    monkeypatch.setenv(split_start.SPLIT_LOCAL_ENV, "2")
    got, _ = both_ranks(f"order{local}", **order)
    assert sorted(int(x) for batches in got for b in batches for x in b[:, 0]) == list(range(30))
    for rank in range(2):
        made_here = [{int(p) for p in b[:, 4]} == {os.getpid()} for b in got[rank]]
        assert made_here == ([True] * 2 + [False] * 2 if local else [False] * 4), (rank, order)


@pytest.mark.parametrize("k", [2])
def test_states_at_every_step_resume_exactly_once_on_one_two_and_three_ranks(ray_session, monkeypatch, k):
    """A state at every step (before, at and after each rank's ``k``-th batch) of a 2-rank epoch that
    started locally, resumed onto 1, 2 and 3 ranks (each resumed run starting locally again)."""
    monkeypatch.setenv(split_start.SPLIT_LOCAL_ENV, str(k))

    def make(rank, world_size, name):
        return IdsLoader(sbloader.DataLoader(list(range(24)), batch_size=4, shuffle=True, num_workers=2, seed=3,
                                             rank=rank, world_size=world_size, name=name, job_id="split-start"))

    check_resume_everywhere(make, list(range(24)), key="id", world_size=2, resume_world_sizes=(1, 3),
                            same_order=True, steps=[0, 1, 2, 3], end_state="empty", rotate_sizes=True,
                            states_in_one_run=True)


def bad_init(worker_id):
    raise KeyError("no such thing")


def test_worker_init_fn_error_in_the_local_phase_is_torchs(ray_session, monkeypatch):
    monkeypatch.setenv(split_start.SPLIT_LOCAL_ENV, "2")
    with pytest.raises(KeyError, match="Caught KeyError in DataLoader worker process") as info:
        both_ranks("badinit", worker_init_fn=bad_init)
    assert "worker_init_fn" in str(info.value)


class StallsLocally(Tagged):
    """:class:`Tagged`; on a local worker (a child of the test's process), its second sample waits for good
    (using no CPU): on the first local worker to get there only when ``once`` (a flag file says it happened)."""

    def __init__(self, n, flag, once=True):
        super().__init__(n)
        self.flag, self.once, self.parent, self.calls = flag, once, os.getpid(), 0

    def __getitem__(self, i):
        self.calls += 1
        if os.getppid() == self.parent and self.calls == 2:
            try:
                os.close(os.open(self.flag, os.O_CREAT | os.O_EXCL))
                first = True
            except FileExistsError:
                first = False
            if first or not self.once:
                import threading

                threading.Event().wait()
        return super().__getitem__(i)


@pytest.mark.timeout(180)
def test_a_stalled_local_worker_leaves_its_ranks_batches_to_new_local_workers(reference, monkeypatch, tmp_path):
    """A local worker that uses no CPU for a whole wait (``SBLOADER_LOCAL_STALL_S``) no longer keeps its rank
    (and the job with it) waiting for good: its rank's batches not received are made by newly forked workers;
    the split epoch's batches and draws."""
    from sbloader.loaders import stalled_workers

    monkeypatch.delenv(split_start.SPLIT_LOCAL_ENV, raising=False)
    monkeypatch.setenv(stalled_workers.STALL_ENV, "1")
    got, _ = both_ranks("stalls-once", data=StallsLocally(30, str(tmp_path / "stalled")))
    assert os.path.exists(tmp_path / "stalled")  # a worker did stall
    for rank in range(2):
        assert [b[:, :2].tolist() for b in got[rank]] == [b[:, :2].tolist() for b in reference[rank]], rank
        assert all(int(p) == os.getpid() for b in got[rank] for p in b[:, 4])  # every batch local


@pytest.mark.timeout(180)
def test_local_workers_that_stall_again_raise_instead_of_waiting_for_good(ray_session, monkeypatch, tmp_path):
    from sbloader.loaders import stalled_workers

    monkeypatch.delenv(split_start.SPLIT_LOCAL_ENV, raising=False)
    monkeypatch.setenv(stalled_workers.STALL_ENV, "1")
    with pytest.raises(split_start.LocalWorkersStalled, match="stalled twice.*SBLOADER_SPLIT_LOCAL_BATCHES=0"):
        both_ranks("stalls-always", data=StallsLocally(30, str(tmp_path / "stalled"), once=False))
