"""One extra "CPU node" for ``bench_scaleout.py`` (benchmark only): a Ray worker node on this host.

    taskset -c 1 python benchmarks/_scaleout_node.py --address 127.0.0.1:PORT --num-cpus 1

What ``ray start --address=... --block`` does, with the node bound to loopback:
``ray start`` refuses a worker node while ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
and with 1 it rewrites a loopback head address to the machine's external address.
So this builds the node the way Ray's own ``ray.cluster_utils.Cluster.add_node``
does (``ray._private.node.Node(head=False)``, node IP 127.0.0.1, gRPC picking free
ports, no second log monitor on the shared session folder) and blocks until
SIGTERM, then stops the node's processes. The head's auth token comes in the
environment (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN``).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray is imported: loopback only


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True, help="the head's GCS address (loopback)")
    p.add_argument("--num-cpus", type=int, default=1)
    p.add_argument("--object-store-memory", type=int, default=512 * 2**20)
    args = p.parse_args()
    if not args.address.startswith("127."):
        raise SystemExit(f"loopback addresses only, found {args.address!r}")
    import ray._private.node
    from ray._private.parameter import RayParams

    params = RayParams(
        gcs_address=args.address, node_ip_address="127.0.0.1", num_cpus=args.num_cpus, num_gpus=0,
        object_store_memory=args.object_store_memory, min_worker_port=0, max_worker_port=0,
        node_manager_port=0, include_log_monitor=False,
    )
    params.dashboard_agent_listen_port = None
    stop = {"now": False}

    def on_term(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    node = ray._private.node.Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    print(f"node up: {node.node_id} at {node.node_ip_address}", flush=True)
    try:
        while not stop["now"]:
            time.sleep(0.2)
    finally:
        node.kill_all_processes(check_alive=False, allow_graceful=True)
        print("node stopped", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
