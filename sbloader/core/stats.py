"""Execution statistics: per operator rows, blocks, bytes, task time, throttling."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class OperatorStats:
    """Counters of one physical stage over one execution.

    Attributes:
        name: the stage's display name.
        rows: rows output.
        blocks: blocks output.
        bytes: bytes output.
        tasks: tasks (or actor calls) completed.
        task_s: wall seconds spent inside tasks.
        throttled_s: seconds the stage had input but was held back by the budget.
        skipped: rows skipped under ``on_error="skip"``.
        actors_created: actors launched (actor stages only).
        actors_ready: actors whose class was constructed (a launched actor can be
            stopped at the end of an epoch before it is ready).
    """

    name: str
    rows: int = 0
    blocks: int = 0
    bytes: int = 0
    tasks: int = 0
    task_s: float = 0.0
    throttled_s: float = 0.0
    skipped: int = 0
    actors_created: int = 0
    actors_ready: int = 0


@dataclass
class ExecutionStats:
    """Statistics of one execution (one epoch of one dataset).

    Attributes:
        operators: one entry per stage, in pipeline order.
        wall_s: seconds from start to the last block.
        first_block_s: seconds from start to the first output block.
        peak_held_bytes: the executor's peak count of bytes held in the object store.
        memory_budget: the budget in bytes.
        duplicates_dropped: re-run outputs dropped because their rows were delivered.
        speculative_partitions: partitions launched a second time because the task
            reading them with others straggled (the first copy back is delivered).
        failed_copies: failed copies of speculated partitions whose other copy
            delivered them or still could (a partition fails only when every copy does).
        stall_s: seconds the consumer waited for a ready block.
        stuck_warnings: warnings logged because work in flight waited for resources
            the cluster did not have free.
        slot_blocks: output blocks the consumer read from its shared-memory slots
            instead of the object store (see ``sbloader/executor/handoff.py``).
    """

    operators: list[OperatorStats] = field(default_factory=list)
    wall_s: float = 0.0
    first_block_s: Optional[float] = None
    peak_held_bytes: int = 0
    memory_budget: int = 0
    duplicates_dropped: int = 0
    speculative_partitions: int = 0
    failed_copies: int = 0
    stall_s: float = 0.0
    stuck_warnings: int = 0
    slot_blocks: int = 0

    @property
    def skipped(self) -> int:
        """Rows skipped under ``on_error="skip"`` across operators."""
        return sum(o.skipped for o in self.operators)

    def to_dict(self) -> dict:
        """A JSON-serialisable copy."""
        d = asdict(self)
        d["skipped"] = self.skipped
        return d

    def __str__(self) -> str:
        head = f"{'operator':<40} {'rows':>9} {'blocks':>7} {'MiB':>9} {'tasks':>6} {'task s':>8} {'throttled s':>11} {'skipped':>7}"
        lines = [head, "-" * len(head)]
        for o in self.operators:
            lines.append(
                f"{o.name[:40]:<40} {o.rows:>9} {o.blocks:>7} {o.bytes / 2**20:>9.1f} {o.tasks:>6} "
                f"{o.task_s:>8.2f} {o.throttled_s:>11.2f} {o.skipped:>7}"
            )
        first = f"{self.first_block_s:.3f}s" if self.first_block_s is not None else "n/a"
        lines.append(
            f"wall {self.wall_s:.2f}s, first block {first}, peak held {self.peak_held_bytes / 2**20:.1f} MiB "
            f"of {self.memory_budget / 2**20:.1f} MiB budget, consumer waited {self.stall_s:.2f}s"
        )
        return "\n".join(lines)


@dataclass
class StallStats:
    """Where the consumer's time went during one epoch.

    Attributes:
        wall_s: seconds from the iterator's creation to its end.
        wait_ready_s: seconds the training loop waited for its next batch.
        fetch_s: seconds spent taking ready blocks (``ray.get``) and copying them
            into tensors. The drop-in loader does this in a background thread, a
            few batches ahead, so it overlaps the loop and is not a stall.
        batches: batches yielded.
    """

    wall_s: float = 0.0
    wait_ready_s: float = 0.0
    fetch_s: float = 0.0
    batches: int = 0

    @property
    def stall_fraction(self) -> float:
        """Fraction of the wall time spent waiting for the next batch."""
        return self.wait_ready_s / self.wall_s if self.wall_s > 0 else 0.0

    def __str__(self) -> str:
        return (
            f"{self.batches} batches in {self.wall_s:.2f}s; waiting {self.stall_fraction:.1%} "
            f"({self.wait_ready_s:.2f}s; fetching took {self.fetch_s:.2f}s)"
        )
