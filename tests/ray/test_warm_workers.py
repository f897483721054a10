"""Warm workers with torch's default arguments (issue #37): the worker processes outlive an epoch,
torch's per-epoch semantics hold, and nothing stays behind (idle timeout, exit)."""
from __future__ import annotations

import functools
import os
import time

import pytest
import ray
import torch
from torch.utils.data import Dataset

import sbloader
from own_session import run_script, script_env


class Mutating(Dataset):
    """Each ``dataset[i]`` bumps a counter of the worker's copy and returns (pid, counter, seed)."""

    def __init__(self, n=8):
        self.n, self.mutations = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.mutations += 1
        return torch.tensor([os.getpid(), self.mutations, torch.initial_seed()])


def record_init(folder, worker_id):
    with open(os.path.join(folder, f"{os.getpid()}-{worker_id}-{time.monotonic_ns()}"), "w"):
        pass


def inits(folder):
    return sorted(name.split("-")[1] for name in os.listdir(folder))


def test_default_arguments_keep_processes_and_torch_semantics(ray_session, tmp_path):
    for persistent in (False, True):
        folder = tmp_path / f"p{int(persistent)}"
        folder.mkdir()
        dl = sbloader.DataLoader(Mutating(), batch_size=2, num_workers=2, persistent_workers=persistent,
                                 worker_init_fn=functools.partial(record_init, str(folder)),
                                 local_start=False)  # the pool's own semantics (the local start: test_local_start)
        epochs = [torch.cat(list(dl)) for _ in range(3)]
        # without persistent_workers every epoch's workers start from the dataset as pickled at its
        # start: each worker's counter counts this epoch's items only (never the last epoch's)
        if persistent:  # torch: a persistent worker keeps its copy, its counter goes on
            assert int(epochs[-1][:, 1].max()) > 8
        else:
            assert all(int(e[:, 1].max()) <= 8 for e in epochs), (persistent, epochs)
        expected = ["0", "1"] if persistent else ["0", "0", "0", "1", "1", "1"]
        deadline = time.monotonic() + 60  # a worker that made no batch may still be constructing
        while inits(folder) != expected and time.monotonic() < deadline:
            time.sleep(0.2)
        # torch: worker_init_fn once per worker per epoch (once for the loader's life when persistent)
        assert inits(folder) == expected
        # the same two processes every epoch: kept warm, not started anew
        assert len({name.split("-")[0] for name in os.listdir(folder)}) == 2
        if not persistent:  # seeds follow torch's rule: base seed + worker id, a new base seed each epoch
            assert len({int(s) for e in epochs for s in e[:, 2]}) >= 3
        del dl


def _answers(handle) -> bool:
    try:
        ray.get(handle.ready.remote(), timeout=10)
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


def test_warm_actors_are_per_process_and_killed_after_the_idle_timeout(ray_session, monkeypatch):
    monkeypatch.setenv("SBLOADER_WARM_IDLE_S", "1")
    dl = sbloader.DataLoader(Mutating(), batch_size=2, num_workers=2, local_start=False)
    assert len(list(dl)) == 4
    deadline = time.monotonic() + 60
    while any(dl._carry.warm_cache.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(dl._carry.warm_cache.values()), "warm actors still kept after the idle timeout"
    monkeypatch.setenv("SBLOADER_WARM_IDLE_S", "600")
    first = torch.cat(list(dl))
    assert len(first) == 8  # a new pool after the timeout
    handles = [getattr(h, "handle", h) for hs in dl._carry.warm_cache.values() for h in hs]
    assert len(handles) == 2
    del dl  # dropped: its warm actors wait for the process's next loader of the same arguments
    assert all(_answers(h) for h in handles)
    # a new loader with the same worker resources takes them: the same processes, rebuilt (fresh dataset)
    dl2 = sbloader.DataLoader(Mutating(), batch_size=2, num_workers=2, local_start=False)
    second = torch.cat(list(dl2))
    kept = [getattr(h, "handle", h) for hs in dl2._carry.warm_cache.values() for h in hs]
    assert {h._actor_id for h in kept} == {h._actor_id for h in handles}
    assert {int(p) for p in second[:, 0]} <= {ray.get(h.ready.remote())[1] for h in handles}
    assert int(second[:, 1].max()) <= 8  # each worker's dataset copy is this epoch's
    assert sum(o.actors_created for o in dl2.stats().operators) == 0  # constructions counted: none new
    del dl2  # its actors wait in the process's idle pool again
    # other worker resources: new actors (the idle ones are not taken)
    dl3 = sbloader.DataLoader(Mutating(), batch_size=2, num_workers=2, local_start=False, worker_num_cpus=0.5)
    third = torch.cat(list(dl3))
    others = [getattr(h, "handle", h) for hs in dl3._carry.warm_cache.values() for h in hs]
    assert not ({h._actor_id for h in others} & {h._actor_id for h in handles})
    assert not ({int(p) for p in third[:, 0]} & {ray.get(h.ready.remote())[1] for h in handles})
    monkeypatch.setenv("SBLOADER_WARM_IDLE_S", "1")
    del dl3  # idle, then killed after the idle time
    dl4 = sbloader.DataLoader(Mutating(), batch_size=2, num_workers=2, local_start=False)
    list(dl4)
    kept = [getattr(h, "handle", h) for hs in dl4._carry.warm_cache.values() for h in hs]
    assert {h._actor_id for h in kept} == {h._actor_id for h in handles}  # dl2's, taken again
    del dl4  # to the process's idle pool, killed after the idle time
    kept += others
    deadline = time.monotonic() + 60
    while any(_answers(h) for h in kept) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_answers(h) for h in kept), "idle warm actors still answer after the idle timeout"


def test_a_new_persistent_loader_takes_a_dropped_ones_processes(ray_session, tmp_path):
    """A resume builds a second ``persistent_workers`` loader right after the first: it takes the dropped
    one's processes, rebuilt (fresh dataset, ``worker_init_fn`` again), and keeps them for its own life;
    a loader whose iterator outlived it hands them over when that epoch ends."""
    folders = [tmp_path / str(k) for k in range(3)]
    for f in folders:
        f.mkdir()

    def loader(k, **kw):
        return sbloader.DataLoader(Mutating(), batch_size=2, num_workers=2, persistent_workers=True, local_start=False,
                                   worker_init_fn=functools.partial(record_init, str(folders[k])), **kw)

    dl = loader(0)
    it = iter(dl)
    list(it)
    # every actor's process, also one that made no batch (it may still have been starting when the epoch ended)
    handles = [getattr(h, "handle", h) for hs in dl._carry.actor_cache.values() for h in hs]
    pids = {ray.get(h.ready.remote())[1] for h in handles}
    assert len(pids) == 2
    del dl  # its iterator lives on (ended): the actors wait for the process's next loader of the same key
    dl2 = loader(1)
    epochs = [torch.cat(list(dl2)) for _ in range(2)]
    assert {int(p) for e in epochs for p in e[:, 0]} <= pids  # the same processes, no new ones
    # Each process's copy counts the items it made. Rebuilt: every copy starts again at 1 (the first
    # loader's had counted on). Persistent from then on: a copy's counter goes on into the next epoch,
    # so each process's last count is every item it made in both epochs (however the items fell).
    counts = [{} for _ in epochs]
    for e, seen in zip(epochs, counts):
        for pid, n in e[:, :2].tolist():
            seen.setdefault(pid, []).append(n)
    assert all(min(v) == 1 for v in counts[0].values()), counts
    last = {**{p: max(v) for p, v in counts[0].items()}, **{p: max(v) for p, v in counts[1].items()}}
    assert sum(last.values()) == sum(len(e) for e in epochs), counts
    deadline = time.monotonic() + 60  # a worker that made no batch may still be rebuilding
    while inits(folders[1]) != ["0", "1"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert inits(folders[1]) == ["0", "1"]  # worker_init_fn once per worker for the new loader's life
    assert sum(o.actors_created for o in dl2.stats().operators) == 0  # constructions counted: none new
    del it
    # another worker count starts its own
    dl3 = loader(2, worker_num_cpus=0.5)
    third = torch.cat(list(dl3))
    assert not ({int(p) for p in third[:, 0]} & pids)
    del dl2, dl3


class EpochCounting(torch.utils.data.IterableDataset):
    """torchdata's ``GeneratorIterable``: each worker's copy counts the epochs it ran to their end."""

    def __init__(self, sizes):
        self.sizes, self.epoch = sizes, 0

    def __iter__(self):
        w = torch.utils.data.get_worker_info().id
        start = sum(self.sizes[:w])
        for i in range(start, start + self.sizes[w]):
            yield i, self.epoch
        self.epoch += 1  # a persistent worker's copy carries this into its next epoch


def test_a_persistent_iterable_workers_shard_runs_on_its_own_actor_every_epoch(ray_session):
    """Worker ``w``'s dataset copy (and the state it keeps from epoch to epoch) lives in one actor: its shard
    runs there from the first epoch on, even while the pool's other actors are still starting."""
    dl = sbloader.DataLoader(EpochCounting([25, 50, 100, 75]), num_workers=4, persistent_workers=True,
                             worker_num_cpus=0.3, collate_fn=lambda x: x)  # a key no idle actor has: a cold pool
    for epoch in range(3):
        got = [b[0] for b in dl]
        assert sorted(i for i, _ in got) == list(range(250))
        assert {e for _, e in got} == {epoch}, (epoch, sorted({(i // 25, e) for i, e in got}))
    del dl


SCRIPT = """
import sys, torch, sbloader
rows = list(sbloader.range(50).map_batches(lambda b: {"id": b["id"] * 2}).iter_rows())  # a native pipeline
assert len(rows) == 50
dl = sbloader.DataLoader(torch.arange(16), batch_size=4, num_workers=2)
it = iter(dl); next(it)           # an epoch left open at exit
dl2 = sbloader.DataLoader(torch.arange(16), batch_size=4, num_workers=2, persistent_workers=True)
assert sum(len(b) for b in dl2) == 16
assert sum(len(b) for b in dl2) == 16
# sbloader never imports Ray Data (checked in a process of its own: other tests' Ray Train may import it)
assert "ray.data" not in sys.modules, "sbloader imported ray.data"
"""


def test_a_script_prints_nothing_at_exit(tmp_path):
    """A drop-in epoch left open, persistent workers and a native pipeline in a fresh process: it exits 0
    and prints nothing; and it never imported Ray Data (what was ``test_sbloader_never_imports_ray_data``)."""
    proc = run_script(["-c", SCRIPT], 600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    noise = [line for line in proc.stderr.splitlines() if "no task finished for" not in line]  # load notice
    assert noise == [], proc.stderr[-3000:]


class Stamp:
    """A callable-class stage that records each construction and stamps rows with its pid."""

    def __init__(self, folder, tag):
        self.tag = tag
        with open(os.path.join(folder, f"{tag}-{os.getpid()}-{time.monotonic_ns()}"), "w"):
            pass

    def __call__(self, batch):
        batch["pid"] = batch["id"] * 0 + os.getpid()
        return batch


def test_a_new_pipelines_class_stage_takes_warm_actors(ray_session, tmp_path):
    """A new pipeline per epoch: its callable-class stage with the same class, constructor arguments and
    resources runs in the actors the last pipeline left (constructions counted); another argument builds
    new ones."""
    def epoch(tag):
        ds = sbloader.from_items([{"id": i} for i in range(24)], rows_per_partition=6).map_batches(
            Stamp, fn_constructor_args=(str(tmp_path), tag), concurrency=(1, 1))
        loader = ds.to_dataloader(6, shuffle=True, seed=0)
        ids, pids = [], set()
        for b in loader:
            ids += b["id"].tolist()
            pids |= set(b["pid"].tolist())
        assert sorted(ids) == list(range(24))
        created = sum(o.actors_created for o in loader.stats().operators)
        return pids, created

    constructions = lambda tag: len([n for n in os.listdir(tmp_path) if n.startswith(f"{tag}-")])  # noqa: E731
    first, created = epoch("a")
    assert created == 1 and constructions("a") == 1
    second, created = epoch("a")  # a new pipeline, the same stage: the warm actor
    assert created == 0 and constructions("a") == 1 and second == first
    third, created = epoch("b")  # another constructor argument: a new actor
    assert created == 1 and constructions("b") == 1 and not (third & first)


IDLE_HOLDS_THE_CPUS = """
import threading, sbloader, torch
sbloader.init(num_cpus=2)
def hold_the_cpus():
    dl = sbloader.DataLoader(torch.arange(16), batch_size=4, num_workers=1, worker_num_cpus=2, local_start=False)
    assert sum(len(b) for b in dl) == 16
    # dropped: its actor (both CPUs: one process to start again after each give-way, not two) waits in the
    # idle pool for an hour (SBLOADER_WARM_IDLE_S)
def bounded(*loops):  # each in a thread, waited for at most 150 s
    threads = [threading.Thread(target=loop, daemon=True) for loop in loops]
    [t.start() for t in threads]
    [t.join(150) for t in threads]
"""
NEW_POOLS = {
    "other worker resources": """
def epoch():
    dl3 = sbloader.DataLoader(torch.arange(16), batch_size=4, num_workers=1, local_start=False, start_timeout=120)
    got.append(sum(len(b) for b in dl3))
bounded(epoch)
assert got == [16], got
""",
    "a split loader's coordinator": """
def rank(r):
    lo = sbloader.DataLoader(torch.arange(16), batch_size=4, num_workers=2, rank=r, world_size=2, job_id="give-way",
                             name="give-way", local_start=False, start_timeout=60)
    got.append(sum(len(b) for b in lo))
bounded(lambda: rank(0), lambda: rank(1))
assert got == [8, 8], got
""",
    "a user's own Ray task (no sbloader pool: the idle actors see it wait)": """
import ray
@ray.remote(num_cpus=1)
def one():
    return 1
got.append(ray.get(one.remote(), timeout=60))  # else it waits the idle hour
assert got == [1], got
""",
    "a native pipeline": """
def epoch():
    ds = sbloader.from_items([{"x": i} for i in range(40)], num_partitions=4).map_batches(lambda b: b)
    got.append(sorted(int(x) for b in ds.to_dataloader(8, local_start=False) for x in b["x"]))
bounded(epoch)
assert got == [list(range(40))], got
""",
}


LIVE_BETWEEN_EPOCHS = """
live = sbloader.DataLoader(torch.arange(16), batch_size=4, num_workers=2, local_start=False)
assert sum(len(b) for b in live) == 16  # between its epochs: its 2 actors hold both CPUs for the idle hour
got = []
def epoch():
    ds = sbloader.from_items([{"x": i} for i in range(40)], num_partitions=4).map_batches(lambda b: b)
    got.append(sorted(int(x) for b in ds.to_dataloader(8, local_start=False) for x in b["x"]))
bounded(epoch)  # torch's loader holds no worker between epochs: the pipeline does not wait for the idle hour
assert got == [list(range(40))], got
assert sum(len(b) for b in live) == 16  # the live loader's next epoch starts new actors
print("ok a live loader between its epochs", flush=True)
"""

DROPPED_RUNNING = """
a = sbloader.DataLoader(torch.arange(4000), batch_size=4, num_workers=2, local_start=False)
it = iter(a)
next(it)  # a's pool runs on both CPUs, and its iterator lives on
del a     # the loader is dropped, its epoch is not
b = sbloader.DataLoader(torch.arange(16), batch_size=4, num_workers=2, local_start=False, start_timeout=120)
assert b._settings().worker_num_cpus == 0.0  # a's running pool still holds the CPUs: b's workers share none
assert sum(len(x) for x in b) == 16
del it, b
from sbloader.loaders import closer
closer.drain(wait_s=60)  # a's epoch closed: its actors wait in the idle pool, as hold_the_cpus's would
print("ok a dropped loader's running epoch", flush=True)
"""


def test_a_dropped_loaders_running_epoch_holds_its_cpus_then_idle_actors_give_way_to_a_new_pool():
    """Two checks in one process (one Ray start, not two; they were ``test_a_dropped_loaders_running_epoch_
    still_holds_its_cpus`` and ``test_idle_actors_give_way_to_a_new_pool``).

    First, on the fresh Ray: torchdata's tests drop a loader whose iterator lives on, then build the next:
    the running pool's CPUs still count, so the new loader's workers do not ask Ray for CPUs it cannot
    have (its pool waited for its start_timeout).

    Then: a dropped loader's idle actors hold every CPU; a new pool starts at once (far below the idle
    timeout): a loader's with other worker resources; the one a split loader's coordinator runs in another
    process, which cannot kill them (a rank's loader has them give way when it finds its coordinator: the
    split-start tests ran 3x slower after this file in one session); a native pipeline's tasks. Before,
    each waited. The three in turn, the idle actors holding both CPUs again before each; the output names
    the last that started. Last, a live loader between its epochs holds both CPUs: a native pipeline's
    tasks make them go (they waited for the idle time) and the loader's next epoch starts new actors."""
    script = IDLE_HOLDS_THE_CPUS + DROPPED_RUNNING + "".join(
        f"hold_the_cpus()\ngot = []\n{body}print({'ok ' + pool!r}, flush=True)\n" for pool, body in NEW_POOLS.items())
    script += LIVE_BETWEEN_EPOCHS
    proc = run_script(["-c", script], 600, script_env(SBLOADER_WARM_IDLE_S="3600"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    expected = (["ok a dropped loader's running epoch"] + [f"ok {pool}" for pool in NEW_POOLS]
                + ["ok a live loader between its epochs"])
    assert proc.stdout.split("\n")[:-1] == expected, proc.stdout + proc.stderr[-3000:]


def test_a_finished_or_dropped_epoch_frees_its_pools_without_the_collector(ray_session, monkeypatch):
    """An execution's scheduler, pools and actor handles are freed by reference counting when the
    loader lets it go: with the cyclic collector off, no pool of the test outlives it (a cycle held
    them, and their actors' CPUs, until the collector's next full pass)."""
    import gc
    import weakref

    from sbloader.executor import pools as pools_mod
    from sbloader.loaders import closer, warm_workers

    made = []
    init = pools_mod.ActorPools.__init__

    def recording(self, *args, **kwargs):
        made.append(weakref.ref(self))
        init(self, *args, **kwargs)
    monkeypatch.setattr(pools_mod.ActorPools, "__init__", recording)
    gc.collect()
    gc.disable()
    try:
        loader = sbloader.DataLoader(list(range(400)), num_workers=2, batch_size=4, local_start=False)
        assert len([b for b in loader]) == 100  # an epoch run to its end
        it = iter(loader)
        next(it)
        del it, loader  # an epoch dropped in its middle, then its loader
        closer.drain(wait_s=10)
        warm_workers.release_idle()
        deadline = time.monotonic() + 20
        while any(r() is not None for r in made) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert made and all(r() is None for r in made), "an execution's pools outlived it (a reference cycle)"
    finally:
        gc.enable()
