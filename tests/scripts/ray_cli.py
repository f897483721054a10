"""Ray's own ``ray`` CLI, for a second node on the same machine as the head (tests only).

``ray start --address=127.0.0.1:PORT`` on a machine whose head listens on loopback
cannot work unchanged: with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (which keeps a
head on loopback) the CLI refuses to start a worker node at all, and without it the
CLI rewrites 127.0.0.1 into the machine's external address, where nothing listens
(and which tests must never use). On real machines neither happens: every node
has its own address. This wrapper keeps a loopback address as given and then runs
Ray's CLI exactly as ``ray`` does, with the same arguments.
"""
from __future__ import annotations

import sys

from ray._private import services
from ray._raylet import is_localhost


def _keep_loopback(host: str) -> str:
    return "127.0.0.1" if is_localhost(host) else host


services.resolve_ip_for_localhost = _keep_loopback

if __name__ == "__main__":
    from ray.scripts.scripts import main

    sys.argv[0] = "ray"
    sys.exit(main())
