"""A child forked from the Ray driver lets go of Ray: the Ray objects it inherited die
without calling into the parent's core worker (whose threads it does not have)."""
import gc
import os
import time

import ray

import sbloader  # noqa: F401  (installs the fork hook)


@ray.remote(num_cpus=0)
class _Idle:
    def ping(self) -> int:
        return os.getpid()


class _Cycle:
    """An actor handle and object refs only the garbage collector frees (a reference cycle)."""

    def __init__(self, handle, refs) -> None:
        self.handle, self.refs, self.me = handle, refs, self


def _wait(pid: int, limit_s: float) -> int:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked child {pid} hung for {limit_s} s freeing inherited Ray objects")


def test_a_forked_child_frees_inherited_ray_objects_without_calling_ray(ray_session):
    actor = _Idle.remote()
    parent_pid = ray.get(actor.ping.remote())
    gc.disable()  # the cycles stay for the child's collector
    try:
        for _ in range(20):
            _Cycle(_Idle.remote(), [ray.put(i) for i in range(5)])
        pid = os.fork()
        if pid == 0:  # the child: no pytest, no exceptions out of here
            code = 0
            try:
                worker = ray._private.worker.global_worker
                if hasattr(worker, "core_worker") or hasattr(worker, "gcs_client"):
                    code = 3  # the hook did not run
                elif gc.collect() == 0:
                    code = 4  # nothing was freed: the test tests nothing
            except BaseException:
                code = 5
            os._exit(code)
    finally:
        gc.enable()
    assert _wait(pid, 30.0) == 0
    gc.collect()
    # the parent's Ray is whole: its actor answers, a new task runs
    assert ray.get(actor.ping.remote()) == parent_pid
    assert ray.get(ray.put(7)) == 7
    assert hasattr(ray._private.worker.global_worker, "core_worker")
