"""The same-node shared-memory hand-off of output blocks (sbloader/_executor/handoff.py).

The arena and the task-side store are tested in this process (no Ray); the
loaders end to end on the session's Ray: every row exactly once, read from the
slots, and a slot never reused while an array still views it.
"""
from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from sbloader.executor import handoff
from sbloader.executor.handoff import SlotArena, SlotBlock, slot_capacity, store, store_here, sweep_stale

MiB = 2**20


def _block(i: int, n: int = 1000) -> dict:
    return {"x": np.full((n, 8), i, dtype=np.float32), "path": np.array([f"f{i}"] * 4, dtype=object),
            "f": np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4) + i)}


def _arena(tmp_path, done=None, max_slots: int = 4) -> SlotArena:
    return SlotArena("node-a", directory=str(tmp_path), max_slots=max_slots, done=done or (lambda refs: []))


def test_a_block_written_into_a_slot_reads_back_equal_and_writable(tmp_path):
    arena = _arena(tmp_path)
    lease = arena.lease(40_000, 100 * MiB)
    out = store(_block(3), lease)
    assert isinstance(out, SlotBlock)
    assert len(pickle.dumps(out)) < 2_000  # what Ray carries: no array bytes
    got = arena.open(out)
    want = _block(3)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert got["x"].flags.writeable and got["f"].flags.f_contiguous  # the slot is this block's alone
    assert got["x"].ctypes.data % 64 == 0


def test_a_slot_is_lent_again_only_once_no_array_views_it(tmp_path):
    arena = _arena(tmp_path, max_slots=2)
    a, b = arena.lease(40_000, 100 * MiB), arena.lease(40_000, 100 * MiB)
    assert {a.slot, b.slot} == {0, 1}
    assert arena.lease(40_000, 100 * MiB) is None  # both lent: the block goes through the object store
    block_a = arena.open(store(_block(1), a))
    column = block_a["x"][10:20]  # a view the consumer keeps
    del block_a
    gc.collect()
    assert arena.lease(40_000, 100 * MiB) is None
    del column
    gc.collect()
    again = arena.lease(40_000, 100 * MiB)
    assert again is not None and again.slot == a.slot


def test_slots_are_reused_last_freed_first(tmp_path):
    arena = _arena(tmp_path)
    leases = [arena.lease(40_000, 100 * MiB) for _ in range(3)]
    arena.free(leases[0])
    arena.free(leases[2])
    assert arena.lease(40_000, 100 * MiB).slot == leases[2].slot
    assert arena.in_use == 2


def test_a_block_the_slot_cannot_take_comes_back_as_it_is(tmp_path):
    arena = _arena(tmp_path)
    lease = arena.lease(10_000, 100 * MiB)
    big = {"x": np.zeros(lease.capacity + 1, dtype=np.uint8)}
    assert store(big, lease) is big
    local_class = type("Local", (), {})
    odd = {"x": np.zeros(4), "o": local_class()}  # pickle cannot take a class made at run time
    assert store(odd, lease) is odd
    other_node = _block(1)
    assert store_here(other_node, lease, "node-b") is other_node
    assert store_here(other_node, None, "node-a") is other_node


def test_a_slot_whose_task_may_still_run_waits_for_it(tmp_path):
    finished: set = set()
    arena = _arena(tmp_path, done=lambda refs: [r for r in refs if r in finished], max_slots=1)
    lease = arena.lease(10_000, 100 * MiB)
    arena.free_when_done(lease, "task-1")
    assert arena.lease(10_000, 100 * MiB) is None
    finished.add("task-1")
    assert arena.lease(10_000, 100 * MiB) is not None


def test_the_arena_grows_its_slots_once_every_slot_is_back(tmp_path):
    arena = _arena(tmp_path)
    small = arena.lease(100_000, 100 * MiB)
    assert small.capacity == slot_capacity(100_000)
    assert arena.lease(5 * MiB, 100 * MiB) is None  # a slot is still out
    arena.free(small)
    big = arena.lease(5 * MiB, 100 * MiB)
    assert big.capacity >= 5 * MiB and big.generation == small.generation + 1
    assert not os.path.exists(small.path) and os.path.exists(big.path)
    with pytest.raises(Exception, match="does not hold"):
        arena.open(SlotBlock(small, pickle.dumps({}), ()))


def test_the_budget_bounds_the_arena(tmp_path):
    arena = _arena(tmp_path, max_slots=32)
    cap = slot_capacity(MiB)
    assert arena.lease(MiB, 1.5 * cap) is None  # room for fewer than 2 slots: no arena
    got = [arena.lease(MiB, 3 * cap) for _ in range(4)]
    assert [g is not None for g in got] == [True, True, True, False]


def test_closing_removes_the_file_and_open_blocks_stay_readable(tmp_path):
    arena = _arena(tmp_path)
    lease = arena.lease(40_000, 100 * MiB)
    block = arena.open(store(_block(7), lease))
    arena.close()
    assert not os.path.exists(lease.path)
    assert arena.lease(40_000, 100 * MiB) is None
    assert float(block["x"][0, 0]) == 7.0


def test_arenas_of_dead_processes_are_swept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    ns = handoff._pid_namespace()
    stale = tmp_path / f"sbloader-slots-{ns}-{int(dead.stdout)}-abc"
    mine = tmp_path / f"sbloader-slots-{ns}-{os.getpid()}-abc"
    other_container = tmp_path / f"sbloader-slots-{ns}1-{int(dead.stdout)}-abc"  # another PID namespace
    for f in (stale, mine, other_container):
        f.write_bytes(b"x")
    assert sweep_stale(str(tmp_path)) == 1
    assert not stale.exists() and mine.exists() and other_container.exists()


def test_a_repeated_free_never_frees_the_slot_s_next_lease(tmp_path):
    arena = _arena(tmp_path, max_slots=1)
    first = arena.lease(10_000, 100 * MiB)
    arena.free(first)
    second = arena.lease(10_000, 100 * MiB)
    assert second.slot == first.slot
    arena.free(first)  # late: the slot now belongs to the second lease
    assert arena.lease(10_000, 100 * MiB) is None and arena.in_use == 1


def test_no_room_for_another_slot_keeps_the_ones_reserved(tmp_path, monkeypatch):
    arena = _arena(tmp_path)
    a = arena.lease(10_000, 100 * MiB)

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    assert arena.lease(10_000, 100 * MiB) is None
    assert arena.disabled is None
    arena.free(a)
    assert arena.lease(10_000, 100 * MiB).slot == a.slot  # the reserved slot is still lent


def test_a_pickled_arena_arrives_empty(tmp_path):
    arena = _arena(tmp_path)
    arena.lease(40_000, 100 * MiB)
    copy = pickle.loads(pickle.dumps(arena))
    assert copy.node_id == "node-a" and copy.in_use == 0


def test_the_environment_turns_the_hand_off_off(monkeypatch):
    monkeypatch.setenv("SBLOADER_SLOT_HANDOFF", "0")
    assert not handoff.enabled() and handoff.consumer_arena() is None
    monkeypatch.setenv("SBLOADER_SLOT_HANDOFF", "1")
    assert handoff.enabled()


# ----- end to end on the session's Ray ------------------------------------
#
# Every loader and dataset of the process shares one arena (handoff.consumer_arena()),
# so these tests count its slots against what was in use when they started.


def _double(batch):
    return {"x": batch["x"] * 2, "i": batch["i"]}


def _items(n: int = 1200) -> list:
    return [{"x": np.full(256, i, dtype=np.float32), "i": i} for i in range(n)]


def _in_use_settled(arena: SlotArena, want: int, timeout_s: float = 30.0) -> int:
    """The arena's slots in use once they settle to ``want`` (tasks of an execution that was
    shut down finish, finalizers run), or what they are at the deadline."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()
        n = arena.in_use
        if n == want or time.monotonic() > deadline:
            return n
        time.sleep(0.1)


@pytest.fixture
def arena(ray_session):
    arena = handoff.consumer_arena()
    assert arena is not None
    _in_use_settled(arena, 0)
    return arena


def test_the_pipeline_loader_reads_its_blocks_from_the_slots_exactly_once(arena):
    import sbloader

    loader = sbloader.from_items(_items(), rows_per_partition=40).map_batches(_double).to_dataloader(
        32, shuffle=True)
    for _ in range(2):
        seen = []
        for b in loader:
            assert (b["x"][:, 0] == 2 * b["i"].float()).all()  # the batches before wrote only their own rows
            b["x"].add_(1)  # writable, as torch's DataLoader gives
            seen += b["i"].tolist()
        assert sorted(seen) == list(range(1200))
    assert loader.stats().slot_blocks == 30  # the second epoch starts from the first's block size
    assert arena.in_use >= 1  # the last batch, still held here, views its slot
    del b
    assert _in_use_settled(arena, 0) == 0


def test_zero_copy_batches_kept_by_the_loop_are_never_overwritten(arena):
    import sbloader

    loader = sbloader.from_items(_items(), rows_per_partition=40).map_batches(_double).to_dataloader(
        40, zero_copy=True, memory_budget=64 * MiB)
    list(loader)  # an epoch to learn the block size: the next one leases from its first task
    kept = list(loader)  # every batch still views its block
    assert loader.stats().slot_blocks > 0
    assert _in_use_settled(arena, loader.stats().slot_blocks) == loader.stats().slot_blocks  # none lent again
    rows = sorted((int(i), float(x)) for b in kept for i, x in zip(b["i"], b["x"][:, 0]))
    assert rows == [(i, 2.0 * i) for i in range(1200)]
    del kept
    assert _in_use_settled(arena, 0) == 0


def test_a_loop_that_breaks_off_leaves_no_slot_lent(arena):
    import sbloader

    loader = sbloader.from_items(_items(), rows_per_partition=40).map_batches(_double).to_dataloader(40)
    list(loader)
    for k, batch in enumerate(loader):
        if k == 3:
            break
    del batch
    assert _in_use_settled(arena, 0) == 0  # tasks still in flight finish, then their slots come back
    assert sorted(int(i) for b in loader for i in b["i"]) == list(range(1200))


def test_a_shut_down_execution_hands_out_no_ready_block(arena):
    import sbloader
    from sbloader.core.errors import ExecutorShutdownError

    ds = sbloader.from_items(_items(400), rows_per_partition=40).map_batches(_double)
    list(ds.iter_batches(64))
    ex = ds.execute(arena=arena, estimates=[20_000.0])  # block size known: every block leases a slot
    item = ex.get_next()
    block = ex.fetch(item)
    import time

    time.sleep(0.5)  # blocks become ready behind the one taken
    assert ex.stats().slot_blocks == 1 and arena.in_use >= 2  # the one taken, and the ones ready or running
    ex.shutdown()
    with pytest.raises(ExecutorShutdownError):
        ex.get_next()
    del block
    assert _in_use_settled(arena, 0) == 0  # the ready blocks' slots came back, once each


def test_the_drop_in_dataloader_reads_its_batches_from_the_slots(arena):
    import torch

    import sbloader

    data = [torch.full((64,), float(i)) for i in range(256)]
    loader = sbloader.DataLoader(data, batch_size=16, num_workers=2, persistent_workers=True)
    for _ in range(2):
        got = sorted(int(v) for b in loader for v in b[:, 0])
        assert got == list(range(256))
    assert loader.stats().slot_blocks > 0


def test_every_dataset_and_loader_of_the_process_shares_one_arena(arena):
    import sbloader

    ds = sbloader.from_items(_items(400), rows_per_partition=40).map_batches(_double)
    other = sbloader.from_items(_items(80), rows_per_partition=40)
    for _ in range(2):
        rows = sorted(int(i) for b in ds.iter_batches(64) for i in b["i"])
        assert rows == list(range(400))
    assert ds.stats().slot_blocks > 0
    got = sorted((int(r["i"]), float(r["x"][0])) for r in ds.iter_rows())
    assert got == [(i, 2.0 * i) for i in range(400)]
    assert ds._slot_arena() is arena and other._slot_arena() is arena
    assert ds.to_dataloader(8).dataset._slot_arena() is arena
