"""One embedded Ray per single-node torchrun job, shared by its ranks.

Local rank 0 starts the Ray (loopback only) and publishes its address and auth
token where the job's other ranks find it: in the job's torch.distributed store
when there is one (the process group's, or torchrun's agent store), else in a
private file named after the job's identity (:mod:`sbloader.runtime.job`: unique
per job, never guessed from parent PIDs, so a launcher that starts ranks as
children of rank 0, like Lightning's, works). The other ranks wait and join. At
exit, rank 0 waits (bounded) for the others to leave before stopping Ray.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

from sbloader.core.errors import SbloaderError
from sbloader.runtime.world import World

_TIMEOUT_S = 180.0


def rendezvous_dir() -> Path:
    """Folder of the rendezvous files (private to this user)."""
    d = Path(tempfile.gettempdir()) / f"sbloader-rdzv-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def _key(world: World) -> str:
    from sbloader.runtime.job import identify, safe

    return f"{safe(identify(world).job_id)}-{world.restart_count}"


def publish(world: World, address: str, token: str) -> Path:
    """Local rank 0: write the Ray address and token for the other ranks."""
    path = rendezvous_dir() / f"{_key(world)}.json"
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"address": address, "token": token}, f)
    os.replace(tmp, path)
    return path


def wait_for(world: World, timeout: float = _TIMEOUT_S) -> dict:
    """Other local ranks: wait for local rank 0's file."""
    path = rendezvous_dir() / f"{_key(world)}.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SbloaderError(
                f"rank {world.rank} waited {timeout:.0f} s for local rank 0 to start the embedded Ray "
                f"({path} never appeared); does local rank 0 create an sbloader loader too? "
                "Or set RAY_ADDRESS to a running cluster."
            )
        time.sleep(0.05)
    return json.loads(path.read_text())


def mark_left(world: World) -> None:
    """A non-zero local rank is done with Ray."""
    (rendezvous_dir() / f"{_key(world)}.left.{world.local_rank}").touch()


def wait_all_left(world: World, timeout: float = 60.0) -> None:
    """Local rank 0: wait for the other local ranks to leave, then clean up."""
    d = rendezvous_dir()
    key = _key(world)
    deadline = time.monotonic() + timeout
    others = [d / f"{key}.left.{r}" for r in range(1, world.local_world_size)]
    while not all(p.exists() for p in others) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in others + [d / f"{key}.json"]:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def read_token() -> str:
    """The auth token of the Ray this process started."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    if token:
        return token
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def join_shared(world: World, start: Callable[[], str], connect: Callable[[str], None],
                store: Optional[Any] = None) -> bool:
    """Start (local rank 0) or join (others) the job's embedded Ray.

    Args:
        world: this process's place in the job.
        start: starts the embedded Ray and returns its address.
        connect: joins a Ray at an address.
        store: the job's torch.distributed store, when there is one (else a file).

    Returns:
        True if this process started (and so owns) the Ray.
    """
    if not world.single_node:
        raise SbloaderError(
            f"a multi-node job (world size {world.world_size}, {world.local_world_size} ranks on this "
            "node) needs one Ray cluster for all nodes: start it with `ray start --head` and set RAY_ADDRESS "
            "(docs/multinode.md)"
        )
    store_key = f"sbloader/embedded-ray/{_key(world)}"
    if world.local_rank == 0:
        address = start()
        if store is not None:
            store.set(store_key, json.dumps({"address": address, "token": read_token()}))
        else:
            publish(world, address, read_token())
        return True
    if store is not None:
        try:
            store.wait([store_key], timedelta(seconds=_TIMEOUT_S))
        except Exception as exc:
            raise SbloaderError(
                f"rank {world.rank} waited {_TIMEOUT_S:.0f} s for local rank 0 to start the embedded Ray ({exc}); "
                "does local rank 0 create an sbloader loader too? Or set RAY_ADDRESS to a running cluster."
            ) from None
        info = json.loads(store.get(store_key))
    else:
        info = wait_for(world)
    if info.get("token"):
        os.environ["RAY_AUTH_TOKEN"] = info["token"]
        # Ray read its auth settings when it was imported; re-read them now.
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()
    connect(info["address"])
    return False
