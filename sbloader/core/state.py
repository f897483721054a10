"""The one state protocol of every loader: a small, versioned, JSON-serialisable dict.

Every loader state has a header (``format``, ``version``, ``fingerprint``), an
``epoch``, and its loader's body (what the epoch consumed). :class:`StateFormat`
writes the header and checks a loaded state with "found X, expected Y" errors:
the format and version (an older version is upgraded where it means the same,
refused with the reason where it does not), the required keys, and, unless
``strict=False``, the fingerprint of the data and batching it was taken over.
No pickles: a checkpoint is data.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from sbloader.core.errors import StateDictError


@dataclass(frozen=True)
class StateFormat:
    """One loader's state format.

    Attributes:
        name: the ``format`` value (``"sbloader.DataLoader"``).
        version: the version written.
        required: keys of the body every state has (``epoch`` and ``fingerprint`` always).
        upgrades: per older version, a function from a state of that version to one of
            the next (raising :class:`~sbloader.core.errors.StateDictError` with the reason
            where it cannot mean the same).
    """

    name: str
    version: int
    required: tuple[str, ...] = ()
    upgrades: Mapping[int, Callable[[dict], dict]] = field(default_factory=dict)

    def header(self, fingerprint: dict) -> dict:
        """The header of a state taken now."""
        return {"format": self.name, "version": self.version, "fingerprint": fingerprint}

    def check(self, state: Any, fingerprint: dict, strict: bool) -> dict:
        """A loaded state, upgraded to this version and checked; raises "found X, expected Y" errors.

        Args:
            state: what was loaded.
            fingerprint: this loader's fingerprint; compared key by key when ``strict``.
            strict: compare the fingerprint (False loads a state of changed data anyway).
        """
        kind = self.name.split(".")[-1]
        if not isinstance(state, dict):
            raise StateDictError(f"a {kind} state is a dict, found {type(state).__name__}")
        if state.get("format") != self.name:
            raise StateDictError(f"state format: found {state.get('format')!r}, expected {self.name!r}")
        while state.get("version") in self.upgrades and state.get("version") != self.version:
            state = self.upgrades[state["version"]](state)
        if state.get("version") != self.version:
            raise StateDictError(f"state version: found {state.get('version')!r}, expected {self.version}")
        for key in ("epoch", *self.required, "fingerprint"):
            if key not in state:
                raise StateDictError(f"the state has no {key!r}: found keys {sorted(state)}")
        if strict:
            check_fingerprint(state["fingerprint"], fingerprint)
        return state


def check_fingerprint(found: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Raise unless every key of ``expected`` has the same value in ``found``."""
    for key, value in expected.items():
        if found.get(key) != value:
            raise StateDictError(
                f"state {key}: found {found.get(key)!r}, expected {value!r} (this loader's). Load it into a "
                "loader over the same data and settings, or pass strict=False to load it anyway"
            )


def check_state(state: Any, *, fmt: str, version: int, required: Sequence[str], fingerprint: dict,
                strict: bool) -> dict:
    """:meth:`StateFormat.check` for a format given by its parts (no upgrades)."""
    return StateFormat(fmt, version, tuple(required)).check(state, fingerprint, strict)
