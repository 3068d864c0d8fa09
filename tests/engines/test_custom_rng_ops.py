"""Custom ops that draw random numbers without saying so (no ``nondeterministic_seeded``
tag): a recomputation replays them from the generator state they first drew from, as
aten's random ops (Invariant 1), so values, gradients and the random stream after the
block are eager's."""

from __future__ import annotations

import pytest
import torch

from tests.utils import assert_bitwise_with_remats


@torch.library.custom_op("dtrtest_rng::noisy", mutates_args=())
def noisy(x: torch.Tensor) -> torch.Tensor:
    return x + torch.randn_like(x)


noisy.register_autograd(lambda ctx, grad: grad)


@torch.library.custom_op("dtrtest_rng::stochastic_round", mutates_args=())
def stochastic_round(x: torch.Tensor) -> torch.Tensor:
    return torch.floor(x + torch.rand_like(x))


stochastic_round.register_autograd(lambda ctx, grad: grad)  # straight through

# Defined and implemented for the CPU key only, with no autograd formula.
_lib = torch.library.Library("dtrtest_rnglib", "DEF")
_lib.define("jitter(Tensor x) -> Tensor")
_lib.define("jitter_with(Tensor x, Generator? generator) -> Tensor")
_lib.impl("jitter", lambda x: x * torch.rand_like(x), "CPU")
_lib.define("jitter_from(Tensor x, Generator? source) -> Tensor")  # named otherwise


def _jitter_with(x, generator):
    return x * torch.rand(x.shape, generator=generator, dtype=x.dtype)


_lib.impl("jitter_with", _jitter_with, "CPU")
_lib.impl("jitter_from", _jitter_with, "CPU")

# Either mode evicts what the custom ops made: stress after every op, or a budget that
# holds a few of the 64x32 activations (8 KiB each).
def _modes(budget_kib: int):
    return pytest.mark.parametrize(
        "mode", [{"stress": True}, {"budget": budget_kib * 1024}], ids=["stress", "budget"]
    )



@_modes(64)
def test_custom_random_ops_replay_their_draws(engine, mode):
    def fn():
        x = torch.randn(64, 32, requires_grad=True)
        h = (x * 2).tanh()
        n = noisy(h)
        r = stochastic_round(n.sin() * 4)
        y = (r * h).exp()
        s = torch.ops.dtrtest_rnglib.jitter(y.detach() + 1)
        z = (y * s).sum()
        z.backward()
        after = torch.rand(3)  # the random stream after the block: eager's
        return [z.detach(), x.grad, n.detach(), r.detach(), s, after]

    assert_bitwise_with_remats(fn, engine, mode)


@_modes(40)
@pytest.mark.parametrize("name", ["jitter_with", "jitter_from"])
def test_custom_random_op_with_a_generator_argument(engine, mode, name):
    op = getattr(torch.ops.dtrtest_rnglib, name)

    def fn():
        g = torch.Generator().manual_seed(3)
        x = torch.randn(64, 32, requires_grad=True)
        h = (x * 3).sigmoid()
        m = op(h.detach(), g)
        z = (h * m).pow(2).sum()
        z.backward()
        return [z.detach(), x.grad, m, g.get_state(), torch.rand(3)]

    assert_bitwise_with_remats(fn, engine, mode)
