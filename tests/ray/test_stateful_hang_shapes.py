"""The shapes of torchdata's test file that once hung or resumed wrong under the drop-in (issue #45),
each as its own test under a 120 s alarm (a hang fails, it never stalls the suite):

- an ``IterableDataset`` whose own state positions a generator, with 3 workers, persistent or not,
  a snapshot every 1 or 5 steps (torchdata's ``TestStatefulDataLoaderGenerator``: ``test_mp_pw``,
  ``test_mp_every_n_steps``);
- a state asked for right after a resume, before every worker made a batch, with 4 persistent
  workers dealing one sample each (``TestFastStateDictRequestRoundRobin``);
- a dataset that sets up its position in ``__iter__``, with 2 workers (``TestStateInitializationDataset``);
- an error raised by a ``state_dict()`` call (a dataset's in a worker, a sampler's in the trainer)
  reaches the loop as an exception within seconds with 0, 2 and 4 workers.

Everything the workers use is defined at module level (conftest puts tests/ on their path).
"""
from __future__ import annotations

import gc
import time

import pytest
from test_stateful_contract import StatefulGenerator, bounded
from test_torchdata_crossover import SetsUpInIter
from torch.utils.data import IterableDataset, Sampler

import sbloader


def ident(x):
    return x


def generator_loader(pw: bool, every: int):
    return sbloader.DataLoader(StatefulGenerator([0, 100, 37]), num_workers=3, collate_fn=ident,
                               snapshot_every_n_steps=every, persistent_workers=pw)


@pytest.mark.parametrize("pw,every", [(False, 1), (True, 5)])
def test_a_dataset_positioned_generator_resumes_to_the_uninterrupted_epoch(ray_session, pw, every):
    with bounded():
        whole = list(generator_loader(pw, every))
        assert sorted(batch[0][0] for batch in whole) == list(range(137))  # batches of one (x, epoch)
        for interrupt in (0, 1, 10):
            it = iter(dl := generator_loader(pw, every))
            got = [next(it) for _ in range(interrupt)]
            state = dl.state_dict()
            assert got == whole[:interrupt]
            del it, dl  # the resume takes the interrupted loader's actors (a resume in a new process starts its own)
            again = generator_loader(pw, every)
            again.load_state_dict(state)
            assert got + list(again) == whole, interrupt
            del again  # let go before the next interrupted loader is built, which takes its actors


class Alternating(IterableDataset):
    """Each step flips one of four bits and yields it (torchdata's PeriodicStateIterableDataset):
    a resume that restores a worker's state at the wrong step yields other bits."""

    def __init__(self):
        self.state, self.step, self.limit = {0: 0, 1: 0, 2: 0, 3: 0}, 0, 100

    def __iter__(self):
        for _ in range(self.step, self.limit):
            self.step += 1
            k = self.step % len(self.state)
            self.state[k] = 1 - self.state[k]
            yield self.state[k]

    def state_dict(self):
        return {"state": dict(self.state), "step": self.step}

    def load_state_dict(self, state):
        self.state, self.step = {int(k): v for k, v in state["state"].items()}, state["step"]


def alternating_loader():
    return sbloader.DataLoader(Alternating(), num_workers=4, batch_size=1, collate_fn=ident,
                               persistent_workers=True)


def test_a_state_asked_for_before_every_worker_made_a_batch_resumes_exactly(ray_session):
    """Taken 2 batches into a resumed epoch of 4 workers: the workers that made no batch yet
    keep the state the resume gave them."""
    with bounded():
        it = iter(dl := alternating_loader())
        for _ in range(15):
            next(it)
        state = dl.state_dict()
        after_two = [next(it), next(it)]
        rest = list(it)
        dl.load_state_dict(state)
        it = iter(dl)
        assert [next(it), next(it)] == after_two
        early = dl.state_dict()
        del it, dl  # its 4 persistent actors go back: the resumed loader's 4 need not find all 8 CPUs free
        gc.collect()
        resumed = alternating_loader()
        resumed.load_state_dict(early)
        assert list(resumed) == rest


def test_a_dataset_set_up_in_iter_resumes_with_two_workers(ray_session):
    with bounded():
        it = iter(dl := sbloader.DataLoader(SetsUpInIter(100), num_workers=2, collate_fn=ident))
        data = [x for _ in range(70) for x in next(it)]
        state = dl.state_dict()
        del it, dl  # the resume takes the interrupted loader's actors
        again = sbloader.DataLoader(SetsUpInIter(100), num_workers=2, collate_fn=ident)
        again.load_state_dict(state)
        it2 = iter(again)
        data += [x for _ in range(30) for x in next(it2)]
        assert sorted(data) == list(range(100))


class StateBreaks(IterableDataset):
    def __iter__(self):
        return iter(range(20))

    def state_dict(self):
        raise RuntimeError("dataset state broke")

    def load_state_dict(self, state):
        pass


class SamplerStateBreaks(Sampler):
    def __len__(self):
        return 20

    def __iter__(self):
        return iter(range(20))

    def state_dict(self):
        raise RuntimeError("sampler state broke")

    def load_state_dict(self, state):
        pass


def take_a_batch_and_the_state(dl) -> None:
    it = iter(dl)
    next(it)
    dl.state_dict()
    list(it)


@pytest.mark.parametrize("num_workers", [0, 2, 4])
def test_an_error_in_a_state_dict_call_reaches_the_loop_within_seconds(ray_session, num_workers):
    """A dataset's ``state_dict()`` runs where the dataset runs (a worker's error comes with the
    worker's traceback, as torch's); a sampler's runs in the trainer, where snapshots are taken
    (from ``next()`` or ``state_dict()``, whichever asks first)."""
    with bounded():
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="dataset state broke"):
            take_a_batch_and_the_state(sbloader.DataLoader(StateBreaks(), batch_size=2, num_workers=num_workers))
        with pytest.raises(RuntimeError, match="sampler state broke"):
            take_a_batch_and_the_state(sbloader.DataLoader(list(range(20)), batch_size=2, sampler=SamplerStateBreaks(),
                                                           num_workers=num_workers))
        assert time.monotonic() - t0 < 30, "the errors took more than seconds"
        assert len(list(sbloader.DataLoader(list(range(20)), batch_size=2, num_workers=num_workers))) == 10
