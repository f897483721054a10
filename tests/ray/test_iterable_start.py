"""The local start of an ``IterableDataset`` epoch (issue #44): shards begin on local worker processes,
then the pool resumes each from the last batch the loop took; every sample once, in the order (and with
the random draws) of a run on the pool alone, wherever the handover falls."""
from __future__ import annotations

import os
import time

import pytest
import torch
from harness import CountsIterCalls
from torch.utils.data import IterableDataset, get_worker_info

import sbloader
from sbloader.loaders import local_start

SIZES = (7, 3, 5, 0)  # values per worker shard (worker w % 4): shards end at different rounds


class Shards(IterableDataset):
    """Worker ``w`` yields ``SIZES[w % 4]`` rows ``(value, a random draw, pid, worker id)``."""

    def __iter__(self):
        info = get_worker_info()
        w = info.id if info is not None else 0
        for v in range(100 * w, 100 * w + SIZES[w % 4]):
            yield torch.tensor([v, int(torch.randint(0, 10**6, ())), os.getpid(), w])


class Positioned(Shards):
    """The same rows, with the dataset's own state (where its shard stands): resumed without a replay."""

    def __init__(self):
        self.pos = 0

    def __iter__(self):
        info = get_worker_info()
        w = info.id if info is not None else 0
        while self.pos < SIZES[w % 4]:
            v = 100 * w + self.pos
            self.pos += 1
            yield torch.tensor([v, 0, os.getpid(), w])

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class CountsOnly(CountsIterCalls, Shards):
    """The same rows, with a state that does not say where its shard stands (torchdata's CountIterCalls)."""


def epoch(monkeypatch, at, workers, dataset=Shards):
    if at is None:
        monkeypatch.delenv(local_start.HANDOVER_AT_ENV, raising=False)
    else:
        monkeypatch.setenv(local_start.HANDOVER_AT_ENV, str(at))
    loader = sbloader.DataLoader(dataset(), batch_size=2, num_workers=workers, seed=7, local_start=at is not None)
    return [b for b in loader], loader


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 4 workers on 2 cores
@pytest.mark.parametrize("workers", [2, 4])
def test_handover_at_every_batch_keeps_the_pools_order_and_draws(ray_session, monkeypatch, workers):
    reference, _ = epoch(monkeypatch, None, workers)  # the pool alone
    values = [b[:, 0].tolist() for b in reference]
    assert sorted(v for b in values for v in b) == sorted(100 * w + i for w in range(workers)
                                                          for i in range(SIZES[w % 4]))
    pool_pids = {int(p) for b in reference for p in b[:, 2]}
    for at in range(len(reference) + 1):
        got, loader = epoch(monkeypatch, at, workers)
        assert [b[:, 0].tolist() for b in got] == values, at  # every sample once, the Ray-only round-robin
        assert [b[:, 1].tolist() for b in got] == [b[:, 1].tolist() for b in reference], at  # the same draws
        local = {int(p) for b in got[:at] for p in b[:, 2]}
        assert os.getpid() not in local and not (local & pool_pids), at  # local batches from forked workers
        assert all(int(w) == int(b[0, 0]) // 100 for b in got for w in b[:, 3])  # worker id = shard, as torch's
        if at < len(reference):  # the pool made the rest
            assert loader.stats() is not None, at


@pytest.mark.parametrize("at", [1, 3])
def test_a_handover_after_local_batches_of_a_dataset_whose_state_holds_no_position_is_exactly_once(
        ray_session, monkeypatch, at):
    """The handover is sbloader's, not a user's resume: it places each shard by the samples taken, never by
    the dataset's own state, which need not hold the position (here a count of ``__iter__`` calls). Before
    2026-12-04 the pool loaded that state and replayed the shard, so the local batches came twice (seen
    once warm actors of another count made the pool ready at the first local batch)."""
    values = sorted(100 * w + i for w in range(2) for i in range(SIZES[w % 4]))
    got, _ = epoch(monkeypatch, at, 2, CountsOnly)
    assert sorted(int(v) for b in got for v in b[:, 0]) == values, at


@pytest.mark.parametrize("dataset", [Shards, Positioned])
@pytest.mark.parametrize("at", [0, 2, 5])
@pytest.mark.parametrize("taken", [1, 3, 6])
def test_state_dict_across_the_handover_resumes_exactly_once(ray_session, monkeypatch, dataset, at, taken):
    whole, _ = epoch(monkeypatch, None, 2, dataset)
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, str(at))
    loader = sbloader.DataLoader(dataset(), batch_size=2, num_workers=2, seed=7)
    it = iter(loader)
    first = [next(it)[:, 0].tolist() for _ in range(taken)]
    state = loader.state_dict()  # before, at or after the handover
    it.close()
    resumed = sbloader.DataLoader(dataset(), batch_size=2, num_workers=2, seed=7)
    resumed.load_state_dict(state)
    rest = [b[:, 0].tolist() for b in resumed]
    assert first + rest == [b[:, 0].tolist() for b in whole], (at, taken)  # once each, the same order


class Broken(IterableDataset):
    def __iter__(self):
        yield torch.zeros(1)
        raise KeyError("shard broke")


def test_an_error_in_the_local_phase_is_torchs(monkeypatch):
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "100")  # all local
    loader = sbloader.DataLoader(Broken(), batch_size=1, num_workers=2)
    with pytest.raises(KeyError, match="shard broke"):
        list(loader)


def note_worker(worker_id):
    info = get_worker_info()
    info.dataset.seen = (worker_id, info.num_workers, info.seed)


class Seen(IterableDataset):
    seen = None

    def __iter__(self):
        info = get_worker_info()
        yield torch.tensor([info.id, self.seen[0], self.seen[1], os.getpid()])


def test_worker_init_fn_and_worker_info_in_the_local_phase(monkeypatch):
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "100")  # all local
    got = torch.stack(list(sbloader.DataLoader(Seen(), batch_size=None, num_workers=2, worker_init_fn=note_worker)))
    assert sorted(got[:, 0].tolist()) == [0, 1] and (got[:, 0] == got[:, 1]).all() and (got[:, 2] == 2).all()
    assert os.getpid() not in got[:, 3].tolist()


class SecondWaits(IterableDataset):
    """Worker 1 starts once worker 0 made all its rows (a file says so): with ``in_order=False`` torch hands
    worker 0's rows out first."""

    def __init__(self, flag):
        self.flag = flag

    def __iter__(self):
        import time

        w = get_worker_info().id
        if w == 1:
            deadline = time.monotonic() + 60
            while not os.path.exists(self.flag) and time.monotonic() < deadline:
                time.sleep(0.01)
        yield from range(5 * w, 5 * w + 5)
        if w == 0:
            open(self.flag, "w").close()


def test_in_order_false_in_the_local_phase_is_torchs(monkeypatch, tmp_path):
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "100")  # all local
    loader = sbloader.DataLoader(SecondWaits(str(tmp_path / "done")), batch_size=None, num_workers=2, in_order=False)
    got = [int(b) for b in loader]
    assert got == list(range(10))  # as they come, not dealt round-robin


class Long(IterableDataset):
    """Each worker's shard goes on far longer than the test reads."""

    def __iter__(self):
        info = get_worker_info()
        w = info.id if info is not None else 0
        for v in range(10**6):
            yield torch.tensor([w, v])


def test_an_epoch_closed_while_its_pool_opens_shuts_that_pool_down(ray_session, monkeypatch):
    """The loop leaves the epoch right after its local batches, while the fetch thread opens the pool (a
    ``persistent_workers`` pool waits there for every actor): the close found no pool to shut down, so its
    rounds ran on for good, their actors' CPUs held and, once the loader was gone, counted by nobody (torch's
    suite stalled on the next loaders' pools). The pool is shut down where it opens, and closed once; the
    loader's next epoch, begun meanwhile, keeps its own pool's CPUs counted."""
    import threading

    from sbloader.loaders import dropin_epoch

    opening, go = threading.Event(), threading.Event()
    real = dropin_epoch.open_pool

    def slow_open(*args, **kwargs):
        if not opening.is_set():  # the first epoch's pool only
            opening.set()
            go.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(dropin_epoch, "open_pool", slow_open)
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "1")
    before = {t.ident for t in threading.enumerate()}
    loader = sbloader.DataLoader(Long(), batch_size=2, num_workers=2, local_start=True)
    carry = loader._carry
    first = iter(loader)
    assert next(first).shape == (2, 2)  # the local batch; then the fetch thread goes on to open the pool
    assert opening.wait(60)
    closing = threading.Thread(target=first.close)  # it waits for the fetch thread, in the pool's opening
    closing.start()
    second = iter(loader)  # the next epoch begins meanwhile: local batch, then its own pool
    assert [tuple(next(second).shape) for _ in range(3)] == [(2, 2)] * 3
    go.set()  # the first epoch's pool opens now, after its close
    closing.join(60)
    assert carry.pools_running == 1 and carry.pool_cpus > 0  # the second's pool, still counted
    assert next(second).shape == (2, 2)
    second.close()

    def running():
        # the closer and the idle-actor watcher serve the process (warm_workers.watch runs while the loader's
        # warm actors wait for its next epoch), not the closed epoch's pool
        return [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("sbloader-")
                and t.name not in ("sbloader-epoch-closer", "sbloader-idle-watch")]
    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(), "a pool opened after its epoch's close still runs"
    assert carry.pools_running == 0 and carry.pool_cpus == 0.0


class StuckLocally(Shards):
    """:class:`Shards`, but shard 1, in a local worker forked by the test's process, waits for good (using no CPU)
    after its first row: a worker stuck on a lock its fork left held."""

    def __iter__(self):
        info = get_worker_info()
        for i, row in enumerate(super().__iter__()):
            if i == 1 and info.id == 1 and os.environ.get("STUCK_PARENT") == str(os.getppid()):
                import threading

                threading.Event().wait()
            yield row


@pytest.mark.timeout(180)
@pytest.mark.parametrize("in_order", [True, False])
def test_a_local_worker_that_stalls_hands_the_shards_to_the_pool(ray_session, monkeypatch, in_order):
    """A local worker that uses no CPU for a whole wait (``SBLOADER_LOCAL_STALL_S``) no longer keeps the epoch
    waiting for good: the pool resumes every shard after the last batch received from it; every sample once,
    and in order, the pool-only order and draws."""
    from sbloader.loaders import stalled_workers

    def rows(**kw):
        loader = sbloader.DataLoader(StuckLocally(), batch_size=2, num_workers=2, seed=7, in_order=in_order, **kw)
        return [b[:, :2].tolist() for b in loader]

    monkeypatch.delenv(local_start.HANDOVER_AT_ENV, raising=False)
    reference = rows(local_start=False)
    monkeypatch.setenv("STUCK_PARENT", str(os.getpid()))
    monkeypatch.setenv(stalled_workers.STALL_ENV, "1")
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "1000")  # every batch local, were none stalled
    got = rows()  # before: the epoch waited for the stalled worker for good
    if in_order:
        assert got == reference
    else:
        assert sorted(r for b in got for r in b) == sorted(r for b in reference for r in b)
