"""Placement on a fake two-node cluster (the pure policy: ``tests/unit/test_placement_policy.py``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys



SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "placement_job.py")


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
