"""A child forked while another thread held the C library's exit-handler lock (``sbloader/runtime/exit_lock.py``):
without help its first C++ static waits forever; :func:`free_in_child` sets the lock free."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sbloader.runtime import exit_lock

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts")


def forks(hammer_so, mode, n, until=""):
    """How ``n`` children forked under the hammer ended (``exit_lock_job.py``; more until one ended as ``until``)."""
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "exit_lock_job.py"), hammer_so, mode, str(n), until],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_child_forked_while_the_lock_is_held_waits_for_good_at_its_first_static(exit_lock_hammer):
    ends = forks(exit_lock_hammer, "off", 1, until="hung")
    # the defect the local workers met (the hammer holds the lock most of the time)
    assert ends.get("hung", 0) >= 1, ends


def test_free_in_child_sets_the_lock_free_and_the_child_goes_on(exit_lock_hammer):
    ends = forks(exit_lock_hammer, "free", 12, until="freed")
    assert set(ends) <= {"free", "freed"}, ends  # none hung, died, or was left held
    assert ends.get("freed", 0) >= 1, ends  # the hammer made forks inherit it held


def test_every_child_of_a_process_with_ray_loaded_sets_it_free(exit_lock_hammer):
    """A torch DataLoader of the user's own, forked while sbloader's background start loads Ray: the same wait."""
    ends = forks(exit_lock_hammer, "ray", 8, until="freed")
    assert set(ends) <= {"free", "freed"}, ends
    assert ends.get("freed", 0) >= 1, ends


def test_a_free_lock_is_left_as_it_is():
    if exit_lock._LIBC is None:
        assert exit_lock.free_in_child() == "left"
    else:
        assert exit_lock.free_in_child() == "free"


MAPS = """\
7f30731e000-7f3073244000 r--p 00000000 fe:00 339380                     /usr/lib/x86_64-linux-gnu/libc.so.6
7f30733ed000-7f30733f1000 r--p 001cf000 fe:00 339380                     /usr/lib/x86_64-linux-gnu/libc.so.6
7f30733f1000-7f30733f3000 rw-p 001d3000 fe:00 339380                     /usr/lib/x86_64-linux-gnu/libc.so.6
7f30733f3000-7f3073400000 rw-p 00000000 00:00 0
7f3073400000-7f3073500000 rw-p 00000000 00:00 0
7f3073600000-7f3073601000 rw-p 00000000 fe:00 12345                      /usr/lib/libother.so
"""


@pytest.mark.parametrize("addr,inside", [
    (0x7f30733f1010, True),  # libc's writable mapping
    (0x7f30733f32c8, True),  # the anonymous mapping right after it (its zeroed data)
    (0x7f3073400010, False),  # the next anonymous mapping: not libc's
    (0x7f30733ed010, False),  # libc, read-only
    (0x7f3073600010, False),  # another library's data
])
def test_only_glibcs_own_writable_data_is_touched(addr, inside):
    assert exit_lock.in_glibc_data(addr, MAPS) is inside
