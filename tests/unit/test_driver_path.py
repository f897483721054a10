"""The folders a process added to sys.path, handed to Ray's workers (``sbloader/runtime/driver_path.py``)."""
from __future__ import annotations

import os

from sbloader.runtime.driver_path import job_config_for, user_folders


def test_user_folders_keep_the_scripts_own_folders_in_order_once_and_drop_installed_and_missing(tmp_path):
    prefix, src, lib, other = (tmp_path / n for n in ("prefix", "src", "lib", "other"))
    for d in (prefix / "lib" / "site-packages", src, lib, other):
        d.mkdir(parents=True)
    path = ["", str(src), str(prefix / "lib" / "site-packages"), str(tmp_path / "gone"), str(lib),
            str(src) + os.sep, str(other), str(prefix)]
    assert user_folders(path, [str(prefix)]) == [str(src.resolve()), str(lib.resolve()), str(other.resolve())]


def test_a_callers_job_config_or_working_dir_is_left_alone():
    assert job_config_for({"job_config": object()}) is None
    assert job_config_for({"runtime_env": {"working_dir": "."}}) is None
