"""Where sbloader runs: the embedded local Ray, or a cluster named by an address.

With no ``RAY_ADDRESS`` (and no ``init(address=...)``) sbloader starts a fresh local
Ray of its own with ``address="local"`` (never a stale cluster found on the
machine), bound to loopback, dashboard off, token authentication left on, once per
process, stopped at exit. With an address it joins that cluster and never shuts
it down.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"owned": False, "info": None}

# Daemons the embedded Ray does not need for a loader: the Ray metrics exporter,
# usage reporting and prestarted idle workers. Set before ray starts so every
# Ray process inherits them.
_EMBEDDED_ENV = {
    # Pin a local Ray to loopback; otherwise it advertises the external address.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # The raylet frees released objects in batches, every second by default: a
    # streaming pipeline releases blocks far faster, and the object store would
    # hold a second's worth of blocks beyond the budget.
    "RAY_free_objects_period_milliseconds": "20",
}


@dataclass(frozen=True)
class RuntimeInfo:
    """What ``sbloader.init`` connected to.

    Attributes:
        address: the GCS address of the Ray cluster.
        embedded: True when sbloader started this Ray itself (and will stop it).
        node_id: the node id of the calling process.
    """

    address: str
    embedded: bool
    node_id: str


def init(
    address: Optional[str] = None,
    *,
    num_cpus: Optional[int] = None,
    num_gpus: Optional[int] = None,
    object_store_memory: Optional[int] = None,
    **ray_init_kwargs: Any,
) -> RuntimeInfo:
    """Start or join the Ray that sbloader runs on. Idempotent.

    Args:
        address: a Ray cluster address. ``None`` uses ``RAY_ADDRESS`` when set and
            otherwise starts an embedded local Ray bound to loopback.
        num_cpus: logical CPUs of the embedded Ray (default: the machine's).
        num_gpus: GPUs of the embedded Ray (default: detected).
        object_store_memory: object store size in bytes of the embedded Ray.
        **ray_init_kwargs: passed to ``ray.init`` unchanged.

    Returns:
        A :class:`RuntimeInfo` describing the Ray in use.
    """
    import ray

    with _LOCK:
        if ray.is_initialized():
            if _STATE["info"] is None:
                ctx = ray.get_runtime_context()
                _STATE["info"] = RuntimeInfo(
                    address=ray.get_runtime_context().gcs_address,
                    embedded=False,
                    node_id=ctx.get_node_id(),
                )
            return _STATE["info"]
        address = address or os.environ.get("RAY_ADDRESS") or None
        kwargs: dict[str, Any] = dict(
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
        kwargs.update(ray_init_kwargs)
        if address is None:
            for key, value in _EMBEDDED_ENV.items():
                os.environ.setdefault(key, value)
            if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
                # ray read the variable at import; if ray was imported before
                # sbloader, apply it now so the node binds to loopback.
                from ray._private import ray_constants

                ray_constants.ENABLE_RAY_CLUSTER = False
            ray.init(
                address="local",
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                object_store_memory=object_store_memory,
                **kwargs,
            )
            embedded = True
            atexit.register(shutdown)
        else:
            ray.init(address=address, **kwargs)
            embedded = False
        ctx = ray.get_runtime_context()
        info = RuntimeInfo(address=ctx.gcs_address, embedded=embedded, node_id=ctx.get_node_id())
        _STATE.update(owned=embedded, info=info)
        logger.info("sbloader: %s Ray at %s", "started embedded" if embedded else "joined", info.address)
        return info


def shutdown() -> None:
    """Stop the embedded Ray if sbloader started it; only forget a joined cluster."""
    import ray

    with _LOCK:
        if _STATE["owned"] and ray.is_initialized():
            ray.shutdown()
        elif ray.is_initialized() and _STATE["info"] is not None and not _STATE["info"].embedded:
            ray.shutdown()
        _STATE.update(owned=False, info=None)


def ensure_initialized() -> RuntimeInfo:
    """Return the runtime, starting the default one on first use."""
    return init()


def cluster_cpus() -> float:
    """Logical CPUs of the whole cluster (at least 1)."""
    import ray

    return max(1.0, float(ray.cluster_resources().get("CPU", 1.0)))
