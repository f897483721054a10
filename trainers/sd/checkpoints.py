"""Checkpoints: ``<ckpt-dir>/step_<step>.pt``, written atomically, the newest few kept."""
from __future__ import annotations

import argparse
import os
from typing import Any

from common import load_checkpoint, save_checkpoint

CKPT_PREFIX = "step_"


def checkpoint_files(ckpt_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every checkpoint in ``ckpt_dir``, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    out = []
    for name in os.listdir(ckpt_dir):
        if name.startswith(CKPT_PREFIX) and name.endswith(".pt") and name[len(CKPT_PREFIX):-3].isdigit():
            out.append((int(name[len(CKPT_PREFIX):-3]), os.path.join(ckpt_dir, name)))
    return sorted(out)


def write_checkpoint(ckpt_dir: str, step: int, keep: int, **state: Any) -> str:
    """Save ``step_<step>.pt`` atomically and keep the newest ``keep`` checkpoints."""
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, f"{CKPT_PREFIX}{step:08d}.pt")
    save_checkpoint(path, step=step, **state)
    for _, old in checkpoint_files(ckpt_dir)[:-keep]:
        os.remove(old)
    return path


def latest_checkpoint(args: argparse.Namespace) -> tuple[str, dict]:
    """The newest checkpoint in ``--ckpt-dir``, checked against ``--loader``.

    Raises:
        FileNotFoundError: there is no checkpoint.
        ValueError: it was written by the other loader, or is not this script's.
    """
    found = checkpoint_files(args.ckpt_dir)
    if not found:
        raise FileNotFoundError(f"--resume: no checkpoint {CKPT_PREFIX}<step>.pt in {args.ckpt_dir!r}")
    path = found[-1][1]
    ckpt = load_checkpoint(path)
    missing = [k for k in ("step", "model", "opt", "loader_state") if k not in (ckpt or {})]
    if missing:
        raise ValueError(f"{path!r} is not a train_sd.py checkpoint: it lacks {missing}")
    kind = ckpt["loader_state"].get("kind")
    if kind != args.loader:
        raise ValueError(f"{path!r} was written with --loader {kind}, found --loader {args.loader}: "
                         f"resume with --loader {kind}, or start a new --ckpt-dir")
    return path, ckpt
