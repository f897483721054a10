"""The rebuild of an epoch after its split coordinator died: the protocol's coordinator side.

A coordinator owns every block of the epochs it runs, so when it dies (its node,
or its process, was lost) the blocks it handed out that no rank fetched go with
it. The ranks then find or create its successor and report what their training
loops took; once every rank has reported, the successor plans the rest again, each
rank owed exactly what it still lacks of its count (``dropin_client.rebuild_epoch``
is the rank side). :class:`RebuildProtocol` is a base of
:class:`~sbloader.distributed.coordinator.SplitCoordinator` and uses its state
(``_lock``, ``_started``, ``_epochs``, ``_rebuilds``, ``_rebuilt``...).

A native pipeline's epoch split across ranks (:class:`~sbloader.distributed.specs.PartitionEpochSpec`)
is rebuilt the same way (``pipeline_client`` is its rank side): each rank reports how
many of its own batches it has cut; the partitions a rank still needs run again (a
partition replays bit for bit) and each rank goes on cutting from where it was.

A block whose fetch by its ref does not end is read by its owner, the coordinator, and sent by
value (:meth:`RebuildProtocol.read_block`). A block lost while its coordinator lives (made on a node
that died before a rank fetched it) is made again from its provenance instead: :meth:`RebuildProtocol.remake`
(a batch of a map-style epoch), :meth:`RebuildProtocol.remake_block` (a worker shard's
block of an ``IterableDataset``'s epoch).
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Optional

from sbloader.core.cut import progress
from sbloader.core.errors import SbloaderError
from sbloader.core.plan import EpochPlan
from sbloader.distributed.epoch import Epoch
from sbloader.distributed.partition_epoch import PartitionEpoch
from sbloader.distributed.specs import EpochSpec, PartitionEpochSpec
from sbloader.distributed.stream_epoch import StreamEpoch


class RebuildProtocol:
    """The coordinator's side of the rebuild (a mixin of the coordinator actor)."""

    _lock: Any
    _started: Any
    _epochs: dict
    _rebuilds: dict
    _rebuilt: set

    def rebuild(self, epoch: int, rank: int, taken: list, spec: Optional[EpochSpec], timeout: float = 120.0,
                wait: bool = True) -> Optional[int]:
        """Rebuild an epoch after the previous coordinator died, from the ranks' own logs.

        Every rank reports the batches its training loop took (their bytes reached
        it; the rest died with the old coordinator, which owned them) and the
        epoch's spec (only rank 0's counts; the others may send None). For a native
        pipeline's epoch (a :class:`PartitionEpochSpec`) ``taken`` is the rank's own
        batches it has cut, ``0 .. n-1``: it goes on from batch ``n``. Once all ranks reported, the
        batches nobody took are planned again, each rank owed exactly what it
        still lacks of its count, and the ranks continue.

        A rank that had already finished the epoch when the coordinator died
        notices only at its next epoch; it reports with ``wait=False`` (all its
        batches taken) so the ranks still in the epoch can go on.

        Returns:
            The per-rank batch count of the epoch (None with ``wait=False``).

        Raises:
            SbloaderError: not every rank reported within ``timeout`` seconds.
        """
        self._last_call = time.monotonic()
        deadline = time.monotonic() + timeout
        with self._lock:
            if epoch in self._epochs and epoch not in self._rebuilds and epoch not in self._rebuilt:
                # this coordinator runs the epoch: it did not die (the rank only lost touch with
                # it for a while); nothing to rebuild, and no report left pending forever
                return self._epochs[epoch].spec.per_rank if wait else None
            if epoch in self._rebuilt:  # a late report: the epoch was rebuilt (and maybe finished)
                ep = self._epochs.get(epoch)
                return ep.spec.per_rank if ep is not None and wait else None
            pend = self._rebuilds.setdefault(epoch, {"taken": {}, "spec": None})
            pend["taken"][rank] = list(taken)
            if rank == 0:
                # Rank 0 started the epoch: the batch indices every rank reports are
                # positions in *its* plan. Another rank's sampler may have drawn
                # another order (an unseeded shuffle), so only rank 0's spec counts.
                pend["spec"] = spec
            self._started.notify_all()
            if not wait:
                if epoch not in self._epochs and len(pend["taken"]) == self._world_size:
                    self._start_rebuilt(epoch, pend["spec"], pend["taken"])
                return None
            while epoch not in self._epochs:
                if len(pend["taken"]) == self._world_size:
                    self._start_rebuilt(epoch, pend["spec"], pend["taken"])
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(self._world_size)) - set(pend["taken"]))
                    raise SbloaderError(
                        f"rebuilding epoch {epoch} after the coordinator died: rank(s) {missing} did not report "
                        f"within {timeout:.0f} s (finished or dead?); restart the job from the last checkpoint"
                    )
                self._started.wait(timeout=remaining)
            return self._epochs[epoch].spec.per_rank

    def _start_rebuilt(self, epoch: int, spec: EpochSpec, taken: dict) -> None:
        """Start the part of ``spec`` that no rank took (called with the lock held)."""
        self._rebuilds.pop(epoch, None)
        self._rebuilt.add(epoch)
        if isinstance(spec, PartitionEpochSpec):
            self._start_rebuilt_partitions(epoch, spec, taken)
            return
        done = {b for batches in taken.values() for b in batches}
        keep = [i for i in range(len(spec.plan.order)) if i not in done]
        plan = EpochPlan(spec.plan.epoch, spec.plan.epoch_seed, tuple(spec.plan.order[i] for i in keep),
                         spec.plan.shuffle)
        assignment = tuple(spec.assignment[i] for i in keep) if spec.assignment is not None else None
        rebuilt = replace(spec, source=spec.source.subset(keep), plan=plan, assignment=assignment,
                          batch_index=tuple(keep))
        ep = Epoch(rebuilt, self._world_size, self._actor_cache, self._estimates,
                    earlier=tuple(self._epochs.values()), taken=taken, ledger=self._ledger)
        self._epochs[epoch] = ep
        ep.start()
        self._started.notify_all()

    def _start_rebuilt_partitions(self, epoch: int, spec: PartitionEpochSpec, taken: dict) -> None:
        """(Lock held) Run again the partitions of a native split epoch some rank still needs.

        Rank ``r`` has cut its first ``len(taken[r])`` batches; every later batch of every
        rank has a cut index of at least :func:`~sbloader.core.cut.progress` of those
        counts, so the partitions whose last use is below it are needed by no rank (the
        blocks a rank already fetched stay in its process). A rank that had cut all its
        batches counts as having left the epoch.
        """
        cut = [len(taken.get(r, ())) for r in range(self._world_size)]
        passed = progress(cut)
        keep = tuple(pid for pid in spec.plan.order if spec.last_use.get(pid, -1) >= passed)
        plan = EpochPlan(spec.plan.epoch, spec.plan.epoch_seed, keep, spec.plan.shuffle)
        ep = PartitionEpoch(replace(spec, plan=plan), self._world_size, self._actor_cache, self._estimates,
                            earlier=tuple(self._epochs.values()))
        for r, n in enumerate(cut):
            if n >= spec.per_rank:
                ep.logs[r].left = ep.logs[r].asked = True
                ep.consumed[r] = spec.per_rank
        self._epochs[epoch] = ep
        ep.start()
        self._started.notify_all()

    def read_block(self, refs: list, timeout_s: float = 30.0) -> Any:
        """The block of ``refs[0]`` (a ref in a list: not resolved on the way in), read here, where it is
        owned, and returned by value: for a rank whose fetch of it by its ref did not end.

        Raises:
            ray.exceptions.GetTimeoutError: not readable here either within ``timeout_s``.
        """
        import ray

        self._last_call = time.monotonic()
        return ray.get(refs[0], timeout=timeout_s)

    def remake(self, epoch: int, index: int) -> Any:
        """Make batch ``index`` of a drop-in epoch again: its block was lost with the node that
        made it (``ObjectLostError`` at the rank) before the rank fetched it.

        The batch's partition runs again on an actor of its own (:func:`make_again`); the
        block ref is returned (this coordinator owns it, as every block of the epoch).

        Raises:
            SbloaderError: the epoch is not running here, or has no such batch.
        """
        self._last_call = time.monotonic()
        ep = self._epochs.get(epoch)
        spec = getattr(ep, "spec", None)
        seqs = [q for q in range(len(spec.plan.order)) if spec.index_of(q) == index] if spec is not None else []
        if not seqs or not hasattr(spec, "assignment"):
            raise SbloaderError(f"batch {index} of epoch {epoch} cannot be made again: that epoch is not running "
                                f"on this coordinator (known: {sorted(self._epochs)})")
        return make_again(ep, seqs[0], spec.plan.order[seqs[0]])

    def remake_block(self, epoch: int, ref_hex: str) -> Any:
        """(An ``IterableDataset``'s epoch, or a native pipeline's split epoch) The block ``ref_hex`` (an
        object ref's hex) made again: it was lost with the node (or the pool actor) that made it
        before a rank fetched it. Its worker shard, or its partition through every stage, runs again
        (:func:`make_again`) once for every rank that asks; the new ref replaces the lost one in
        what the ranks take next (:meth:`StreamEpoch.remake <sbloader.distributed.stream_epoch.StreamEpoch.remake>`,
        :meth:`PartitionEpoch.remake <sbloader.distributed.partition_epoch.PartitionEpoch.remake>`).

        Raises:
            SbloaderError: the epoch is not running here, or made no such block.
        """
        self._last_call = time.monotonic()
        ep = self._epochs.get(epoch)
        if isinstance(ep, PartitionEpoch):  # a native pipeline's block: its partition through every stage again
            return ep.remake(ref_hex, lambda seq, pid: make_again(ep, seq, pid))
        if not isinstance(ep, StreamEpoch):
            raise SbloaderError(f"block {ref_hex} of epoch {epoch} cannot be made again: that epoch of an "
                                f"IterableDataset is not running on this coordinator (known: {sorted(self._epochs)})")
        return ep.remake(ref_hex, lambda seq, pid, source: make_again(ep, seq, pid, source))


def make_again(ep: Epoch, seq: int, pid: int, source: Any = None) -> Any:
    """Partition ``pid`` (at ``seq`` in the epoch's plan) run again through every stage of the
    epoch's pipeline (:func:`~sbloader.executor.remake.remake`): its block ref (the drop-in's one
    reading stage, or a native pipeline's read, functions and callable classes, in order), owned by
    the caller, the coordinator. ``source``: where the partition is (a segment of a stream's round);
    None: the epoch's source.
    """
    from sbloader.executor.failures import shared_arg
    from sbloader.executor.remake import remake
    from sbloader.executor.stages import build_stages
    from sbloader.executor.tasks import EpochInfo

    spec = ep.spec
    source = spec.source if source is None else source
    part = next(p for p in source.partitions(spec.epoch, spec.plan.epoch_seed, shuffle=spec.plan.shuffle)
                if p.id == pid)
    info = EpochInfo(spec.epoch, spec.plan.epoch_seed, spec.plan.shuffle)
    block = remake(build_stages(source.name, list(spec.ops)), spec.options, info,
                   shared_arg((source.reader(), source.shared())), part, seq)
    if ep.executor is not None:  # (a stream's rounds: the round running now, counted in the epoch's)
        getattr(ep.executor, "current_stats", ep.executor.stats)().rerun_partitions += 1
    return block
