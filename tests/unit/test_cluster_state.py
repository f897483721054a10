"""The cluster's state asked with a deadline: the last answer stands when the GCS is slow,
and with none the error says what to check."""
import pytest

from sbloader.runtime import cluster_state


class _Info:
    def __init__(self, node: bytes, state: int, cpus: float) -> None:
        self.node_id, self.state = node, state
        self.node_manager_address = "127.0.0.1"
        self.resources_total = {"CPU": cpus, "memory": 10.0}


class _Usage:
    def __init__(self, node: bytes, cpus: float) -> None:
        self.node_id, self.resources_available = node, {"CPU": cpus}


class _Reply:
    def __init__(self, batch: list) -> None:
        self.resource_usage_data = type("Data", (), {"batch": batch})()


class _Client:
    def __init__(self) -> None:
        self.fail = False
        self.timeouts: list = []

    def get_all_resource_usage(self, timeout=None):
        self.timeouts.append(timeout)
        return _Reply([_Usage(b"\x01", 1.0), _Usage(b"\x02", 0.5), _Usage(b"\x03", 8.0)])

    def get_all_node_info(self, timeout=None):
        self.timeouts.append(timeout)
        if self.fail:
            raise TimeoutError("deadline exceeded")
        return {1: _Info(b"\x01", 0, 2.0), 2: _Info(b"\x02", 0, 4.0), 3: _Info(b"\x03", 1, 8.0)}


@pytest.fixture
def client(monkeypatch):
    fake = _Client()
    monkeypatch.setattr(cluster_state, "_client", lambda: fake)
    monkeypatch.setattr(cluster_state, "_LAST", {})
    return fake


def test_live_nodes_only_and_every_call_has_a_deadline(client):
    assert [(n.node_id, n.alive) for n in cluster_state.nodes()] == [("01", True), ("02", True), ("03", False)]
    assert cluster_state.cpus() == 6.0  # the dead node's 8 are not counted
    assert cluster_state.total_resources(exclude=("01",)) == {"CPU": 4.0, "memory": 10.0}
    assert client.timeouts and all(t == cluster_state.CALL_TIMEOUT_S for t in client.timeouts)


def test_a_gcs_that_does_not_answer_leaves_the_last_answer(client):
    assert cluster_state.cpus() == 6.0
    client.fail, client.timeouts = True, []
    assert cluster_state.cpus() == 6.0
    assert len(client.timeouts) == 2  # asked twice, then the last answer


def test_no_answer_ever_is_a_clear_error(client):
    client.fail = True
    with pytest.raises(cluster_state.ClusterStateError, match=r"did not answer 'nodes'.*ray status"):
        cluster_state.cpus()


def test_free_cpus_of_live_nodes_and_the_summary_for_an_error(client, monkeypatch):
    import ray

    assert cluster_state.available_resources() == {"CPU": 1.5}  # the dead node's 8 free are not counted
    assert cluster_state.available_resources(exclude=("02",)) == {"CPU": 1.0}
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert cluster_state.cpu_summary() == "the cluster has 6 CPUs, 1.5 free now"
    client.fail = True
    monkeypatch.setattr(cluster_state, "_LAST", {})
    assert cluster_state.cpu_summary() == ""  # never raises into the error it explains


def test_cpus_held_by_a_loader_count_before_ray_is_up(monkeypatch):
    """A loader whose epoch started on local workers holds its pool's CPUs before Ray is up: a second
    loader built meanwhile shares what is left (its pool would wait for good for CPUs the first one's
    actors take), and a named cluster not joined yet is unknown."""
    import os

    from sbloader.loaders import dropin_settings

    monkeypatch.setattr(dropin_settings, "ray_is_up", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert dropin_settings.free_cpus(2.0) == 0.0 and dropin_settings.free_cpus(0.5) == 1.5
    cpus, free = dropin_settings.available_cpus(), dropin_settings.free_cpus(2.0)
    assert dropin_settings.fitted_worker_cpus(2, 1.0, cpus, free) == 0.0
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert dropin_settings.free_cpus(2.0) is None
