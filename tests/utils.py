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


def eager_chain_grad(x: torch.Tensor, n: int, step=torch.tanh) -> torch.Tensor:
    """The gradient of sum(step^n(x)) with respect to x, computed eagerly on a copy."""
    x2 = x.detach().requires_grad_()
    h = x2
    for _ in range(n):
        h = step(h)
    h.sum().backward()
    return x2.grad
