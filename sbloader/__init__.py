"""sbloader: a PyTorch data loader that streams batches from a Ray cluster.

The public surface; everything else is internal.
"""
import os as _os

# A local Ray must bind to loopback. Ray reads this when it is first imported, so
# it is set before anything here imports ray (only when no cluster address is
# given: a driver joining a real cluster must find its own address).
if not _os.environ.get("RAY_ADDRESS"):
    _os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
from ._runtime import RuntimeInfo, init, shutdown
from .block import Batch, BlockMeta, Provenance
from .context import TaskContext, get_context, report_skipped
from .dataloader import DataLoader
from .dataset import Dataset
from .errors import (
    ExecutorShutdownError,
    MemoryBudgetError,
    SbloaderError,
    SourceReadError,
    StateDictError,
    TaskLostError,
    UserFunctionError,
)
from .images import read_images
from .parquet import read_parquet
from .read_api import from_items, from_torch
from .read_api import range_dataset as range
from .stats import ExecutionStats, OperatorStats, StallStats
from .videos import read_videos
from . import transforms  # noqa: E402  (sbloader.transforms: Pillow/NumPy augmentations)

__version__ = "0.1.0"

__all__ = sorted([
    "Batch",
    "BlockMeta",
    "DataLoader",
    "Dataset",
    "ExecutionStats",
    "ExecutorShutdownError",
    "MemoryBudgetError",
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
    "from_items",
    "from_torch",
    "get_context",
    "init",
    "range",
    "read_images",
    "read_parquet",
    "read_videos",
    "report_skipped",
    "shutdown",
    "transforms",
])
