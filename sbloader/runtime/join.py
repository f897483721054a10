"""Joining a Ray cluster that someone started with ``ray start``: address checks and the auth token.

Ray 2.60 turns token authentication on for every cluster it starts, but a process
that *joins* one (``ray.init(address=...)``) only sends the token when
``RAY_AUTH_MODE=token`` is set, even with the token sitting in
``~/.ray/auth_token``: the join then fails after ~20 s of ``InvalidAuthToken``
messages. :func:`prepare` does what a node of that cluster does: it turns token
mode on when a token is available and the mode is unset, and it checks, within
seconds, that the address answers and accepts the token, with an error that says
what to do when it does not.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
from typing import Iterator, Optional

from sbloader.core.errors import SbloaderError

CONNECT_TIMEOUT_S = 5.0
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_TOKEN_HELP = (
    "The cluster was started with token authentication. Give this process the "
    "head's token: copy the head node's ~/.ray/auth_token to this machine's ~/.ray/auth_token, or set "
    "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to it; `ray get-auth-token` on the head prints it."
)


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); raises SbloaderError naming a malformed address."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise SbloaderError(f"Ray address {address!r} is not host:port (for example 10.0.0.5:6379); "
                            "set RAY_ADDRESS or init(address=...) to the address `ray start --head` printed")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """True for addresses of this machine's loopback interface."""
    return host in _LOOPBACK or host.startswith("127.")


def enable_token_if_available() -> bool:
    """Turn Ray's token mode on for this process when a token exists and ``RAY_AUTH_MODE`` is unset.

    Returns True when token mode is on afterwards. An explicit ``RAY_AUTH_MODE``
    is always respected.
    """
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return False
    return bool(maybe_enable_token_auth_if_token_available(warn_if_disabled=False))


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise SbloaderError within ``timeout_s`` when nothing accepts connections at ``address``."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise SbloaderError(
            f"no Ray cluster answers at {address} ({exc}). Is the head running (`ray start --head` on that "
            "machine prints its address), and is the port reachable from here? Fix RAY_ADDRESS or "
            "init(address=...), or unset it to run on an embedded local Ray."
        ) from None


def _refused(exc: BaseException) -> bool:
    return "AuthToken" in str(exc) or type(exc).__name__ == "AuthenticationError"


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send this process's file descriptor 2 to /dev/null for the duration (Ray's C++ client logs
    straight to it: a probe that expects a refusal must not print ``InvalidAuthToken`` lines)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable stderr: nothing to hide
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def token_accepted(address: str) -> bool:
    """Whether the cluster at ``address`` accepts this process as it is (False only on an auth refusal).

    A probe: a refusal is expected where a token exists but token mode is off, and what
    Ray's client logs about it (``gcs_client.cc ... InvalidAuthToken``, twice) is not shown;
    :func:`check_token` reports a refusal that remains.
    """
    try:
        from ray._raylet import GcsClient
    except ImportError:
        return True
    try:
        with _quiet_stderr():
            GcsClient(address=address)
    except Exception as exc:
        if _refused(exc):
            return False
    return True


def check_token(address: str) -> None:
    """Raise SbloaderError at once when the cluster at ``address`` refuses this process's token."""
    try:
        from ray._raylet import GcsClient
    except ImportError:
        return
    try:
        GcsClient(address=address)
    except Exception as exc:
        if _refused(exc):
            mode = os.environ.get("RAY_AUTH_MODE") or "unset"
            raise SbloaderError(
                f"the Ray cluster at {address} refused this process's authentication token "
                f"(RAY_AUTH_MODE={mode}). {_TOKEN_HELP}"
            ) from None
        raise


def prepare(address: str) -> str:
    """Check and set up a join of the cluster at ``address``; returns the address to pass to ``ray.init``.

    - ``ray://`` (Ray Client) is refused: a loader's driver must run on a node of
      the cluster (its coordinators stream object references to the ranks).
    - ``auto`` is left to Ray (it reads the cluster file of ``ray start`` on this machine).
    - A loopback address keeps Ray on loopback (it would otherwise rewrite
      127.0.0.1 into the machine's external address and miss a head bound to loopback).
    - Nothing listening, or a refused token, fail within seconds with what to do.
    """
    if address.startswith("ray://"):
        raise SbloaderError(
            f"{address} is a Ray Client address; sbloader's loaders run on a node of the cluster (ranks take "
            "object references straight from the cluster), which Ray Client does not support. Run the training "
            "script on a cluster node with RAY_ADDRESS=<head ip>:6379, or submit it with `ray job submit`."
        )
    if address == "auto":
        enable_token_if_available()
        return address
    host, _ = split_address(address)
    if is_loopback(host):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    check_reachable(address)
    # Only when the cluster refuses this process as it is: turning token mode on re-reads
    # Ray's config, which would drop the system config of a Ray this process started itself
    # (ray.cluster_utils in tests).
    if not token_accepted(address):
        enable_token_if_available()
        check_token(address)
    return address


def token_hint(exc: BaseException) -> Optional[str]:
    """The token advice when a failed ``ray.init`` looks like an authentication failure, else None."""
    text = str(exc)
    if "AuthToken" in text or "Authentication" in text:
        return _TOKEN_HELP
    return None
