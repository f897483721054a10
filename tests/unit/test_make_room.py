"""Idle warm actors of other worker resources give way to a new pool that needs their CPUs, instead of
holding them until their idle timeout (a script whose second loader asks for other resources)."""
import threading

from sbloader.loaders import warm_workers
from sbloader.runtime import cluster_state


def _park(key, name):
    timer = threading.Timer(3600, lambda: None)
    warm_workers._IDLE[key] = ({0: [name]}, timer)
    return timer


def test_idle_actors_of_other_keys_are_killed_only_when_their_cpus_are_needed(monkeypatch):
    killed = []
    monkeypatch.setattr(warm_workers, "kill_cached", lambda cache: killed.extend(cache[0]))
    monkeypatch.setattr(warm_workers, "_IDLE", {})
    mine, other = (2, 1.0, (), False), (2, 0.5, (), False)
    _park(mine, "mine")
    _park(other, "other")
    monkeypatch.setattr(cluster_state, "available_resources", lambda: {"CPU": 2.0})
    warm_workers.make_room(mine)  # 2 CPUs free: room enough, the idle ones stay
    assert killed == [] and set(warm_workers._IDLE) == {mine, other}
    monkeypatch.setattr(cluster_state, "available_resources", lambda: {"CPU": 1.0})
    warm_workers.make_room(mine)  # 1 free, 2 asked: the other key's idle actors go; this key's are kept
    assert killed == ["other"] and set(warm_workers._IDLE) == {mine}


def test_an_unanswering_cluster_keeps_the_idle_actors(monkeypatch):
    killed = []
    monkeypatch.setattr(warm_workers, "kill_cached", lambda cache: killed.extend(cache[0]))
    monkeypatch.setattr(warm_workers, "_IDLE", {})
    _park((2, 0.5, (), False), "other")

    def fails():
        raise cluster_state.ClusterStateError("no answer")

    monkeypatch.setattr(cluster_state, "available_resources", fails)
    warm_workers.make_room((2, 1.0, (), False))
    assert killed == []
