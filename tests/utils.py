"""Test helpers: devices, and comparing against plain eager PyTorch."""

from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def assert_bitwise(actual, expected, what: str = "value") -> None:
    """Equal in every bit, and plain tensors (not dtr wrappers)."""
    assert type(actual) is torch.Tensor, f"{what}: got {type(actual).__name__}, not a plain tensor"
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert torch.equal(actual, expected), f"{what} differs from eager"
