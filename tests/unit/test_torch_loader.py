"""The local start's workers run through torch's own DataLoader, even where torch.utils.data.DataLoader was
swapped for sbloader's (torch's own test file under the swap: each local start took an sbloader loader, whose
own local start took another, each starting a pool of actors ahead, without end)."""
from __future__ import annotations

import re

import pytest
import torch.utils.data
import torch.utils.data.dataloader

import sbloader
from sbloader.loaders import torch_loader as tl


def test_torchs_class_when_nobody_replaced_it():
    # torch's class itself, with only the worker-end check below added
    assert tl.torch_loader().__bases__ == (torch.utils.data.dataloader.DataLoader,)
    assert tl.torch_loader() is tl.torch_loader()


def test_torchs_class_where_torchs_module_was_patched_with_sbloaders(monkeypatch):
    original = torch.utils.data.dataloader.DataLoader
    monkeypatch.setattr(torch.utils.data, "DataLoader", sbloader.DataLoader)
    monkeypatch.setattr(torch.utils.data.dataloader, "DataLoader", sbloader.DataLoader)
    assert tl.torch_loader().__bases__ == (original,)


def test_replaced_before_sbloader_was_imported_says_what_to_do(monkeypatch):
    class Other:  # neither the module's class nor the one seen at sbloader's import is torch's
        pass

    monkeypatch.setattr(torch.utils.data.dataloader, "DataLoader", Other)
    monkeypatch.setattr(tl, "_AT_IMPORT", Other)
    with pytest.raises(RuntimeError, match="import sbloader before replacing it"):
        tl.torch_loader()


# A fresh process: torch's SIGCHLD handler is not installed there (it is once any torch iterator is made on
# the main thread), as in the drop-in, whose local workers' iterator runs in its fetch thread.
_DIES_OFF_THE_MAIN_THREAD = """
import sys, threading, traceback
sys.path.insert(0, {scripts!r})
from sbloader.loaders.torch_loader import torch_loader
from segfaults import Segfaults, quiet

def load(out):
    loader = torch_loader()(Segfaults(4), num_workers=1, worker_init_fn=quiet, multiprocessing_context="fork")
    try:
        next(iter(loader))
    except Exception:
        out.append(traceback.format_exc())

out = []
thread = threading.Thread(target=load, args=(out,))
thread.start()
thread.join()
print(out[0] if out else "no error")
"""


def test_a_killed_worker_off_the_main_thread_names_its_signal_as_torchs():
    # torch's handler (main thread only) adds "is killed by signal: Segmentation fault" to its "exited
    # unexpectedly": torch's own test_segfault reads it; off the main thread only "exited unexpectedly" was left
    import os
    import subprocess
    import sys

    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    out = subprocess.run([sys.executable, "-c", _DIES_OFF_THE_MAIN_THREAD.format(scripts=scripts)],
                         capture_output=True, text=True, timeout=120).stdout
    assert "RuntimeError: DataLoader worker (pid(s)" in out and "exited unexpectedly" in out, out
    assert re.search(r"DataLoader worker \(pid \d+\) is killed by signal: Segmentation fault", out), out


# torch's SIGCHLD handler installed (a torch iterator made on the main thread first, as any program that used
# torch's loader has it): a worker of the local start's iterator, read off the main thread, ends badly while
# the main thread is busy elsewhere (its training step). torch's handler raised its error there, in the main
# thread, wherever it was; the error belongs to the loop that reads the worker.
_HANDLER_INSTALLED = """
import sys, threading, time, traceback
sys.path.insert(0, {scripts!r})
import torch.utils.data
from sbloader.loaders.torch_loader import torch_loader
from segfaults import ExitsOne, {dataset}, quiet

list(torch.utils.data.DataLoader(list(range(2)), num_workers=1))  # installs torch's SIGCHLD handler
out = []

def load():
    loader = torch_loader()({dataset}(4), num_workers=1, worker_init_fn=quiet, multiprocessing_context="fork")
    try:
        next(iter(loader))
    except Exception:
        out.append(traceback.format_exc())

thread = threading.Thread(target=load)
thread.start()
try:
    while thread.is_alive():  # the main thread's own work, until the loop that reads the worker has its error
        time.sleep(0.05)
    print("main thread undisturbed")
except Exception:
    print("main thread interrupted: " + traceback.format_exc())
thread.join()
print(out[0] if out else "no error")
"""


@pytest.mark.parametrize("dataset,words", [("ExitsOne", r"exited unexpectedly with exit code 1"),
                                           ("Segfaults", r"is killed by signal: Segmentation fault")])
def test_a_worker_ending_badly_raises_in_the_loop_that_reads_it_not_in_the_main_thread(dataset, words):
    import os
    import subprocess
    import sys

    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    out = subprocess.run([sys.executable, "-c", _HANDLER_INSTALLED.format(scripts=scripts, dataset=dataset)],
                         capture_output=True, text=True, timeout=120).stdout
    assert "main thread undisturbed" in out, out
    assert "RuntimeError: DataLoader worker (pid(s)" in out and "exited unexpectedly" in out, out
    assert re.search(r"DataLoader worker \(pid \d+\) " + words, out), out
