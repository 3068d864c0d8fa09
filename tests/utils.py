"""Test helpers: devices, and comparing against plain eager PyTorch."""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

if torch.cuda.is_available():
    # Deterministic cuBLAS (and cuDNN RNNs) need a fixed workspace configuration, which
    # PyTorch reads once, at the process's first GEMM: set it on import, before any test
    # has run a kernel (a value the caller exported wins).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# What PyTorch warns, under use_deterministic_algorithms(True, warn_only=True), when an
# op it runs has no deterministic implementation on this device.
_NONDETERMINISTIC = "does not have a deterministic implementation"


@contextlib.contextmanager
def deterministic(device: str):
    """Run what is compared (an eager run and a dtr run) inside this.

    On CPU it changes nothing: the CPU kernels are deterministic, so results must be
    bitwise equal. On CUDA it selects deterministic kernels wherever PyTorch has one
    (``torch.use_deterministic_algorithms``, cuDNN benchmarking off), with
    ``warn_only=True`` so that an op without one still runs. It yields a list that, when
    the block ends, names those ops (from PyTorch's warnings): empty means every kernel
    was deterministic and the comparison must be bitwise (``exact=not that list``)."""
    seen: list[str] = []
    if torch.device(device).type != "cuda":
        yield seen
        return
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", message=f".*{_NONDETERMINISTIC}")
            yield seen
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[2:]
    for w in caught:
        text = str(w.message)
        if _NONDETERMINISTIC in text:
            seen.append(text.split(_NONDETERMINISTIC)[0].strip())
        else:  # not ours: hand it on to the filters (and pytest) as it was
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def eager_and_dtr(fn, device, **kwargs):
    """fn() eagerly and under dtr.enable(**kwargs), each after torch.manual_seed(0) (which
    seeds every device's generator); returns (eager, dtr, stats, exact): exact unless a
    CUDA kernel without a deterministic implementation ran."""
    import dtr

    with deterministic(device) as nondeterministic:
        torch.manual_seed(0)
        expected = fn()
        torch.manual_seed(0)
        with dtr.enable(**kwargs) as session:
            got = fn()
            got = [dtr.materialize(t) if isinstance(t, torch.Tensor) else t for t in got]
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
    return expected, got, session.stats(), not nondeterministic


def assert_bitwise(actual, expected, what: str = "value") -> None:
    """Equal in every bit, and plain tensors: neither dtr wrappers nor the native engine's
    managed tensors (whose type is torch.Tensor too)."""
    assert type(actual) is torch.Tensor, f"{what}: got {type(actual).__name__}, not a plain tensor"
    assert not _native_managed(actual), f"{what}: a native engine's managed tensor, not a plain one"
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert torch.equal(actual, expected), f"{what} differs from eager"


def _native_managed(t: torch.Tensor) -> bool:
    import dtr.engines.native.session

    try:
        return dtr.engines.native.session.is_managed(t)
    except ImportError:  # no C++ extension: no native engine
        return False


def assert_bitwise_with_remats(fn, engine: str, mode: dict):
    """fn() on the CPU under dtr (engine, roofline costs, mode: stress or a budget) equal
    to eager in every value it returns, with recomputations made; returns the stats."""
    expected, got, stats, _ = eager_and_dtr(fn, "cpu", engine=engine, cost_model="roofline", **mode)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_bitwise(g, e, f"value {i}")
    assert stats.remats > 0
    return stats


def assert_matches(actual, expected, exact: bool = True, what: str = "value") -> None:
    """assert_bitwise when exact (always on CPU). Otherwise, for a CUDA run that used a
    kernel without a deterministic implementation (see ``deterministic``: atomicAdd
    reductions sum in a different order each run, so two eager runs differ in the last
    bits too), a plain tensor of the same dtype and shape within the dtype's default
    tolerance of torch.testing.assert_close (a few ulps: rtol 1.3e-6, atol 1e-5 for
    float32)."""
    if exact:
        assert_bitwise(actual, expected, what)
        return
    assert type(actual) is torch.Tensor, f"{what}: got {type(actual).__name__}, not a plain tensor"
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what} differs from eager: {m}")


def eager_chain_grad(x: torch.Tensor, n: int, step=torch.tanh) -> torch.Tensor:
    """The gradient of sum(step^n(x)) with respect to x, computed eagerly on a copy."""
    x2 = x.detach().requires_grad_()
    h = x2
    for _ in range(n):
        h = step(h)
    h.sum().backward()
    return x2.grad
