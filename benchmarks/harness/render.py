"""Rendering: Markdown tables, the words next to a ratio, PNG figures that carry their
own provenance, and the JSON + Markdown result files with their header."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from .machine import RESULTS_DIR, command_line, machine_info, machine_line, versions_line


def ratio_words(ratio: Optional[float], baseline: str, quiet: bool, what: str = "") -> str:
    """The words for a side-by-side ratio ``contender / baseline`` of a higher-is-better figure.

    A ratio from a loaded machine is said to be one (never called a speed-up): the
    others' load slows contenders unevenly.
    """
    if ratio is None:
        return "–"
    text = f"{ratio:.2f}x {baseline}" + (f" ({what})" if what else "")
    return text if quiet else text + " [loaded machine: a ratio, not a speed-up]"


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Optional[Sequence[str]] = None) -> str:
    """A Markdown table of ``rows`` (dicts) with the given columns, in order (default: the
    first row's keys)."""
    columns = list(rows[0]) if columns is None else columns
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend; None without matplotlib
    (the benchmarks then write no figure)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_results(name: str, payload: Mapping[str, Any], markdown: str, *,
                  title: Optional[str] = None, results_dir: Path = RESULTS_DIR) -> tuple[Path, Path]:
    """Write ``<name>.json`` (payload + command + machine) and ``<name>.md``.

    The Markdown gets a header with the command, machine, versions and date.

    Returns:
        The two paths.
    """
    results_dir.mkdir(parents=True, exist_ok=True)
    machine = payload.get("machine") or machine_info()
    command = payload.get("command") or command_line()
    full = {"command": command, "machine": machine, **{k: v for k, v in payload.items() if k not in ("command", "machine")}}
    jpath = results_dir / f"{name}.json"
    jpath.write_text(json.dumps(full, indent=2, default=str) + "\n")
    header = [
        f"# {title or name}",
        "",
        f"- command: `{command}`",
        f"- date: {machine['date']}",
        f"- machine: {machine_line(machine)}",
        f"- versions: {versions_line(machine)}",
        f"- raw data: `{jpath.name}`",
        "",
    ]
    mpath = results_dir / f"{name}.md"
    mpath.write_text("\n".join(header) + markdown.rstrip() + "\n")
    return jpath, mpath


def publish(name: str, payload: Mapping[str, Any], markdown: str, *, title: str, png: Optional[Path] = None,
            alt: Optional[str] = None, show: bool = True, note: str = "") -> tuple[Path, Path]:
    """:func:`write_results`, then say so: the Markdown (unless ``show=False``) and a
    ``wrote <json> and <md>[ and <png>]<note>`` line.

    Args:
        png: a figure already saved next to the results: shown at the end of the
            Markdown (``![alt](name.png)``, ``alt`` default ``name``) and named in the line.

    Returns:
        The JSON and Markdown paths.
    """
    if png is not None:
        markdown += f"\n\n![{alt or name}]({png.name})\n"
    jpath, mpath = write_results(name, payload, markdown, title=title)
    if show:
        print(mpath.read_text())
    print(f"wrote {jpath} and {mpath}" + (f" and {png}" if png else "") + note, flush=True)
    return jpath, mpath


def provenance_lines(command: str, machine: Mapping[str, Any], load: str) -> list[str]:
    """The lines every figure carries: command, machine, versions, date, load."""
    return [f"command: {command}", f"machine: {machine_line(machine)}", f"versions: {versions_line(machine)}",
            f"date: {machine['date']}", load]


def bar_figure(path: Path, title: str, bars: Sequence[Mapping[str, Any]], unit: str,
               provenance: Sequence[str]) -> Optional[Path]:
    """A bar per contender (median) with min–max whiskers, quiet bars solid and loaded
    ones hatched, the provenance printed under the plot. None without matplotlib.

    Args:
        bars: dicts with ``label``, ``median``, ``min``, ``max`` and ``quiet`` (bool).
    """
    plt = pyplot()
    bars = [b for b in bars if b.get("median") is not None]
    if plt is None or not bars:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.4 + 0.12 * len(provenance)))
    xs = range(len(bars))
    med = [b["median"] for b in bars]
    err = [[m - b["min"] for m, b in zip(med, bars)], [b["max"] - m for m, b in zip(med, bars)]]
    rects = ax.bar(xs, med, yerr=err, capsize=4, color="#4c72b0")
    for r, b in zip(rects, bars):
        if not b.get("quiet"):
            r.set_hatch("//")
            r.set_facecolor("#a0b4d8")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([b["label"] for b in bars], rotation=15, ha="right", fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(title + "  (hatched: loaded rounds; whiskers: min–max)", fontsize=9)
    fig.text(0.01, 0.01, "\n".join(provenance), fontsize=6, va="bottom", family="monospace", wrap=True)
    fig.subplots_adjust(bottom=0.2 + 0.03 * len(provenance), top=0.9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
