"""A mixture through the drop-in (``sbloader.DataLoader(sbloader.mix({...torch datasets...}), ...)``,
sbloader/loaders/mix_dropin.py): torch batches (``default_collate``) drawn at the weights, each
source's epoch once, resumed exactly, deterministic for a seed across ``num_workers``, reweighted,
arguments that cannot apply refused."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.utils.data

import sbloader

SIZES = {"a": 120, "b": 60, "c": 30}
OFFSETS = {"a": 0, "b": 100_000, "c": 200_000}
WEIGHTS = {"a": 0.6, "b": 0.3, "c": 0.1}


class MapStyle(torch.utils.data.Dataset):
    """Samples ``(features, id)`` as torch users write them."""

    def __init__(self, n: int, offset: int) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple:
        return torch.full((3,), float(self.offset + i)), self.offset + i


class Stream(torch.utils.data.IterableDataset):
    """The same samples from an IterableDataset, sharded across torch workers."""

    def __init__(self, n: int, offset: int) -> None:
        self.n, self.offset = n, offset

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, self.n, nw):
            yield torch.full((3,), float(self.offset + i)), self.offset + i


def _source_of(i: int) -> str:
    return "c" if i >= 200_000 else "b" if i >= 100_000 else "a"


def _loader(num_workers: int = 0, num_samples: int = 600, seed: int = 0, **kw):
    mixed = sbloader.mix({"a": MapStyle(SIZES["a"], 0), "b": MapStyle(SIZES["b"], 100_000),
                          "c": Stream(SIZES["c"], 200_000)}, weights=WEIGHTS, seed=seed)
    return sbloader.DataLoader(mixed, batch_size=16, shuffle=True, num_workers=num_workers,
                               num_samples=num_samples, **kw)


def _ids(batches) -> list:
    return [i for b in batches for i in b]


def _take(it, k: int) -> list:
    out = []
    for _ in range(k):
        x, ids = next(it)
        out.append(ids.tolist())
    return out


def _all(loader) -> list:
    out = []
    for x, ids in loader:
        assert isinstance(x, torch.Tensor) and isinstance(ids, torch.Tensor)  # default_collate's batches
        assert x.shape == (len(ids), 3) and torch.equal(x[:, 0], ids.float())
        out.append(ids.tolist())
    return out


def _epochs_once(ids: list, name: str) -> None:
    n, offset = SIZES[name], OFFSETS[name]
    from harness import each_source_epoch_once

    each_source_epoch_once([i for i in ids if _source_of(i) == name], n, offset)


def test_torch_batches_at_the_weights_each_source_epoch_once(ray_session):
    loader = _loader(num_workers=2, num_samples=3000)
    assert type(loader).__name__ == "MixDataLoader" and isinstance(loader, sbloader.DataLoader)
    assert len(loader) == math.ceil(3000 / 16)
    batches = _all(loader)
    assert len(batches) == len(loader)
    ids = _ids(batches)
    assert len(ids) == 3000
    for name, w in WEIGHTS.items():
        count = sum(_source_of(i) == name for i in ids)
        assert abs(count - 3000 * w) <= 4.5 * math.sqrt(3000 * w * (1 - w)), (name, count)
        _epochs_once(ids, name)
    assert loader.stats().sources["c"].epoch >= 3  # the stream restarted, each pass whole


def test_deterministic_for_a_seed_across_num_workers(ray_session):
    runs = {w: _ids(_all(_loader(num_workers=w))) for w in (0, 2)}
    # which source each sample comes from is the schedule's, and a map-style source's order is its seed's
    assert [_source_of(i) for i in runs[0]] == [_source_of(i) for i in runs[2]]
    for name in ("a", "b"):
        assert [i for i in runs[0] if _source_of(i) == name] == [i for i in runs[2] if _source_of(i) == name]
    # an IterableDataset's order is its workers' sharding (as torch's): each pass holds the same samples
    for run in runs.values():
        _epochs_once(run, "c")
    other = _ids(_all(_loader(num_workers=0, seed=1)))
    assert other != runs[0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_at_a_few_steps_repeats_the_uninterrupted_run(ray_session, num_workers):
    """Each step's state is taken during the uninterrupted run (the same state, key for key, as a run
    cut and closed at that step: compared at these steps for 0 and 2 workers when this replaced those
    runs), then a fresh loader resumes it."""
    loader = _loader(num_workers)
    steps = (1, 6, 23, len(loader) - 1)
    whole, states = [], {}
    for x, ids in loader:
        assert isinstance(x, torch.Tensor) and isinstance(ids, torch.Tensor)  # default_collate's batches
        assert x.shape == (len(ids), 3) and torch.equal(x[:, 0], ids.float())
        whole.append(ids.tolist())
        if len(whole) in steps:
            states[len(whole)] = json.loads(json.dumps(loader.state_dict()))  # a checkpoint: plain JSON
    assert len(whole) == len(loader) and sorted(states) == list(steps)
    del loader  # let go, as a resuming script lets its interrupted loader go: its source's workers wait in
    # the idle pool for the resumed loader (kept, with its stream's next epoch in flight, it holds them and
    # each resume beside it started workers of its own)
    for k in steps:
        resumed = _loader(num_workers)
        resumed.load_state_dict(states[k])
        assert whole[:k] + _all(resumed) == whole, f"resumed after {k} batches"
        del resumed  # the next resume takes its workers


def test_set_weights_reweights_from_the_next_batch_and_is_checkpointed(ray_session):
    loader = _loader(num_samples=800)
    it = iter(loader)
    before = _take(it, 5)
    loader.set_weights({"a": 0.0, "c": 0.5})
    after = _take(it, 10)
    assert {_source_of(i) for i in _ids(after)} <= {"b", "c"}
    assert loader.weights == {"a": 0.0, "b": 0.3, "c": 0.5}
    state = json.loads(json.dumps(loader.state_dict()))
    rest = [b[1].tolist() for b in it]
    resumed = _loader(num_samples=800)
    resumed.load_state_dict(state)
    assert _all(resumed) == rest
    ids = _ids(before + after + rest)
    for name in SIZES:
        _epochs_once(ids, name)


def test_arguments_that_cannot_apply_are_refused_with_what_to_do(ray_session):
    mixed = sbloader.mix({"a": MapStyle(10, 0), "b": Stream(5, 100_000)}, weights={"a": 1, "b": 1})
    for arg, value, says in (("sampler", [0, 1], "leave sampler out"),
                             ("batch_sampler", [[0, 1]], "pass batch_size"),
                             ("generator", torch.Generator(), "mix\\(..., seed=\\)"),
                             ("seed", 3, "mix\\(..., seed=\\)")):
        with pytest.raises(ValueError, match=says):
            sbloader.DataLoader(mixed, batch_size=4, **{arg: value})
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        sbloader.DataLoader(mixed, batch_size=None)
    with pytest.raises(ValueError, match="in_order"):
        sbloader.DataLoader(mixed, batch_size=4, in_order=False)
    with pytest.raises(TypeError, match="does not take"):
        sbloader.DataLoader(mixed, batch_size=4, dtypes={})
    with pytest.raises(TypeError, match="num_samples"):
        len(sbloader.DataLoader(mixed, batch_size=4))
    native = sbloader.mix({"a": sbloader.from_items([{"id": 1}]), "b": MapStyle(3, 0)}, weights={"a": 1, "b": 1})
    with pytest.raises(TypeError, match=r"to_dataloader\(batch_size\)"):
        sbloader.DataLoader(native, batch_size=4)
    # an ordinary dataset still makes an ordinary DataLoader
    assert type(sbloader.DataLoader(MapStyle(4, 0), batch_size=2)) is sbloader.DataLoader
