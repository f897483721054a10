"""The benchmarks' one measurement harness (see benchmarks/README.md and
/work/shared/BENCHMARKING.md), split by concern:

- :mod:`.machine`: machine, versions, date, command, commit; Ray workers' import path.
- :mod:`.procs`: the process tree and what /proc says about it (CPU ticks, PSS, classes); what a
  finished scenario left running (``left_behind``, ``wait_gone``).
- :mod:`.load`: the machine's load (/proc/stat, /proc/loadavg) and the quiet-round mark.
- :mod:`.measure`: one measured run (wall, first item, peak PSS, CPU by class, others' load).
- :mod:`.rounds`: interleaving, medians with min–max, calibrations, pausing the idle.
- :mod:`.trials`: a scenario's interleaved trials and their tables (paired ratios).
- :mod:`.render`: Markdown, the words beside a ratio, PNG figures, result files.
- :mod:`.scenario`: the scenario format; :mod:`.report`: REPORT.md.
"""
from .load import QUIET_OUTSIDE_FRAC, LoadWindow, cpu_account, is_quiet, load_line, loadavg, machine_busy_ticks
from .machine import (BENCH_DIR, RESULTS_DIR, ROOT, command_line, git_state, machine_info, ray_worker_env,
                      version)
from .measure import Measurement, Result, TreeSampler, measure
from .procs import (CLASSES, CLK_TCK, ProcTree, _ppid_map, _read_stat, adopt_orphans, classify, cmdline, descendants,
                    is_ray_process, left_behind, pss_bytes, ray_session_roots, reap, reaped_children_ticks, snapshot,
                    wait_gone)
from .render import markdown_table, publish, pyplot, ratio_words, write_results
from .rounds import fmt_range, interleave, interleave_order, median, quiet, summarize
from .scenario import Outcome, Plan
from .trials import Trial, Trials, paired_ratios, run_interleaved, table_rows


__all__ = [n for n in dir() if not n.startswith("__")]
