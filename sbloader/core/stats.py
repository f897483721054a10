"""Execution statistics: per operator rows, blocks, bytes, task time, throttling."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
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
        full_decodes: images ``sbloader.transforms`` decoded whole because its crop
            decode could not take them (not a JPEG, a file libjpeg-turbo rejects...).
        actors_created: actors launched (actor stages only).
        actors_ready: actors whose class was constructed (a launched actor can be
            stopped at the end of an epoch before it is ready).
        actors_retired: actors the pool let go, idle with no input coming.
        actors_lost: actors that died (their calls ran again on others).
        construction_s: seconds the actors spent constructing the callable class, in all.
        resource_wait_s: seconds the stage's work waited for resources before it ran:
            actors from their launch to their construction, tasks from their launch
            to their start (Ray's scheduling queue).
        pool_limit: (actor stages) the most actors the pool may have: its maximum, or
            the room the other stages' reservations leave.
        counters: named counts the stage's reads reported (remote sources:
            ``cache_hits``, ``cache_misses`` (both shown, zeros included, for a cached source)
            and ``cache_hit_ratio``, ``bytes_read`` from the store, ``cache_bytes`` read from
            the node-local cache, ``retries``, ``not_admitted``).
    """

    name: str
    rows: int = 0
    blocks: int = 0
    bytes: int = 0
    tasks: int = 0
    task_s: float = 0.0
    throttled_s: float = 0.0
    skipped: int = 0
    full_decodes: int = 0
    actors_created: int = 0
    actors_ready: int = 0
    actors_retired: int = 0
    actors_lost: int = 0
    construction_s: float = 0.0
    resource_wait_s: float = 0.0
    pool_limit: int = 0
    counters: dict = field(default_factory=dict)


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
        shuffle_note: set when the epoch did not fit its shuffle window: the share of
            the epoch a batch could draw from and the knob to raise (one line).
        rerun_partitions: partitions run again because the cluster lost their call (a
            node or a pool actor gone; :mod:`sbloader.executor.failures`).
        lost_nodes: the nodes whose loss made partitions run again ("?" where Ray did not say).
        rebuilt_coordinators: times the split coordinator was lost and rebuilt in this epoch.
        local_partitions: partitions made on this machine's local worker processes while
            Ray started (:mod:`sbloader.loaders.native_start`); counted in each operator too.
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
    shuffle_note: str = ""
    rerun_partitions: int = 0
    lost_nodes: list = field(default_factory=list)
    rebuilt_coordinators: int = 0
    local_partitions: int = 0

    @property
    def skipped(self) -> int:
        """Rows skipped under ``on_error="skip"`` across operators."""
        return sum(o.skipped for o in self.operators)

    @property
    def full_decodes(self) -> int:
        """Images decoded whole instead of by crop window, across operators."""
        return sum(o.full_decodes for o in self.operators)

    def to_dict(self) -> dict:
        """A JSON-serialisable copy."""
        d = asdict(self)
        d["skipped"] = self.skipped
        d["full_decodes"] = self.full_decodes
        return d

    def starved(self, least_s: float = 0.5, least_share: float = 0.1) -> Optional[OperatorStats]:
        """The stage whose work waited longest for resources (Ray's queue for a task, the
        launch-to-ready time of an actor), when that wait is at least ``least_s`` seconds,
        ``least_share`` of the wall time, and longer than the stage's work itself (a task
        queued behind its stage's own running tasks, as the executor keeps one, waits
        less than they work); else None."""
        if not self.operators:
            return None
        worst = max(self.operators, key=lambda o: o.resource_wait_s)
        w = worst.resource_wait_s
        if w >= max(least_s, least_share * self.wall_s) and w > worst.task_s:
            return worst
        return None

    def __str__(self) -> str:
        head = (f"{'operator':<40} {'rows':>9} {'blocks':>7} {'MiB':>9} {'tasks':>6} {'task s':>8} "
                f"{'throttled s':>11} {'wait s':>7} {'skipped':>7}")
        lines = [head, "-" * len(head)]
        for o in self.operators:
            lines.append(
                f"{o.name[:40]:<40} {o.rows:>9} {o.blocks:>7} {o.bytes / 2**20:>9.1f} {o.tasks:>6} "
                f"{o.task_s:>8.2f} {o.throttled_s:>11.2f} {o.resource_wait_s:>7.2f} {o.skipped:>7}"
            )
            if o.actors_created:
                built = f", construction {o.construction_s / o.actors_ready:.2f}s each" if o.actors_ready else ""
                lines.append(f"  pool: {o.actors_created} constructed (limit {o.pool_limit}), {o.actors_retired} "
                             f"retired, {o.actors_lost} lost{built}")
            if o.counters:
                lines.append("  reads: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in sorted(o.counters.items())))
        first = f"{self.first_block_s:.3f}s" if self.first_block_s is not None else "n/a"
        lines.append(
            f"wall {self.wall_s:.2f}s, first block {first}, peak held {self.peak_held_bytes / 2**20:.1f} MiB "
            f"of {self.memory_budget / 2**20:.1f} MiB budget, consumer waited {self.stall_s:.2f}s"
        )
        if self.full_decodes:
            lines.append(f"{self.full_decodes} image(s) decoded whole: the crop decode could not take them "
                         "(not JPEG, or rejected by libjpeg-turbo; see sbloader/sources/jpeg_window.py)")
        if self.shuffle_note:
            lines.append(self.shuffle_note)
        if self.lost_nodes or self.rerun_partitions or self.rebuilt_coordinators:
            lines.append(failures_line(self.lost_nodes, self.rerun_partitions, self.rebuilt_coordinators))
        starved = self.starved()
        if starved is not None:
            lines.append(f"starved: {starved.name} waited {starved.resource_wait_s:.2f}s before its work ran (Ray "
                         "starting workers, or CPUs/GPUs held by other stages or jobs); if it recurs after the "
                         "first epoch, lower the other pools' sizes or num_cpus, or give Ray more nodes")
        return "\n".join(lines)


_PEAKS = ("peak_held_bytes", "memory_budget")  # the largest of the parts, not their sum
_LISTS = ("lost_nodes",)


def combined(parts: list[ExecutionStats]) -> ExecutionStats:
    """The statistics of executions run one after another as one (an ``IterableDataset`` epoch's
    rounds of segments): counts and seconds summed, peaks the largest, the first block the first
    part's, each operator matched by its place in the pipeline."""
    from sbloader.core.context import merge_counters

    if len(parts) == 1:
        return parts[0]
    out = ExecutionStats()
    for part in parts:
        for f in fields(ExecutionStats):
            mine, theirs = getattr(out, f.name), getattr(part, f.name)
            if f.name == "operators":
                continue
            if f.name in _PEAKS:
                setattr(out, f.name, max(mine, theirs))
            elif f.name in _LISTS:
                mine.extend(x for x in theirs if x not in mine)
            elif f.name == "first_block_s":
                setattr(out, f.name, mine if mine is not None else theirs)
            elif f.name == "shuffle_note":
                setattr(out, f.name, mine or theirs)
            else:
                setattr(out, f.name, mine + theirs)
        for i, op in enumerate(part.operators):
            if i == len(out.operators):
                out.operators.append(OperatorStats(op.name))
            into = out.operators[i]
            for f in fields(OperatorStats):
                if f.name == "name":
                    continue
                if f.name == "counters":
                    merge_counters(into.counters, op.counters)
                elif f.name == "pool_limit":
                    into.pool_limit = max(into.pool_limit, op.pool_limit)
                else:
                    setattr(into, f.name, getattr(into, f.name) + getattr(op, f.name))
    return out


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
        failures: what the cluster lost during the epoch and what was done about it
            (lost nodes, partitions re-run, coordinators rebuilt); empty when nothing.
    """

    wall_s: float = 0.0
    wait_ready_s: float = 0.0
    fetch_s: float = 0.0
    batches: int = 0
    failures: str = ""

    @property
    def stall_fraction(self) -> float:
        """Fraction of the wall time spent waiting for the next batch."""
        return self.wait_ready_s / self.wall_s if self.wall_s > 0 else 0.0

    def __str__(self) -> str:
        return (
            f"{self.batches} batches in {self.wall_s:.2f}s; waiting {self.stall_fraction:.1%} "
            f"({self.wait_ready_s:.2f}s; fetching took {self.fetch_s:.2f}s)"
            + (f"; {self.failures}" if self.failures else "")
        )

    def note_failures(self, stats: Optional[ExecutionStats], rebuilt: int = 0) -> None:
        """Name in the report what the execution lost (``stats``) and the coordinators rebuilt."""
        nodes = list(stats.lost_nodes) if stats is not None else []
        reruns = stats.rerun_partitions if stats is not None else 0
        if nodes or reruns or rebuilt:
            self.failures = failures_line(nodes, reruns, rebuilt)


def failures_line(lost_nodes: list, reruns: int, rebuilt: int) -> str:
    """One line: the nodes lost, the partitions re-run, the coordinators rebuilt."""
    return (f"failures: lost node(s) {', '.join(n[:12] for n in lost_nodes) or 'none'}; "
            f"{reruns} partition(s) re-run elsewhere; {rebuilt} coordinator(s) rebuilt")
