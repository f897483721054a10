"""A lost node is named once per job, not once per epoch's execution (issue #46).

The coordinator runs every epoch of its job: epoch 0's calls lost on the node, and
epoch 1's node watch then saw the node gone; each warned (2 lines for one death in
the drivers' output on a cluster whose nodes keep their own logs).
"""
from __future__ import annotations

import logging

import ray

from sbloader.core.stats import ExecutionStats
from sbloader.executor import reruns as reruns_mod
from sbloader.executor.calls import Call, Running
from sbloader.executor.reruns import Reruns
from sbloader.sources.base import Partition


def _running(pid: int) -> Running:
    part = Partition(pid, 10, None, f"part {pid}")
    return Running(0, 3, object(), 0, 0.0, Call(1, None, ((3, part),)), pid)


def test_a_node_lost_in_epoch_0_and_seen_gone_by_epoch_1_is_one_warning(caplog):
    getattr(reruns_mod, "_WARNED", set()).discard("nodeX")  # a clean slate for this process
    e = ray.exceptions.ActorUnavailableError("unreachable", b"a" * 16)
    first, second = ExecutionStats(), ExecutionStats()
    with caplog.at_level(logging.WARNING, logger="sbloader.executor.reruns"):
        Reruns(0, first).record(_running(1), e, "read", "nodeX")
        watch = Reruns(1, second)
        watch.watch_nodes(now=10.0, nodes=[{"NodeID": "nodeX", "Alive": True}, {"NodeID": "nodeY", "Alive": True}])
        watch.watch_nodes(now=20.0, nodes=[{"NodeID": "nodeX", "Alive": False}, {"NodeID": "nodeY", "Alive": True}])
    lines = [r.getMessage() for r in caplog.records if "lost node" in r.getMessage()]
    assert len(lines) == 1 and "nodeX" in lines[0], lines
    assert first.lost_nodes == ["nodeX"] and second.lost_nodes == ["nodeX"]  # each epoch's stats still name it
