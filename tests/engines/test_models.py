"""The five bench models train bitwise identically to eager PyTorch under dtr.

For each model and optimizer: three steps eagerly, then under dtr with no budget (which
reports the peak P), then at budgets of 100%, 50% and 30% of P, and in stress mode (every
evictable tensor evicted after every op, so every reuse is a recomputation). Losses,
gradients after every step, parameters and buffers must be equal in every bit. The
deterministic cost model keeps eviction decisions, and so feasibility, the same from run
to run. All five models are feasible at 30% (see README, "What is tested"). Each run is
made on both engines (the `engine` fixture: the subclass engine, and the native one on
the CPU), each at fractions of its own peak. (On CUDA the
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

from tests.conftest import HAVE_CPP
from tests.utils import DEVICES, deterministic, mismatches, train

HAVE_NATIVE = HAVE_CPP  # the native engine is part of the C++ extension

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
def _unbudgeted(name: str, optimizer: str, device: str, engine: str):
    return _train(name, optimizer, device, {"cost_model": "roofline", "engine": engine})


def _on(engine: str, device: str) -> str:
    if engine == "native" and device != "cpu":
        pytest.skip("the native engine runs on the CPU only")
    return engine


def _check(name: str, optimizer: str, dtr_kwargs: dict, device: str):
    expected, exact = _eager(name, optimizer, device)
    got, exact_here = _train(name, optimizer, device, dtr_kwargs)
    assert mismatches(expected, got, exact and exact_here) == []
    return got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", MODELS)
def test_unbudgeted_matches_eager(name, optimizer, device, engine):
    expected, exact = _eager(name, optimizer, device)
    got, exact_here = _unbudgeted(name, optimizer, device, _on(engine, device))
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


# The lowest fraction of its unbudgeted peak each model trains at. The CNN's lies higher:
# its convolutions' backward kernels allocate buffers of their own (measured by the CPU
# allocator's meter and made room for, so that the budget bounds real memory) as large as
# two thirds of a budget of 0.3 of the peak. The LSTM's layer op needs 0.31 of the peak at
# once (its op-level floor, Stats.op_floor_bytes): no lower budget can run it.
LOWEST = {"cnn": 0.4, "lstm": 0.35}


def lowest(name: str) -> float:
    return LOWEST.get(name, 0.3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [1.0, 0.5, "lowest"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", MODELS)
def test_budget_matches_eager(name, optimizer, ratio, device, engine):
    peak = _unbudgeted(name, optimizer, device, _on(engine, device))[0].stats.peak_resident_bytes
    fixed = _cudnn_dropout_state_bytes() * 3 if name == "lstm" and device == "cuda" else 0
    fixed = min(fixed, peak)
    ratio = lowest(name) if ratio == "lowest" else ratio
    budget = fixed + int((peak - fixed) * ratio)
    kwargs = {"budget": budget, "cost_model": "roofline", "engine": engine}
    got = _check(name, optimizer, kwargs, device)
    stats = got.stats
    assert stats.peak_resident_bytes <= budget
    if ratio < 1.0:
        assert stats.evictions > 0 and stats.remats > 0, "the budget did not bind"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", MODELS)
def test_stress_matches_eager(name, optimizer, device, engine):
    got = _check(name, optimizer, {"stress": True, "engine": _on(engine, device)}, device)
    assert got.stats.remats > got.stats.ops / 2, "stress mode recomputed too little"


@pytest.mark.parametrize("name", MODELS)
def test_cores_and_engines_decide_alike_at_the_lowest_budget(name, monkeypatch):
    # The same run on the subclass engine's C++ core, on its pure-Python twin and on the
    # native engine: same results, and the same decisions (the counters agree exactly
    # under the deterministic cost model).
    peak = _unbudgeted(name, "sgd", "cpu", "subclass")[0].stats.peak_resident_bytes
    kwargs = {"budget": int(peak * lowest(name)), "cost_model": "roofline"}
    runs = {"c++": _check(name, "sgd", {**kwargs, "engine": "subclass"}, "cpu").stats}
    if HAVE_NATIVE:
        runs["native"] = _check(name, "sgd", {**kwargs, "engine": "native"}, "cpu").stats
    monkeypatch.setenv("DTR_FORCE_PYTHON", "1")
    runs["python"] = _check(name, "sgd", {**kwargs, "engine": "subclass"}, "cpu").stats
    # the native engine runs the C++ core
    assert {kind: stats.core for kind, stats in runs.items()} == {
        k: "c++" if k == "native" else k for k in runs
    }
    decisions = {k: (s.evictions, s.remats, s.peak_resident_bytes) for k, s in runs.items()}
    assert len(set(decisions.values())) == 1, decisions
