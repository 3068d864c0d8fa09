"""The thrash stop (Core.thrash, docs/design.md "Thrash stop") and what a run that fails on
its budget leaves: nothing allocated past the budget while the block ends, and tensors
held from it either right or refused with a dtr: error when read."""

from __future__ import annotations

import pytest
import torch

import dtr
from dtr import config as _config
from dtr.units import format_bytes

from tests.utils import assert_bitwise, profiled_bytes, quiet_stderr

N = 300  # chain length
SIZE = 64 * 1024  # elements per activation (256 KiB)
ACT = SIZE * 4


def chain(x: torch.Tensor, n: int = N) -> torch.Tensor:
    h = x
    for _ in range(n):
        h = torch.tanh(h)
    return h


def open_session(engine: str, budget: int, **options):
    return dtr.enable(budget=budget, engine=engine, cost_model="roofline", **options)


def test_runaway_recomputation_stops_with_numbers(engine):
    """A chain's backward under a budget of a few activations recomputes the chain over and
    over (quadratic in its length); with thrash=3 the step stops once its recomputations
    pass 2 x max(its ops, 1000) and says why, with the numbers and what to do."""
    x = torch.randn(SIZE, requires_grad=True)
    budget = 6 * ACT
    with pytest.raises(dtr.BudgetError) as info:
        with open_session(engine, budget, thrash=3) as session:
            chain(x).sum().backward()
    stats = session.stats()
    # every op is recorded before the backward that thrashes: at most 2 x N + a few ops
    allowance = 2 * max(stats.ops, 1000)
    assert allowance <= stats.remats <= allowance + 1, (stats.remats, stats.ops)
    msg = str(info.value)
    assert msg.startswith(
        f"dtr: cannot stay within the memory budget of {format_bytes(budget)}: "
        "recomputation is running away, "
    )
    assert f"{stats.remats} recomputations in this step against its {stats.ops} ops" in msg
    assert "(no step completed yet)" in msg
    assert "thrash=3" in msg and "resident" in msg and "pinned" in msg
    assert "raise it" in msg and "thrash=0" in msg


def test_same_program_without_the_stop_recomputes_far_more(engine):
    """The program above is a runaway indeed: with no stop it finishes, right, after many
    times the recomputations the stop allows (so the test above measures the stop)."""
    x = torch.randn(SIZE, requires_grad=True)
    with open_session(engine, 6 * ACT, thrash=0) as session:
        chain(x).sum().backward()
        got = dtr.materialize(x.grad)
    x2 = x.detach().requires_grad_()
    chain(x2).sum().backward()
    assert_bitwise(got, x2.grad, "grad")
    stats = session.stats()
    assert stats.remats > 5 * 2 * max(stats.ops, 1000)


def test_previous_step_counts_in_the_message(engine):
    """A second step that thrashes names the first one's ops and peak."""
    x = torch.randn(SIZE, requires_grad=True)
    with pytest.raises(dtr.BudgetError) as info:
        with open_session(engine, 6 * ACT, thrash=3) as session:
            chain(x, 20).sum().backward()
            session.end_step()
            first = session.steps()[0]
            chain(x).sum().backward()
    assert f"the previous step had {first.ops} ops and peaked at " in str(info.value)


@pytest.mark.parametrize("bad", [-1, 0.5, 1, 1.0, float("inf"), float("nan"), "3", True])
def test_thrash_option_validated(bad):
    with pytest.raises(dtr.ConfigError, match="thrash must be a finite number > 1"):
        dtr.enable(thrash=bad)


@pytest.mark.parametrize("raw", ["abc", "1", "-2", "0.5"])
def test_thrash_env_validated(raw):
    with pytest.raises(dtr.ConfigError, match="DTR_THRASH"):
        _config.resolve(env={_config.ENV_THRASH: raw})


def test_thrash_values():
    assert _config.resolve(env={}).thrash == _config.THRASH_DEFAULT
    assert _config.resolve(env={}, thrash=None).thrash == 0
    assert _config.resolve(env={}, thrash=0).thrash == 0
    assert _config.resolve(env={_config.ENV_THRASH: "0"}).thrash == 0
    assert _config.resolve(env={_config.ENV_THRASH: "7"}).thrash == 7
    assert _config.resolve(env={_config.ENV_THRASH: "7"}, thrash=4).thrash == 4


def test_feasible_budget_unaffected_by_default(engine):
    """A chain whose backward recomputes under its budget, at the default thrash: eager's
    gradient in every bit."""
    x = torch.randn(SIZE, requires_grad=True)
    n = 60
    with open_session(engine, 12 * ACT) as session:
        chain(x, n).sum().backward()
        got = dtr.materialize(x.grad)
    x2 = x.detach().requires_grad_()
    chain(x2, n).sum().backward()
    assert_bitwise(got, x2.grad, "grad")
    assert session.stats().remats > 0
    assert session.config.thrash == _config.THRASH_DEFAULT


def _fail_in_block(engine: str, budget: int, how: str):
    """Forward a chain whose activations the program holds, then fail on the budget:
    a backward stopped by the thrash stop ("thrash"), or an op whose output alone is
    larger than the budget ("budget"). Returns x and what the program holds after the
    block: the output and the activations."""
    x = torch.randn(SIZE, requires_grad=True)
    held = {}
    with pytest.raises(dtr.BudgetError):
        with open_session(engine, budget, thrash=3):
            acts = []
            h = x
            for _ in range(N):
                h = torch.tanh(h)
                acts.append(h)
            held["out"] = h
            held["acts"] = acts
            if how == "thrash":
                h.sum().backward()
            else:
                h.repeat(budget // ACT + 2)
    return x, held


HOW = ["thrash", "budget"]


@pytest.mark.parametrize("how", HOW)
def test_failed_block_does_not_rebuild_past_budget(engine, how):
    """A block ending with a BudgetError leaves what is evicted evicted: closing it
    allocates nothing like the N activations the program still holds (N x 256 KiB
    against a budget of 6)."""
    budget = 6 * ACT
    with quiet_stderr(), torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        _, held = _fail_in_block(engine, budget, how)
    _, peak = profiled_bytes(prof)
    # the budget, and an op's output over it (repeat's 8 activations) or the gradient
    # buffers of the backward in flight
    assert peak < budget + 10 * ACT, format_bytes(peak)
    assert len(held["acts"]) == N


@pytest.mark.parametrize("how", HOW)
def test_tensor_held_from_failed_block_right_or_refused(engine, how):
    """After the block failed on its budget: each held activation reads eager's value
    or raises a dtr: error saying why; the output's backward is refused too."""
    x, held = _fail_in_block(engine, 6 * ACT, how)
    h = x.detach()
    refused = 0
    for got in held["acts"]:
        h = torch.tanh(h)
        try:
            value = got.clone()
        except RuntimeError as exc:
            assert str(exc).startswith(
                "dtr: this tensor was evicted when its dtr.enable() block ended with a "
                "BudgetError, and is not rebuilt after it"
            ), str(exc)
            refused += 1
            continue
        assert torch.equal(value, h)
    assert refused > N // 2
    with pytest.raises(RuntimeError, match="dtr: this tensor was evicted when"):
        held["out"].sum().backward()


@pytest.mark.parametrize("how", HOW)
def test_caught_budget_error_leaves_resident_within_budget(engine, how):
    """A BudgetError caught in the block leaves resident bytes within the budget at once
    (what the failed op made is freed, not at the next op), and the program goes on with
    eager's values."""
    budget = 6 * ACT
    x = torch.randn(SIZE, requires_grad=True)
    with open_session(engine, budget, thrash=3) as session:
        acts = []
        h = x
        for _ in range(N):
            h = torch.tanh(h)
            acts.append(h)
        with pytest.raises(dtr.BudgetError):
            if how == "thrash":
                h.sum().backward()
            else:
                h.repeat(budget // ACT + 2)
        assert session.stats().resident_bytes <= budget
        got = dtr.materialize(acts[5] * 2)
    want = x.detach()
    for _ in range(6):
        want = torch.tanh(want)
    assert_bitwise(got, want * 2, "value")


def test_stress_mode_has_no_default_stop():
    """Stress mode recomputes every reuse by design: no thrash stop unless asked for."""
    assert _config.resolve(env={}, stress=True).thrash == 0
    assert _config.resolve(env={}, stress=True, thrash=5).thrash == 5
    assert _config.resolve(env={_config.ENV_THRASH: "5"}, stress=True).thrash == 5


def test_mamba_failing_on_its_budget_stays_inside_memory(engine):
    """Hugging Face's Mamba (bench.zoo's tiny config) at a budget where its backward
    recomputes without end: it stops with a BudgetError, the block ends without
    rebuilding the graph the program still holds (dtr would otherwise allocate ~17x the
    budget), and that graph's backward after the block is refused, not wrong."""
    pytest.importorskip("transformers")
    from bench.zoo_models import ZOO

    entry = ZOO["mamba"]
    torch.manual_seed(0)
    model = entry.build()
    model.train()
    batch = entry.batch(torch.Generator().manual_seed(1))
    budget = int(3.8 * 2**20)
    with quiet_stderr(), torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        with pytest.raises(dtr.BudgetError):
            with open_session(engine, budget) as session:
                loss = entry.loss(model, batch)
                loss.backward()
    _, peak = profiled_bytes(prof)
    assert peak < budget * 1.2, format_bytes(peak)
    stats = session.stats()
    assert stats.remats <= (_config.THRASH_DEFAULT - 1) * max(stats.ops, 1000) + 1
    # refused: by dtr, or by autograd where the failed backward had freed what it read
    with pytest.raises(
        RuntimeError, match="dtr: this tensor was evicted when|backward through the graph a second"
    ):
        loss.backward()


def test_python_core_stops_at_the_same_rerun(monkeypatch):
    """The pure-Python core (DTR_FORCE_PYTHON) stops at the same recomputation as the
    C++ one, with the same message."""
    messages = []
    for force in ("0", "1"):
        monkeypatch.setenv(_config.ENV_FORCE_PYTHON, force)
        x = torch.randn(SIZE, requires_grad=True)
        with pytest.raises(dtr.BudgetError) as info:
            with open_session("subclass", 6 * ACT, thrash=3) as session:
                chain(x).sum().backward()
        assert session.stats().core == ("python" if force == "1" else "c++")
        messages.append(str(info.value))
    assert messages[0] == messages[1]
