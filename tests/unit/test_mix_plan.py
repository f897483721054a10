"""The mixture's schedule (sbloader/core/mix_plan.py): shares within binomial bounds, a pure
function of (seed, position, weight history), weight changes and drops from their position on."""
from __future__ import annotations

import math

import numpy as np
import pytest

from sbloader.core.errors import StateDictError
from sbloader.core.mix_plan import (WeightChange, append_change, check_weights, counts, schedule,
                                    uniforms)


def _history(weights: dict, names) -> tuple:
    return (WeightChange(0, check_weights(weights, names)),)


def _within_binomial(count: int, n: int, p: float, z: float = 4.5) -> bool:
    """``count`` of ``n`` draws at probability ``p`` within ``z`` standard deviations."""
    return abs(count - n * p) <= z * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize("weights", [{"a": 0.7, "b": 0.3}, {"web": 0.7, "curated": 0.2, "synthetic": 0.1}])
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_shares_within_binomial_bounds_over_10000(weights, seed):
    names = sorted(weights)
    s = schedule(seed, _history(weights, names), names, 0, 10_000)
    c = counts(s, len(names))
    for i, n in enumerate(names):
        assert _within_binomial(int(c[i]), 10_000, weights[n]), (n, c, weights)


def test_weights_need_not_sum_to_one():
    names = ["a", "b"]
    s = schedule(0, _history({"a": 3, "b": 1}, names), names, 0, 10_000)
    assert _within_binomial(int(counts(s, 2)[0]), 10_000, 0.75)


def test_pure_in_seed_and_position_any_chunking():
    names = ["a", "b", "c"]
    h = _history({"a": 0.5, "b": 0.3, "c": 0.2}, names)
    whole = schedule(7, h, names, 0, 5000)
    pieces = np.concatenate([schedule(7, h, names, lo, min(lo + 333, 5000)) for lo in range(0, 5000, 333)])
    assert (whole == pieces).all()
    assert (schedule(7, h, names, 0, 5000) == whole).all()
    assert (schedule(8, h, names, 0, 5000) != whole).any()


def test_uniforms_are_uniform_and_distinct_per_seed():
    u = uniforms(3, 0, 20_000)
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.01
    assert (uniforms(3, 100, 200) == u[100:200]).all()
    assert not np.allclose(uniforms(4, 0, 100), u[:100])


def test_weight_change_applies_from_its_position_only():
    names = ["a", "b"]
    h = _history({"a": 1.0, "b": 0.0}, names)
    h = append_change(h, WeightChange(1000, check_weights({"a": 0.0, "b": 1.0}, names)))
    s = schedule(0, h, names, 0, 2000)
    assert (s[:1000] == 0).all() and (s[1000:] == 1).all()
    # the draws before the change are those of the unchanged history
    before = schedule(0, _history({"a": 1.0, "b": 0.0}, names), names, 0, 1000)
    assert (before == s[:1000]).all()


def test_a_dropped_source_shares_its_weight_with_the_rest():
    names = ["a", "b", "c"]
    w = check_weights({"a": 0.5, "b": 0.25, "c": 0.25}, names)
    h = (WeightChange(0, w), WeightChange(100, w, ("a",)))
    s = schedule(0, h, names, 0, 10_100)
    assert not (s[100:] == 0).any()
    assert _within_binomial(int(counts(s[100:], 3)[1]), 10_000, 0.5)


def test_zero_weight_source_never_drawn_and_all_zero_refused():
    names = ["a", "b"]
    s = schedule(0, _history({"a": 1.0, "b": 0.0}, names), names, 0, 10_000)
    assert (s == 0).all()
    h = (WeightChange(0, check_weights({"a": 1.0, "b": 0.0}, names), ("a",)),)
    with pytest.raises(ValueError, match="no source left"):
        schedule(0, h, names, 0, 10)


@pytest.mark.parametrize("bad,match", [({"a": -1, "b": 1}, "finite and >= 0"), ({"a": 1}, "no weight to"),
                                       ({"a": 1, "b": 1, "z": 1}, "does not have"),
                                       ({"a": 0, "b": 0}, "all 0"), ({"a": "x", "b": 1}, "a number"),
                                       ({"a": float("nan"), "b": 1}, "finite")])
def test_bad_weights_say_what_is_wrong(bad, match):
    with pytest.raises(ValueError, match=match):
        check_weights(bad, ["a", "b"])


def test_history_round_trips_json_and_refuses_unknown_sources():
    names = ["a", "b"]
    c = WeightChange(5, check_weights({"a": 1, "b": 2}, names), ("b",))
    assert WeightChange.from_json(c.to_json(), names) == c
    with pytest.raises(StateDictError, match="names sources"):
        WeightChange.from_json([0, {"a": 1, "q": 1}, []], names)
    with pytest.raises(StateDictError, match="expected"):
        WeightChange.from_json({"position": 0}, names)


def test_history_only_grows():
    names = ["a", "b"]
    h = _history({"a": 1, "b": 1}, names)
    h = append_change(h, WeightChange(10, check_weights({"a": 1, "b": 0}, names)))
    h = append_change(h, WeightChange(10, check_weights({"a": 0, "b": 1}, names)))
    assert [c.position for c in h] == [0, 10] and dict(h[-1].weights)["a"] == 0
    with pytest.raises(ValueError, match="only grows"):
        append_change(h, WeightChange(3, check_weights({"a": 1, "b": 1}, names)))
