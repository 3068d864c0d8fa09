"""The five bench models train bitwise identically to eager PyTorch under dtr.

For each model and optimizer: three steps eagerly, then under dtr with no budget (which
reports the peak P), then at budgets of 100%, 50% and 30% of P, and in stress mode (every
evictable tensor evicted after every op, so every reuse is a recomputation). Losses,
gradients after every step, parameters and buffers must be equal in every bit. The
deterministic cost model keeps eviction decisions, and so feasibility, the same from run
to run. All five models are feasible at 30% (see README, "What is tested"), on the
native engine too (dtr.enable(engine="native"), at 30% of its own peak). (On CUDA the
LSTM's budgets are fractions of P less cuDNN's dropout states, which no budget can evict:
see _cudnn_dropout_state_bytes.)

Each comparison runs on every device in ``tests.utils.DEVICES``. On CUDA the runs use
deterministic algorithms and are compared bitwise unless a kernel without a
deterministic implementation ran (PyTorch warns, ``tests.utils.deterministic`` records
it); then two eager runs differ in the last bits too, and the comparison is within a few
ulps. The check that the Python core makes the C++ core's decisions is about
bookkeeping, which no device changes: CPU only.
"""

from __future__ import annotations

import functools

import pytest
import torch

from bench.harness import mismatches, train
from tests.utils import DEVICES, deterministic

MODELS = ["mlp", "cnn", "lstm", "transformer", "tree"]
OPTIMIZERS = ["sgd", "adam"]


def _train(name: str, optimizer: str, device: str, dtr_kwargs: dict | None):
    """(trajectory, exact): exact unless a nondeterministic CUDA kernel ran."""
    with deterministic(device) as nondeterministic:
        got = train(name, optimizer=optimizer, dtr_kwargs=dtr_kwargs, device=device)
    return got, not nondeterministic


@functools.cache
def _eager(name: str, optimizer: str, device: str):
    return _train(name, optimizer, device, None)


@functools.cache
def _unbudgeted(name: str, optimizer: str, device: str):
    return _train(name, optimizer, device, {"cost_model": "roofline"})


def _check(name: str, optimizer: str, dtr_kwargs: dict, device: str):
    expected, exact = _eager(name, optimizer, device)
    got, exact_here = _train(name, optimizer, device, dtr_kwargs)
    assert mismatches(expected, got, exact and exact_here) == []
    return got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", MODELS)
def test_unbudgeted_matches_eager(name, optimizer, device):
    expected, exact = _eager(name, optimizer, device)
    got, exact_here = _unbudgeted(name, optimizer, device)
    assert mismatches(expected, got, exact and exact_here) == []
    assert got.stats.evictions == 0 and got.stats.remats == 0
    assert got.stats.peak_resident_bytes > 0


def _cudnn_dropout_state_bytes() -> int:
    """The bytes of cuDNN's RNN dropout state on this GPU (6.2 MiB on an H200: one RNG
    state per thread the GPU can hold). A test-size LSTM with dropout keeps up to three
    that dtr can never evict, the live one and the snapshots the forward's and the
    backward's recipes replay from (dtr/schema.py), next to about 1 MiB of activations:
    budgets take a fraction of the rest."""
    if not torch.backends.cudnn.is_available():
        return 0
    state = torch._cudnn_init_dropout_state(0.1, True, 0, dtype=torch.uint8, device="cuda")
    return state.untyped_storage().nbytes()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.3])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", MODELS)
def test_budget_matches_eager(name, optimizer, ratio, device):
    peak = _unbudgeted(name, optimizer, device)[0].stats.peak_resident_bytes
    fixed = _cudnn_dropout_state_bytes() * 3 if name == "lstm" and device == "cuda" else 0
    fixed = min(fixed, peak)
    budget = fixed + int((peak - fixed) * ratio)
    got = _check(name, optimizer, {"budget": budget, "cost_model": "roofline"}, device)
    stats = got.stats
    assert stats.peak_resident_bytes <= budget
    if ratio < 1.0:
        assert stats.evictions > 0 and stats.remats > 0, "the budget did not bind"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", MODELS)
def test_stress_matches_eager(name, optimizer, device):
    got = _check(name, optimizer, {"stress": True}, device)
    assert got.stats.remats > got.stats.ops / 2, "stress mode recomputed too little"


@pytest.mark.parametrize("name", MODELS)
def test_python_core_matches_eager_at_30_percent(name, monkeypatch):
    # The same run on the pure-Python core: same results, and the same decisions as the
    # C++ core (the counters agree exactly under the deterministic cost model).
    peak = _unbudgeted(name, "sgd", "cpu")[0].stats.peak_resident_bytes
    kwargs = {"budget": int(peak * 0.3), "cost_model": "roofline"}
    cpp = _check(name, "sgd", kwargs, "cpu").stats
    monkeypatch.setenv("DTR_FORCE_PYTHON", "1")
    py = _check(name, "sgd", kwargs, "cpu").stats
    assert py.core == "python"
    assert (py.evictions, py.remats, py.peak_resident_bytes) == (
        cpp.evictions,
        cpp.remats,
        cpp.peak_resident_bytes,
    )


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", MODELS)
def test_native_engine_at_30_percent_matches_eager(name, optimizer):
    """The native engine (dtr.enable(engine="native")) at 30% of its own unbudgeted peak:
    losses, gradients after every step, parameters and buffers bitwise as eager."""
    pytest.importorskip("dtr._C", reason="the native engine is C++")
    native = {"engine": "native", "cost_model": "roofline"}
    free, _ = _train(name, optimizer, "cpu", native)
    budget = int(free.stats.peak_resident_bytes * 0.3)
    got = _check(name, optimizer, {**native, "budget": budget}, "cpu")
    assert got.stats.core == "native" and got.stats.peak_resident_bytes <= budget
    assert got.stats.evictions > 0 and got.stats.remats > 0
