"""How a job finds its split coordinators: names, the namespace, and the environment switches."""
from __future__ import annotations

import os
import time
from typing import Any, Optional, Union

import ray

from sbloader.core.errors import SbloaderError
from sbloader.distributed.coordinator import DEFAULT_IDLE_EXIT_S, SplitCoordinator
from sbloader.runtime.job import JobIdentity, token_of

#: prefix of every job's namespace (``sbloader-<job id>``): a job's named actors live in its own
NAMESPACE = "sbloader"
NO_LEDGER_ENV = "SBLOADER_NO_LEDGER"
IDLE_EXIT_ENV = "SBLOADER_COORDINATOR_IDLE_EXIT_S"


def idle_exit_s() -> float:
    """Seconds without a call after which a coordinator exits (``SBLOADER_COORDINATOR_IDLE_EXIT_S``)."""
    raw = os.environ.get(IDLE_EXIT_ENV)
    if raw is None:
        return DEFAULT_IDLE_EXIT_S
    try:
        value = float(raw)
    except ValueError:
        raise SbloaderError(f"{IDLE_EXIT_ENV} must be a number of seconds, found {raw!r}") from None
    if value <= 0:
        raise SbloaderError(f"{IDLE_EXIT_ENV} must be positive, found {raw!r}")
    return value


def ledger_enabled() -> bool:
    """False when ``SBLOADER_NO_LEDGER=1`` (benchmarks only): coordinators keep counts, no ledger."""
    return os.environ.get(NO_LEDGER_ENV, "") != "1"


def coordinator_name(job_id: str, loader_name: str, restart_count: int = 0) -> str:
    """The Ray actor name of a loader's coordinator in a job."""
    return f"sbloader-coordinator:{job_id}:{restart_count}:{loader_name}"


def as_identity(job: Union[JobIdentity, str]) -> JobIdentity:
    """A job identity; a bare id string (tests, tools) gets the token derived from it."""
    return job if isinstance(job, JobIdentity) else JobIdentity(job, token_of(job), "job_id=")


NAME_FREED_S = 30.0  # at most this long a dead coordinator's name is asked for again until it names a live one


def get_coordinator(job: Union[JobIdentity, str], loader_name: str, world_size: int, fingerprint: dict,
                    restart_count: int = 0, stall_report_s: float = 60.0, rank: int = 0,
                    loader: Optional[str] = None) -> Any:
    """The job's coordinator for a loader: created by the first rank to ask, found by the rest
    (``loader``: the id of this rank's loader, whose drop tells the coordinator).

    It lives in the job's namespace and keeps the job's token: a rank of another job
    that reaches it anyway (the same ``job_id=`` given to two jobs) is refused.
    """
    job = as_identity(job)
    name = coordinator_name(job.job_id, loader_name, restart_count)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # On the node of the rank that creates it, so that it shares its fate with a rank, never
    # with a CPU node lost mid-epoch (the objects it owns, every block of the epoch, go with
    # it). Hard: a soft affinity put a detached num_cpus=0 actor on another node in 2 of 4
    # placements on a `ray start` cluster (issue #35), and the job died with that node.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    ctx = ray.get_runtime_context()
    deadline = time.monotonic() + NAME_FREED_S
    while True:
        handle = SplitCoordinator.options(
            name=name, namespace=job.namespace, get_if_exists=True, lifetime="detached", scheduling_strategy=here,
        ).remote(world_size, fingerprint, stall_report_s, ledger_enabled(), idle_exit_s(), job.token)
        try:
            reply = ray.get(handle.hello.remote(world_size, fingerprint, job.token, rank, ctx.get_job_id(),
                                                ctx.get_node_id(), loader))
            break
        except ray.exceptions.RayActorError:
            # the name still named a coordinator that had just died (killed, or its process lost: a rank
            # reconnecting at once, CI): the GCS frees the name a moment later, then the first to ask makes one
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    if not reply["ok"]:
        if reply.get("reason") == "token":
            raise SbloaderError(
                f"coordinator {name!r} in namespace {job.namespace!r} belongs to another job (its token differs): "
                "two jobs were given the same job id. Give each job its own job_id= (or SBLOADER_JOB_ID), or leave "
                "it unset so the launcher's identity is used."
            )
        if reply.get("reason") == "rank":
            raise SbloaderError(
                f"coordinator {name!r}: rank {rank} is already served to another live process "
                f"(Ray job {reply.get('holder')}); two jobs share one job id. Give each job its own job_id=."
            )
        raise SbloaderError(
            f"coordinator {name!r} already exists for another loader: found world_size="
            f"{reply['world_size']} and {reply['fingerprint']}, expected world_size={world_size} and "
            f"{fingerprint}. Give the loader a distinct name= or a fresh job id."
        )
    if restart_count > 0:
        _retire(coordinator_name(job.job_id, loader_name, restart_count - 1), job.namespace)
    return handle


def _retire(name: str, namespace: str) -> None:
    """Kill the coordinator of the job's previous (elastic) restart and its worker pool.

    Coordinators are detached, so they outlive the rank that created them; after
    torchrun restarts the workers, the previous restart's coordinator serves
    nobody (the new job resumes from a checkpoint) but would keep its pool's CPUs.
    """
    try:
        old = ray.get_actor(name, namespace=namespace)
    except ValueError:  # none, or already retired by another rank
        return
    try:
        ray.get(old.shutdown.remote(), timeout=10)
    except Exception:  # dead or stuck: the kill below is enough (its pool actors die with it)
        pass
    try:
        ray.kill(old)
    except Exception:
        pass
