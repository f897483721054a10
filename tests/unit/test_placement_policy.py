"""Placement: the pure policy over node ids (which nodes preprocessing avoids)."""
from __future__ import annotations

import itertools

import pytest

from sbloader.runtime.placement import NodeInfo, excluded_nodes


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
