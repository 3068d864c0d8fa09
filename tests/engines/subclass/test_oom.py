"""Evicting on demand when the allocator runs out of memory (dtr/engines/subclass/oom.py).

A CPU machine never raises torch.OutOfMemoryError on its own, so these tests model a
small device: custom ops that raise it, with the CUDA allocator's message, whenever dtr's
resident count plus their output would pass a capacity. Under no budget at all, dtr must
evict, rerun the op and train bit for bit as eager does; when nothing is left to evict, or
the op writes in place, it must say so with a BudgetError."""

from __future__ import annotations

import pytest
import torch

import dtr
from dtr.engines.subclass import oom

CAPACITY = {"bytes": None}  # None: the fake device never runs out
FAILS = {"first": 0}  # ops left that fail once after drawing random numbers


def _pressure_check(x: torch.Tensor) -> None:
    session = dtr.session.current()
    cap = CAPACITY["bytes"]
    if session is None or cap is None:
        return
    resident = session.stats().resident_bytes
    need = x.untyped_storage().nbytes()
    if resident + need > cap:
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {need / 2**20:.2f} MiB. GPU 0 has a "
            f"total capacity of {cap} bytes"
        )


@torch.library.custom_op("dtr_test::pressure", mutates_args=())
def pressure(x: torch.Tensor) -> torch.Tensor:
    _pressure_check(x)
    return torch.tanh(x) * 1.5


@pressure.register_fake
def _(x):
    return torch.empty_like(x)


def _pressure_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * 1.5 * (1 - torch.tanh(x) ** 2)


pressure.register_autograd(
    _pressure_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs)
)


@torch.library.custom_op("dtr_test::pressure_", mutates_args=("x",))
def pressure_(x: torch.Tensor) -> None:
    _pressure_check(x)
    x.mul_(2)


@torch.library.custom_op(
    "dtr_test::noisy", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def noisy(x: torch.Tensor) -> torch.Tensor:
    noise = torch.rand_like(x)  # draws first, then "runs out of memory"
    if FAILS["first"] > 0 and dtr.session.current() is not None:
        FAILS["first"] -= 1
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
    return x + noise


@noisy.register_fake
def _(x):
    return torch.empty_like(x)


noisy.register_autograd(lambda ctx, grad: grad, setup_context=lambda ctx, inputs, output: None)


@pytest.fixture(autouse=True)
def _reset():
    yield
    CAPACITY["bytes"] = None
    FAILS["first"] = 0


def _model():
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(96, 96) for _ in range(8))


def _step(layers, x):
    h = x
    for layer in layers:
        h = pressure(layer(h))
    return h.square().mean()


def _run(capacity=None, **kwargs):
    layers = _model()
    x = torch.randn(512, 96, generator=torch.Generator().manual_seed(1))
    # roofline costs: the same evictions every run (measured ones depend on the machine)
    with dtr.enable(**{"cost_model": "roofline", **kwargs}) as session:
        CAPACITY["bytes"] = capacity
        loss = _step(layers, x)
        loss.backward()
        CAPACITY["bytes"] = None
    grads = [p.grad for p in layers.parameters()]
    return loss, grads, session.stats()


def test_requested_bytes_is_read_from_the_allocator_message():
    assert oom.requested_bytes(RuntimeError("Tried to allocate 20.00 MiB. GPU 0")) == 20 * 2**20
    assert oom.requested_bytes(RuntimeError("tried to allocate 512 bytes")) == 512
    assert oom.requested_bytes(RuntimeError("out of memory")) == 0


def test_no_budget_evicts_on_demand_and_matches_eager(core):
    loss0, grads0, free = _run()
    assert free.evictions == 0 and free.oom_retries == 0
    loss, grads, stats = _run(capacity=int(0.5 * free.peak_resident_bytes))
    assert stats.oom_retries > 0 and stats.evictions > 0 and stats.remats > 0
    assert stats.budget_bytes is None
    assert torch.equal(loss, loss0)
    for g, g0 in zip(grads, grads0, strict=True):
        assert type(g) is torch.Tensor and torch.equal(g, g0)


def test_on_demand_eviction_under_a_budget_too(core):
    _, grads0, free = _run()
    _, grads, stats = _run(
        capacity=int(0.5 * free.peak_resident_bytes), budget=int(0.8 * free.peak_resident_bytes)
    )
    assert stats.oom_retries > 0 and all(torch.equal(g, g0) for g, g0 in zip(grads, grads0, strict=True))


def test_nothing_left_to_evict_is_a_budget_error_with_the_numbers(core):
    with pytest.raises(dtr.BudgetError, match="nothing left to evict") as info:
        _run(capacity=1024)
    message = str(info.value)
    assert "dtr_test.pressure" in message and "Tried to allocate" in message
    assert "resident" in message and "pinned" in message
    assert isinstance(info.value, torch.OutOfMemoryError)
    assert dtr.session.current() is None
    _, _, stats = _run()  # the process stays usable
    assert stats.evictions == 0


def test_ops_that_write_in_place_are_not_retried(core):
    with dtr.enable() as session:
        a = torch.randn(256, 256, requires_grad=True) * 2
        b = a + 1
        CAPACITY["bytes"] = 1  # any op of pressure_ fails
        with pytest.raises(dtr.BudgetError, match="does not retry ops that write"):
            torch.ops.dtr_test.pressure_(b)
        CAPACITY["bytes"] = None
        assert torch.equal(b, a + 1)  # the failed op wrote nothing
    assert session.stats().oom_retries == 0


def test_a_random_op_retried_draws_the_same_numbers(core):
    # noisy draws its numbers, then fails once: the retry must start from the captured
    # generator state, or y (and every later recomputation of it) would differ from eager
    def run(fail: int):
        torch.manual_seed(3)
        x = torch.randn(32, 32, requires_grad=True)
        with dtr.enable() as session:
            spare = [x * k for k in range(3, 6)]  # something to evict when noisy fails
            FAILS["first"] = fail
            y = noisy(x * 2)
            z = (y * y).sum()
            z.backward()
            after = torch.rand(4)  # the stream the program sees goes on as in eager
            del spare
        return dtr.materialize(y), x.grad, after, session.stats()

    y0, g0, after0, _ = run(0)
    y1, g1, after1, stats = run(1)
    assert stats.oom_retries == 1 and stats.evictions > 0
    assert torch.equal(y1, y0) and torch.equal(g1, g0) and torch.equal(after1, after0)
