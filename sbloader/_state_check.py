"""Validation shared by every loader state: header, required keys, fingerprint."""
from __future__ import annotations

from typing import Any, Sequence

from .errors import StateDictError


def check_state(state: Any, *, fmt: str, version: int, required: Sequence[str], fingerprint: dict,
                strict: bool) -> dict:
    """Check a loaded state and return it; raise "found X, expected Y" errors.

    Args:
        state: what was loaded.
        fmt: the expected ``format`` value.
        version: the expected ``version``.
        required: keys the state must have.
        fingerprint: this loader's fingerprint; compared key by key when ``strict``.
        strict: compare the fingerprint (False loads a state of changed data anyway).
    """
    if not isinstance(state, dict):
        raise StateDictError(f"a {fmt.split('.')[-1]} state is a dict, found {type(state).__name__}")
    if state.get("format") != fmt:
        raise StateDictError(f"state format: found {state.get('format')!r}, expected {fmt!r}")
    if state.get("version") != version:
        raise StateDictError(f"state version: found {state.get('version')!r}, expected {version}")
    for key in ("epoch", *required, "fingerprint"):
        if key not in state:
            raise StateDictError(f"the state has no {key!r}: found keys {sorted(state)}")
    if strict:
        for key, expected in fingerprint.items():
            found = state["fingerprint"].get(key)
            if found != expected:
                raise StateDictError(
                    f"state {key}: found {found!r}, expected {expected!r} (this loader's). Load it into a "
                    "loader over the same data and settings, or pass strict=False to load it anyway"
                )
    return state
