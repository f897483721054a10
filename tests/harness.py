"""The one resume harness: save the state at every step of a small epoch and resume from each.

Modelled on torchdata's ``run_test_save_load_state``. For every stateful piece (the
drop-in loader in this process, on a worker pool, split across ranks; the native
loader in one process and split across ranks) :func:`check_resume_everywhere`
runs one uninterrupted epoch, then for every step ``k`` of it: a fresh loader per
rank takes its first ``k`` batches, rank 0's ``state_dict()`` goes through JSON,
and fresh loaders (of the same or another world size) load it and run the rest.
With ``states_in_one_run`` the uninterrupted epoch's rank 0 saves its state at every
step instead, every rank waiting meanwhile: the same states as those runs cut at each
step (key for key, for the drop-in and the native loader, local starts included), in
one run instead of one per step.
The ids the first part took plus every id of the rest must be the epoch, each
exactly once; with ``same_order`` (a deterministic loader, the same world size) the
resumed run must repeat the uninterrupted one batch for batch. A state taken after
the epoch's last batch resumes either the next epoch, whole (the native loader), or, with
``end_state="empty"`` (the drop-in, as torchdata's StatefulDataLoader), an empty remainder
of that epoch and then the next epoch, whole.

Ranks run in threads of this process (rank/world_size given to the loader), on the
test session's Ray.
"""
from __future__ import annotations

import itertools
import json
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

MakeLoader = Callable[[int, int, str], Any]  # (rank, world_size, name) -> a loader
_NAMES = itertools.count()


@dataclass
class Taken:
    """What one rank's loop took: each batch's ids (padding left out)."""

    batches: list

    @property
    def ids(self) -> list:
        return [i for b in self.batches for i in b]


class IdsLoader:
    """A drop-in loader whose batches (tensors of ids) read as ``{"id": ...}``."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Any:
        return ({"id": b.numpy()} for b in self.loader)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


def ids_of(batch: Any, key: str) -> list:
    """The ids of a batch's real rows (rows marked ``sbloader_padding`` left out)."""
    ids = np.asarray(batch[key]).reshape(-1)
    pad = batch.get("sbloader_padding") if isinstance(batch, dict) else None
    if pad is not None:
        ids = ids[~np.asarray(pad).astype(bool)]
    return [int(i) for i in ids]


def in_rank_threads(rank_loop: Callable[[int], None], world_size: int, timeout: float = 240.0) -> None:
    """``rank_loop(rank)`` for every rank, each in a thread; the first rank's error raised here, and a
    rank still running after ``timeout`` seconds is a failure."""
    errors: list = []

    def guarded(rank: int) -> None:
        try:
            rank_loop(rank)
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"rank(s) {hung} hung past {timeout:.0f} s; where this process's threads are:\n{thread_stacks()}"


def thread_stacks(frames: int = 12) -> str:
    """Where each thread of this process that runs sbloader's (or a test's) code is: the innermost
    ``frames`` frames of each, for the failure message of a hang."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        stack = traceback.extract_stack(frame)
        if not any("sbloader" in f.filename or "/tests/" in f.filename for f in stack):
            continue
        out.append(f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_list(stack[-frames:])))
    return "\n".join(out)


def run_ranks(make: MakeLoader, world_size: int, name: str, key: str, take: Optional[int] = None,
              state: Optional[dict] = None, timeout: float = 240.0, then_next: bool = False,
              save_at: Any = None) -> tuple[list[Taken], Any]:
    """Every rank's loader in a thread: load ``state`` if given, take ``take`` batches (None: the
    epoch; with ``then_next``, the epoch and then the next one, which must come after an empty
    first). Returns what each rank took and rank 0's state after it (JSON round-tripped).

    ``save_at``: steps (batches every rank has taken: a list, or ``"every"`` step) at which
    rank 0 saves its state during the epoch while every other rank waits, as after a run cut
    at that step; the epoch then goes on. The state returned is ``{step: state}``.
    """
    out: list = [None] * world_size
    saved: list = [None] if save_at is None else [{}]
    errors: list = []
    at: list = [None] * world_size  # where each rank waits: a step of save_at, or "end"

    def same_place() -> None:
        assert len(set(at)) == 1, f"{name}: the ranks met at different steps {at} (different batch counts)"

    barrier = threading.Barrier(world_size, action=same_place)

    def save(rank: int, loader: Any, step: Any) -> None:
        """At ``step``: every rank waits while rank 0 saves its state (JSON round-tripped); at
        ``"end"`` every rank waits for the others' last batch."""
        if step != "end" and save_at != "every" and step not in save_at:
            return
        at[rank] = step
        try:
            barrier.wait(timeout)
            if rank == 0 and step != "end":
                saved[0][step] = json.loads(json.dumps(loader.state_dict()))
            barrier.wait(timeout)
        except threading.BrokenBarrierError as e:  # a rank failed, or stopped at another step
            raise AssertionError(f"{name}: rank {rank} at step {step}: another rank failed or never reached it") from e

    def rank_loop(rank: int) -> None:
        try:
            loader = make(rank, world_size, name)
            if state is not None:
                loader.load_state_dict(json.loads(json.dumps(state)))
            it = iter(loader)
            if save_at is not None:
                batches: list = []
                save(rank, loader, 0)
                for batch in it:
                    batches.append(ids_of(batch, key))
                    save(rank, loader, len(batches))
                save(rank, loader, "end")
                out[rank] = Taken(batches)
                return
            batches = [ids_of(batch, key) for batch in (itertools.islice(it, take) if take is not None else it)]
            if then_next:
                assert not batches, f"rank {rank}: a state taken after the epoch's last batch resumed {len(batches)} batch(es), not an empty remainder"
                batches = [ids_of(batch, key) for batch in loader]
            barrier.wait(timeout)  # every rank took its k batches: rank 0 checkpoints now
            if rank == 0 and take is not None:
                saved[0] = json.loads(json.dumps(loader.state_dict()))
            barrier.wait(timeout)
            out[rank] = Taken(batches)
            del it
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):  # where each hung rank waits, for the failure's report
        import faulthandler
        import sys

        print(f"--- {name}: a rank is still running after {timeout} s; every thread's stack:", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    free_coordinators(name)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), f"a rank hung ({name})"
    return out, saved[0]


def free_coordinators(name: str) -> None:
    """Shut down and kill the split coordinators of loaders called ``name`` (each run of the
    harness is a job of its own: its pool must not hold CPUs the next run needs)."""
    import ray

    from sbloader.distributed.naming import NAMESPACE

    for entry in ray.util.list_named_actors(all_namespaces=True):
        if not entry["namespace"].startswith(NAMESPACE) or not entry["name"].endswith(f":{name}"):
            continue
        try:
            handle = ray.get_actor(entry["name"], namespace=entry["namespace"])
            ray.get(handle.shutdown.remote(), timeout=10)
            ray.kill(handle)
        except Exception:  # gone already
            pass


def check_resume_everywhere(make: MakeLoader, epoch_ids: list, *, key: str = "id", world_size: int = 1,
                            resume_world_sizes: tuple = (), same_order: bool = False,
                            steps: Optional[list] = None, end_state: str = "next",
                            rotate_sizes: bool = False, states_in_one_run: bool = False) -> None:
    """Save at every step of an epoch and resume from each; see the module's docstring.

    Args:
        make: builds a loader for ``(rank, world_size, name)``.
        epoch_ids: the ids one epoch yields (each once).
        key: the batch column (or key) holding the ids.
        world_size: ranks of the interrupted run.
        resume_world_sizes: other world sizes to resume onto as well.
        same_order: the resumed run (same world size) repeats the uninterrupted one.
        steps: the steps to save at (default: every step, 0 and the last included).
        end_state: what a state taken after the epoch's last batch resumes: ``"next"`` (the
            next epoch) or ``"empty"`` (an empty remainder, then the next epoch).
        rotate_sizes: resume each step onto one of ``resume_world_sizes`` in turn (step ``i`` of
            ``steps`` onto the ``i``-th, round robin) instead of onto each: every step still
            changes the world size and every size is still resumed onto, in fewer runs (each run
            is a job: a coordinator and its pool).
        states_in_one_run: take every step's state from the uninterrupted epoch (rank 0 saves it
            at each step while every rank waits) instead of from a run of its own cut at that
            step: the same states, every one from fresh loaders' first epoch on a fresh
            coordinator, in one job instead of one per step.
    """
    base = f"resume{next(_NAMES)}"
    save_at = (list(steps) if steps is not None else "every") if states_in_one_run else None
    whole, states = run_ranks(make, world_size, f"{base}-whole", key, save_at=save_at)
    per_rank = len(whole[0].batches)
    assert all(len(t.batches) == per_rank for t in whole), "ranks got different batch counts"
    assert sorted(i for t in whole for i in t.ids) == sorted(epoch_ids)
    for n, k in enumerate(steps if steps is not None else range(per_rank + 1)):
        if states_in_one_run:  # every rank's first k batches of the epoch, and rank 0's state then
            assert k in states, f"no step {k}: the epoch has {per_rank} batches per rank"
            head, state = [Taken(t.batches[:k]) for t in whole], states[k]
        else:
            head, state = run_ranks(make, world_size, f"{base}-head{k}", key, take=k)
        taken = [i for t in head for i in t.ids]
        others = tuple(resume_world_sizes)
        if rotate_sizes and others:
            others = (others[n % len(others)],)
        for ws in (world_size,) + others:
            rest, _ = run_ranks(make, ws, f"{base}-rest{k}-{ws}", key, state=state,
                                then_next=k == per_rank and end_state == "empty")
            if k == per_rank:  # a state taken after the epoch's last batch starts the next epoch
                assert sorted(taken) == sorted(epoch_ids)
                assert sorted(i for t in rest for i in t.ids) == sorted(epoch_ids), f"{ws} rank(s): next epoch"
                continue
            got = taken + [i for t in rest for i in t.ids]
            assert sorted(got) == sorted(epoch_ids), (
                f"resumed at step {k} onto {ws} rank(s): lost {sorted(set(epoch_ids) - set(got))}, "
                f"twice {sorted(i for i in set(got) if got.count(i) > 1)}")
            if same_order and ws == world_size:
                for r in range(ws):
                    assert head[r].batches + rest[r].batches == whole[r].batches, \
                        f"rank {r} resumed at step {k} did not repeat the uninterrupted run"


class Tagged:
    """A map-style dataset: ``dataset[i]`` -> a tensor (i, a draw of torch's RNG, the worker's pid, its
    worker id, its parent's pid: the trainer's for a local worker, a raylet's for a pool actor)."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import os

        import torch
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        assert info is None or info.dataset is self  # torch's worker info names the user's dataset
        return torch.tensor([i, int(torch.randint(0, 2**30, ())), os.getpid(), info.id if info else -1,
                             os.getppid()])


class CountsIterCalls:
    """Mixin of an ``IterableDataset`` whose state does not say where its shard stands, as torchdata's
    ``CountIterCalls``: ``state_dict`` counts ``__iter__`` calls, ``load_state_dict`` keeps nothing. First
    in the bases, before the dataset that yields: ``class CountsOnly(CountsIterCalls, Shards)``."""

    iter_calls = 0

    def __iter__(self):
        self.iter_calls += 1
        return super().__iter__()

    def state_dict(self) -> dict:
        return {"iter_calls": self.iter_calls}

    def load_state_dict(self, state: dict) -> None:
        pass


def each_source_epoch_once(ids: list, n: int, offset: int = 0) -> None:
    """A mixture's source's ids in the order the job read them (``offset`` .. ``offset + n``): every
    consecutive run of ``n`` is one whole epoch of it, the last (short) one without repeats."""
    for lo in range(0, len(ids), n):
        chunk = ids[lo:lo + n]
        assert len(set(chunk)) == len(chunk), f"source at {offset}: a sample twice in one epoch"
        if len(chunk) == n:
            assert sorted(chunk) == list(range(offset, offset + n)), f"source at {offset}: lost samples"


_LOCAL_CALLS: list = []  # in a local worker: the calls of stall_locally_at so far


def stall_locally_at(n: int) -> None:
    """At its ``n``-th call in a local worker forked by the test's process (``STUCK_PARENT``: that pid), wait for
    good using no CPU (a lock the fork left held); elsewhere (the test's process, Ray's workers) return."""
    import os

    if os.environ.get("STUCK_PARENT") == str(os.getppid()):
        _LOCAL_CALLS.append(1)
        if len(_LOCAL_CALLS) == n:
            threading.Event().wait()
