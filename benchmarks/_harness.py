"""The older scripts' name for the harness: it is :mod:`benchmarks.harness` now.

``import _harness as h`` (with ``benchmarks/`` on ``sys.path``) keeps working; new code
imports ``benchmarks.harness``.
"""
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.harness import *  # noqa: E402,F401,F403
from benchmarks.harness import __all__  # noqa: E402,F401
