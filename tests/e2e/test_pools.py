"""Actor pools on Rays of their own (``tests/scripts/pools_job.py``): a fresh one-node Ray of
2 CPUs and a logical GPU (the CPU-only pools and the GPU pool, one after the other), and a
two-node cluster with the GPU on the other node.

The allocation rule itself: ``tests/unit/test_reservations.py``; the pools driven step by
step: ``tests/ray/test_executor.py::test_pool_never_retires_while_input_is_coming``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "pools_job.py")


def _start(scenario: str, tmp_path) -> tuple:
    """Start the comma-separated ``scenario`` in one process."""
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    proc = subprocess.Popen([sys.executable, SCRIPT, scenario, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(tmp_path), env=env)
    return scenario, proc


def _result(started: tuple) -> dict:
    """Each scenario's JSON by name, once its process ended."""
    scenario, proc = started
    try:
        stdout, stderr = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    lines = {d["scenario"]: d for d in (json.loads(x) for x in stdout.splitlines() if x.startswith("{"))}
    want = scenario.split(",")
    assert sorted(lines) == sorted(want), f"pools job {scenario} failed (rc {proc.returncode}):\n{stderr[-3000:]}"
    return lines


@pytest.fixture(scope="module")
def pool_runs(tmp_path_factory):
    """Both processes side by side (a Ray's start is mostly waiting; what is checked are counts and
    placements, none a time but the floor of ``Tagger``'s own construction): ``starve``, ``cold`` and
    ``gpu1`` in one process, one fresh Ray of 2 CPUs and 1 logical GPU (only ``gpu1``'s pool asks for the
    GPU); ``gpu2`` on its two-node cluster in another. Scenario -> its JSON."""
    procs = [_start("starve,cold,gpu1", tmp_path_factory.mktemp("pools")),
             _start("gpu2", tmp_path_factory.mktemp("pools_gpu2"))]
    try:
        return {k: v for started in procs for k, v in _result(started).items()}
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_pools_on_two_cpus_never_starve_their_reads(pool_runs):
    """The issue's case on a fresh 2-CPU Ray: a JPEG read feeding a callable class.

    With default concurrency the pool takes the read in (its actors read their
    partitions): up to one actor per CPU, built once for two epochs. With
    ``concurrency=(1, 2)`` a read stage of its own feeds the pool, which stops at one
    actor so that the read stage keeps the other CPU. Either way no actor is retired,
    none is built twice, and every image comes once per epoch."""
    out = pool_runs["starve"]
    for name, limit in (("default", 2), ("bounded", 1)):
        run = out[name]
        first, second = run["epochs"]
        for epoch in (first, second):
            assert epoch["rows"] == epoch["distinct"] == out["files"], epoch
            assert epoch["pool"]["retired"] == 0 and epoch["pool"]["lost"] == 0, epoch["report"]
            assert epoch["pool"]["limit"] == limit, epoch["report"]
        # a pool that reads grows at once to its limit (many partitions queued); the second epoch builds none
        assert first["pool"]["created"] == limit and second["pool"]["created"] == 0, (name, run)
        assert run["kept"] == first["pool"]["created"], run  # every actor built is kept for the next epoch
        assert run["built"] == first["pool"]["created"]  # constructed once each, counted by the class itself
        assert f"(limit {limit}), 0 retired, 0 lost" in first["report"]
    assert out["default"]["epochs"][0]["stages"] == ["ReadImages->MapBatches(Crop)"]
    assert out["bounded"]["epochs"][0]["stages"] == ["ReadImages", "MapBatches(Crop)"]


def test_cold_pool_of_one_to_two_constructs_at_most_two(pool_runs):
    """``concurrency=(1, 2)`` on 2 CPUs beside a read stage that reserves one: the pool's limit is
    exactly 1 (``reservations.pool_limit``: the room the read stage leaves), so its one actor is
    built once (counted by the class itself), never rebuilt nor lost, and is the only one."""
    out = pool_runs["cold"]
    assert out["ids"]
    assert out["built"] == out["pool"]["created"] == out["pool"]["limit"] == 1, out
    assert out["pool"]["lost"] == 0, out
    assert out["pool"]["retired"] == 0, out
    assert out["pool"]["construction_s"] >= 0.5 * out["built"] - 0.05  # Tagger sleeps 0.5 s to build


def test_gpu_pool_holds_no_cpu_on_a_logical_gpu(pool_runs):
    """``ray.init(num_gpus=1)`` without a GPU: the GPU actor holds the GPU and no CPU, so the
    read stage keeps both CPUs; every row once."""
    out = pool_runs["gpu1"]
    assert out["ids"]
    assert out["gpu_actor_cpus"] == [0.0]
    assert out["pool"]["created"] == 1 and out["pool"]["limit"] == 1 and out["built"] == 1
    assert out["gpu_nodes"] == [out["node"]] and out["read_nodes"] == [out["node"]]


def test_gpu_pool_stays_on_the_gpu_node_cpu_stages_run_on_both(pool_runs):
    out = pool_runs["gpu2"]
    assert out["ids"]
    assert out["gpu_nodes"] == [out["gpu_node"]], out
    assert out["gpu_actor_cpus"] == [0.0]
    assert set(out["read_nodes"]) == {out["head"], out["gpu_node"]}, out  # CPUs free on both nodes
