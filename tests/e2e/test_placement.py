"""Placement on a fake two-node cluster (the pure policy: ``tests/unit/test_placement_policy.py``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "placement_job.py")
HEAD_CPUS = (2.0, 0.0)


def _start(head_cpus: float, tmp_path) -> subprocess.Popen:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    return subprocess.Popen([sys.executable, SCRIPT, str(head_cpus)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=str(tmp_path), env=env)


def _result(proc: subprocess.Popen) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 3, f"placement job failed (rc {proc.returncode}):\n{stderr[-3000:]}"
    return {d["scenario"]: d for d in lines}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Both clusters' jobs side by side (each its own fake two-node cluster; a cluster's start is mostly
    waiting): head CPUs -> each scenario's JSON."""
    procs = {cpus: _start(cpus, tmp_path_factory.mktemp(f"head{int(cpus)}")) for cpus in HEAD_CPUS}
    try:
        return {cpus: _result(proc) for cpus, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_preprocessing_avoids_the_trainer_node_when_another_has_cpus(runs):
    out = runs[2.0]
    default, allowed, loader = out["default"], out["allow_trainer_node"], out["dataloader"]
    assert default["nodes"] == [default["worker"]], f"tasks ran on {default['nodes']}, trainer {default['trainer']}"
    assert loader["nodes"] == [loader["worker"]], f"loader workers ran on {loader['nodes']}"
    assert set(allowed["nodes"]) <= {allowed["worker"], allowed["trainer"]} and allowed["nodes"]


def test_trainer_node_without_cpus_for_tasks(runs):
    out = runs[0.0]
    for name in ("default", "allow_trainer_node", "dataloader"):
        assert out[name]["nodes"] == [out[name]["worker"]], out[name]
