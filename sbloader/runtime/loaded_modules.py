"""Modules looked at without importing them (:func:`loaded`)."""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Optional


def loaded(name: str) -> Optional[ModuleType]:
    """Module ``name`` if it is fully imported, else None, without importing anything: for code that
    may run at exit or in a ``__del__``, where an import could wait forever for a module lock that a
    background thread (:mod:`sbloader.runtime.background`'s Ray start) held when the interpreter began
    to shut down, and for ``ray`` where the open files ran out (its import aborts the process there)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is None or (spec is not None and getattr(spec, "_initializing", False)):
        return None
    return module
