"""How straight the drop-in's epoch path is: the loaders modules one ``iter(loader)`` walks through.

Issue #44 asks that the path get simpler, not longer. This traces one ``iter()`` of a second
loader (a first one has imported everything) with ``sys.setprofile`` in the calling thread and
prints the sequence of ``sbloader.loaders`` modules on top of the stack (a module entered again
after another is one more visit), the number of visits and how many are returns to a module
already left. A property or helper of another module counts as a visit, as it is one in the
reading of the code.

    python scripts/epoch_path.py map        # DataLoader(list(range(1000)), batch_size=32, shuffle=True, num_workers=2)
    python scripts/epoch_path.py iterable   # an IterableDataset of 100 ints, batch_size=8, num_workers=2

At 7356819~1 (before #44's local start): map 27 visits (19 returns), iterable 31 (22). At 2b899ea:
map 59 (47), iterable 57 (45). With the epoch as three stages (plan, producer, iterator): map 25 (16),
iterable 23 (13).
"""
from __future__ import annotations

import sys
import threading

import sbloader
from torch.utils.data import IterableDataset


class Ints(IterableDataset):
    """100 ints (each worker yields them all: the path, not the data, is measured)."""

    def __iter__(self):
        return iter(range(100))


def make(kind: str) -> sbloader.DataLoader:
    """A loader with torch's default arguments: map-style (``"map"``) or an ``IterableDataset``."""
    if kind == "map":
        return sbloader.DataLoader(list(range(1000)), batch_size=32, shuffle=True, num_workers=2)
    return sbloader.DataLoader(Ints(), batch_size=8, num_workers=2)


def trace(loader: sbloader.DataLoader) -> list:
    """The loaders modules on top of the stack during ``iter(loader)``, consecutive repeats merged."""
    calls, main = [], threading.get_ident()

    def profile(frame, event, arg):
        mod = frame.f_globals.get("__name__", "")
        if threading.get_ident() == main and event in ("call", "return") and mod.startswith("sbloader.") \
                and frame.f_code.co_name != "<module>":
            calls.append((event, mod))

    sys.setprofile(profile)
    it = iter(loader)
    sys.setprofile(None)
    path, stack = [], []
    for event, mod in calls:
        if event == "call":
            stack.append(mod)
        elif stack:
            stack.pop()
        top = next((m for m in reversed(stack) if ".loaders." in m), None)
        if top and (not path or path[-1] != top):
            path.append(top)
    next(it)
    it.close()
    return path


def main() -> None:
    """Trace a second loader's ``iter()`` and print its path."""
    kind = sys.argv[1] if len(sys.argv) > 1 else "map"
    first = iter(make(kind))
    next(first)
    first.close()
    path = trace(make(kind))
    back = sum(1 for i in range(1, len(path)) if path[i] in path[:i - 1])
    print(f"{len(path)} visits, {back} returns to a module already left")
    print(" -> ".join(p.rsplit(".", 1)[-1] for p in path))


if __name__ == "__main__":
    main()
