"""Ray's retry and node-death chatter is hidden from the driver unless SBLOADER_RAY_VERBOSE=1 (issue #46)."""
from __future__ import annotations

from ray._private import worker

from sbloader.runtime import ray_chatter

RETRY = ("Task MapActor.read_process failed. There are 3 retries remaining, so the task will be retried. "
         "Error: The actor is temporarily unavailable: RpcError: RPC error: Socket closed rpc_code: 14")
DEAD = ("The node with node id: 4d64 and address: 127.0.0.1 and node name: 127.0.0.1 has been marked dead "
        "because the detector has missed too many heartbeats from it.")
RECOVER = ("Attempting to recover 2 lost objects by resubmitting their tasks or setting a new primary location from "
           "existing copies. To disable object reconstruction, set @ray.remote(max_retries=0).")
OTHER = "A worker died or was killed while executing a task by an unexpected system error."


def test_only_the_retry_node_death_and_object_recovery_lines_are_chatter():
    assert ray_chatter.is_chatter(RETRY) and ray_chatter.is_chatter(DEAD) and ray_chatter.is_chatter(RECOVER)
    assert not ray_chatter.is_chatter(OTHER) and not ray_chatter.is_chatter("sbloader epoch 0: lost node ab")
    data = {"lines": [RETRY, OTHER, DEAD], "pid": "raylet", "is_err": False}
    assert ray_chatter.without_chatter(data) == {"lines": [OTHER], "pid": "raylet", "is_err": False}


def test_the_driver_prints_no_chatter_and_everything_else(monkeypatch):
    printed = []
    monkeypatch.delenv(ray_chatter.VERBOSE_ENV, raising=False)
    monkeypatch.setattr(worker, "print_to_stdstream", lambda data, ignore_prefix: printed.append(data["lines"]))
    assert ray_chatter.install() and ray_chatter.install()  # idempotent
    worker.print_to_stdstream({"lines": [RETRY], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    worker.print_to_stdstream({"lines": [RETRY, OTHER], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    assert printed == [[OTHER]]


def test_the_workers_log_lines_lose_their_chatter_too(monkeypatch):
    """A worker's log line (the coordinator's ``Attempting to recover ...``) reaches the terminal
    through the handler ``ray.init`` registered before sbloader could patch the printer."""
    from ray._private.ray_logging import WorkerStandardStreamDispatcher

    printed = []
    dispatcher = WorkerStandardStreamDispatcher()
    dispatcher.add_handler("ray_print_logs", lambda data: printed.append(data["lines"]))
    monkeypatch.setattr(worker, "global_worker_stdstream_dispatcher", dispatcher)
    monkeypatch.setattr(worker, "print_to_stdstream", lambda data, ignore_prefix: None)
    monkeypatch.delenv(ray_chatter.VERBOSE_ENV, raising=False)
    assert ray_chatter.install() and ray_chatter.install()  # idempotent: one filter
    dispatcher.emit({"lines": [RECOVER], "pid": 17427, "is_err": True})
    dispatcher.emit({"lines": [RECOVER, OTHER], "pid": 17427, "is_err": True})
    assert printed == [[OTHER]] and len(dispatcher.handlers) == 1


def test_sbloader_ray_verbose_shows_the_chatter(monkeypatch):
    printed = []
    monkeypatch.setenv(ray_chatter.VERBOSE_ENV, "1")
    monkeypatch.setattr(worker, "print_to_stdstream", lambda data, ignore_prefix: printed.append(data["lines"]))
    assert not ray_chatter.install()
    worker.print_to_stdstream({"lines": [RETRY], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    assert printed == [[RETRY]]
