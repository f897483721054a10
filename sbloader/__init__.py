"""sbloader: a PyTorch data loader that streams batches from a Ray cluster.

The public surface; everything else is internal.
"""
import os as _os

# A local Ray must bind to loopback. Ray reads this when it is first imported, so
# it is set before anything here imports ray (only when no cluster address is
# given: a driver joining a real cluster must find its own address).
if not _os.environ.get("RAY_ADDRESS"):
    _os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
from sbloader.runtime.session import RuntimeInfo, init, shutdown
from sbloader.core.block import Batch, BlockMeta, Provenance
from sbloader.core.context import TaskContext, get_context, report_skipped
from sbloader.loaders.dataloader import DataLoader
from sbloader.dataset.dataset import Dataset
from sbloader.core.errors import (
    ExecutorShutdownError,
    MemoryBudgetError,
    ResourceError,
    SbloaderError,
    SourceReadError,
    StateDictError,
    TaskLostError,
    UserFunctionError,
)
from sbloader.dataset.read import from_items, from_torch, read_images, read_parquet, read_videos
from sbloader.dataset.read import range_dataset as range
from sbloader.dataset.read_formats import from_huggingface, read_webdataset
from sbloader.core.stats import ExecutionStats, OperatorStats, StallStats
from sbloader import transforms  # noqa: E402  (sbloader.transforms: Pillow/NumPy augmentations)

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BlockMeta",
    "DataLoader",
    "Dataset",
    "ExecutionStats",
    "ExecutorShutdownError",
    "MemoryBudgetError",
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
    "range",
    "read_images",
    "read_parquet",
    "read_videos",
    "read_webdataset",
    "report_skipped",
    "shutdown",
    "transforms",
]
