"""What each stage of a pipeline is guaranteed to hold, and how far an actor pool may grow (pure).

Every stage holds a reservation that lets it make progress: one task in flight for a
task stage (the read stage included), its pool's minimum of actors for an actor
stage. An actor pool then grows only into the room the other stages' reservations
leave free: a pool that took every CPU of the cluster would leave the reads that feed
it none, its queue would drain, and it would sit idle (and, before this rule, retire
its actors and build them again when the reads ran). Where the cluster cannot hold
every stage's reservation, :func:`shortfall` says which stage needs what, before
the pipeline starts, instead of letting it stall.

Resources are Ray's names (``CPU``, ``GPU``, custom ones), summed over the nodes the
pipeline may use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence


@dataclass(frozen=True)
class StageNeeds:
    """What one stage asks of the cluster.

    Attributes:
        name: the stage's display name.
        actor: an actor-pool stage (else a task stage).
        per_call: the resources one task or one actor holds.
        min_actors: (actor stage) the pool's minimum.
        max_actors: (actor stage) the pool's maximum the user gave (None: as the room allows).
    """

    name: str
    actor: bool
    per_call: Mapping[str, float] = field(default_factory=dict)
    min_actors: int = 1
    max_actors: Optional[int] = None

    def __post_init__(self) -> None:
        if any(v < 0 for v in self.per_call.values()):
            raise ValueError(f"resources must be >= 0, found {dict(self.per_call)}")
        if self.actor and (self.min_actors < 1 or (self.max_actors is not None and self.max_actors < self.min_actors)):
            raise ValueError(f"need 1 <= min_actors <= max_actors, found {self.min_actors}, {self.max_actors}")

    def reservation(self) -> dict[str, float]:
        """What the stage holds to make progress: one task, or its pool's minimum of actors."""
        times = self.min_actors if self.actor else 1
        return {k: v * times for k, v in self.per_call.items() if v > 0}


def _sum(reservations: Sequence[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in reservations:
        for k, v in r.items():
            out[k] = out.get(k, 0.0) + v
    return out


def shortfall(stages: Sequence[StageNeeds], total: Mapping[str, float]) -> Optional[str]:
    """None when the cluster holds every stage's reservation at once; else what is short.

    Args:
        stages: every stage of the pipeline.
        total: the resources of the nodes the pipeline may use.

    Returns:
        A message naming each stage's reservation, the sum per resource and what the
        cluster has, for the resources that do not fit.
    """
    need = _sum([s.reservation() for s in stages])
    short = {k: v for k, v in need.items() if v > total.get(k, 0.0) + 1e-9}
    if not short:
        return None
    parts = []
    for s in stages:
        res = {k: v for k, v in s.reservation().items() if k in short}
        if res:
            what = f"its pool's minimum of {s.min_actors} actor(s)" if s.actor else "one task"
            parts.append(f"{s.name} needs {_fmt(res)} ({what})")
    have = ", ".join(f"{k} {total.get(k, 0.0):g}" for k in sorted(short))
    return (f"the pipeline cannot run on this cluster: every stage needs room to make progress, and "
            f"{'; '.join(parts)}: {_fmt(short)} in all, where the nodes it may use have {have}. Lower the pools' "
            "minimum (concurrency=(min, max)) or their num_cpus/num_gpus, or give Ray more resources")


def _fmt(res: Mapping[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(res.items()))


def pool_limit(stages: Sequence[StageNeeds], total: Mapping[str, float], i: int) -> int:
    """How many actors the pool of stage ``i`` may have: as many as fit in the room the other
    stages' reservations leave (per resource its actors hold), within its own bounds.

    Never below the pool's minimum (that is its own reservation, checked by :func:`shortfall`).
    """
    stage = stages[i]
    if not stage.actor:
        raise ValueError(f"stage {i} ({stage.name}) is not an actor stage")
    others = _sum([s.reservation() for j, s in enumerate(stages) if j != i])
    fit = math.inf
    for k, v in stage.per_call.items():
        if v > 0:
            fit = min(fit, (total.get(k, 0.0) - others.get(k, 0.0)) / v)
    if fit == math.inf:  # its actors hold nothing the cluster counts: one per CPU, as a default
        limit = stage.max_actors if stage.max_actors is not None else int(total.get("CPU", 1.0))
    else:
        limit = int(fit + 1e-9) if stage.max_actors is None else min(stage.max_actors, int(fit + 1e-9))
    return max(stage.min_actors, limit)


def idle_limit_s(construction_s: Optional[float], floor_s: float) -> float:
    """How long an actor must sit idle before it may be retired: longer than building one took
    (a model can cost seconds to construct), and at least ``floor_s``."""
    return max(floor_s, 2.0 * (construction_s or 0.0))
