"""Which processes are ranks of one job: the job's identity, taken from what the launcher provides.

A job's split coordinators are named after its id, so two jobs on one cluster
must never get the same id, and all ranks of a job must get the same one. The id
is never guessed from a constant or from parent PIDs; it comes from, in order:

1. ``job_id=`` given to the loader, or ``SBLOADER_JOB_ID``;
2. a world of one rank: an id drawn at random once per process;
3. ``TORCHELASTIC_RUN_ID`` when it is not one of torchrun's constants (``none``,
   empty): ``torchrun --standalone`` and elastic rendezvous draw a unique one;
4. the torch.distributed process group, once it exists (Lightning, Accelerate, Ray
   Train, any script that called ``init_process_group``): rank 0 draws a random id
   and shares it through the group's store;
5. torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``: a static rendezvous,
   ``accelerate launch``) before any process group exists: the same exchange.

Where none applies (several ranks, no process group, no usable run id) the loader
fails at once with :class:`JobIdentityError`, naming the fixes.

Each identity also has a token, drawn with the id wherever the id is exchanged
through a store: the coordinator created by the job keeps it and refuses ranks
that bring another one, so two jobs whose names collide anyway fail loudly.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from sbloader.core.errors import SbloaderError
from sbloader.runtime.world import World

JOB_ID_ENV = "SBLOADER_JOB_ID"
#: run ids that torchrun and the launchers built on it use for every job alike
CONSTANT_RUN_IDS = frozenset({"", "none", "default"})
STORE_TIMEOUT_S = 60.0
_KEY = "sbloader/job"

_LOCK = threading.Lock()
_CACHE: dict[Any, "JobIdentity"] = {}


class JobIdentityError(SbloaderError):
    """The ranks of a multi-rank job cannot be told apart from other jobs' ranks."""


@dataclass(frozen=True)
class JobIdentity:
    """One job's identity, the same on all its ranks.

    Attributes:
        job_id: unique to the job; names its coordinators and their namespace.
        token: checked by the job's coordinators on every rank's first call.
        source: where the id came from (``job_id=``, ``process``, ``torchelastic``,
            ``process group``, ``agent store``), for messages and docs.
    """

    job_id: str
    token: str
    source: str

    @property
    def namespace(self) -> str:
        """The Ray namespace of the job's named actors."""
        return f"sbloader-{safe(self.job_id)}"


def safe(text: str) -> str:
    """``text`` with everything but letters, digits, ``-`` and ``_`` replaced (for names and paths)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)[:96]


def token_of(job_id: str) -> str:
    """The token of an id that was given, not drawn (it guards against mistakes, not against attacks)."""
    return hashlib.sha256(f"sbloader:{job_id}".encode()).hexdigest()[:32]


def _draw() -> tuple[str, str]:
    return uuid.uuid4().hex[:16], uuid.uuid4().hex


def _exchange(store: Any, rank: int, key: str) -> tuple[str, str]:
    """Rank 0 draws (id, token) and puts it in ``store``; the others wait for it."""
    if rank == 0:
        job_id, token = _draw()
        store.set(key, json.dumps({"job_id": job_id, "token": token}))
        return job_id, token
    try:
        store.wait([key], timedelta(seconds=STORE_TIMEOUT_S))
    except Exception as exc:
        raise JobIdentityError(
            f"rank {rank} waited {STORE_TIMEOUT_S:.0f} s for rank 0 to publish the job's identity in the "
            f"torch.distributed store ({exc}); does rank 0 create this loader too?"
        ) from None
    got = json.loads(store.get(key))
    return got["job_id"], got["token"]


def _group_store() -> Optional[Any]:
    """The default process group's store, or None when there is no process group."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


def _agent_store(world: World) -> Optional[Any]:
    """torchrun's agent store (a client), when the launcher says its workers may use it."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not host or not port:
        return None
    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore(host, int(port), world.world_size, is_master=False,
                     timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
    return PrefixStore(f"sbloader/{world.restart_count}", store)


def identify(world: World) -> JobIdentity:
    """The identity of this process's job (memoized per process and world).

    Raises:
        JobIdentityError: several ranks and nothing that identifies their job.
    """
    key = (world.job_id, world.world_size, world.rank, world.restart_count)
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = _identify(world)
        return _CACHE[key]


def _identify(world: World) -> JobIdentity:
    explicit = world.job_id or os.environ.get(JOB_ID_ENV)
    if explicit:
        return JobIdentity(explicit, token_of(explicit), "job_id=")
    if world.world_size == 1:
        job_id, token = _draw()
        return JobIdentity(f"local-{job_id}", token, "process")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id.strip().lower() not in CONSTANT_RUN_IDS:
        return JobIdentity(f"{run_id}-{world.restart_count}", token_of(f"{run_id}-{world.restart_count}"),
                           "torchelastic")
    store = _group_store()
    source = "process group"
    if store is None:
        store = _agent_store(world)
        source = "agent store"
    if store is not None:
        job_id, token = _exchange(store, world.rank, _KEY)
        return JobIdentity(job_id, token, source)
    raise JobIdentityError(
        f"this process is rank {world.rank} of {world.world_size}, but nothing identifies its job: no "
        f"process group yet, and TORCHELASTIC_RUN_ID is {run_id or 'unset'!r} (the same for every job). Two "
        "jobs on one cluster would share one split coordinator. Fix: create the process group "
        "(torch.distributed.init_process_group) before iterating the loader, or pass job_id= (the same "
        f"on every rank, unique per job) to the loader, or set {JOB_ID_ENV}."
    )


def store_for_rendezvous(world: World) -> Optional[Any]:
    """A store all ranks of the job reach (process group's, else torchrun's agent store), or None."""
    store = _group_store()
    if store is None:
        try:
            store = _agent_store(world)
        except Exception:
            store = None
    return store
