"""What the two conformance scenarios share (torch's and torchdata's own test files run with
the drop-in): the runner scripts under ``scripts/conformance/`` imported as modules, and
their per-test outcomes turned into the section's notes. Not a scenario."""
from __future__ import annotations

import importlib.util
import tempfile
from types import ModuleType
from typing import Mapping, Optional

from benchmarks.harness.machine import BENCH_DIR

SCRIPTS = BENCH_DIR.parent / "scripts" / "conformance"


def script(name: str) -> ModuleType:
    """``scripts/conformance/<name>.py`` as a module (the runners are scripts, not a package)."""
    import sys

    sys.path.insert(0, str(SCRIPTS))  # torchdata_suite imports torch_dataloader_suite by name
    spec = importlib.util.spec_from_file_location(f"_conformance_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def workdir(label: str) -> str:
    """A fresh folder for one run's logs and JUnit XML (kept: the section names it)."""
    return tempfile.mkdtemp(prefix=f"sbloader-{label}-")


def totals(outcomes: Mapping[str, tuple]) -> dict[str, int]:
    """``{outcome: count}`` of ``{test: (outcome, message)}``."""
    out: dict[str, int] = {}
    for outcome, _ in outcomes.values():
        out[outcome] = out.get(outcome, 0) + 1
    return out


def hung(outcomes: Mapping[str, tuple]) -> list[str]:
    """The tests pytest-timeout cut (a hang counts as a failure)."""
    return sorted(t for t, (o, m) in outcomes.items() if o != "passed" and "Timeout" in m)


def failures_note(failing: Mapping[str, tuple], why: Optional[Mapping[str, str]] = None) -> str:
    """A Markdown table of the tests that do not pass, each with its reason (``why``'s, else
    the first line of its failure)."""
    why = why or {}
    if not failing:
        return "Every test passes."
    rows = [f"| {t} | {o}{' (by design)' if t in why else ''} | {why.get(t, m).replace('|', '/')[:200]} |"
            for t, (o, m) in sorted(failing.items())]
    return "\n".join(["The tests that do not pass, with why:", "", "| test | outcome | why |", "|---|---|---|"]
                     + rows)


def slowest_note(seconds: Mapping[str, float], n: int = 10) -> str:
    """A Markdown table of the ``n`` slowest tests (where the file's time goes)."""
    if not seconds:
        return "No per-test times (no JUnit XML was written)."
    top = sorted(seconds.items(), key=lambda kv: -kv[1])[:n]
    return "\n".join([f"The {len(top)} slowest of {len(seconds)} tests ({sum(seconds.values()):.0f} s in tests):",
                      "", "| test | s |", "|---|---|"] + [f"| {t} | {s:.1f} |" for t, s in top])
