"""dtr.sim.floor: the op-level floor of a trace is what its largest op needs next to the
constants, and no budget below it can be met."""

from __future__ import annotations

import pytest
import torch

import dtr
import dtr.sim
from dtr.sim.floor import op_floor
from tests.utils import train


def test_floor_of_a_chain_is_its_largest_backward_op_next_to_the_constant(tmp_path):
    path = str(tmp_path / "chain.jsonl")
    x = torch.randn(1000, requires_grad=True)  # 4,000 bytes, a constant to dtr
    with dtr.enable(trace=path, cost_model="roofline"):
        h = x
        for _ in range(6):
            h = torch.exp(h * 0.5)
        h.sum().backward()
    prog = dtr.sim.load(path)
    # forward ops read one 4,000-byte value and make one; exp's backward reads the
    # incoming gradient and its saved result and makes one: three, next to x
    assert op_floor(prog) == 4 * 4000


@pytest.mark.parametrize("name", ["mlp", "cnn", "lstm", "transformer", "tree"])
def test_no_budget_below_the_floor_is_feasible(tmp_path, name):
    path = str(tmp_path / f"{name}.jsonl")
    train(name, steps=1, dtr_kwargs={"trace": path, "cost_model": "roofline"})
    prog = dtr.sim.load(path)
    floor = op_floor(prog)
    assert 0 < floor <= dtr.sim.peak(prog)
    assert not dtr.sim.simulate(prog, budget=floor - 1).feasible
    assert dtr.sim.simulate(prog, budget=dtr.sim.peak(prog)).feasible
