"""Failures during an epoch: a node removed, a pool actor killed, a worker killed.

Runs tests/scripts/failures.py (its own ``ray.cluster_utils.Cluster``) in a
subprocess; each scenario must deliver every row exactly once and prove from
provenance (node ids, pids in the rows) that the victim had run partitions.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "failures.py")


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=900,
                          cwd=str(tmp_path_factory.mktemp("failures")), env=env)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"the failure script printed nothing (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    out = {d["scenario"]: d for d in lines}
    out["_log"] = f"rc {proc.returncode}; stderr:\n{proc.stderr[-3000:]}"
    return out


@pytest.mark.parametrize("name", ["node_removed_tasks", "node_removed_actors", "actor_killed", "worker_killed"])
def test_epoch_completes_exactly_once_after_failure(scenarios, name):
    assert name in scenarios, f"scenario {name} did not finish; got {sorted(k for k in scenarios if k != '_log')}; {scenarios['_log']}"
    out = scenarios[name]
    assert out["rows"] == 300 and out["exactly_once"], out
    assert out["victim_ran"], f"the victim of {name} never ran a partition, so the test proves nothing: {out}"
