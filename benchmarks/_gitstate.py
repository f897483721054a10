"""The older scripts' name for :func:`benchmarks.harness.machine.git_state`."""
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.harness.machine import git_state  # noqa: E402,F401
