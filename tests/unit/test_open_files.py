"""A process with few open files (``ulimit -n`` 100) never dies in Ray's start: sbloader refuses to start
Ray there with an error that says what to do, and the drop-in's local workers load what they can, as torch's
(torch's ``test_fd_limit_exceeded``: before, the background start of Ray aborted the whole process in C++)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=env)


def test_ray_is_not_started_with_too_few_open_files_and_the_error_says_what_to_do():
    r = _run("""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
        from sbloader.runtime.session import _check_open_files
        try:
            _check_open_files()
        except RuntimeError as e:
            print("refused:", e)
        """)
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "only 100 files" in r.stdout and "ulimit -n 8192" in r.stdout


def test_a_process_whose_files_ran_out_is_refused_before_ray_is_imported():
    """``import ray`` loads C++ that seeds its random numbers from a file: where none can be opened any more
    it aborts the process (absl's SeedGenException, CI's stop 87) or leaves a half-imported ``ray`` that the
    exit's shutdown trips on. The refusal comes first, and the exit imports nothing."""
    r = _run("""
        import os, resource, sys
        from sbloader.runtime import session
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
        held = []
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        try:
            session.init()
        except RuntimeError as e:
            print("refused:", "ulimit -n" in str(e))
        print("ray imported:", any(m.split(".")[0] == "ray" for m in sys.modules))
        """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused: True" in r.stdout and "ray imported: False" in r.stdout, r.stdout + r.stderr[-3000:]
    assert r.stderr == ""


def test_the_drop_in_with_a_hundred_open_files_ends_as_torchs_loader_does():
    """torch's shape: tensors kept alive from a worker until the files run out; torch's own error (naming
    ``ulimit -n`` and ``set_sharing_strategy``) or the whole epoch, never a crash."""
    r = _run("""
        import resource
        import torch
        from torch.utils.data import IterableDataset
        from sbloader import DataLoader

        class RandomDataset(IterableDataset):
            def __init__(self, n):
                self.n = n

            def __iter__(self):
                return self

            def __next__(self):
                if self.n <= 0:
                    raise StopIteration
                self.n -= 1
                return torch.randn(2, 2)

        keep = []
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
            for t in DataLoader(RandomDataset(200), multiprocessing_context="fork", num_workers=1):
                keep.append(t)
        except RuntimeError as e:
            assert "ulimit -n" in str(e) and "set_sharing_strategy" in str(e), e
        import sys
        print("ended", len(keep), "ray imported:", any(m.split(".")[0] == "ray" for m in sys.modules))
        """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ended" in r.stdout
    # the pool's prestart waits for Ray's start (refused here) before it imports anything that imports ray
    assert "ray imported: False" in r.stdout, r.stdout + r.stderr[-3000:]
