"""The cluster's nodes and resources, asked of the GCS with a deadline.

``ray.nodes()``, ``ray.cluster_resources()`` and ``ray.available_resources()`` go through a
second GCS client of the driver (Ray's global state accessor), whose calls wait for their
reply without a deadline: one was seen to wait for good in a driver that had forked worker
processes (the CI, in a ``DataLoader`` constructor), the GCS and the raylet alive. Here the
driver's own GCS client (the core worker's, which starts every actor) is asked, each call
with a deadline (:data:`CALL_TIMEOUT_S`, then once more); when both time out, the last
answer stands, and with none a :class:`ClusterStateError` says what to check.

Every answer counts live nodes only, as ``ray.cluster_resources()`` does.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

#: Seconds one GCS call may take before it is asked again.
CALL_TIMEOUT_S = 10.0
_TRIES = 2
_LAST: dict = {}  # what each query last answered: the answer when the GCS does not
_LOCK = threading.Lock()


class ClusterStateError(RuntimeError):
    """The GCS did not answer a query about the cluster in time."""


@dataclass(frozen=True)
class NodeView:
    """One node of the cluster as the GCS sees it."""

    node_id: str  # hex, as ``ray.get_runtime_context().get_node_id()``
    alive: bool
    address: str
    resources: dict = field(default_factory=dict)  # its total resources


def _client() -> Any:
    import ray

    if not ray.is_initialized():
        raise ClusterStateError("Ray is not running in this process: start it first (sbloader.init() or ray.init()).")
    return ray._private.worker.global_worker.gcs_client


def _ask(name: str, call: Any) -> Any:
    error: Optional[BaseException] = None
    for _ in range(_TRIES):
        try:
            answer = call(CALL_TIMEOUT_S)
        except ClusterStateError:
            raise
        except Exception as e:  # a timeout or a GCS that is restarting
            error = e
            continue
        with _LOCK:
            _LAST[name] = answer
        return answer
    with _LOCK:
        if name in _LAST:
            return _LAST[name]
    raise ClusterStateError(
        f"the Ray GCS did not answer {name!r} within {CALL_TIMEOUT_S:g} s, {_TRIES} times ({error!r}); "
        "check that the cluster's head node is up (`ray status`) and reachable from this process.") from error


def nodes() -> list[NodeView]:
    """Every node the GCS knows, the dead ones too (``alive`` False), like ``ray.nodes()``."""
    def call(timeout: float) -> list[NodeView]:
        info = _client().get_all_node_info(timeout=timeout)
        return [NodeView(n.node_id.hex(), n.state == 0, n.node_manager_address, dict(n.resources_total))
                for n in info.values()]

    return _ask("nodes", call)


def alive_nodes() -> list[NodeView]:
    """The live nodes."""
    return [n for n in nodes() if n.alive]


def sum_resources(per_node: dict, exclude: Sequence[str] = ()) -> dict:
    """Resources summed over the nodes of ``per_node`` (node id -> resources) not in ``exclude``."""
    out: dict = {}
    for node, res in per_node.items():
        if node not in exclude:
            for k, v in res.items():
                out[k] = out.get(k, 0.0) + float(v)
    return out


def total_resources(exclude: Sequence[str] = ()) -> dict:
    """The live nodes' total resources (all but ``exclude``), like ``ray.cluster_resources()``."""
    return sum_resources({n.node_id: n.resources for n in alive_nodes()}, exclude)


def available_resources(exclude: Sequence[str] = ()) -> dict:
    """The live nodes' free resources (all but ``exclude``), like ``ray.available_resources()``."""
    def call(timeout: float) -> dict:
        reply = _client().get_all_resource_usage(timeout=timeout)
        return {bytes(b.node_id).hex(): dict(b.resources_available) for b in reply.resource_usage_data.batch}

    per_node = _ask("available", call)
    alive = {n.node_id for n in alive_nodes()}
    return sum_resources({k: v for k, v in per_node.items() if k in alive}, exclude)


def cpus_waiting(timeout: float = 2.0) -> float:
    """CPUs that tasks and actors queued on the nodes ask for and wait to get (feasible requests not placed
    yet for want of free CPUs: the raylets' resource load, reported within about a second). One GCS call
    with a ``timeout``; raises when the GCS does not answer (no last answer stands in: a stale demand
    would be acted on)."""
    reply = _client().get_all_resource_usage(timeout=timeout)
    total = 0.0
    for node in reply.resource_usage_data.batch:
        for demand in node.resource_load_by_shape.resource_demands:
            queued = demand.num_ready_requests_queued + demand.backlog_size
            total += float(demand.shape.get("CPU", 0.0)) * queued
    return total


def cpus(exclude: Sequence[str] = ()) -> float:
    """The live nodes' CPUs (all but ``exclude``)."""
    return float(total_resources(exclude).get("CPU", 0.0))


def cpu_summary() -> str:
    """``"the cluster has N CPUs, M free now"`` for an error message; empty when Ray is not up or the
    GCS does not answer (never raises)."""
    try:
        import ray

        if not ray.is_initialized():
            return ""
        return f"the cluster has {cpus():g} CPUs, {available_resources().get('CPU', 0.0):g} free now"
    except Exception:
        return ""
