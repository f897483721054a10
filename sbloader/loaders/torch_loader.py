"""torch's own ``DataLoader`` class, for the local workers, even where ``torch.utils.data.DataLoader`` was replaced.

The local start (:mod:`~sbloader.loaders.local_start`, :mod:`~sbloader.loaders.iterable_start`,
:mod:`~sbloader.loaders.native_start`) runs its worker processes through torch's own
``DataLoader``. A program that swaps ``torch.utils.data.DataLoader`` for ``sbloader.DataLoader``
(a test harness that patches torch's module, as ``scripts/conformance/torch_dataloader_suite.py``
does) would otherwise give the local start an sbloader loader, whose own local start takes
another, and so on: each level started a pool of actors ahead, without end. The class is
taken as torch defined it, or as it was when sbloader was imported.
"""
from __future__ import annotations

import torch.utils.data.dataloader as _torch_dataloader

_AT_IMPORT = _torch_dataloader.DataLoader  # torch's class as it was when sbloader was imported
_TORCH_MODULE = "torch.utils.data.dataloader"


def torch_loader() -> type:
    """torch's ``DataLoader`` class: ``torch.utils.data.dataloader.DataLoader`` when that is torch's own,
    else the one that was there when sbloader was imported.

    Raises:
        RuntimeError: neither is torch's (replaced before sbloader was imported): import sbloader first.
    """
    for cls in (_torch_dataloader.DataLoader, _AT_IMPORT):
        if getattr(cls, "__module__", None) == _TORCH_MODULE:
            return cls
    raise RuntimeError("torch.utils.data.DataLoader was replaced before sbloader was imported, and sbloader's "
                       "local workers need torch's own DataLoader: import sbloader before replacing it")
