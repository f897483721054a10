"""Partitions run again because the cluster lost their call, and the nodes lost.

A call the system lost (:func:`~sbloader.executor.failures.system_failure`: its
pool actor or node gone) runs again elsewhere from its partition's provenance:
the scheduling loop queues the partition (or the input block) again, the pool
regrows on the surviving nodes. This module counts, bounds and reports it: one
warning line per lost node (or per kind of loss where Ray does not say which
node), and the execution's statistics name the nodes and count the re-runs.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

from sbloader.core.stats import ExecutionStats
from sbloader.executor.calls import Running
from sbloader.executor.failures import MAX_RERUNS, lost

logger = logging.getLogger(__name__)

UNKNOWN_NODE = "?"
NODE_POLL_S = 2.0  # how often an execution looks at the cluster's nodes

# Losses already warned about in this process: one line per lost node for the job, not one per
# epoch's execution (a coordinator runs every epoch of its job; epoch 1's node watch would name
# again the node epoch 0's calls lost).
_WARNED: set[str] = set()


def warn_once(tag: str, message: str, *args: Any) -> bool:
    """Log ``message`` as a warning unless ``tag`` (a node id, or a kind of loss) was warned
    about in this process already; True when it was logged."""
    if tag in _WARNED:
        return False
    _WARNED.add(tag)
    logger.warning(message, *args)
    return True


def _first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, at most 160 characters."""
    return (str(error).strip().splitlines() or [""])[0][:160]


class Reruns:
    """The re-runs of one execution.

    Args:
        epoch: the execution's epoch (named in the warnings).
        stats: its statistics (``rerun_partitions``, ``lost_nodes``).
    """

    def __init__(self, epoch: int, stats: ExecutionStats) -> None:
        self._epoch, self._stats = epoch, stats
        self._counts: dict[tuple[int, int], int] = {}
        self._warned: set[str] = set()
        self._alive: Optional[set] = None
        self._polled = 0.0

    def record(self, run: Running, error: BaseException, stage_name: str, node: Optional[str]) -> None:
        """One lost call's partition (``node``: where it ran, if known) is about to run again.

        Raises:
            TaskLostError: the partition was already run again :data:`MAX_RERUNS` times.
        """
        self._count(run.stage, run.partition_id, run.call.items, error, stage_name)
        self._stats.rerun_partitions += 1
        where = node or UNKNOWN_NODE
        if where not in self._stats.lost_nodes:
            self._stats.lost_nodes.append(where)
        self._warn(where if node else f"{UNKNOWN_NODE}{type(error).__name__}",
                   "sbloader epoch %d: lost node %s (a %r call failed: %s: %s); its partitions run again on the other "
                   "nodes from their provenance, and pools regrow there", self._epoch,
                   where if node else "(unknown)", stage_name, type(error).__name__, _first_line(error))

    def record_lost_block(self, stage: int, seq: int, part: Any, error: BaseException, stage_name: str) -> None:
        """The ready block of partition ``part`` (at ``seq`` in the plan; made by stage ``stage``, the last) was lost
        before the consumer read it (its node or its pool actor died): the partition is about to run again.

        Raises:
            TaskLostError: the partition was already run again :data:`MAX_RERUNS` times.
        """
        self._count(stage, part.id, ((seq, part),), error, stage_name)
        self._stats.rerun_partitions += 1
        self._warn(f"{UNKNOWN_NODE}lost-block", "sbloader epoch %d: a ready block of %r was lost before it was read "
                   "(%s: %s); its partition runs again from its provenance", self._epoch, stage_name,
                   type(error).__name__, _first_line(error))

    def _warn(self, tag: str, message: str, *args: Any) -> None:
        """``message`` once per ``tag`` in this execution, and once in this process (:func:`warn_once`)."""
        if tag not in self._warned:
            self._warned.add(tag)
            warn_once(tag, message, *args)

    def _count(self, stage: int, partition_id: int, items: Any, error: BaseException, stage_name: str) -> None:
        key = (stage, partition_id)
        n = self._counts.get(key, 0) + 1
        if n > MAX_RERUNS:
            raise lost(stage_name, self._epoch, items, partition_id, error)
        self._counts[key] = n

    def watch_nodes(self, pools: Any = None, now: Optional[float] = None, nodes: Optional[list] = None) -> bool:
        """Look at the cluster's nodes (at most every :data:`NODE_POLL_S`): a node gone is named
        (Ray re-runs a lost task by itself, so no call of ours may fail) and its pool actors
        leave their pools (``pools.lose_node``): an idle one would otherwise be restarted by
        Ray and wait for CPUs beside its replacement, and Ray's reconstruction of the blocks
        it made would wait for it. One that joined is logged. Returns True when a node
        joined: the caller may launch more work.

        Args:
            nodes: the cluster's nodes as ``ray.nodes()`` gives them (asked of :mod:`~sbloader.runtime.cluster_state` when None).
        """
        now = time.monotonic() if now is None else now
        if now - self._polled < NODE_POLL_S:
            return False
        self._polled = now
        try:
            if nodes is None:
                from sbloader.runtime import cluster_state

                nodes = [{"NodeID": n.node_id, "Alive": n.alive} for n in cluster_state.nodes()]
        except Exception:  # the GCS is busy: next time
            return False
        alive = {n["NodeID"] for n in nodes if n.get("Alive")}
        before, self._alive = self._alive, alive
        if before is None:
            return False
        for node in sorted(before - alive):
            if pools is not None:
                pools.lose_node(node)
            if node not in self._stats.lost_nodes:
                self._stats.lost_nodes.append(node)
            self._warn(node, "sbloader epoch %d: lost node %s (it left the cluster); the work it held runs again on "
                       "the other nodes", self._epoch, node)
        for node in sorted(alive - before):
            logger.info("sbloader epoch %d: node %s joined the cluster; work is placed on it", self._epoch, node)
        return bool(alive - before)

    @property
    def total(self) -> int:
        """Partitions run again so far."""
        return sum(self._counts.values())
