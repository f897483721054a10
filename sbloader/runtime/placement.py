"""Where preprocessing runs: off the trainer's nodes when other nodes have CPUs (pure policy).

On a cluster the trainer's node has its GPUs to feed and its own CPUs to spare
for the training loop, so by default tasks and worker actors go to the other
nodes — unless none of them has CPUs, in which case the pipeline may use every
node rather than not run at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

NODE_ID_LABEL = "ray.io/node-id"


@dataclass(frozen=True)
class NodeInfo:
    """What the policy needs to know about a Ray node.

    Attributes:
        node_id: the node's id.
        cpus: logical CPUs the node offers to tasks.
        alive: whether the node is alive.
    """

    node_id: str
    cpus: float
    alive: bool = True


def excluded_nodes(nodes: Iterable[NodeInfo], trainer_nodes: Iterable[str], allow_trainer_nodes: bool) -> frozenset:
    """The node ids preprocessing must avoid.

    Args:
        nodes: the cluster's nodes.
        trainer_nodes: nodes where training processes run.
        allow_trainer_nodes: preprocessing may use the trainer's nodes too.

    Returns:
        The trainer's nodes, when some other alive node offers CPUs and the trainer's
        nodes are not allowed; otherwise nothing.
    """
    trainers = frozenset(trainer_nodes)
    if allow_trainer_nodes or not trainers:
        return frozenset()
    others = [n for n in nodes if n.alive and n.node_id not in trainers and n.cpus > 0]
    return trainers if others else frozenset()


def cluster_nodes() -> list[NodeInfo]:
    """The live cluster's nodes (needs Ray)."""
    from sbloader.runtime import cluster_state

    return [NodeInfo(n.node_id, float(n.resources.get("CPU", 0.0)), n.alive) for n in cluster_state.nodes()]


def scheduling_strategy(exclude: Iterable[str]) -> Optional[Any]:
    """A Ray scheduling strategy that keeps tasks off ``exclude`` (None when empty)."""
    exclude = sorted(exclude)
    if not exclude:
        return None
    from ray.util.scheduling_strategies import NodeLabelSchedulingStrategy, NotIn

    return NodeLabelSchedulingStrategy(hard={NODE_ID_LABEL: NotIn(*exclude)})


def exclusions_here(allow_trainer_nodes: bool) -> tuple:
    """The node ids to avoid when this process is the trainer (needs Ray running)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    return tuple(sorted(excluded_nodes(cluster_nodes(), [here], allow_trainer_nodes)))


def usable_resources(exclude: Sequence[str]) -> tuple[dict, dict]:
    """(free, total) resources of the nodes the pipeline may use (all but ``exclude``)."""
    from sbloader.runtime import cluster_state

    return cluster_state.available_resources(exclude), cluster_state.total_resources(exclude)
