"""What an execution tells its user while it runs: a warning when it waits for resources
nothing frees, and tqdm progress bars per stage."""
from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable, Optional, Sequence

from sbloader.runtime.placement import usable_resources

logger = logging.getLogger("sbloader.executor.executor")

# No task finished and no actor started for this long while work is in flight: say
# which resources the waiting work needs and what the cluster has free (a pool of
# another loader's persistent workers holding every CPU looks like a silent hang).
STUCK_WARN_S = 20.0


def resource_demand(ray_options: dict) -> dict:
    """The Ray resources one task or actor of a stage asks for (CPU 1 unless set)."""
    need = {"CPU": float(ray_options.get("num_cpus", 1) or 0)}
    if ray_options.get("num_gpus"):
        need["GPU"] = float(ray_options["num_gpus"])
    need.update({k: float(v) for k, v in (ray_options.get("resources") or {}).items()})
    return {k: v for k, v in need.items() if v > 0}


def stuck_message(demand: list, available: dict, total: dict, silent_s: float, excluded: int = 0) -> Optional[str]:
    """The warning for a pipeline that made no progress for ``silent_s`` seconds, or None.

    Only when some waiting stage needs a resource the nodes it may use do not have
    free (``available``/``total`` count those nodes; ``excluded`` nodes, the
    trainer's, are left out): slow tasks that hold the CPUs they asked for are not
    reported.
    """
    short = []
    for name, n, need in demand:
        lacking = {k: v for k, v in need.items() if available.get(k, 0.0) + 1e-9 < v}
        if lacking:
            want = ", ".join(f"{k}={v:g}" for k, v in need.items())
            have = ", ".join(f"{k} {available.get(k, 0.0):g} of {total.get(k, 0.0):g}" for k in lacking)
            short.append(f"{name} ({n} call(s) waiting, each needs {want}; free: {have})")
    if not short:
        return None
    where = (f" on the nodes it may use ({excluded} trainer node(s) left out; allow_trainer_node=True "
             "lets tasks run there too)") if excluded else ""
    return (
        f"sbloader: no task finished for {silent_s:.0f} s and the pipeline waits for resources{where}: "
        + "; ".join(short)
        + ". Something else holds them: another loader's persistent workers (delete that loader or use "
        "persistent_workers=False), actors of another job, or a pool larger than the cluster. Lower "
        "num_workers / worker_num_cpus / concurrency, or give Ray more CPUs (sbloader.init(num_cpus=...))."
    )


class StuckWatch:
    """Warns (at most every three periods) when no work finished for :data:`STUCK_WARN_S`
    seconds and a waiting stage needs resources the usable nodes lack.

    Args:
        exclude_nodes: the nodes the pipeline may not use (the trainer's).
    """

    def __init__(self, exclude_nodes: Sequence[str]) -> None:
        self._exclude = tuple(exclude_nodes)
        self.last_progress = time.monotonic()
        self._last_warning = 0.0
        self.warnings = 0

    def progressed(self) -> None:
        """Work finished just now."""
        self.last_progress = time.monotonic()

    def check(self, demand: Callable[[], list]) -> None:
        """Warn if stuck; ``demand()`` lists ``(stage name, calls waiting, resources one needs)``."""
        now = time.monotonic()
        if now - self.last_progress < STUCK_WARN_S or now - self._last_warning < 3 * STUCK_WARN_S:
            return
        self._last_warning = now
        available, total = usable_resources(self._exclude)
        msg = stuck_message(demand(), available, total, now - self.last_progress, excluded=len(self._exclude))
        if msg:
            self.warnings += 1
            logger.warning(msg)


class ProgressBars:
    """One tqdm bar per stage, counting its output rows (the first stage's total is the
    source's row count unless a fused filter/flat_map changes it).

    Args:
        stages: the execution's stages.
        source_rows: the source's row count (None: unknown).
        show: show the bars (None: only when stderr is a terminal).
    """

    def __init__(self, stages: Sequence[Any], source_rows: Optional[int], show: Optional[bool]) -> None:
        self._bars: list[Any] = []
        if not (show if show is not None else sys.stderr.isatty()):
            return
        from tqdm.auto import tqdm

        keeps_rows = not any(op.kind in ("filter", "flat_map") for op in stages[0].ops)
        total = source_rows if keeps_rows else None
        self._bars = [tqdm(total=total if i == 0 else None, desc=s.name[:30], unit="row", position=i, leave=False)
                      for i, s in enumerate(stages)]

    def update(self, stage: int, rows: int) -> None:
        """Stage ``stage`` output ``rows`` more rows."""
        if self._bars:
            self._bars[stage].update(rows)

    def show_bytes(self, stage: int, counters: dict) -> None:
        """Show on stage ``stage``'s bar the bytes its reads took from the store and from the cache."""
        if self._bars:
            mb = 2 ** 20
            self._bars[stage].set_postfix_str(f"store {counters.get('bytes_read', 0) / mb:.1f} MiB, cache "
                                              f"{counters.get('cache_bytes', 0) / mb:.1f} MiB", refresh=False)

    def close(self) -> None:
        """Close the bars (idempotent)."""
        for b in self._bars:
            b.close()
        self._bars = []
