"""The open-files limit that Ray needs, checked before ``ray`` is imported.

Ray's core worker dies in C++ when it cannot open its sockets (errno 24), and ``import ray`` loads C++
that seeds its random numbers from a file: where none can be opened it aborts the process (absl's
``SeedGenException``). So sbloader raises the limit as Ray does and refuses to start Ray below
:data:`MIN_OPEN_FILES`, before anything imports ``ray`` (torch's ``test_fd_limit_exceeded`` under the swap).
"""
from __future__ import annotations

MIN_OPEN_FILES = 256  # below this many open files Ray's core worker dies in C++ (errno 24), taking the process


def check() -> None:
    """Raise the process's open-files limit as Ray does (to its hard limit, at most 65,536); refuse to start
    Ray below :data:`MIN_OPEN_FILES` with an error that says what to do (Ray itself would abort the process
    when its core worker cannot open its sockets)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
        except ValueError:
            pass
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        raise RuntimeError(
            f"sbloader: Ray was not started: this process may open only {soft} files (ulimit -n) and Ray's "
            f"daemons and workers need at least {MIN_OPEN_FILES} (8192 recommended). Raise the limit (ulimit -n "
            "8192) to load on Ray's workers; local worker processes load what they can meanwhile (with few "
            "files, torch's advice for its workers holds too: torch.multiprocessing.set_sharing_strategy"
            "('file_system')).")
