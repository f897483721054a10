"""The local start of a drop-in epoch (issue #44): the first batches from local worker processes,
then the pool; every sample once, the Ray-only order, batch boundaries and states kept across the
handover, wherever it falls."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import get_worker_info

import sbloader
from harness import Tagged
from own_session import run_script, script_env
from sbloader.loaders import local_start


def epoch_rows(loader, epoch=0):
    loader.set_epoch(epoch)
    return [b for b in loader]


def run(monkeypatch, at, **kw):
    if at is None:
        monkeypatch.delenv(local_start.HANDOVER_AT_ENV, raising=False)
    else:
        monkeypatch.setenv(local_start.HANDOVER_AT_ENV, str(at))
    loader = sbloader.DataLoader(Tagged(), batch_size=4, shuffle=True, seed=7, local_start=at is not None, **kw)
    return epoch_rows(loader), loader


@pytest.mark.parametrize("workers", [2, 4])
def test_handover_at_every_batch_keeps_order_and_samples(ray_session, monkeypatch, workers):
    reference, _ = run(monkeypatch, None, num_workers=workers)  # the pool alone
    ref_ids = [b[:, 0].tolist() for b in reference]
    assert sorted(i for ids in ref_ids for i in ids) == list(range(40))
    pids_ray = {int(p) for b in reference for p in b[:, 2]}
    for at in range(len(reference) + 1):
        got, loader = run(monkeypatch, at, num_workers=workers)
        # every sample once, in the Ray-only order, the same batch boundaries
        assert [b[:, 0].tolist() for b in got] == ref_ids, at
        # the same augmentation draws: each batch seeded from the plan, wherever it was made
        assert [b[:, 1].tolist() for b in got] == [b[:, 1].tolist() for b in reference], at
        pids = [{int(p) for p in b[:, 2]} for b in got]
        local = set().union(*pids[:at]) if at else set()
        assert os.getpid() not in local and not (local & pids_ray)  # local batches from forked workers
        # worker ids as torch's: 0..num_workers-1 in both phases
        assert {int(w) for b in got for w in b[:, 3]} <= set(range(workers))
        if at < len(reference):  # the pool made the rest
            assert loader.stats() is not None


def test_zero_workers_has_no_local_phase(ray_session, monkeypatch):
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "1")
    loader = sbloader.DataLoader(Tagged(), batch_size=4, shuffle=True, seed=7, num_workers=0)
    rows = [b[:, 0].tolist() for b in loader]
    assert sorted(i for r in rows for i in r) == list(range(40))
    assert all(int(p) == os.getpid() for b in loader for p in b[:, 2])


@pytest.mark.parametrize("at", [0, 2, 5])
@pytest.mark.parametrize("taken", [1, 3, 6])
def test_state_dict_across_the_handover_resumes_exactly_once(ray_session, monkeypatch, at, taken):
    from sbloader.loaders import warm_workers

    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, str(at))
    monkeypatch.setattr(warm_workers, "DRAIN_S", 60.0)
    loader = sbloader.DataLoader(Tagged(), batch_size=4, shuffle=True, seed=3, num_workers=2)
    it = iter(loader)
    first = [next(it)[:, 0].tolist() for _ in range(taken)]
    state = loader.state_dict()  # taken before, at or after the handover
    del it
    resumed = sbloader.DataLoader(Tagged(), batch_size=4, shuffle=True, seed=3, num_workers=2)
    resumed.load_state_dict(state)
    rest = [b[:, 0].tolist() for b in resumed]
    ids = [i for r in first + rest for i in r]
    assert sorted(ids) == list(range(40)), (at, taken)
    # the resume took the dropped epoch's actors (started ahead, before or after its handover), not new ones:
    # its pool's start waited for the dropped epoch's close (DRAIN_S; raised here: no race with this machine's speed)
    assert resumed.stats() is None or resumed.stats().operators[0].actors_created == 0, (
        at, taken, getattr(loader._carry, "warm_key", None), getattr(resumed._carry, "warm_key", None))
    # the same order as an uninterrupted run
    whole = sbloader.DataLoader(Tagged(), batch_size=4, shuffle=True, seed=3, num_workers=2)
    assert first + rest == [b[:, 0].tolist() for b in whole]


@pytest.mark.parametrize("at", [1, 3])
def test_states_around_the_handover_resume_on_one_and_two_ranks(ray_session, monkeypatch, at):
    """Every step of an epoch handed over at batch ``at``, resumed on 1 and 2 ranks (the shared harness)."""
    from harness import IdsLoader, check_resume_everywhere

    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, str(at))

    def make(rank, world_size, name):
        return IdsLoader(sbloader.DataLoader(list(range(24)), batch_size=4, shuffle=True, num_workers=2, seed=3,
                                        rank=rank, world_size=world_size, name=name, job_id="local-start"))

    # each step's state from the uninterrupted epoch (the harness's states_in_one_run: the same states
    # as runs cut there); step 0 once (at - 1 is 0 for at=1)
    check_resume_everywhere(make, list(range(24)), key="id", resume_world_sizes=(2,), same_order=True,
                            steps=sorted({0, at - 1, at, at + 1, 6}), end_state="empty", states_in_one_run=True)


class FailsAt(Tagged):
    def __getitem__(self, i):
        if i == 5:
            raise ValueError("bad sample 5")
        return super().__getitem__(i)


def test_local_phase_error_is_torchs_and_the_epoch_goes_on(monkeypatch):
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "100")  # all local
    loader = sbloader.DataLoader(FailsAt(12), batch_size=2, num_workers=2)
    got, errors = [], []
    it = iter(loader)
    while True:
        try:
            got.append(next(it)[:, 0].tolist())
        except StopIteration:
            break
        except ValueError as e:
            errors.append(str(e))
    assert len(errors) == 1 and "Caught ValueError in DataLoader worker process" in errors[0]
    assert "bad sample 5" in errors[0]
    assert [i for b in got for i in b] == [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]


def _live_local_workers() -> list:
    """torch iterators of local phases whose workers were not shut down (found without a collection)."""
    import gc

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    return [o for o in gc.get_objects() if isinstance(o, _MultiProcessingDataLoaderIter) and not o._shutdown]


@pytest.mark.parametrize("dataset", ["items", "iterable"])
def test_a_raised_local_batch_lets_its_iterator_and_workers_go_without_a_collection(monkeypatch, dataset):
    # A batch's error raised in the loop referenced, through its traceback, torch's reraise frame (a cycle
    # with the error itself) and the loop's frame (its iterator, whose fetch thread held the failed batch):
    # the local workers lived until a garbage collection, whose join then took 5 s per worker (a test's
    # teardown took 20 s at 4 workers). "items" fails without the fix; "iterable" (a fatal error: the
    # epoch closes at once) guards the same for an IterableDataset's local phase.
    import gc
    import time

    from torch.utils.data import IterableDataset

    class Fails(IterableDataset):
        def __iter__(self):
            raise IndexError("iter broke")

    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "100")  # all local
    make = (lambda: FailsAt(40)) if dataset == "items" else Fails
    gc.collect()
    gc.disable()
    try:
        try:
            next(iter(sbloader.DataLoader(make(), batch_size=2 if dataset == "iterable" else 8, num_workers=2)))
        except (ValueError, IndexError):
            pass
        deadline = time.monotonic() + 15
        while _live_local_workers() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _live_local_workers(), "the local workers outlived their iterator until a collection"
    finally:
        gc.enable()


def record_init(worker_id):
    info = get_worker_info()
    # torch's order: seeded base_seed + id before worker_init_fn, get_worker_info() set
    assert info.seed == torch.initial_seed()
    assert info.id == worker_id


def test_worker_init_fn_and_seeds_as_torchs_in_the_local_phase(monkeypatch):
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "100")
    seeds = []
    for _ in range(2):
        loader = sbloader.DataLoader(Tagged(8), batch_size=2, num_workers=2, seed=11, worker_init_fn=record_init)
        seeds.append([b[:, 1].tolist() for b in loader])
    assert seeds[0] == seeds[1]  # a seed fixes the draws


def bad_init(worker_id):
    raise KeyError("no such thing")


def test_worker_init_fn_error_in_the_local_phase(monkeypatch):
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "100")
    loader = sbloader.DataLoader(Tagged(8), batch_size=2, num_workers=2, worker_init_fn=bad_init)
    with pytest.raises(KeyError, match="Caught KeyError in DataLoader worker process") as info:
        list(loader)
    assert "worker_init_fn" in str(info.value) and isinstance(info.value.__cause__, KeyError)


class Unpicklable(Tagged):
    def __init__(self, n=8):
        import threading

        super().__init__(n)
        self.lock = threading.Lock()


def test_a_dataset_that_cannot_be_pickled(monkeypatch):
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "100")
    # torch's spawn context pickles the dataset: torch's error
    with pytest.raises(TypeError, match="pickle"):
        list(sbloader.DataLoader(Unpicklable(), batch_size=2, num_workers=2, multiprocessing_context="spawn"))
    # with local_start off the pool pickles it: the same error
    monkeypatch.delenv(local_start.HANDOVER_AT_ENV)
    with pytest.raises(TypeError, match="pickle"):
        list(sbloader.DataLoader(Unpicklable(), batch_size=2, num_workers=2, local_start=False))


EXIT_SCRIPT = """
import sys, time
import sbloader
loader = sbloader.DataLoader(list(range(1000)), batch_size=32, shuffle=True, num_workers=2)
it = iter(loader)
print(next(it)[:2].tolist(), flush=True)
if sys.argv[1] == "drain":
    assert sum(len(b) for b in it) == 1000 - 32
"""


@pytest.mark.parametrize("when", ["first_batch", "drain"])
def test_a_script_exits_at_once_and_prints_nothing(tmp_path, when):
    """A script that ends right after its first batch (Ray still starting in the background), or after the
    epoch: it exits, prints nothing of ours or Ray's, and leaves no process behind."""
    import subprocess

    proc = run_script(["-c", EXIT_SCRIPT, when], 240, script_env(drop=(local_start.HANDOVER_AT_ENV,)))
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, err[-3000:]
    assert len(out.splitlines()) == 1
    noise = [line for line in err.splitlines() if "no task finished for" not in line]  # a load notice
    assert noise == [], err[-3000:]
    import time

    deadline = time.monotonic() + 30  # Ray's daemons die with their parent (parent-death signal, reaper)
    while time.monotonic() < deadline:
        left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
        if not left:
            break
        time.sleep(0.5)
    assert not left, f"processes left behind: {left}"


SHORT_EPOCHS_SCRIPT = """
import time
import sbloader
from harness import Tagged
from sbloader.loaders import local_start
loader = sbloader.DataLoader(list(range(16)), batch_size=4, num_workers=2)
assert len(list(loader)) == 4 and loader.stats() is None  # epoch 0 ends on the local workers, Ray not up yet
deadline = time.monotonic() + 45
while not local_start.pool_is_up(loader._settings(), loader._carry) and time.monotonic() < deadline:
    time.sleep(0.2)  # the actors its background start made wait for the next epoch
assert local_start.pool_is_up(loader._settings(), loader._carry), "the actors were not kept for the next epoch"
assert len(list(loader)) == 4 and loader.stats() is not None  # epoch 1 on the pool from its first batch
print("ok", flush=True)
"""


def test_an_epoch_shorter_than_rays_start_leaves_the_actors_for_the_next():
    """A fresh process whose first epoch ends before Ray is up: the background start goes on and its
    actors stay warm, so the next epoch starts on the pool."""
    r = run_script(["-c", SHORT_EPOCHS_SCRIPT], 300, script_env(drop=(local_start.HANDOVER_AT_ENV,)))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_a_local_start_counts_its_pools_cpus_at_once(ray_session):
    """The CPUs of the pool a local start starts in the background are held from ``iter()`` on: a loader
    built the next moment fits its workers into what is left (8 CPUs, 6 held: 4 workers of 0.5), never
    asks for CPUs the background start is about to take (and then waits for them for good)."""
    first = sbloader.DataLoader(Tagged(), batch_size=4, num_workers=6)
    it = iter(first)
    try:
        second = sbloader.DataLoader(Tagged(), batch_size=4, num_workers=4)
        assert second._settings().worker_num_cpus == 0.5
        assert len(list(second)) == 10
    finally:
        it.close()


class StuckLocally(torch.utils.data.Dataset):
    """Sample ``i`` and its maker's pid; waits for good, using no CPU, in a local worker forked by the test."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        if os.environ.get("STUCK_PARENT") == str(os.getppid()):
            import threading

            threading.Event().wait()
        return torch.tensor([i, os.getpid()])


@pytest.mark.timeout(180)
def test_a_local_worker_that_stalls_hands_the_epoch_to_the_pool(ray_session, monkeypatch):
    """A local worker that uses no CPU for a whole wait (``SBLOADER_LOCAL_STALL_S``: a lock its fork left
    held) no longer keeps the epoch waiting forever: the pool makes it from the first partition not received,
    every sample once, in the pool-only order."""
    from sbloader.loaders import stalled_workers

    def ids(**kw):
        loader = sbloader.DataLoader(StuckLocally(), batch_size=4, shuffle=True, seed=5, num_workers=2, **kw)
        return [b[:, 0].tolist() for b in loader]

    monkeypatch.delenv(local_start.HANDOVER_AT_ENV, raising=False)
    reference = ids(local_start=False)
    monkeypatch.setenv("STUCK_PARENT", str(os.getpid()))
    monkeypatch.setenv(stalled_workers.STALL_ENV, "1")
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "1000")  # every partition local, were none stalled
    assert ids() == reference  # before: the epoch waited for the stalled worker for good


class OneStuckLocally(StuckLocally):
    """Sample ``i`` and whether a local worker (a child of the test's process) made it; local worker 1 waits for
    good, worker 0 goes on."""

    def __init__(self):
        self.parent = os.getpid()

    def __getitem__(self, i):
        local = os.getppid() == self.parent
        if local and get_worker_info().id == 1:
            import threading

            threading.Event().wait()
        return torch.tensor([i, int(local)])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("in_order", [True, False])
def test_one_stalled_local_worker_leaves_the_pool_the_partitions_it_held(ray_session, monkeypatch, in_order):
    """One local worker stalls while the other delivers (out of order with ``in_order=False``): the pool makes
    exactly the partitions not received, those the stalled worker held first; every sample once, in order the
    pool-only order."""
    from sbloader.loaders import stalled_workers

    def batches(**kw):
        loader = sbloader.DataLoader(OneStuckLocally(), batch_size=4, shuffle=True, seed=5, num_workers=2,
                                     in_order=in_order, **kw)
        return [b.tolist() for b in loader], loader

    monkeypatch.delenv(local_start.HANDOVER_AT_ENV, raising=False)
    reference, _ = batches(local_start=False)
    monkeypatch.setenv(stalled_workers.STALL_ENV, "1")
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "1000")  # every partition local, were none stalled
    got, loader = batches()
    ids = [[i for i, _ in b] for b in got]
    if in_order:
        assert ids == [[i for i, _ in b] for b in reference]
    else:
        assert sorted(ids) == sorted([i for i, _ in b] for b in reference)
    local = [b for b in got if all(flag for _, flag in b)]
    assert local and len(local) < len(got)  # worker 0's partitions here, the rest from the pool
    assert not any(flag for b in got if b not in local for _, flag in b)  # a batch is made in one place
    assert loader.stats().operators[0].rows == len(got) - len(local)  # each batch (a partition) once
