"""The loop of :mod:`loader_per_epoch` with one loader iterated for every epoch (torch's default
``persistent_workers=False``: a new iterator per epoch), sbloader's drop-in against torch's."""
from __future__ import annotations

from typing import Any

from benchmarks.harness import Outcome, Plan

from .loader_per_epoch import PARAMS, QUICK, contenders, run_holding  # noqa: F401  (the scenario's parameters)

ORDER = 12
TITLE = "One loader for 3 epochs, 50 ms step, vs torch"


def plan(**p: Any) -> Plan:
    """Two contenders, ``rounds`` rounds of ``epochs`` epochs each."""
    return Plan(list(contenders(False)), p["rounds"],
                notes=f"{p['images']} JPEGs, batch {p['batch_size']}, {p['num_workers']} workers, "
                      f"{p['epochs']} epochs, {p['step_ms']} ms step")


def run(**p: Any) -> Outcome:
    """Each contender ``rounds`` times, interleaved."""
    return run_holding(False, **p)
