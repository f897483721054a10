"""Placement: the pure policy over node ids, and a fake two-node cluster."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

from sbloader.runtime.placement import NodeInfo, excluded_nodes

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "placement_job.py")


@pytest.mark.parametrize("n_nodes,trainer_count,allow", itertools.product(range(0, 5), range(0, 3), [False, True]))
def test_policy_excludes_trainer_nodes_only_when_others_have_cpus(n_nodes, trainer_count, allow):
    for cpus in itertools.product([0.0, 2.0], repeat=n_nodes):
        nodes = [NodeInfo(f"n{i}", c) for i, c in enumerate(cpus)]
        trainers = [f"n{i}" for i in range(min(trainer_count, n_nodes))]
        out = excluded_nodes(nodes, trainers, allow)
        others_have_cpus = any(n.cpus > 0 for n in nodes if n.node_id not in trainers)
        if allow or not trainers or not others_have_cpus:
            assert out == frozenset(), (cpus, trainers, allow, out)
        else:
            assert out == frozenset(trainers), (cpus, trainers, allow, out)


def test_dead_nodes_do_not_count_as_somewhere_else_to_run():
    nodes = [NodeInfo("trainer", 4.0), NodeInfo("gone", 8.0, alive=False)]
    assert excluded_nodes(nodes, ["trainer"], False) == frozenset()
    nodes.append(NodeInfo("cpu", 8.0))
    assert excluded_nodes(nodes, ["trainer"], False) == {"trainer"}


def _run(head_cpus: float, tmp_path) -> dict:
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    proc = subprocess.run([sys.executable, SCRIPT, str(head_cpus)], capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path), env=env)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 3, f"placement job failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return {d["scenario"]: d for d in lines}


def test_preprocessing_avoids_the_trainer_node_when_another_has_cpus(tmp_path):
    out = _run(2.0, tmp_path)
    default, allowed, loader = out["default"], out["allow_trainer_node"], out["dataloader"]
    assert default["nodes"] == [default["worker"]], f"tasks ran on {default['nodes']}, trainer {default['trainer']}"
    assert loader["nodes"] == [loader["worker"]], f"loader workers ran on {loader['nodes']}"
    assert set(allowed["nodes"]) <= {allowed["worker"], allowed["trainer"]} and allowed["nodes"]


def test_trainer_node_without_cpus_for_tasks(tmp_path):
    out = _run(0.0, tmp_path)
    for name in ("default", "allow_trainer_node", "dataloader"):
        assert out[name]["nodes"] == [out[name]["worker"]], out[name]
