"""sbloader: a PyTorch data loader that streams batches from a Ray cluster.

The public surface; everything else is internal.
"""
import os as _os

# A local Ray must bind to loopback. Ray reads this when it is first imported, so
# it is set before anything here imports ray (only when no cluster address is
# given: a driver joining a real cluster must find its own address).
if not _os.environ.get("RAY_ADDRESS"):
    _os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# A child forked from this process (a torch worker, a local worker) lets go of Ray: the Ray
# objects it inherited must not call into the parent's core worker (see fork_child).
from sbloader.runtime import fork_child as _fork_child  # noqa: E402

_fork_child.install()
# Public names resolve on first use (PEP 562): ``import sbloader`` imports none of Ray,
# pyarrow or the executor, so it costs about what ``import torch`` does; ``DataLoader``
# imports Ray only when an epoch needs it (in the background, see ``docs/architecture.md``).
_LAZY = {
    "RuntimeInfo": "sbloader.runtime.session", "init": "sbloader.runtime.session",
    "shutdown": "sbloader.runtime.session",
    "Batch": "sbloader.core.block", "BlockMeta": "sbloader.core.block", "Provenance": "sbloader.core.block",
    "TaskContext": "sbloader.core.context", "get_context": "sbloader.core.context",
    "report_skipped": "sbloader.core.context",
    "DataLoader": "sbloader.loaders.dataloader",
    "Dataset": "sbloader.dataset.dataset",
    "ExecutorShutdownError": "sbloader.core.errors", "MemoryBudgetError": "sbloader.core.errors",
    "ResourceError": "sbloader.core.errors", "SbloaderError": "sbloader.core.errors",
    "SourceReadError": "sbloader.core.errors", "StateDictError": "sbloader.core.errors",
    "TaskLostError": "sbloader.core.errors", "UserFunctionError": "sbloader.core.errors",
    "from_items": "sbloader.dataset.read", "from_torch": "sbloader.dataset.read",
    "read_images": "sbloader.dataset.read", "read_parquet": "sbloader.dataset.read",
    "read_videos": "sbloader.dataset.read", "range": "sbloader.dataset.read:range_dataset",
    "from_huggingface": "sbloader.dataset.read_formats", "mix": "sbloader.dataset.mix",
    "MixedDataset": "sbloader.dataset.mix", "read_webdataset": "sbloader.dataset.read_formats",
    "ExecutionStats": "sbloader.core.stats", "OperatorStats": "sbloader.core.stats",
    "StallStats": "sbloader.core.stats",
    "transforms": "sbloader.transforms:",
}


def __getattr__(name: str):
    """Resolve a public name on first use (and keep it: the next access is a plain attribute)."""
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'sbloader' has no attribute {name!r}")
    import importlib

    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    value = module if target.endswith(":") else getattr(module, attr or name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BlockMeta",
    "DataLoader",
    "Dataset",
    "ExecutionStats",
    "ExecutorShutdownError",
    "MemoryBudgetError",
    "MixedDataset",
    "ResourceError",
    "OperatorStats",
    "Provenance",
    "RuntimeInfo",
    "SbloaderError",
    "SourceReadError",
    "StallStats",
    "StateDictError",
    "TaskContext",
    "TaskLostError",
    "UserFunctionError",
    "from_huggingface",
    "from_items",
    "from_torch",
    "get_context",
    "init",
    "mix",
    "range",
    "read_images",
    "read_parquet",
    "read_videos",
    "read_webdataset",
    "report_skipped",
    "shutdown",
    "transforms",
]
