"""The folders this process added to ``sys.path``, handed to Ray's workers as torch's are.

torch's workers see their parent's ``sys.path`` (forked, or given it when spawned), so a
dataset class or a function from a module found through a folder the script put on the path
(``sys.path.insert(0, "src")``) works in them. Ray's workers start from their own path and
only get the driver's script folder and working directory: such a module is pickled by name
and the worker fails with ``ModuleNotFoundError``. :func:`job_config_for` gives Ray the
driver's own folders (``JobConfig``'s driver sys.path, which Ray fills with the script folder
itself), so every worker of this job puts them on its path too.
"""
from __future__ import annotations

import os
import site
import sys
from typing import Any, Optional, Sequence


def user_folders(path: Sequence[str], installed: Sequence[str]) -> list[str]:
    """The folders of ``path`` (a ``sys.path``) that are not under one of ``installed`` (the
    interpreter's prefixes and site folders: every worker has those), in order, once each."""
    roots = [os.path.realpath(p) for p in installed if p]
    out: list[str] = []
    for entry in path:
        if not entry or not os.path.isdir(entry):
            continue
        real = os.path.realpath(entry)
        if any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots) or real in out:
            continue
        out.append(real)
    return out


def _installed() -> list[str]:
    roots = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    try:
        roots += list(site.getsitepackages()) + [site.getusersitepackages()]
    except AttributeError:  # a virtualenv's old site module
        pass
    return roots


def job_config_for(ray_init_kwargs: dict) -> Optional[Any]:
    """A ``ray.job_config.JobConfig`` carrying this process's own ``sys.path`` folders to the
    workers, or None where the caller passed a ``job_config`` (theirs is kept) or a
    ``runtime_env`` with a ``working_dir`` (its uploaded code must not be shadowed by the
    driver's folders, as Ray itself decides for the script folder)."""
    if "job_config" in ray_init_kwargs:
        return None
    runtime_env = ray_init_kwargs.get("runtime_env") or {}
    if isinstance(runtime_env, dict) and runtime_env.get("working_dir"):
        return None
    folders = user_folders(sys.path, _installed())
    if not folders:
        return None
    from ray.job_config import JobConfig

    return JobConfig(_py_driver_sys_path=folders)
