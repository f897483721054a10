"""The local start of a native pipeline's epoch (issue #44): the plan's first partitions from local
worker processes while Ray starts, then the executor; the Ray-only order, rows, draws and states kept
wherever the handover falls (``SBLOADER_HANDOVER_AT`` forces it at a partition of the plan)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import sbloader
from sbloader.core.errors import UserFunctionError
from harness import stall_locally_at
from sbloader.loaders import local_start

ROWS, PARTS, BATCH = 60, 6, 8


def noisy(batch: dict) -> dict:
    """A seeded draw per row (the task context seeds NumPy per partition) and the maker's pid and parent."""
    out = dict(batch)
    out["draw"] = np.random.randint(0, 10**6, len(batch["x"]))
    out["pid"] = np.full(len(batch["x"]), os.getpid())
    out["ppid"] = np.full(len(batch["x"]), os.getppid())
    return out


def failing(batch: dict) -> dict:
    if 15 in set(batch["x"].tolist()):
        raise ValueError("row 15 is bad")
    return batch


class Doubler:
    """A callable class: its stage waits for its pool."""

    def __call__(self, batch: dict) -> dict:
        return {**batch, "x2": batch["x"] * 2}


def force_handover(monkeypatch, at):
    """Every local start hands over at partition ``at`` of the plan (None: no local start, Ray only)."""
    if at is None:
        monkeypatch.delenv(local_start.HANDOVER_AT_ENV, raising=False)
        monkeypatch.setenv(local_start.LOCAL_START_ENV, "0")
    else:
        monkeypatch.setenv(local_start.HANDOVER_AT_ENV, str(at))
        monkeypatch.delenv(local_start.LOCAL_START_ENV, raising=False)


def epoch(monkeypatch, at, fn=noisy, window=None, state=None, stop=None):
    """One epoch's batches (as lists) and the loader; ``at``: the forced handover (None: Ray only)."""
    force_handover(monkeypatch, at)
    ds = sbloader.from_items([{"x": i} for i in range(ROWS)], num_partitions=PARTS).map_batches(fn)
    loader = ds.to_dataloader(BATCH, shuffle=True, seed=5, deterministic=True, shuffle_window=window)
    if state is not None:
        loader.load_state_dict(state)
    out = []
    for b in loader:
        out.append({k: v.tolist() for k, v in b.items()})
        if stop is not None and len(out) == stop:
            break
    return out, loader


def _cols(batches, *names):
    return [[b[n] for n in names] for b in batches]


@pytest.mark.filterwarnings("ignore:shuffle window")
@pytest.mark.parametrize("window,handovers", [(None, range(PARTS + 1)), ("25 rows", (0, 3, PARTS))])
def test_handover_at_every_partition_keeps_rows_order_and_draws(ray_session, monkeypatch, window, handovers):
    reference, ref_loader = epoch(monkeypatch, None, window=window)
    assert ref_loader.stats().local_partitions == 0
    assert sorted(x for b in reference for x in b["x"]) == list(range(ROWS))
    assert os.getpid() not in {p for b in reference for p in b["ppid"]}
    for at in handovers:
        got, loader = epoch(monkeypatch, at, window=window)
        # every row once, in the Ray-only order and batch boundaries, with the same seeded draws
        assert _cols(got, "x", "draw") == _cols(reference, "x", "draw"), at
        assert loader.stats().local_partitions == at
        assert loader.stats().operators[-1].rows == ROWS
        # the first ``at`` partitions (10 rows each) from processes forked here, none in this one
        assert os.getpid() not in {p for b in got for p in b["pid"]}
        assert sum(p == os.getpid() for b in got for p in b["ppid"]) == 10 * at, at


def test_state_before_at_and_after_the_handover_resumes_exactly_once(ray_session, monkeypatch):
    reference, _ = epoch(monkeypatch, None)
    xs = [b["x"] for b in reference]
    for stop in (1, 3, len(reference) - 1):  # before, at (2 partitions of 10 rows: 2.5 batches) and after
        _, first = epoch(monkeypatch, 2, stop=stop)  # handover after the plan's 2nd partition
        state = first.state_dict()
        rest, _ = epoch(monkeypatch, 1, state=state)  # resumed with its own handover elsewhere
        assert xs[:stop] + [b["x"] for b in rest] == xs, stop


def test_an_error_in_a_local_partition_is_the_ray_runs_error(ray_session, monkeypatch):
    errors = []
    for at in (None, PARTS):
        with pytest.raises(UserFunctionError) as info:
            epoch(monkeypatch, at, fn=failing)
        errors.append(info.value)
    assert all("row 15 is bad" in str(e) for e in errors)
    assert isinstance(errors[1].original, ValueError)


def test_a_class_stage_waits_for_its_pool(ray_session, monkeypatch):
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "3")
    ds = sbloader.from_items([{"x": i} for i in range(ROWS)], num_partitions=PARTS).map_batches(Doubler)
    loader = ds.to_dataloader(BATCH, shuffle=True, seed=5)
    assert sorted(x for b in loader for x in b["x2"].tolist()) == [2 * i for i in range(ROWS)]
    assert loader.stats().local_partitions == 0


def test_local_start_false_waits_for_ray(ray_session, monkeypatch):
    monkeypatch.setenv(local_start.HANDOVER_AT_ENV, "3")
    ds = sbloader.from_items([{"x": i} for i in range(ROWS)], num_partitions=PARTS).map_batches(noisy)
    loader = ds.to_dataloader(BATCH, shuffle=True, seed=5, local_start=False)
    assert sorted(x for b in loader for x in b["x"].tolist()) == list(range(ROWS))
    assert loader.stats().local_partitions == 0


SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "native_start_job.py")


def test_a_fresh_process_starts_before_ray_and_cuts_the_ray_only_batches(tmp_path):
    """A fresh process, Ray not started: the first batch comes from local processes before Ray is up;
    Parquet's default window (half the default budget, from the embedded Ray's store size known before
    its start) cuts the batches a Ray-only run cuts; nothing printed, at exit too."""
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    for key in ("RAY_ADDRESS", local_start.HANDOVER_AT_ENV, local_start.LOCAL_START_ENV):
        env.pop(key, None)
    runs = {}
    for mode, extra in (("local", {}), ("ray", {local_start.LOCAL_START_ENV: "0"})):
        try:
            proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path / mode)], capture_output=True, text=True,
                                  timeout=240, env={**env, **extra})
        except subprocess.TimeoutExpired as e:  # the job dumped every thread's stack at 200 s: show it whole
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            pytest.fail(f"the {mode} run did not end within 240 s; its stacks:\n{err[-12000:]}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stderr == "", proc.stderr[-3000:]
        lines = proc.stdout.splitlines()
        assert len(lines) == 1, proc.stdout[-3000:]
        runs[mode] = json.loads(lines[0])
    local, ray_only = runs["local"], runs["ray"]
    assert local["batches"] == ray_only["batches"]
    assert sorted(x for b in local["batches"] for x in b) == list(range(local["rows"]))
    assert local["predicted_budget"] == local["budget"] == ray_only["budget"]
    assert local["ray_up_at_first_batch"] is False and local["local_partitions"] >= 1
    assert ray_only["ray_up_at_first_batch"] is True and ray_only["local_partitions"] == 0


def test_iter_batches_hands_over_as_the_loader_does(ray_session, monkeypatch):
    def batches(at):
        force_handover(monkeypatch, at)
        ds = sbloader.from_items([{"x": i} for i in range(ROWS)], num_partitions=PARTS).map_batches(noisy)
        out = [[b["x"].tolist(), b["draw"].tolist()] for b in ds.iter_batches(BATCH, shuffle=True, seed=5,
                                                                             deterministic=True)]
        return out, ds.stats()

    reference, ref_stats = batches(None)
    assert ref_stats.local_partitions == 0
    for at in (0, 3, PARTS):
        got, stats = batches(at)
        assert got == reference, at
        assert stats.local_partitions == at and stats.operators[-1].rows == ROWS


def evens(batch: dict) -> dict:
    keep = batch["x"] % 2 == 0
    return {k: v[keep] for k, v in batch.items()}


def first_half(batch: dict) -> dict:
    keep = batch["x"] < ROWS // 2
    return {k: v[keep] for k, v in noisy(batch).items()}


def test_each_stage_counts_its_own_output_rows_on_local_workers(ray_session, monkeypatch):
    """A stage that drops rows before another stage: the local start counts each stage's output
    as the executor does (its rows, not the last stage's)."""
    def run(at):
        force_handover(monkeypatch, at)
        ds = sbloader.from_items([{"x": i} for i in range(ROWS)], num_partitions=PARTS).map_batches(evens) \
            .map_batches(first_half, num_cpus=0.5)  # other resources: a stage of its own
        loader = ds.to_dataloader(BATCH, shuffle=True, seed=5, deterministic=True)
        xs = sorted(x for b in loader for x in b["x"].tolist())
        return xs, loader.stats()

    ref_xs, ref = run(None)
    got_xs, got = run(3)
    assert ref_xs == got_xs == list(range(0, ROWS // 2, 2))
    assert len(ref.operators) == len(got.operators) == 2 and got.local_partitions == 3
    assert [op.rows for op in got.operators] == [op.rows for op in ref.operators] == [ROWS // 2, ROWS // 4]
    assert [op.blocks for op in got.operators] == [op.blocks for op in ref.operators] == [PARTS, PARTS]


HAMMERED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "hammered_start_job.py")


def test_local_workers_forked_while_the_exit_lock_is_held_make_their_partitions(tmp_path, exit_lock_hammer):
    """A local worker forked while another thread of the trainer held the C library's exit-handler lock
    (the background Ray start loading Ray's C++ libraries) waited forever at its first C++ static, and the
    epoch with it (CI, the fresh-process test above): the lock is set free in each local worker."""
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", **{local_start.HANDOVER_AT_ENV: "1000"})
    for key in ("RAY_ADDRESS", local_start.LOCAL_START_ENV):
        env.pop(key, None)
    try:
        proc = subprocess.run([sys.executable, HAMMERED, exit_lock_hammer, str(tmp_path / "data")],
                              capture_output=True, text=True, timeout=90, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the local starts did not end within 90 s: a local worker waits on the exit-handler lock")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["whole"] == [True, True, True]
    assert out["local_partitions"] == [6, 6]


def stuck_on_a_local_worker(batch: dict) -> dict:
    """Waits for good, using no CPU, in a local worker forked by the test's process (never on Ray's workers)."""
    if os.environ.get("STUCK_PARENT") == str(os.getppid()):
        import threading

        threading.Event().wait()
    return noisy(batch)


@pytest.mark.timeout(180)
def test_a_local_worker_that_stalls_hands_the_rest_of_the_plan_to_ray(ray_session, monkeypatch):
    """A local worker that uses no CPU for a whole wait (``SBLOADER_LOCAL_STALL_S``: a lock its fork left held)
    no longer keeps the epoch waiting forever: the plan goes on from the first partition not received, on
    Ray's workers, with the rows, order and draws of a Ray-only run."""
    from sbloader.loaders import stalled_workers

    reference, _ = epoch(monkeypatch, None)
    monkeypatch.setenv("STUCK_PARENT", str(os.getpid()))
    monkeypatch.setenv(stalled_workers.STALL_ENV, "1")
    got, loader = epoch(monkeypatch, PARTS, fn=stuck_on_a_local_worker)
    assert _cols(got, "x", "draw") == _cols(reference, "x", "draw")
    assert loader.stats().local_partitions == 0
    assert loader.stats().operators[-1].rows == ROWS


def stuck_at_a_local_workers_second_partition(batch: dict) -> dict:
    """Waits for good, using no CPU, at the second partition a local worker forked by the test's process makes
    (never on Ray's workers): with two workers and the handover at partition 3, the plan's partition 2."""
    stall_locally_at(2)
    return noisy(batch)


@pytest.mark.timeout(180)
def test_a_local_worker_that_stalls_after_the_handover_began_leaves_its_partitions_to_ray(ray_session, monkeypatch):
    """The executor already makes the plan's rest (the handover at partition 3 began once the first local block
    came) when the local worker owing partition 2 stalls: a second execution makes what the local workers
    still owed, delivered before the rest; the rows, order and draws of a Ray-only run (before: waited for
    good)."""
    from sbloader.loaders import native_start, stalled_workers

    monkeypatch.setattr(native_start, "local_workers", lambda: 2)
    reference, _ = epoch(monkeypatch, None)
    monkeypatch.setenv("STUCK_PARENT", str(os.getpid()))
    monkeypatch.setenv(stalled_workers.STALL_ENV, "1")
    got, loader = epoch(monkeypatch, 3, fn=stuck_at_a_local_workers_second_partition)
    assert _cols(got, "x", "draw") == _cols(reference, "x", "draw")
    assert loader.stats().local_partitions == 2
    assert loader.stats().operators[-1].rows == ROWS
