"""The local start's workers run through torch's own DataLoader, even where torch.utils.data.DataLoader was
swapped for sbloader's (torch's own test file under the swap: each local start took an sbloader loader, whose
own local start took another, each starting a pool of actors ahead, without end)."""
from __future__ import annotations

import pytest
import torch.utils.data
import torch.utils.data.dataloader

import sbloader
from sbloader.loaders import torch_loader as tl


def test_torchs_class_when_nobody_replaced_it():
    assert tl.torch_loader() is torch.utils.data.dataloader.DataLoader


def test_torchs_class_where_torchs_module_was_patched_with_sbloaders(monkeypatch):
    original = torch.utils.data.dataloader.DataLoader
    monkeypatch.setattr(torch.utils.data, "DataLoader", sbloader.DataLoader)
    monkeypatch.setattr(torch.utils.data.dataloader, "DataLoader", sbloader.DataLoader)
    assert tl.torch_loader() is original


def test_replaced_before_sbloader_was_imported_says_what_to_do(monkeypatch):
    class Other:  # neither the module's class nor the one seen at sbloader's import is torch's
        pass

    monkeypatch.setattr(torch.utils.data.dataloader, "DataLoader", Other)
    monkeypatch.setattr(tl, "_AT_IMPORT", Other)
    with pytest.raises(RuntimeError, match="import sbloader before replacing it"):
        tl.torch_loader()
