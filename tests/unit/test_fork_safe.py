"""A local worker forked while another thread imports a module it needs imports that module anew.

The lock of a module being imported at the moment of a fork belongs, in the child, to a thread that
does not exist there: before ``fork_safe.forget_foreign_imports`` a child importing it waited for
good (the fault soak's dataset imported Ray in ``__getitem__`` while the trainer's background start
imported it: its local-start workers never made a batch).
"""
from __future__ import annotations

import importlib
import multiprocessing
import sys
import threading
import time

from sbloader.loaders.fork_safe import ForkGate

SLOW = "import time\ntime.sleep({sleep})\nVALUE = 7\n"


def _import_and_tell(name: str, queue) -> None:
    module = importlib.import_module(name)
    queue.put(module.VALUE)


def _being_imported(tmp_path, monkeypatch, name: str, sleep: float) -> threading.Thread:
    """A thread importing ``name`` (a module that sleeps ``sleep`` s at import), once it is in the middle."""
    (tmp_path / f"{name}.py").write_text(SLOW.format(sleep=sleep))
    monkeypatch.syspath_prepend(str(tmp_path))
    importer = threading.Thread(target=importlib.import_module, args=(name,), daemon=True)
    importer.start()
    deadline = time.monotonic() + 10
    while name not in sys.modules and time.monotonic() < deadline:
        time.sleep(0.01)
    assert name in sys.modules, "the importing thread did not start"
    return importer


def test_a_child_forked_while_a_thread_imports_a_module_imports_it_anew(tmp_path, monkeypatch):
    name = "sbloader_slow_import"
    importer = _being_imported(tmp_path, monkeypatch, name, sleep=4)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_import_and_tell, args=(name, queue), daemon=True)
    with ForkGate().forking():
        child.start()
    try:
        got = queue.get(timeout=20)  # before: the child waited for good on the module's lock
    finally:
        child.join(timeout=20)
        if child.is_alive():
            child.kill()
    assert got == 7  # imported whole in the child
    importer.join(timeout=10)
    assert sys.modules[name].VALUE == 7  # the parent's import completed as ever


def test_numpy_random_is_whole_before_the_local_workers_fork():
    """torch's worker loop seeds ``numpy.random``, which numpy 2 imports only on first use: a fork while the
    background Ray start imported it left it half made in every child, whose C parts cannot be made anew
    there ("cannot import name 'MT19937'": every local worker died at its start, 3 runs in 4 of
    ``test_iterable_datasets_resume_exactly_through_torch_save_and_json[3]``). The gate imports it first."""
    import subprocess

    code = ("import sys, numpy\n"
            "from sbloader.loaders.fork_safe import ForkGate\n"
            "assert 'numpy.random' not in sys.modules, 'numpy imported numpy.random itself'\n"
            "with ForkGate().forking():\n"
            "    print('numpy.random' in sys.modules and hasattr(sys.modules['numpy.random'], 'MT19937'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_a_child_forked_while_another_thread_seeds_torch_seeds_its_own():
    """``torch.manual_seed`` holds ``torch.cuda._initialization_lock``; a local worker forked while
    another thread of the trainer was inside it waited forever in its own seeding (a mixture's
    ``IterableDataset`` source seeding in the loop's thread while another source forked its local
    workers). The child gets a fresh lock; the trainer's own seeding waits for the fork."""
    import os

    import torch
    import torch.cuda

    from sbloader.loaders import fork_safe

    held = torch.cuda._initialization_lock
    with held:  # as another thread inside torch.manual_seed at the fork
        with ForkGate().forking():
            pid = os.fork()
            if pid == 0:  # the local worker: seeds as torch's worker loop does
                torch.manual_seed(3)
                os._exit(0)
            seeder = threading.Thread(target=fork_safe.seed_here, args=(5,), daemon=True)
            seeder.start()
            seeder.join(0.2)
            assert seeder.is_alive(), "the trainer's seeding ran while local workers were being forked"
    seeder.join(10)
    assert not seeder.is_alive()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child waited forever in torch.manual_seed (the parent's lock)")
