"""Who this process is in a distributed job: rank, world size, job id."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class World:
    """The process's place in a (torchrun) job.

    Attributes:
        rank: global rank.
        world_size: number of ranks.
        local_rank: rank on this node.
        local_world_size: ranks on this node.
        job_id: the job id given by the user (``job_id=`` or ``SBLOADER_JOB_ID``), or None:
            :func:`sbloader.runtime.job.identify` then takes it from the launcher.
        restart_count: torchrun's restart count (a new incarnation of the job).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    job_id: Optional[str] = None
    restart_count: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, found rank={self.rank}, world_size={self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"need 0 <= local_rank < local_world_size, found {self.local_rank}, {self.local_world_size}"
            )

    @property
    def single_node(self) -> bool:
        """All ranks run on this node."""
        return self.local_world_size == self.world_size

    @classmethod
    def detect(cls, rank: Optional[int] = None, world_size: Optional[int] = None,
               job_id: Optional[str] = None) -> "World":
        """Read the launcher's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...), with overrides.

        Once a torch.distributed process group exists, its rank and world size win
        over the environment (Lightning's launcher, for one, sets no ``RANK`` in the
        processes it starts). Outside any launcher this is a world of one.
        """
        env = os.environ
        group = _process_group()
        ws = world_size if world_size is not None else group[1] if group else int(env.get("WORLD_SIZE", "1"))
        r = rank if rank is not None else group[0] if group else int(env.get("RANK", "0"))
        local_ws = int(env.get("LOCAL_WORLD_SIZE", str(ws if "LOCAL_RANK" in env or ws == 1 else 1)))
        local_r = int(env.get("LOCAL_RANK", "0"))
        if rank is not None and "LOCAL_RANK" not in env:
            local_ws, local_r = 1, 0
        jid = job_id or env.get("SBLOADER_JOB_ID") or None
        return cls(rank=r, world_size=ws, local_rank=local_r, local_world_size=max(local_ws, local_r + 1),
                   job_id=jid, restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))


def _process_group() -> Optional[tuple[int, int]]:
    """(rank, world size) of the default torch.distributed process group, or None."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return None
