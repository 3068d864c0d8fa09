"""Bad input and faults: malformed settings (arguments and environment alike), budgets
that cannot be met, exceptions and interrupts inside the block, and threads.

Complements tests/unit/test_config.py (budget syntax through arguments),
tests/engines/test_memory.py (an infeasible budget on the CNN) and
tests/engines/subclass/test_runtime.py (a user error inside the block, nesting, reading
wrappers from other threads).

Threads: one session at a time in the process. A second ``dtr.enable()`` while one is
active, on any thread, is refused with a DTRError; the session's wrappers may be used
from any thread (each op is served by the session's runtime under its lock), and plain
work on other threads is left alone.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtr
from dtr.engines.subclass import runtime as dtr_runtime
from tests.conftest import HAVE_CPP
from tests.utils import assert_bitwise, eager_chain_grad

FORMS = ("'800000B'", "'512MB'", "'1.5GiB'", "powers of 1000", "KiB, MiB, GiB, TiB")


def _names_forms(msg: str) -> None:
    for form in FORMS:
        assert form in msg, f"the message does not say what is accepted ({form}): {msg}"


# ====================================================================== bad input
# The budgets the issue lists, plus ones that overflowed or fell outside the core's
# int64 count before (they raised OverflowError, or TypeError on entering the block).
MALFORMED_ENV = ["abc", "-1GB", "1.5XB", "0", "True", "nan", "NaN", "inf", "-inf", "1e400"]
MALFORMED_ENV += ["1e300TiB", "9223372036854775808", "1e99999999999", "0.1B", "1 2", "1GB!"]


@pytest.mark.parametrize("value", MALFORMED_ENV)
def test_malformed_env_budget_names_variable_value_and_forms(monkeypatch, value):
    monkeypatch.setenv("DTR_MEMORY_BUDGET", value)
    with pytest.raises(dtr.ConfigError) as info:
        dtr.enable()
    msg = str(info.value)
    assert msg.startswith("dtr: invalid DTR_MEMORY_BUDGET value")
    assert repr(value) in msg
    _names_forms(msg)


@pytest.mark.parametrize(
    "value",
    [
        "1e400",
        "1e300TiB",
        2**63,
        10**30,
        1e30,
        -math.inf,
        np.float64("nan"),
        np.int64(0),
        b"1GB",
        torch.tensor(1000),
        "1e99999999999",
    ],
    ids=repr,
)
def test_malformed_budget_arguments_beyond_test_config(value):
    with pytest.raises(dtr.ConfigError) as info:
        dtr.enable(budget=value)
    msg = str(info.value)
    assert msg.startswith("dtr: invalid budget")
    assert repr(value) in msg
    _names_forms(msg)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("8.2MB", 8_200_000),  # 8199999 with float arithmetic
        ("4.35MB", 4_350_000),
        ("0.1KiB", 102),
        ("1e18", 10**18),
        (2**63 - 1, 2**63 - 1),
        ("9223372036854775807B", 2**63 - 1),
    ],
)
def test_budget_strings_are_parsed_exactly(value, expected):
    assert dtr.enable(budget=value).config.budget_bytes == expected


def test_largest_budget_enters_on_each_core(core):
    # The core counts bytes in an int64: the largest accepted budget must enter.
    x = torch.randn(4, requires_grad=True)
    with dtr.enable(budget=2**63 - 1) as session:
        (x * 2).sum().backward()
    assert session.stats().budget_bytes == 2**63 - 1
    assert session.stats().core == core


def test_empty_env_budget_means_unset(monkeypatch):
    monkeypatch.setenv("DTR_MEMORY_BUDGET", "  ")
    assert dtr.enable().config.budget_bytes is None


@pytest.mark.parametrize("name", ["DTR_STRESS", "DTR_CHECK", "DTR_FORCE_PYTHON"])
@pytest.mark.parametrize("value", ["maybe", "2", "True!"])
def test_bad_env_flags_name_variable_value_and_accepted(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(dtr.ConfigError) as info:
        dtr.enable()
    msg = str(info.value)
    assert msg.startswith("dtr: ") and name in msg and repr(value) in msg
    assert "1, true, yes, on, 0, false, no, off" in msg


@pytest.mark.parametrize("value", ["LRU", "best", "dtr,lru"])
def test_unknown_env_heuristic_names_variable_value_and_all_heuristics(monkeypatch, value):
    monkeypatch.setenv("DTR_HEURISTIC", value)
    with pytest.raises(dtr.ConfigError) as info:
        dtr.enable()
    msg = str(info.value)
    assert msg.startswith("dtr: ") and "DTR_HEURISTIC" in msg and repr(value) in msg
    for name in dtr.HEURISTICS:
        assert name in msg


@pytest.mark.parametrize("value", ["", " dtr", "DTR", 3, None])
def test_unknown_heuristic_argument_lists_all_heuristics(monkeypatch, value):
    if value is None:  # None reads the environment, which is unset here: the default
        assert dtr.enable(heuristic=None).config.heuristic == "dtr_held"
        return
    with pytest.raises(dtr.ConfigError) as info:
        dtr.enable(heuristic=value)
    msg = str(info.value)
    assert msg.startswith("dtr: ") and repr(value) in msg
    for name in dtr.HEURISTICS:
        assert name in msg


def test_bad_env_cost_model_names_the_variable(monkeypatch):
    monkeypatch.setenv("DTR_COST_MODEL", "flops")
    with pytest.raises(dtr.ConfigError) as info:
        dtr.enable()
    msg = str(info.value)
    assert "DTR_COST_MODEL" in msg and "'flops'" in msg and "time, roofline" in msg


@pytest.mark.parametrize(
    "option, value",
    [
        ("stress", "yes"),
        ("stress", 1),
        ("check", "on"),
        ("seed", -1),
        ("seed", 1.5),
        ("seed", True),
        ("min_evict_bytes", -3),
        ("min_evict_bytes", "1KB"),
        ("search_sample", -1),
        ("search_sample", 2.5),
        ("cost_model", "flops"),
        ("trace", 5),
        ("trace", ""),
    ],
)
def test_bad_option_values_name_option_and_value(option, value):
    with pytest.raises(dtr.ConfigError) as info:
        dtr.enable(**{option: value})
    msg = str(info.value)
    assert msg.startswith("dtr: ") and option in msg and repr(value) in msg


def test_unknown_options_are_all_named():
    with pytest.raises(dtr.ConfigError) as info:
        dtr.enable(budjet="1GB", stres=True)
    msg = str(info.value)
    assert "budjet" in msg and "stres" in msg
    for name in ("stress", "seed", "min_evict_bytes", "check", "cost_model", "trace"):
        assert name in msg


@pytest.mark.parametrize("via_env", [False, True])
def test_trace_into_a_missing_folder_fails_at_enable(monkeypatch, tmp_path, via_env):
    # It used to pass enable() and fail on entering the block with FileNotFoundError.
    path = str(tmp_path / "no-such-folder" / "run.jsonl")
    if via_env:
        monkeypatch.setenv("DTR_TRACE", path)
    with pytest.raises(dtr.ConfigError) as info:
        dtr.enable() if via_env else dtr.enable(trace=path)
    msg = str(info.value)
    assert repr(path) in msg and "does not exist" in msg and "DTR_TRACE" in msg


@pytest.mark.parametrize("value", ["abc", 0, True, math.nan, "-1GB", "1.5XB", 2**63])
def test_set_budget_with_a_malformed_value_keeps_the_session(value, core):
    x = torch.randn(32, 32, requires_grad=True)
    with dtr.enable(budget="1MiB", check=True) as session:
        h = x.tanh().tanh()
        with pytest.raises(dtr.ConfigError) as info:
            session.set_budget(value)
        msg = str(info.value)
        assert msg.startswith("dtr: invalid budget") and repr(value) in msg
        _names_forms(msg)
        assert session.stats().budget_bytes == 2**20  # unchanged
        h.sum().backward()
    assert torch.equal(x.grad, eager_chain_grad(x, 2))


# ====================================================================== infeasible budgets
def _train(model, batches, opt, session=None):
    """Plain training loop; returns the losses."""
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(dtr.materialize(loss.detach()).clone())
    return losses


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(64, 128), nn.Tanh(), nn.Dropout(0.2)]
    for act in (nn.ReLU, nn.Tanh, nn.ReLU, nn.Tanh):
        layers += [nn.Linear(128, 128), act()]
    return nn.Sequential(*layers, nn.Linear(128, 10))


@functools.cache
def _mlp_peak() -> int:
    """peak_resident_bytes of three training steps of _mlp() under dtr, no budget."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(5)
    with dtr.enable(cost_model="roofline") as session:
        _train(model, _batches(3), opt)
    return session.stats().peak_resident_bytes


def _batches(n: int, seed: int = 1, size: int = 256):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 64, generator=g), torch.randint(0, 10, (size,), generator=g))] * n


def _trains_bitwise_after(core_kwargs: dict) -> None:
    """A fresh session trains three steps bitwise equal to eager (the process is usable)."""
    eager = _mlp()
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    torch.manual_seed(5)
    expected = _train(eager, _batches(3), opt)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(5)
    with dtr.enable(**core_kwargs) as session:
        got = _train(model, _batches(3), opt)
    for g, e in zip(got, expected, strict=True):
        assert_bitwise(g, e, "loss")
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert_bitwise(p.detach(), q.detach(), "parameter")
    assert session.stats().remats > 0


def test_budget_below_the_parameters_fails_at_the_first_op(core):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(8, 256)
    with pytest.raises(dtr.BudgetError) as info:
        with dtr.enable(budget="64KiB", cost_model="roofline") as session:
            model(x).sum().backward()
    assert session.stats().ops == 1  # within one op, not after a loop of evictions
    msg = str(info.value)
    # weight 256 KiB + bias 1 KiB + batch 8 KiB (constants) + the 8 KiB output
    assert msg.startswith(
        "dtr: cannot stay within the memory budget of 64.00 KiB while running "
        "aten.addmm.default: 273.00 KiB resident, 8.00 KiB requested, 265.00 KiB pinned"
    ), msg
    assert "Largest unevictable: constant[256x256] 256.00 KiB" in msg
    assert isinstance(info.value, torch.OutOfMemoryError)
    # A clean state: no session, the model untouched, and eager work on it plain again
    # (dtr's gradient hooks are gone).
    assert dtr.session.current() is None
    for p, b in zip(model.parameters(), before, strict=True):
        assert p.grad is None and torch.equal(p.detach(), b)
    model(x).sum().backward()
    assert all(type(p.grad) is torch.Tensor for p in model.parameters())
    _trains_bitwise_after({"budget": int(_mlp_peak() * 0.6), "cost_model": "roofline"})


def test_budget_below_one_ops_inputs_and_outputs(core):
    x = torch.randn(128, 128, requires_grad=True)  # 64 KiB, a constant
    with pytest.raises(dtr.BudgetError) as info:
        with dtr.enable(budget="96KiB", cost_model="roofline") as session:
            (x @ x).sum().backward()  # 64 KiB in + 64 KiB out > 96 KiB
    assert session.stats().ops == 1
    msg = str(info.value)
    assert msg.startswith(
        "dtr: cannot stay within the memory budget of 96.00 KiB while running "
        "aten.mm.default: 128.00 KiB resident, 64.00 KiB requested, 64.00 KiB pinned"
    ), msg
    assert x.grad is None and dtr.session.current() is None
    with dtr.enable(budget="512KiB", cost_model="roofline"):
        (x @ x).sum().backward()
    x2 = x.detach().requires_grad_()
    (x2 @ x2).sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_budget_error_advice_fits_the_case(engine):
    # Below what the parameters and inputs take, no budget can work and a smaller batch
    # cannot help: the message says how much they take and the least budget to give.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    with pytest.raises(dtr.BudgetError) as info:
        with dtr.enable(engine=engine, budget="64KiB", cost_model="roofline"):
            model(torch.randn(8, 256)).sum().backward()
    msg = str(info.value)
    assert "265.00 KiB pinned" in msg  # the numbers stay
    # weight 256 KiB + bias 1 KiB + batch 8 KiB; addmm's 8 KiB output on top
    assert msg.endswith(
        "The parameters and inputs (constants) take 265.00 KiB; running aten.addmm.default "
        "needed 8.00 KiB. No budget below 273.00 KiB can run this step (aten.addmm.default "
        "needs 8.00 KiB at once on top of the constants). The parameters and inputs alone "
        "take 271360 bytes: a budget below that cannot work; give at least 279552 (273.00 KiB)."
    ), msg
    assert "batch size" not in msg
    # Above the constants, a larger budget (at least the floor) or a smaller batch can help.
    x = torch.randn(128, 128, requires_grad=True)  # 64 KiB, a constant
    with pytest.raises(dtr.BudgetError) as info:
        with dtr.enable(engine=engine, budget="96KiB", cost_model="roofline"):
            (x @ x).sum().backward()
    assert str(info.value).endswith(
        "The parameters and inputs (constants) take 64.00 KiB; running aten.mm.default needed "
        "64.00 KiB. No budget below 128.00 KiB can run this step (aten.mm.default needs 64.00 "
        "KiB at once on top of the constants). Raise the budget to at least 131072 bytes "
        "(128.00 KiB), or reduce the batch size."
    ), str(info.value)


def test_budget_error_while_recomputing_is_caught_and_the_session_goes_on(core):
    x = torch.randn(64, 64, requires_grad=True)
    with dtr.enable(cost_model="roofline", check=True) as session:
        hs = [x.tanh()]
        for _ in range(7):
            hs.append(hs[-1].tanh())
        # x, one activation and a scalar: the sum runs (and evicts), no remat fits
        session.set_budget(2 * 64 * 64 * 4 + 64)
        hs[-1].sum()
        with pytest.raises(dtr.BudgetError, match="while recomputing aten.tanh.default") as info:
            dtr.materialize(hs[3])
        assert "KiB resident" in str(info.value) and "16.00 KiB requested" in str(info.value)
        assert session.stats().evictions > 0
        session.set_budget(None)
        # The held values read back correctly inside the block, and a new backward works.
        ref = x.detach()
        for h in hs:
            ref = ref.tanh()
            assert torch.equal(dtr.materialize(h), ref)
        x.grad = None
        hs[-1].sum().backward()
    assert torch.equal(x.grad, eager_chain_grad(x, 8))


def test_detaching_evicted_values_needs_no_memory(engine):
    # After a backward that freed the graph, a program detaches what it holds: each
    # detach() names the value as it is, evicted or not, so a budget too tight for any
    # recomputation does not fail it.
    x = torch.randn(64, 64, requires_grad=True)
    hs_eager = [x.tanh()]
    for _ in range(5):
        hs_eager.append(hs_eager[-1].tanh())
    with dtr.enable(engine=engine, cost_model="roofline", stress=True, check=True) as session:
        hs = [x.tanh()]
        for _ in range(5):
            hs.append(hs[-1].tanh())
        hs[-1].sum().backward()
        (x * 2).sum()  # stress mode evicts at the boundary of an op
        remats = session.stats().remats
        session.set_budget(64 * 64 * 4)  # x alone: no recomputation fits
        detached = [h.detach() for h in hs]
        assert session.stats().remats == remats
        assert all(h.requires_grad and not d.requires_grad for h, d in zip(hs, detached, strict=True))
        session.set_budget(None)
        for d, e in zip(detached, hs_eager, strict=True):
            assert torch.equal(dtr.materialize(d), e.detach())
        assert session.stats().remats > remats  # they were evicted
    for h, d, e in zip(hs, detached, hs_eager, strict=True):
        assert torch.equal(h.detach(), e.detach()) and torch.equal(d, e.detach())


def test_budget_error_caught_inside_the_block_then_training_goes_on(core):
    eager = _mlp()
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    torch.manual_seed(5)
    expected = _train(eager, _batches(3), opt)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = _batches(3)
    budget = int(_mlp_peak() * 0.6)
    torch.manual_seed(5)
    with dtr.enable(budget="16KiB", cost_model="roofline", check=True) as session:
        with pytest.raises(dtr.BudgetError, match="while running aten.addmm"):
            model(batches[0][0])  # fails at the first layer, before dropout draws
        session.set_budget(budget)
        got = _train(model, batches, opt)
    assert session.stats().evictions > 0
    for g, e in zip(got, expected, strict=True):
        assert_bitwise(g, e, "loss")
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert_bitwise(p.detach(), q.detach(), "parameter")


def test_peak_after_the_block_stays_within_the_budget(core):
    # Found by tests/integration/test_fuzz.py: materializing what the program holds when the block
    # ends (budget lifted) was counted in peak_resident_bytes, so a session that kept
    # the budget at every op boundary reported a peak above it.
    x = torch.randn(64, 64, requires_grad=True)
    budget = 5 * 64 * 64 * 4
    with dtr.enable(budget=budget, cost_model="roofline") as session:
        hs = [x.sin()]
        for _ in range(9):
            hs.append(hs[-1].sin())
        inside = session.stats()
    after = session.stats()
    assert inside.evictions > 0
    assert after.resident_bytes > budget  # everything held is resident now...
    assert after.peak_resident_bytes <= budget  # ...which is not an op boundary
    assert after.peak_resident_bytes == inside.peak_resident_bytes
    assert after.max_transient_bytes == inside.max_transient_bytes


# ====================================================================== exceptions
class _Interrupt(KeyboardInterrupt):
    """A KeyboardInterrupt the tests raise on purpose."""


def _held_values_are_evicted(tensors) -> bool:
    return all(t._dtr_ref.node.value is None for t in tensors)


def test_keyboard_interrupt_in_a_forward_hook(core):
    def run(use_dtr: bool):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        (x1, y1), (x2, _) = _batches(1, size=32)[0], _batches(1, seed=2, size=32)[0]
        held, after = {}, {}
        evicted = []

        def interrupt(module, args, out):
            if use_dtr:
                evicted.append(_held_values_are_evicted(after.values()))
            raise _Interrupt

        torch.manual_seed(3)
        ctx = dtr.enable(stress=True, cost_model="roofline") if use_dtr else _nothing()
        with pytest.raises(_Interrupt):
            with ctx:
                # A full step (its tensors are pinned when opt.step() writes the
                # parameters they were computed from), then a forward interrupted in
                # its fourth linear layer, whose first layers' outputs the program keeps.
                hidden = model[:2](x1)
                logits = model[2:](hidden)
                loss = F.cross_entropy(logits, y1)
                loss.backward()
                opt.step()
                opt.zero_grad()
                held.update(hidden=hidden, logits=logits, loss=loss, probs=logits.softmax(1))
                after["h"] = model[:2](x2)
                after["dropped"] = model[2](after["h"])  # replays its RNG state
                after["twice"] = after["h"] * 2
                after["deep"] = model[3:5](after["dropped"])
                handle = model[7].register_forward_hook(interrupt)
                model[5:](after["deep"])
        handle.remove()
        held.update(after)
        return model, opt, held, evicted

    _, _, expected, _ = run(False)
    model, opt, got, evicted = run(True)
    assert evicted == [True]  # the held tensors really were evicted at the interrupt
    assert dtr.session.current() is None
    for name in expected:
        assert_bitwise(dtr.materialize(got[name]).detach(), expected[name].detach(), name)
        assert type(got[name] * 1) is torch.Tensor  # plain after the block
    # A later session trains on, bitwise equal to eager.
    eager, eager_opt, _, _ = run(False)
    torch.manual_seed(9)
    expected_losses = _train(eager, _batches(2), eager_opt)
    torch.manual_seed(9)
    with dtr.enable(budget=int(_mlp_peak() * 0.6), cost_model="roofline") as session:
        got_losses = _train(model, _batches(2), opt)
    assert session.stats().evictions > 0
    for g, e in zip(got_losses, expected_losses, strict=True):
        assert_bitwise(g, e, "loss")
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert_bitwise(p.detach(), q.detach(), "parameter")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_keyboard_interrupt_during_backward(core):
    # Interrupted in the middle of a backward that recomputes (stress mode): the
    # tensors held from the forward read back correctly, and the next session works.
    x = torch.randn(32, 32, requires_grad=True)
    calls = []

    def interrupt(grad):
        calls.append(1)
        raise _Interrupt

    with pytest.raises(_Interrupt):
        with dtr.enable(stress=True) as session:
            hs = [x.sin()]
            for _ in range(6):
                hs.append(hs[-1].sin())
            hs[3].register_hook(interrupt)
            hs[-1].sum().backward()
    assert calls == [1] and session.stats().remats > 0
    ref = x.detach()
    for h in hs:
        ref = ref.sin()
        assert_bitwise(dtr.materialize(h).detach(), ref)
    x.grad = None
    with dtr.enable(stress=True):
        (x.sin().sin() * 2).sum().backward()
    x2 = x.detach().requires_grad_()
    (x2.sin().sin() * 2).sum().backward()
    assert_bitwise(x.grad, x2.grad)


class _InterruptingCore:
    """Forwards to the real core and raises KeyboardInterrupt before call number `at`:
    where a real Ctrl-C lands between two of dtr's bookkeeping steps."""

    def __init__(self, core, at: int):
        object.__setattr__(self, "_core", core)
        object.__setattr__(self, "_at", at)
        object.__setattr__(self, "calls", 0)

    def __getattr__(self, name):
        attr = getattr(self._core, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            object.__setattr__(self, "calls", self.calls + 1)
            if self.calls == self._at:
                raise _Interrupt(name)
            return attr(*args, **kwargs)

        return call

    def __setattr__(self, name, value):
        setattr(self._core, name, value)


def _interruptible_program(held: list) -> None:
    x = torch.randn(16, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    h = x
    for i in range(4):
        h = torch.tanh(h @ w)
        held.append(h)
        if i == 1:
            g = h * 1
            g[2:5].mul_(2)  # a write through a view while the base is held: pinned
            held.append(g)
    v = held[0].clone()
    v.add_(1)  # a private write: a new version
    held.append(v)
    held.append(F.dropout(h, 0.5, training=True))
    sum(t.sum() for t in held).backward()


@pytest.mark.parametrize(
    "kind, mode, stride",
    # Both cores see the same sequence of calls, so the Python one samples it.
    [("c++", "budget", 1), ("python", "budget", 7), ("c++", "stress", 41)],
)
def test_interrupt_between_any_two_core_calls(monkeypatch, subclass_engine, kind, mode, stride):
    # An interrupt lands between two of dtr's core calls, at every such point of a
    # program (~940 with a budget; every 41st of ~6000 under stress mode), the end of
    # the block included. After each, no session is left active and every tensor the
    # program held reads back bitwise as eager computed it. Found this way: an interrupt
    # between an eviction and the drain that mirrors it made close() skip the value
    # (unreadable after the block); one during close() lost what was not yet
    # materialized; one inside Session.__exit__'s bookkeeping left the session active
    # for good; and one between a rerun that writes into the old version's storage
    # (core.steals) and remat_done made the retry apply the op twice (a wrong value).
    if kind == "c++" and not HAVE_CPP:
        pytest.skip("the C++ core is not built")
    monkeypatch.setenv("DTR_FORCE_PYTHON", "1" if kind == "python" else "0")
    torch.manual_seed(0)
    expected: list = []
    _interruptible_program(expected)
    expected = [t.detach().clone() for t in expected]
    kwargs = {"budget": "15KiB"} if mode == "budget" else {"budget": "20KiB", "stress": True}

    at = [0]
    make = dtr_runtime.Runtime.__init__

    def init(self, config):
        make(self, config)
        if at[0]:
            self.core = _InterruptingCore(self.core, at[0])

    monkeypatch.setattr(dtr_runtime.Runtime, "__init__", init)
    points = 0
    while True:
        at[0] += stride
        held: list = []
        torch.manual_seed(0)
        try:
            with dtr.enable(cost_model="roofline", **kwargs) as session:
                _interruptible_program(held)
        except _Interrupt:
            points += 1
        else:
            assert session.stats().evictions > 0
            break  # no call left to interrupt
        assert dtr.session.current() is None, at[0]
        for k, t in enumerate(held):
            got = dtr.materialize(t).detach()
            assert torch.equal(got, expected[k]), f"held tensor {k} after interrupt {at[0]}"
    assert points > 100
    at[0] = 0
    with dtr.enable(stress=True):  # and the process stays usable
        held = []
        torch.manual_seed(0)
        _interruptible_program(held)
    for k, t in enumerate(held):
        assert torch.equal(dtr.materialize(t).detach(), expected[k])


def test_failing_kernel_inside_the_block_releases_its_locks(core):
    x = torch.randn(32, 32, requires_grad=True)
    with dtr.enable(budget="16KiB", check=True, cost_model="roofline") as session:
        h = x.tanh()
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            h @ torch.randn(3, 3)  # a user error raised by the kernel
        assert session._runtime.core.locked_bytes() == 0
        y = h.tanh().tanh()
        y.sum().backward()
        assert session.stats().evictions > 0
    assert torch.equal(x.grad, eager_chain_grad(x, 3))


def test_a_failing_op_leaves_no_stale_constant_behind(core):
    # The failed op's plain argument was registered as a constant (keyed by its storage's
    # address) and released when the op raised, but the mirror was not drained: the next
    # plain tensor allocated at that address got the dead constant's id (the C++ core
    # raised "no tensor 2", the Python one an AttributeError).
    x = torch.randn(4, 4, requires_grad=True)
    with dtr.enable(check=True) as session:
        rt = session._runtime
        h = x * 2
        pairs = []
        for _ in range(20):
            with pytest.raises(RuntimeError, match="cannot be multiplied"):
                h @ torch.randn(3, 3)
            rt.check_mirror()  # every storage dtr maps names a constant the core has
            q = torch.randn(4, 4)
            pairs.append((h + q, q))
        assert rt.core.locked_bytes() == 0
    for y, q in pairs:
        assert torch.equal(y, x.detach() * 2 + q)


def test_an_interrupted_flush_keeps_the_other_handles_pending(core):
    # Handles the program dropped are released at the next op; a KeyboardInterrupt in the
    # middle of that must not lose the rest (their tensors and lineage would stay held).
    class Interrupting:
        @property
        def tid(self):
            raise KeyboardInterrupt

    x = torch.randn(8, 8, requires_grad=True)
    with dtr.enable(check=True) as session:
        rt = session._runtime
        held = [x * k for k in range(1, 5)]
        nodes = [t._dtr_ref.node for t in held]
        del held
        pending = list(rt.pending_refs)
        assert sorted(map(id, pending)) == sorted(map(id, nodes))
        rt.pending_refs.insert(1, Interrupting())
        with pytest.raises(KeyboardInterrupt):
            x * 5
        assert rt.pending_refs == pending[1:]  # the first one was released
        y = x * 6  # the next op releases the rest
        assert not rt.pending_refs and all(n.tid < 0 for n in nodes)
    assert torch.equal(y, x.detach() * 6)


# ====================================================================== threads
def _run_thread(fn, *args):
    box = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # handed back to the test's thread
            box["error"] = exc

    t = threading.Thread(target=target)
    t.start()
    return t, box


def test_a_second_session_on_another_thread_is_rejected(core):
    x = torch.randn(32, 32, requires_grad=True)

    def other_session():
        with dtr.enable():
            return "entered"

    with dtr.enable(budget="20KiB", cost_model="roofline", check=True) as session:
        h = x.sin().sin()
        t, box = _run_thread(other_session)
        t.join(300)
        h.sin().sum().backward()
    assert isinstance(box.get("error"), dtr.DTRError), box
    msg = str(box["error"])
    assert msg.startswith("dtr: ") and "already active" in msg and "concurrent" in msg
    assert repr(threading.current_thread().name) in msg  # names the session's thread
    assert session.stats().evictions > 0
    assert torch.equal(x.grad, eager_chain_grad(x, 3, torch.sin))
    # Once it ended, another thread may run its own session.
    t, box = _run_thread(other_session)
    t.join(300)
    assert box == {"value": "entered"}


def test_sessions_started_together_on_two_threads(core):
    # Both threads try to enter at once, ten times: exactly one gets in each round and
    # computes correctly; the other gets a clear DTRError, never a half-made session.
    x = torch.randn(24, 24, requires_grad=True)
    expected = eager_chain_grad(x, 4, torch.sin)
    for _ in range(10):
        start = threading.Barrier(2)
        tried = [threading.Event(), threading.Event()]

        def worker(i):
            start.wait(300)
            xi = x.detach().requires_grad_()
            try:
                with dtr.enable(stress=True, check=True):
                    tried[i].set()
                    tried[1 - i].wait(300)  # hold the session until the other has tried
                    h = xi
                    for _ in range(4):
                        h = h.sin()
                    h.sum().backward()
            except dtr.DTRError as exc:
                tried[i].set()
                return str(exc)
            return xi.grad

        threads = [_run_thread(worker, i) for i in range(2)]
        for t, _ in threads:
            t.join(300)
        results = [box["value"] for _, box in threads]
        grads = [r for r in results if isinstance(r, torch.Tensor)]
        errors = [r for r in results if isinstance(r, str)]
        assert len(grads) == 1 and len(errors) == 1, results
        assert torch.equal(grads[0], expected)
        winner = threads[0][0] if isinstance(results[0], torch.Tensor) else threads[1][0]
        assert "already active on thread" in errors[0] and repr(winner.name) in errors[0]
        assert dtr.session.current() is None


def test_wrappers_used_by_other_threads_concurrently(core):
    # Four threads run forward and backward (their own torch.autograd.grad through the
    # shared graph) on the session's wrappers while the owning thread does the same,
    # all under a tight budget: every result is eager's, bit for bit, and the budget
    # holds. Results are checked where they are made (torch.equal on a wrapper reads it
    # without pinning it), so that the threads do not pile up pinned memory.
    x = torch.randn(48, 48, requires_grad=True)
    depth, budget = 8, 12 * 48 * 48 * 4  # 43 evictions when the same work runs serially
    refs = [x.detach()]
    for _ in range(depth):
        refs.append(refs[-1].sin())
    expected_grads = []
    for i in range(5):
        xi = x.detach().requires_grad_()
        h = xi
        for _ in range(i + 2):
            h = h.sin()
        (h * (i + 1)).sum().backward()
        expected_grads.append(xi.grad)

    with dtr.enable(budget=budget, cost_model="roofline", check=True) as session:
        hs = [x]
        for _ in range(depth):
            hs.append(hs[-1].sin())
        start = threading.Barrier(5)

        def worker(i):
            start.wait(300)
            checks = []
            for _ in range(3):
                (g,) = torch.autograd.grad((hs[i + 2] * (i + 1)).sum(), x, retain_graph=True)
                checks.append(torch.equal(g, expected_grads[i]))
                checks.append(torch.equal(hs[depth - i] * 1, refs[depth - i]))
                checks.append(type(torch.ones(2) * 2) is torch.Tensor)  # plain stays plain
            return checks

        threads = [_run_thread(worker, i) for i in range(4)]
        mine = worker(4)  # this thread too
        for t, _ in threads:
            t.join(300)
        stats = session.stats()
    for i, (_, box) in enumerate(threads):
        assert "error" not in box, box.get("error")
        assert box["value"] == [True] * 9, (i, box["value"])
    assert mine == [True] * 9
    assert stats.evictions > 0 and stats.remats > 0
    assert stats.peak_resident_bytes <= budget


class _SpyLock:
    """The runtime's RLock, reporting when a thread starts waiting for it while another
    holds it."""

    def __init__(self):
        self._lock = threading.RLock()
        self.owner = None
        self.depth = 0
        self.waiting = threading.Event()

    def acquire(self):
        if self.owner not in (None, threading.get_ident()):
            self.waiting.set()
        self._lock.acquire()
        self.owner = threading.get_ident()
        self.depth += 1

    def release(self):
        self.depth -= 1
        if self.depth == 0:
            self.owner = None
        self._lock.release()

    def __enter__(self):
        self.acquire()

    def __exit__(self, *exc):
        self.release()


@pytest.mark.parametrize("what", ["op", "read"])
def test_block_ends_while_another_thread_waits_for_the_runtime(core, what):
    # An op from another thread that waited for the runtime while the block ended must
    # not be recorded by the closed runtime: stress mode would then evict its inputs and
    # output for good ("could not be recomputed").
    x = torch.randn(64, 64, requires_grad=True)
    with dtr.enable(stress=True) as session:
        spy = session._runtime.lock = _SpyLock()
        hs = [x.sin()]
        for _ in range(4):
            hs.append(hs[-1].sin())
        spy.acquire()  # the block's thread holds the runtime...
        work = (lambda: hs[2] * 2) if what == "op" else (lambda: dtr.materialize(hs[2]))
        t, box = _run_thread(work)
        assert spy.waiting.wait(300)  # ...while the other thread waits for it
    spy.release()  # the block has ended: now the other thread goes on
    t.join(300)
    ref = x.detach().sin().sin().sin()
    got = box["value"]
    assert type(got) is torch.Tensor, box
    assert torch.equal(got, ref * 2 if what == "op" else ref)
    for h in hs:  # and nothing the program holds was lost
        ref_h = dtr.materialize(h)
        assert type(ref_h) is torch.Tensor
    assert torch.equal(dtr.materialize(hs[-1]), x.detach().sin().sin().sin().sin().sin())


def test_parameter_written_on_another_thread_during_a_step(core):
    # The step's thread computes a forward, another thread updates a parameter in place
    # (an optimizer on the wrong thread), then the step's backward runs. Eager's backward
    # uses the activations computed from the old value; under stress mode dtr recomputes
    # them.
    def run(use_dtr: bool):
        torch.manual_seed(0)
        w = torch.randn(16, 16, requires_grad=True)
        x = torch.randn(16, 16, requires_grad=True)

        def update():
            with torch.no_grad():
                w.add_(1)

        with dtr.enable(stress=True) if use_dtr else _nothing():
            h = (x + w).exp()  # add saves nothing: h is all that backward keeps
            y = h.sin()
            t, _ = _run_thread(update)
            t.join(300)
            y.sum().backward()
        return x.grad

    run(False)
    # dtr cannot see the write (the other thread has no dtr mode); the recomputation
    # notices the parameter's version changed and refuses rather than use the new value
    with pytest.raises(dtr.UnsupportedError, match="written in place where dtr could not"):
        run(True)


@pytest.mark.parametrize("replace", ["data", "half", "unseen"])
def test_storage_swapped_in_without_an_op(core, replace):
    # `p.data = ...` (and Module.half(), which converts parameters that way) gives a
    # tensor another storage with no op and no new version. dtr's `.data` setter pins
    # what read the old value first (dtr/data_setter.py), so it keeps eager's value. A
    # swap it cannot see (PyTorch's own setter, as C++ code reaches it) would make
    # recomputing read the new values where the program read the old ones: refused,
    # with what to do.
    def run(use_dtr: bool) -> float:
        torch.manual_seed(0)
        conv = nn.Conv2d(2, 2, 3)
        x = torch.randn(1, 2, 5, 5)
        with dtr.enable(stress=True) if use_dtr else _nothing():
            y = conv(x)  # evicted at once: its value must be recomputed to be read
            if replace == "data":
                conv.weight.data = conv.weight.data * 0.5
            elif replace == "half":
                conv.half()
            else:
                torch._C.TensorBase.data.__set__(conv.weight, conv.weight.detach() * 0.5)
            return y.sum().item()

    if replace != "unseen":
        assert run(True) == run(False)
        return
    with pytest.raises(dtr.UnsupportedError, match="storage has since been replaced") as info:
        run(True)
    assert "in place" in str(info.value)


def test_parameters_updated_through_data_in_place_recompute_correctly(core):
    # The supported spelling of a manual update: in place, through .data or no_grad.
    def run(use_dtr: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        x = torch.randn(32, 8)
        kept = []
        with dtr.enable(stress=True) if use_dtr else _nothing():
            for step in range(3):
                out = model(x)
                kept.append(out.detach())  # read again at the end, after the updates
                out.square().mean().backward()
                for p in model.parameters():
                    if step % 2:
                        p.data.sub_(0.1 * p.grad)
                    else:
                        with torch.no_grad():
                            p.sub_(0.1 * p.grad)
                    p.grad = None
            result = torch.cat(kept)
            return torch.cat(
                [result.flatten(), *[p.detach().flatten() for p in model.parameters()]]
            )

    assert torch.equal(run(True), run(False))


def _scripted_mlp():
    torch.manual_seed(0)
    layers = [nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64)]
    with warnings.catch_warnings():  # torch.jit.script is deprecated, and still used
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(nn.Sequential(*layers))


def test_a_budget_error_inside_a_scripted_module_keeps_its_type_and_message(engine):
    # TorchScript reports an op that failed below its interpreter as its own
    # RuntimeError: it read the subclass engine's BudgetError (raised in Python, in dtr's
    # dispatch mode) as an empty message, and the native engine's as a plain
    # RuntimeError. The session ends by raising the dtr error, from the interpreter's.
    model = _scripted_mlp()
    with pytest.raises(dtr.BudgetError, match="dtr: cannot stay within the memory budget") as e:
        with dtr.enable(budget=300_000, engine=engine):
            h = torch.randn(256, 64, requires_grad=True) * 1.0
            model(h).sum().backward()
    assert type(e.value.__cause__) is RuntimeError
    assert "TorchScript interpreter" in str(e.value.__cause__)


def test_a_kernels_error_inside_a_scripted_module_keeps_its_message(engine):
    # The same for PyTorch's own errors on managed tensors (a shape mismatch), which
    # the interpreter also read as empty on the subclass engine; a dtr error made
    # earlier in the block (a refused nested session) is not taken for it.
    model = _scripted_mlp()
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as e:
        with dtr.enable(engine=engine):
            with pytest.raises(dtr.DTRError):
                dtr.enable().__enter__()  # nested sessions are refused
            model(torch.randn(8, 32) * 1.0)  # the wrong width, on a managed tensor
    assert not isinstance(e.value, dtr.DTRError)
