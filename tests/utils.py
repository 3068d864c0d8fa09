"""Test helpers, in one place: devices, comparing against plain eager PyTorch, training
loops compared with eager, and traces written by hand."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Callable

import pytest
import torch

import dtr

# The bench's training harness and memory meter, which the benchmarks report with: the
# tests train the bench models and meter memory with the same code, and take it from
# here rather than from bench/ themselves.
from bench.common import profiled_bytes, profiled_peak, quiet_stderr
from bench.harness import Trajectory, make_optimizer, to_device, train

__all__ = [
    "Case",
    "DEVICES",
    "REPO",
    "Run",
    "Trajectory",
    "assert_bitwise",
    "assert_bitwise_with_remats",
    "assert_matches",
    "call",
    "check",
    "cuda_only",
    "deterministic",
    "eager_and_dtr",
    "eager_chain_grad",
    "make_optimizer",
    "mismatches",
    "profiled_bytes",
    "profiled_peak",
    "quiet_stderr",
    "record_grads",
    "to_device",
    "train",
    "unbudgeted_peak",
    "write_trace",
]

# The repository's root: the folder tests run in subprocesses from, and where the files
# some tests read (README.md, notebooks/, bench/results/) lie.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


# ====================================================================== training runs
@functools.cache
def unbudgeted_peak(name: str, engine: str = "subclass") -> int:
    """The peak resident bytes of three steps of bench model `name` under dtr with no
    budget (deterministic costs): what the tests' budgets are fractions of."""
    dtr_kwargs = {"cost_model": "roofline", "engine": engine}
    return train(name, dtr_kwargs=dtr_kwargs).stats.peak_resident_bytes


def _same(x: torch.Tensor, y: torch.Tensor, exact: bool) -> bool:
    if exact:
        return torch.equal(x, y)
    # within the dtype's default tolerance of assert_close (a few ulps)
    try:
        torch.testing.assert_close(y, x)
    except AssertionError:
        return False
    return True


def _lengths(a: Trajectory, b: Trajectory) -> list[str]:
    """How the shapes of two trajectories differ (steps, parameters, buffers)."""
    kinds = (("steps", a.grads, b.grads), ("params", a.params, b.params))
    kinds += (("buffers", a.buffers, b.buffers),)
    out = [f"{len(ys)} {what}, expected {len(xs)}" for what, xs, ys in kinds if len(xs) != len(ys)]
    if not out:
        steps = enumerate(zip(a.grads, b.grads, strict=True))
        out = [
            f"{len(y)} grads at step {k}, expected {len(x)}"
            for k, (x, y) in steps
            if len(x) != len(y)
        ]
    return out


def mismatches(a: Trajectory, b: Trajectory, exact: bool = True) -> list[str]:
    """Where two trajectories differ bitwise (empty when identical). exact=False
    compares within assert_close's default tolerance instead, for runs that used a
    kernel without a deterministic implementation (some CUDA kernels)."""
    out = []
    if a.losses != b.losses and (
        exact or not _same(torch.tensor(a.losses), torch.tensor(b.losses), False)
    ):
        out.append(f"losses {a.losses} != {b.losses}")
    shapes = _lengths(a, b)
    if shapes:
        return out + shapes
    for step, (ga, gb) in enumerate(zip(a.grads, b.grads, strict=True)):
        for i, (x, y) in enumerate(zip(ga, gb, strict=True)):
            if (x is None) != (y is None) or (
                x is not None and (type(y) is not torch.Tensor or not _same(x, y, exact))
            ):
                out.append(f"grad {i} at step {step}")
    for kind, xs, ys in (("param", a.params, b.params), ("buffer", a.buffers, b.buffers)):
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            if not _same(x, y, exact):
                out.append(f"{kind} {i}")
    return out


# ====================================================================== training loops
# A case is a model and the training loop a user writes for it; check() runs it eagerly
# and under dtr and compares everything the loop recorded (tests/integration: torch.nn
# blocks and Hugging Face models).
@dataclasses.dataclass
class Run(Trajectory):
    # Tensors a loop produces besides gradients: evaluation outputs, gradient norms.
    outputs: list[torch.Tensor] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Case:
    """build(small) -> (model, data), from the seeds trajectory() sets; small is the
    size stress mode runs (every reuse a recomputation: cost grows with depth squared).
    train(model, data, run) runs the whole loop, optimizer included, recording into
    run. ratios: the budgets, as fractions of the unbudgeted peak."""

    name: str
    build: Callable
    train: Callable
    ratios: tuple[float, ...] = (0.5, 0.3)
    stress: bool = True

    def modes(self) -> list:
        return ["unbudgeted", *self.ratios] + (["stress"] if self.stress else [])


def trajectory(
    case: Case, dtr_kwargs: dict | None = None, small: bool = False, engine: str = "subclass"
) -> Run:
    """Build the model outside the block, run case.train eagerly (dtr_kwargs None) or
    inside dtr.enable(engine=engine, **dtr_kwargs), and collect what the loop recorded."""
    torch.manual_seed(0)
    model, data = case.build(small)
    model.train()
    run = Run([], [], [], [], None)
    torch.manual_seed(1)  # dropout's stream
    ctx = contextlib.nullcontext()
    if dtr_kwargs is not None:
        ctx = dtr.enable(engine=engine, **dtr_kwargs)
    with ctx as session:
        case.train(model, data, run)
    run.params = [p.detach().clone() for p in model.parameters()]
    run.buffers = [b.clone() for b in model.buffers()]
    run.stats = session.stats() if dtr_kwargs is not None else None
    return run


def record_grads(run: Run, model: nn.Module) -> None:
    run.grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])


def _differences(expected: Run, got: Run) -> list[str]:
    out = mismatches(expected, got)
    if len(expected.outputs) != len(got.outputs):
        out.append(f"{len(got.outputs)} outputs, expected {len(expected.outputs)}")
    for i, (x, y) in enumerate(zip(expected.outputs, got.outputs, strict=True)):
        if type(y) is not torch.Tensor or x.dtype != y.dtype or not torch.equal(x, y):
            out.append(f"output {i}")
    return out


@functools.cache
def _eager_run(case: Case, small: bool = False) -> Run:
    return trajectory(case, None, small)


@functools.cache
def _unbudgeted_run(case: Case, engine: str = "subclass") -> Run:
    return trajectory(case, {"cost_model": "roofline"}, engine=engine)


def check(case: Case, mode, engine: str = "subclass") -> dtr.Stats:
    """Run case under the engine in one of case.modes() and compare it with eager, bit
    for bit. Budgets must bind: the run evicts and recomputes, and stays within the
    budget (a fraction of the engine's own unbudgeted peak)."""
    small = mode == "stress"
    if mode == "unbudgeted":
        got = _unbudgeted_run(case, engine)
        assert got.stats.evictions == 0 and got.stats.remats == 0
    elif mode == "stress":
        got = trajectory(case, {"stress": True}, small=True, engine=engine)
        assert got.stats.remats > got.stats.ops / 2, "stress mode recomputed too little"
    else:
        budget = int(_unbudgeted_run(case, engine).stats.peak_resident_bytes * mode)
        got = trajectory(case, {"budget": budget, "cost_model": "roofline"}, engine=engine)
        assert got.stats.peak_resident_bytes <= budget
        assert got.stats.evictions > 0 and got.stats.remats > 0, "the budget did not bind"
    assert _differences(_eager_run(case, small), got) == []
    return got.stats


# ====================================================================== hand-written traces
def write_trace(path, records) -> str:
    """records (dicts) as a trace file of dtr.sim's format, one JSON object a line."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps({k: v if isinstance(v, list) else str(v) for k, v in r.items()}))
            f.write("\n")
    return str(path)


def call(name, args, results, time, sizes, aliases=None) -> list[dict]:
    """The records of one op call: the call, then each result's size and alias."""
    out = [{"INSTRUCTION": "CALL", "NAME": name, "ARGS": args, "RESULT": results, "TIME": time}]
    for k, r in enumerate(results):
        out.append({"INSTRUCTION": "MEMORY", "NAME": r, "MEMORY": sizes[k]})
        alias = -1 if aliases is None else aliases[k]
        out.append({"INSTRUCTION": "ALIAS", "NAME": r, "ALIAS": alias})
    return out
