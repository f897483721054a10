"""The streaming executor end to end on the session's Ray."""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray

import sbloader
from sbloader.core.errors import MemoryBudgetError, UserFunctionError

MiB = 2**20


_GCS_STATE = {}


def _store_bytes_used() -> int:
    """Bytes in the object store, from Ray's own accounting (one GCS client per Ray session: a new one
    per call cost the sampler most of its time, and the pipeline its CPU)."""
    from ray._private import internal_api

    address = ray.get_runtime_context().gcs_address
    if address not in _GCS_STATE:
        _GCS_STATE[address] = internal_api.get_state_from_address(address)
    return int(internal_api.get_memory_info_reply(_GCS_STATE[address]).store_stats.object_store_bytes_used)


class _StoreSampler:
    """Samples Ray's object-store usage in a thread; ``peak`` is the maximum seen."""

    def __init__(self, interval: float = 0.01) -> None:
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _store_bytes_used())
            self.samples += 1
            time.sleep(self._interval)

    def __enter__(self) -> "_StoreSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _log_line(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, (text + "\n").encode())
    finally:
        os.close(fd)


def test_streaming_keeps_object_store_under_budget_and_streams_early(ray_session, tmp_path):
    """A dataset 12.5x the budget: Ray's store stays under budget; first batch before 10% is read.

    Blocks of 1/16 of the budget (they were 1/4, 100 of them: the budget then held ~3 blocks, and each
    released block counts until Ray freed it, budget.FREE_LAG_S = 0.25 s: 24 s of throttling)."""
    log = tmp_path / "reads.log"
    block_bytes = MiB // 4
    n_parts = 200
    budget = 4 * MiB  # 50 MiB of data through a 4 MiB budget

    def make(batch):
        _log_line(log, "read")
        n = len(batch["id"])
        return {"id": batch["id"], "x": np.full((n, block_bytes // n), 7, dtype=np.uint8)}

    ds = sbloader.range(n_parts * 4, num_partitions=n_parts).map_batches(make)
    baseline = _store_bytes_used()
    seen = []
    reads_at_first = None
    with _StoreSampler() as sampler:
        for batch in ds.iter_batches(4, memory_budget=budget, prefetch_blocks=1):
            if reads_at_first is None:
                reads_at_first = len(log.read_text().splitlines())
            seen.extend(batch["id"].tolist())
            time.sleep(0.005)  # a consumer that is not infinitely fast
    assert sorted(seen) == list(range(n_parts * 4))
    assert reads_at_first is not None and reads_at_first < n_parts * 0.1, reads_at_first
    assert sampler.samples > 10
    peak = sampler.peak - baseline
    assert peak <= budget, f"object store held {peak} bytes, budget {budget}"
    stats = ds.stats()
    assert stats.peak_held_bytes <= budget + block_bytes * 1.1
    assert stats.operators[0].throttled_s > 0


def test_budget_too_small_for_prefetch_raises_clear_error(ray_session):
    def big(batch):
        return {"x": np.zeros((len(batch["id"]), 256 * 1024), dtype=np.uint8)}

    ds = sbloader.range(40, num_partitions=10).map_batches(big)  # ~1 MiB blocks
    with pytest.raises(MemoryBudgetError, match="prefetch_blocks=4"):
        for _ in ds.iter_batches(4, memory_budget=2 * MiB, prefetch_blocks=4):
            pass


def test_invalid_budget_is_rejected(ray_session):
    with pytest.raises(ValueError, match="memory_budget"):
        list(sbloader.range(4).iter_batches(2, memory_budget=0))


def _delayed_identity(batch):
    time.sleep(int.from_bytes(os.urandom(2), "little") / 65535 * 0.05)  # not seeded: real jitter
    return batch


@pytest.mark.parametrize("seed", [0, 7])
def test_deterministic_order_is_independent_of_concurrency_and_timing(ray_session, seed):
    def run(concurrency):
        ds = sbloader.range(300, num_partitions=30).map_batches(_delayed_identity, concurrency=concurrency)
        return [int(r["id"]) for r in ds.iter_rows(deterministic=True, shuffle=True, seed=seed)]

    one = run(1)
    four = run(4)
    assert one == four
    assert sorted(one) == list(range(300))
    assert one != list(range(300))  # shuffled
    assert run(4) == one


def test_nondeterministic_mode_delivers_everything_once(ray_session):
    ds = sbloader.range(400, num_partitions=40).map_batches(_delayed_identity, concurrency=4)
    ids = [int(r["id"]) for r in ds.iter_rows(shuffle=True, seed=1)]
    assert sorted(ids) == list(range(400))


def test_killed_task_is_rerun_and_rows_arrive_once(ray_session, tmp_path):
    marker_dir = tmp_path / "killed"
    marker_dir.mkdir()

    def die_once(batch):
        pid = sbloader.get_context().partition_id
        marker = marker_dir / f"p{pid}"
        if pid in (2, 5) and not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)  # the worker process dies mid-task
        return batch

    ds = sbloader.range(100, num_partitions=10).map_batches(die_once)
    ids = [int(r["id"]) for r in ds.iter_rows()]
    assert sorted(ids) == list(range(100))
    assert sorted(p.name for p in marker_dir.iterdir()) == ["p2", "p5"]


def test_provenance_on_every_row_and_batch(ray_session):
    ds = sbloader.range(120, num_partitions=6).filter(lambda r: r["id"] % 3 != 0)
    rows = list(ds.iter_rows(seed=3, shuffle=True))
    assert len(rows) == 80
    # shuffled: partition p of the epoch holds 20 ids drawn from the epoch seed; row k is its k-th
    from sbloader.core.plan import epoch_seed_from

    parts = ds.source.partitions(0, epoch_seed_from(3, 0), shuffle=True)
    for r in rows:
        p = r.provenance
        assert p.epoch == 0
        assert int(r["id"]) == int(parts[p.partition_id].payload[p.row_range[0]])
        assert p.row_range[1] == p.row_range[0] + 1
    for batch in ds.iter_batches(16, deterministic=True, seed=3):
        covered = sum(pr.row_range[1] - pr.row_range[0] for pr in batch.provenance)
        assert covered >= len(batch["id"])
        for pr in batch.provenance:
            assert 0 <= pr.partition_id < 6


def test_user_function_error_names_operator_and_partition(ray_session):
    def explode(batch):
        if sbloader.get_context().partition_id == 3:
            raise KeyError("no such column 'label'")
        return batch

    ds = sbloader.range(50, num_partitions=5).map_batches(explode)
    with pytest.raises(UserFunctionError) as info:
        list(ds.iter_batches(10))
    err = info.value
    assert err.operator == "MapBatches(explode)"
    assert err.partition_id == 3
    assert "no such column 'label'" in str(err)
    assert "explode" in err.remote_traceback  # the original traceback travels


def test_stats_count_rows_blocks_bytes_and_time(ray_session):
    ds = sbloader.range(200, num_partitions=8).map_batches(
        lambda b: {"x": np.ones((len(b["id"]), 10), np.float32)}
    )
    assert ds.stats() is None
    total = sum(len(b["x"]) for b in ds.iter_batches(32))
    st = ds.stats()
    assert total == 200
    op = st.operators[0]
    assert (op.rows, op.blocks) == (200, 8)
    # 8 partitions on 9 slots: queued // slots is 0, so every read task takes one
    assert op.tasks == 8
    assert op.bytes >= 200 * 10 * 4
    assert op.task_s > 0
    assert st.first_block_s is not None and st.wall_s >= st.first_block_s
    assert "ReadRange" in str(st)
    assert st.to_dict()["operators"][0]["rows"] == 200


def test_per_partition_rng_replays_identically(ray_session):
    def augment(batch):
        ctx = sbloader.get_context()
        noise = ctx.rng.integers(0, 1_000_000, size=len(batch["id"]))
        legacy = np.random.randint(0, 1_000_000, size=len(batch["id"]))  # seeded per partition too
        return {"id": batch["id"], "noise": noise, "legacy": legacy}

    def run(seed, epoch=0):
        ds = sbloader.range(100, num_partitions=10).map_batches(augment, concurrency=3)
        return {int(r["id"]): (int(r["noise"]), int(r["legacy"])) for r in ds.iter_rows(seed=seed, epoch=epoch)}

    a, b = run(5), run(5)
    assert a == b
    assert run(6) != a
    assert run(5, epoch=1) != a
    assert len({v[0] for v in a.values()}) > 90  # partitions draw different numbers


class _Tagger:
    def __init__(self, log: str, delay: float) -> None:
        _log_line(Path(log), f"init {os.getpid()}")
        self.delay = delay

    def __call__(self, batch):
        time.sleep(self.delay)
        return {"id": batch["id"], "pid": np.full(len(batch["id"]), os.getpid())}


def test_actor_pool_constructs_once_per_actor_and_autoscales_within_bounds(ray_session, tmp_path):
    log = tmp_path / "init.log"
    ds = sbloader.range(240, num_partitions=24).map_batches(
        _Tagger, concurrency=(1, 3), fn_constructor_kwargs={"log": str(log), "delay": 0.15}
    )
    rows = list(ds.iter_rows())
    assert sorted(int(r["id"]) for r in rows) == list(range(240))
    inits = [line.split()[1] for line in log.read_text().splitlines()]
    assert len(inits) == len(set(inits)), "an actor constructed its class twice"
    used = {int(r["pid"]) for r in rows}
    assert used <= {int(p) for p in inits}
    created = ds.stats().operators[1].actors_created
    assert 2 <= created <= 3, created  # queued work grew the pool, never past max
    # an actor still starting when the epoch ended is killed before its constructor logs
    assert 2 <= len(inits) <= created


def test_pool_never_retires_while_input_is_coming(ray_session, tmp_path, monkeypatch):
    """The pools on their own, driven step by step: a pool grows on queued input, up to its
    limit; an idle actor stays while input will still come from upstream and is retired
    once none will; and no more than the limit is ever constructed in one execution."""
    from sbloader.core.ops import Op
    from sbloader.core.stats import OperatorStats
    from sbloader.executor import pools
    from sbloader.executor.options import ExecutionOptions
    from sbloader.executor.stages import build_stages

    monkeypatch.setattr(pools, "IDLE_TIMEOUT_S", 0.1)
    log = tmp_path / "init.log"
    ops = [Op("map_batches", _Tagger, "T", concurrency=(1, 2), fn_constructor_kwargs={"log": str(log), "delay": 0})]
    stages = build_stages("Range", ops)
    stats = [OperatorStats(s.name) for s in stages]
    pool = pools.ActorPools(stages, {1: (1, 2)}, ExecutionOptions(), stats, None)

    def settle() -> None:  # let every starting actor finish its constructor
        while pool.pending:
            for ref in list(pool.pending):
                pool.constructed(ref, ray.get(ref))

    def step(queued: int, upstream: bool) -> None:
        pool.scale({1: queued}, {1: True}, {1: upstream})
        settle()

    step(0, True)
    assert len(pool.pools[1]) == 1  # the minimum at once
    step(5, True)
    assert len(pool.pools[1]) == 2  # queued input and no free slot: one more
    step(5, True)
    assert len(pool.pools[1]) == 2 and stats[1].pool_limit == 2  # never past the limit
    time.sleep(0.3)  # both idle for longer than the idle limit
    for _ in range(3):
        step(0, True)  # ... but the reads will feed them again
    assert len(pool.pools[1]) == 2 and stats[1].actors_retired == 0
    step(0, False)
    assert len(pool.pools[1]) == 1 and stats[1].actors_retired == 1  # nothing will come: one goes
    step(5, True)
    # the pool built its limit already in this execution: it does not build a third actor
    assert len(pool.pools[1]) == 1 and stats[1].actors_created == 2
    assert stats[1].actors_ready == 2 and stats[1].construction_s >= 0 and stats[1].resource_wait_s >= 0
    assert len(log.read_text().splitlines()) == 2
    pool.shutdown()


def test_pool_that_cannot_fit_says_so_before_it_starts(ray_session):
    from sbloader.runtime import cluster_state

    gpus = cluster_state.total_resources().get("GPU", 0)
    ds = sbloader.range(10).map_batches(_Tagger, num_gpus=gpus + 1, fn_constructor_kwargs={"log": "/dev/null",
                                                                                         "delay": 0})
    with pytest.raises(sbloader.ResourceError, match=r"MapBatches\(_Tagger\) needs GPU=.*its pool's minimum"):
        list(ds.iter_rows())


def test_fixed_size_actor_pool(ray_session, tmp_path):
    log = tmp_path / "init.log"
    ds = sbloader.range(40, num_partitions=8).map_batches(
        _Tagger, concurrency=2, fn_constructor_kwargs={"log": str(log), "delay": 0.01}
    )
    assert sorted(int(r["id"]) for r in ds.iter_rows()) == list(range(40))
    inits = log.read_text().splitlines()
    stats = ds.stats().operators[1]
    assert stats.actors_created == 2  # the pool is started at its fixed size at once
    # on a loaded machine an actor may still be starting when the short epoch ends
    assert stats.actors_ready >= 1 and stats.actors_ready <= len(inits) <= 2, (inits, stats)


def test_first_rows_arrive_before_the_input_is_read(ray_session, tmp_path):
    """Streaming, not bulk: the first block comes long before the last partition is read."""
    log = tmp_path / "reads.log"

    def slow(batch):
        _log_line(log, "read")
        time.sleep(0.05)
        return batch

    it = sbloader.range(400, num_partitions=80).map_batches(slow).iter_batches(5)
    next(it)
    reads = len(log.read_text().splitlines())
    rest = sum(len(b["id"]) for b in it)
    assert rest == 395
    assert reads < 40, reads


# ----- a pipeline waiting for resources nobody frees says so (no silent hang)

def test_stuck_message_names_the_stage_and_the_missing_resource():
    from sbloader.executor.diagnostics import resource_demand, stuck_message

    need = resource_demand({"num_cpus": 1})
    assert need == {"CPU": 1.0}
    assert resource_demand({"num_cpus": 0.5, "num_gpus": 1, "resources": {"disk": 2}}) == \
        {"CPU": 0.5, "GPU": 1.0, "disk": 2.0}
    msg = stuck_message([("ReadImages->MapBatches(crop)", 3, need)], {"CPU": 0.0}, {"CPU": 2.0}, 21.0)
    assert "ReadImages->MapBatches(crop)" in msg and "3 call(s)" in msg
    assert "CPU 0 of 2" in msg and "persistent_workers=False" in msg
    # tasks that are merely slow hold CPUs they asked for while others stay free: no warning
    assert stuck_message([("Map", 2, need)], {"CPU": 1.0}, {"CPU": 4.0}, 60.0) is None
    assert stuck_message([], {}, {}, 60.0) is None


def test_stuck_message_counts_only_the_nodes_the_pipeline_may_use():
    from sbloader.executor.diagnostics import stuck_message
    from sbloader.runtime.cluster_state import sum_resources

    per_node = {"trainer": {"CPU": 6.0, "GPU": 1.0}, "cpu-a": {"CPU": 0.0}, "cpu-b": {"CPU": 0.0}}
    totals = {"trainer": {"CPU": 8.0, "GPU": 1.0}, "cpu-a": {"CPU": 4.0}, "cpu-b": {"CPU": 4.0}}
    assert sum_resources(per_node) == {"CPU": 6.0, "GPU": 1.0}
    free, total = sum_resources(per_node, ("trainer",)), sum_resources(totals, ("trainer",))
    assert free == {"CPU": 0.0} and total == {"CPU": 8.0}
    demand = [("Map", 2, {"CPU": 1.0})]
    # the trainer's free CPUs hid the shortage before; counted without it, the warning comes
    assert stuck_message(demand, sum_resources(per_node), sum_resources(totals), 30.0) is None
    msg = stuck_message(demand, free, total, 30.0, excluded=1)
    assert "CPU 0 of 8" in msg and "1 trainer node(s) left out" in msg and "allow_trainer_node=True" in msg


def test_pipeline_waiting_for_resources_nobody_has_warns_then_stops_cleanly(ray_session, monkeypatch, caplog):
    import logging

    from sbloader.executor import diagnostics

    monkeypatch.setattr(diagnostics, "STUCK_WARN_S", 0.3)
    ds = sbloader.range(8, num_partitions=2).map_batches(lambda b: b, resources={"sbloader_test_absent": 1})
    with pytest.raises(sbloader.ResourceError, match=r"MapBatches\(<lambda>\) needs sbloader_test_absent=1 \(one task\)"):
        ds.execute()
    # an autoscaling cluster may add such nodes: waited for, with the warnings
    monkeypatch.setenv("SBLOADER_WAIT_FOR_RESOURCES", "1")
    executor = ds.execute()
    try:
        with caplog.at_level(logging.WARNING, logger="sbloader.executor.executor"):
            deadline = time.monotonic() + 20
            while executor.stats().stuck_warnings == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
        assert executor.stats().stuck_warnings >= 1, "the executor waited silently"
        assert "sbloader_test_absent 0 of 0" in caplog.text
        with pytest.raises(TimeoutError):
            executor.get_next(timeout=0.2)
    finally:
        import ray

        for ref in list(executor._loop.inflight):  # never schedulable: cancelled, not left pending for the session
            ray.cancel(ref)
        executor.shutdown()


def test_operators_are_pickled_once_per_execution_and_unpickled_once_per_worker(ray_session):
    from sbloader.executor.tasks import Packed, pack, unpack

    scale = 3

    def times(batch):  # a closure from a test module: pickled by value
        return {"id": batch["id"] * scale}

    packed = pack((times,))
    assert isinstance(packed, Packed)
    assert unpack(packed) is unpack(packed), "a worker must reuse the unpickled operators"
    assert unpack(packed)[0]({"id": np.arange(3)})["id"].tolist() == [0, 3, 6]
    # object refs and actor handles keep Ray's own serialisation (it tracks them)
    ref = ray.put(1)
    assert pack((ref,)) == (ref,)
    rows = sorted(r["id"] for r in sbloader.range(40, num_partitions=8).map_batches(times).iter_rows())
    assert rows == [3 * i for i in range(40)]


def test_a_large_shared_argument_is_unpickled_once_per_worker_process(ray_session, tmp_path, monkeypatch):
    """A read task's source (for a bucket: every object's listed version) travels as a ref named by its
    digest: a worker process unpickles it once, not once a task (#47: 4.6 MB and ~40 ms a task for
    100,000 keys); the kept arguments are bounded by their bytes."""
    import tempfile

    from sbloader.executor import task_args
    from sbloader.executor.failures import shared_arg
    from sbloader.executor.task_args import Packed, SharedRef, pack, unpack

    class Counted:  # each unpickle makes a file in tmp_path
        def __reduce__(self):
            return tempfile.mkstemp, ("", "unpickled-", str(tmp_path))

    arg = shared_arg((Counted(), bytes(200_000)))
    assert isinstance(arg, SharedRef)

    @ray.remote(num_cpus=0.5)
    def use(a):
        from sbloader.executor.task_args import unpack as unpack_here

        assert len(unpack_here(a)[1]) == 200_000
        return os.getpid()

    pids = ray.get([use.remote(arg) for _ in range(12)])
    assert len(os.listdir(tmp_path)) == len(set(pids)) < 12
    monkeypatch.setattr(task_args, "UNPACKED_MAX_BYTES", 300_000)
    a, b = pack(bytes(200_000)), pack(bytes(200_001))
    assert isinstance(a, Packed) and unpack(a) is unpack(a)
    unpack(b)  # both would pass the bound: the older goes
    assert a.digest not in task_args._UNPACKED and b.digest in task_args._UNPACKED


def _quarter_mib(batch):
    return {"id": batch["id"], "x": np.zeros((len(batch["id"]), 64 * 1024), dtype=np.uint8)}


def _quarter_mib_in_a_tenth(batch):
    time.sleep(0.1)
    return _quarter_mib(batch)


@pytest.mark.parametrize("partitions", [96, 192])
def test_default_budget_holds_a_flat_number_of_blocks_ahead_of_a_slow_consumer(ray_session, partitions):
    """The default budget is a quarter of the store; blocks ahead are capped, so a slow
    consumer never makes the pipeline hold more as the dataset grows. The cap counts a
    read task's blocks per slot: as many partitions as the partition time gives for
    TARGET_TASK_S (here 0.1 s each: at most 3), not more as blocks pile up."""
    from sbloader.executor.budget import FREE_LAG_S
    from sbloader.executor.policy import TARGET_TASK_S, blocks_ahead_cap

    executor = sbloader.range(4 * partitions, num_partitions=partitions).map_batches(
        _quarter_mib_in_a_tenth).execute(prefetch_blocks=2)
    block = 4 * 64 * 1024
    n = 0
    try:
        while (item := executor.get_next(timeout=60)) is not None:
            time.sleep(0.02)
            executor.release(item.meta.nbytes)
            n += 1
    finally:
        executor.shutdown()
    assert n == partitions
    assert len(executor._loop._slots) == 1
    cap = blocks_ahead_cap(2, executor._loop._slots[0] * int(TARGET_TASK_S / 0.1))
    assert cap < partitions, "the dataset must not fit under the cap: nothing would be tested"
    # + the block the consumer holds, + released blocks still counted until Ray frees them
    freeing = int(FREE_LAG_S / 0.02) + 2
    assert executor.stats().peak_held_bytes <= (cap + 1 + freeing) * block * 1.1, \
        (executor.stats().peak_held_bytes / block, cap)


class _PidTagger:
    """Pool class that records how many times it was constructed (a file per construction)."""

    def __init__(self, marker_dir: str) -> None:
        import os
        import uuid

        open(os.path.join(marker_dir, uuid.uuid4().hex), "w").close()
        self.pid = os.getpid()

    def __call__(self, batch: dict) -> dict:
        batch["pid"] = np.full(len(batch["item"]), self.pid)
        return batch


def test_prestarted_pool_actors_are_adopted_not_duplicated(ray_session, tmp_path):
    """prestart_pools starts a pool's minimum actors ahead of the epoch; the epoch's executor adopts
    them (they run its blocks; it creates no more), and they are constructed once each."""
    import os

    import ray

    from sbloader.executor.options import ExecutionOptions
    from sbloader.executor.pools import PrestartedActor, prestart_pools
    from sbloader.executor.executor import StreamingExecutor
    from sbloader.executor.stages import build_stages
    from sbloader.loaders.batching import iter_blocks

    ds = sbloader.from_items(list(range(64)), rows_per_partition=8).map_batches(
        _PidTagger, concurrency=(2, 2), num_cpus=0.5, fn_constructor_args=(str(tmp_path),))
    source, ops = ds._source, ds._ops
    options = ExecutionOptions()
    cache: dict = {}
    assert prestart_pools(source.name, ops, options, cache) == 2
    assert prestart_pools(source.name, ops, options, cache) == 0  # the pool already has its actors
    started = [a for handles in cache.values() for a in handles]
    assert len(started) == 2 and all(isinstance(a, PrestartedActor) for a in started)
    pids = {ray.get(a.handle.__ray_call__.remote(lambda self: self._instance.pid)) for a in started}
    ex = StreamingExecutor(source, build_stages(source.name, ops), ds.plan(epoch=0), options, actor_cache=cache)
    seen = set()
    items = []
    for block, _ in iter_blocks(ex.start()):
        seen.update(int(p) for p in block["pid"])
        items.extend(int(x) for x in block["item"])
    assert sorted(items) == list(range(64))
    assert seen <= pids and seen  # only the prestarted actors ran blocks
    assert ex.stats().operators[-1].actors_created == 2
    assert len(os.listdir(tmp_path)) == 2  # constructed once per actor, no third actor



class _Twice:
    """A callable class for an actor pool."""

    def __call__(self, batch: dict) -> dict:
        batch["twice"] = batch["id"] * 2
        return batch


def test_shutdown_from_two_threads_at_once_runs_once(ray_session):
    """A loader's consumer and its fetch thread may both shut the executor down: the
    second call must neither fail on the first's cleared state nor cache actors twice."""
    from sbloader.executor.pools import kill_cached

    cache: dict = {}
    ds = sbloader.range(400, rows_per_partition=10).map_batches(_Twice, concurrency=(1, 2))
    try:
        for _ in range(3):
            executor = ds.execute(actor_cache=cache)
            assert executor.get_next(timeout=60) is not None  # running, calls in flight
            errors: list = []

            def stop() -> None:
                try:
                    executor.shutdown()
                except BaseException as e:  # noqa: BLE001 - asserted below
                    errors.append(e)

            threads = [threading.Thread(target=stop) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors
            actor_ids = [getattr(h, "handle", h)._actor_id.hex() for hs in cache.values() for h in hs]
            assert actor_ids, "the pool's actors are kept in the cache for the next execution"
            assert len(actor_ids) <= 2  # the pool's bound: nothing cached twice
            assert sorted(set(actor_ids)) == sorted(actor_ids), f"an actor cached twice: {actor_ids}"
    finally:
        kill_cached(cache)


def _a_little_work(batch):
    time.sleep(0.02)
    return batch


def _eager(executor):
    """Report a consumer that never spends time on a block: the pipeline is the
    bottleneck, so read tasks take several partitions whatever this machine's timing."""
    pace = executor.consumer_pace
    pace.external = True
    pace.add(0.0, 1)
    return executor


def _drain(executor, delivered: Path = None) -> dict:
    """partition id -> (seconds from the start to its delivery, its ids). ``delivered``: a file that
    gets one line per partition as it is delivered (what a held map function waits on)."""
    t0, out = time.monotonic(), {}
    try:
        while (item := executor.get_next(timeout=60)) is not None:
            assert item.meta.partition_id not in out, f"partition {item.meta.partition_id} delivered twice"
            out[item.meta.partition_id] = (time.monotonic() - t0, ray.get(item.ref)["id"])
            if delivered is not None:
                with open(delivered, "a") as f:
                    f.write(f"{item.meta.partition_id}\n")
            executor.release(item.meta.nbytes)
    finally:
        executor.shutdown()
    return out


def test_read_tasks_take_several_partitions_each_its_own_block(ray_session):
    """Once a partition's time is known a read task reads several (fewer Ray calls);
    every partition still comes back once, as its own block with its own metadata."""
    executor = _eager(sbloader.range(480, num_partitions=60).map_batches(_a_little_work).execute())
    got = _drain(executor)
    assert sorted(got) == list(range(60))
    assert sorted(np.concatenate([ids for _, ids in got.values()]).tolist()) == list(range(480))
    for pid, (_, ids) in got.items():
        assert sorted(ids.tolist()) == list(range(8 * pid, 8 * pid + 8))
    op = executor.stats().operators[0]
    assert op.blocks == 60
    assert op.tasks < 60, f"every partition got its own task ({op.tasks})"


_STRAGGLER_PARTITION = 30


def _straggle(batch, marker_dir):
    """The straggler partition's first copy is held until its second copy has run (60 s at most;
    it was 6 s for every copy); the second copy runs as any other partition."""
    if 8 * _STRAGGLER_PARTITION in batch["id"]:
        first, second = os.path.join(marker_dir, "first-copy"), os.path.join(marker_dir, "second-copy")
        if not os.path.exists(first):
            open(first, "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(second) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            open(second, "w").close()
    time.sleep(0.02)
    return batch


def _held_straggler(batch, marker_dir):
    """The straggler partition (every copy of it) is held until the 59 others were delivered (the
    consumer's ``delivered`` file), 60 s at most; each hold's end goes to ``held-<pid>.txt``."""
    if 8 * _STRAGGLER_PARTITION in batch["id"]:
        delivered = os.path.join(marker_dir, "delivered")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if os.path.exists(delivered) and len(Path(delivered).read_text().split()) >= 59:
                break
            time.sleep(0.05)
        ended = "count" if time.monotonic() < deadline else "timeout"
        with open(os.path.join(marker_dir, f"held-{os.getpid()}.txt"), "a") as f:
            f.write(ended + "\n")
    else:
        time.sleep(0.02)
    return batch


def test_a_straggling_partition_does_not_hold_back_the_others_of_its_task(ray_session, tmp_path):
    """A read task of several partitions returns their blocks together; when it runs
    far longer than expected, its partitions are launched again one per task and the
    first copy back is delivered: the others all arrive while the straggler is held (its
    hold ends by their count, not by its timeout), before it."""
    executor = _eager(sbloader.range(480, num_partitions=60).map_batches(
        _held_straggler, fn_kwargs={"marker_dir": str(tmp_path)}).execute())
    got = _drain(executor, delivered=tmp_path / "delivered")
    assert sorted(got) == list(range(60))
    assert sorted(np.concatenate([ids for _, ids in got.values()]).tolist()) == list(range(480))
    st = executor.stats()
    assert st.operators[0].tasks < 60
    assert st.speculative_partitions >= 1, "the straggler's task was not launched again"
    order = (tmp_path / "delivered").read_text().split()
    assert order[-1] == str(_STRAGGLER_PARTITION), f"the straggler was not the last delivered: {order}"
    ends = [x for f in tmp_path.glob("held-*.txt") for x in f.read_text().split()]
    assert "count" in ends, f"the straggler's hold never ended by the others' delivery: {ends}"


_FAILING_PARTITION = 40


def _fails_on_40(batch):
    if 8 * _FAILING_PARTITION in batch["id"]:
        raise ValueError("partition 40 is bad")
    time.sleep(0.02)
    return batch


def test_an_error_in_a_task_of_several_partitions_names_its_partition(ray_session):
    with pytest.raises(UserFunctionError) as info:
        _drain(_eager(sbloader.range(480, num_partitions=60).map_batches(_fails_on_40).execute()))
    assert info.value.partition_id == _FAILING_PARTITION
    assert "partition 40 is bad" in str(info.value)


def test_a_failed_call_of_several_partitions_leaves_ray_no_unhandled_error_to_print(ray_session, capfd):
    """A read call of several partitions fails as one: each partition's block and metadata hold the
    error. The one raised is fetched; the others were dropped unfetched and Ray printed each as an
    "Unhandled error" with its traceback (4 of them for one failing function, beside our error)."""
    import gc

    with pytest.raises(UserFunctionError):
        _drain(_eager(sbloader.range(480, num_partitions=60).map_batches(_fails_on_40).execute()))
    gc.collect()  # the execution and its refs go now
    err = ""
    deadline = time.monotonic() + 2.0  # Ray reports a dropped error from its own thread
    while time.monotonic() < deadline and "Unhandled error" not in err:
        time.sleep(0.1)
        err += capfd.readouterr().err
    assert "Unhandled error" not in err, err[:1000]


def _dies_on_5(batch):
    if 8 * 5 in batch["id"]:
        os._exit(3)  # the worker process dies, as one killed for memory or crashing in a decoder
    return batch


def test_a_task_whose_worker_dies_raises_an_error_naming_its_partitions(ray_session):
    import pickle

    from sbloader.executor.options import ExecutionOptions
    from sbloader.executor.executor import StreamingExecutor
    from sbloader.executor.stages import build_stages
    from sbloader.core.errors import TaskLostError

    ds = sbloader.range(80, num_partitions=10).map_batches(_dies_on_5)
    ex = StreamingExecutor(ds._source, build_stages(ds._source.name, ds._ops), ds.plan(epoch=2),
                           ExecutionOptions(max_task_retries=0))
    with pytest.raises(TaskLostError) as info:
        _drain(ex.start())
    err = info.value
    assert 5 in err.partition_ids and err.epoch == 2
    assert isinstance(err.__cause__, ray.exceptions.RayError)  # Ray's own error kept as the cause
    msg = str(err)
    assert "partition(s) [" in msg and "epoch 2" in msg and "worker-*.err" in msg
    assert type(err.__cause__).__name__ in msg
    again = pickle.loads(pickle.dumps(err))
    assert again.partition_ids == err.partition_ids and str(again) == msg


def test_speculated_partitions_keep_plan_order_when_deterministic(ray_session, tmp_path):
    executor = _eager(sbloader.range(480, num_partitions=60).map_batches(
        _straggle, fn_kwargs={"marker_dir": str(tmp_path)}).execute(deterministic=True))
    order = []
    try:
        while (item := executor.get_next(timeout=60)) is not None:
            order.append(item.meta.partition_id)
            executor.release(item.meta.nbytes)
    finally:
        executor.shutdown()
    assert order == list(range(60))
    assert executor.stats().speculative_partitions >= 1
    assert (tmp_path / "second-copy").exists(), "the straggler's first copy ran out its 60 s: no second copy"


def _wait_for(path: str, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def _first_copy_straggles_then_fails(batch, marker_dir):
    """Partition 30's first copy (in a task of several) is held until its second copy (launched on
    its own once the first straggles) was delivered, then fails. Partition 59, alone in its task,
    is held until the executor has counted that failure, so the epoch is still running when it
    comes. Each waits on an event, not a time (it was 4 s and 6 s: on a slow machine the epoch
    could end before the failure)."""
    if 8 * 59 in batch["id"]:
        _wait_for(os.path.join(marker_dir, "failure-counted"))
    if 8 * _STRAGGLER_PARTITION in batch["id"]:
        marker = os.path.join(marker_dir, "first-copy")
        if not os.path.exists(marker):
            open(marker, "w").close()
            delivered = os.path.join(marker_dir, "delivered")
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (
                    os.path.exists(delivered) and str(_STRAGGLER_PARTITION) in open(delivered).read().split()):
                time.sleep(0.05)
            raise ValueError("the first copy fails")
    time.sleep(0.02)
    return batch


def test_a_failed_copy_of_a_delivered_partition_does_not_fail_the_epoch(ray_session, tmp_path):
    ds = sbloader.range(480, num_partitions=60).map_batches(
        _first_copy_straggles_then_fails, fn_kwargs={"marker_dir": str(tmp_path)})
    executor = _eager(ds.execute())
    done = threading.Event()

    def watch() -> None:  # tells partition 59 once the executor counted the first copy's failure
        while not done.is_set() and executor.stats().failed_copies < 1:
            time.sleep(0.05)
        (tmp_path / "failure-counted").touch()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        got = _drain(executor, tmp_path / "delivered")
    finally:
        done.set()
        watcher.join(timeout=10)
    assert sorted(got) == list(range(60))
    st = executor.stats()
    assert st.speculative_partitions >= 1
    # Partition 30's task straggles: each of its partitions got a second copy (else its first copy's
    # failure would have failed the epoch), and the failure dropped the first copies. On a loaded
    # machine other tasks may straggle and be copied too (seen: 3 failed copies of more speculated
    # partitions, load average 10): their first copies do not fail.
    assert 1 <= st.failed_copies <= st.speculative_partitions, \
        f"the first copy's failure was not counted before the epoch's end: {st.failed_copies} failed copies"


def test_consumer_pace_skips_the_first_blocks_then_averages_per_row():
    from sbloader.executor.pace import ConsumerPace

    pace = ConsumerPace(skip=2, alpha=0.5)
    # a fetch thread filling its queue: three blocks taken back to back, not measured
    for t in (0.0, 0.001, 0.002):
        pace.asked(t)
        pace.took(t, 10)
    assert pace.row_s is None
    # then it asks 0.06 s after each 10-row block it took (a training step), then 0.02 s
    for asked_at in (0.062, 0.122, 0.142):
        pace.asked(asked_at)
        assert pace.row_s is not None
        pace.took(asked_at, 10)
    assert pace.row_s == pytest.approx(0.004)  # 0.006, then 0.006, then halfway to 0.002


def test_consumer_pace_reported_by_a_loader_replaces_the_executors_own():
    from sbloader.executor.pace import ConsumerPace

    pace = ConsumerPace(skip=0)
    pace.external = True
    for t in (0.0, 0.001, 0.002, 0.003):  # the fetch thread's quick asks are not the loop's pace
        pace.asked(t)
        pace.took(t, 64)
    assert pace.row_s is None
    pace.add(0.064, 64)
    assert pace.row_s == pytest.approx(0.001)


def test_a_consumer_slower_than_the_pipeline_keeps_one_partition_per_task(ray_session):
    """A training loop that needs longer per block than the pipeline takes to make one
    (a GPU step) leaves the pipeline CPU to spare: small tasks keep blocks' latency low."""
    executor = sbloader.range(480, num_partitions=60).map_batches(_a_little_work).execute()
    pace = executor.consumer_pace
    pace.external = True
    pace.add(1.0, 8)  # 1 s per 8-row block: far slower than 0.02 s partitions on several slots
    got = _drain(executor)
    assert sorted(got) == list(range(60))
    op = executor.stats().operators[0]
    assert op.tasks == op.blocks == 60


def test_usable_resources_leave_out_the_excluded_nodes(ray_session):
    from sbloader.runtime.placement import usable_resources

    here = ray.get_runtime_context().get_node_id()
    _, everything = usable_resources(())
    _, others = usable_resources(("not-a-node",))
    _, without_here = usable_resources((here,))
    assert everything["CPU"] == others["CPU"] == ray.cluster_resources()["CPU"] > 0
    assert without_here.get("CPU", 0.0) == 0.0  # the session's only node left out
    free, _ = usable_resources(())
    assert set(free) <= set(everything) and 0 <= free.get("CPU", 0.0) <= everything["CPU"]  # 0 free: no key


def _spans(batch, log):
    t0 = time.time()
    time.sleep(0.3)
    _log_line(Path(log), f"{t0} {time.time()}")
    return batch


@pytest.mark.parametrize("alone", [True, False])
def test_a_first_call_alone_runs_before_any_other_even_with_estimates_known(ray_session, tmp_path, alone):
    """``first_call_alone`` (a mixture's sources): an epoch whose block sizes are known from an earlier one
    starts several calls at once, except with the option, where the source stage's second call starts only
    once its first block is out (so each source's first call goes before the others' second in Ray's queue)."""
    from sbloader.executor.executor import StreamingExecutor
    from sbloader.executor.options import ExecutionOptions
    from sbloader.executor.stages import build_stages
    from sbloader.loaders.batching import iter_blocks

    log = tmp_path / "spans.log"
    ds = sbloader.range(8, num_partitions=4).map_batches(_spans, fn_kwargs={"log": str(log)})
    first = ds.execute()
    assert sum(len(b["id"]) for b, _ in iter_blocks(first)) == 8
    estimates = first.estimates()
    assert estimates[0] is not None
    log.unlink()
    ex = StreamingExecutor(ds._source, build_stages(ds._source.name, ds._ops), ds.plan(epoch=1),
                           ExecutionOptions(first_call_alone=alone), estimates=estimates)
    assert sum(len(b["id"]) for b, _ in iter_blocks(ex.start())) == 8
    spans = sorted(tuple(map(float, line.split())) for line in log.read_text().splitlines())
    assert len(spans) == 4
    if alone:
        assert spans[1][0] >= spans[0][1] - 0.01, f"a second call started before the first ended: {spans}"
    else:
        assert spans[1][0] < spans[0][1], f"with estimates known the calls ran one by one: {spans}"


def test_a_function_from_a_module_the_workers_cannot_import_is_named_with_what_to_do(ray_session, tmp_path,
                                                                                    monkeypatch):
    """A map function pickled by name from a module only this process's sys.path finds: the error names the
    module and says how to give it to the workers, not a worker's death or memory."""
    import importlib

    from sbloader.core.errors import TaskLostError
    from sbloader.loaders import local_start

    monkeypatch.setenv(local_start.LOCAL_START_ENV, "0")  # processes forked here would find it: Ray's workers only
    (tmp_path / "sbl_only_on_the_drivers_path.py").write_text("def same(batch):\n    return batch\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("sbl_only_on_the_drivers_path")
    try:
        loader = sbloader.range(8, num_partitions=2).map_batches(mod.same).to_dataloader(4)
        with pytest.raises(TaskLostError) as info:
            list(loader)
    finally:
        sys.modules.pop("sbl_only_on_the_drivers_path", None)
    err = info.value
    assert err.missing_module == "sbl_only_on_the_drivers_path"
    msg = str(err)
    assert "cannot import module 'sbl_only_on_the_drivers_path'" in msg and "PYTHONPATH" in msg
    assert "py_modules" in msg and "killed for memory" not in msg
    import pickle

    assert str(pickle.loads(pickle.dumps(err))) == msg
