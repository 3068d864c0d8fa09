"""loss.backward(create_graph=True): the gradients put in the leaves' .grad are part of the
graph, as in eager PyTorch, so that a gradient penalty written with .backward trains."""

from __future__ import annotations


import pytest
import torch
from torch import nn


from tests.utils import assert_bitwise_with_remats

# Eager warns that backward(create_graph=True) makes a reference cycle through .grad:
# what these programs do on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")

# Either mode forces recomputation: stress evicts after every op; 128 KiB holds a few of
# the MLP's 64x48 activations (12 KiB each) next to the pinned gradients of the first
# backward, which the second-order graph reads.
BUDGET = 128 * 1024
MODES = [{"stress": True}, {"budget": BUDGET}]


def _mlp():
    return nn.Sequential(nn.Linear(6, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 1))



@pytest.mark.parametrize("mode", MODES, ids=["stress", "budget"])
def test_a_penalty_made_of_grads_alone_backpropagates(engine, mode):
    def fn():
        model = _mlp()
        x = torch.randn(64, 6)
        model(x).pow(2).mean().backward(create_graph=True)
        params = list(model.parameters())
        assert all(p.grad.requires_grad for p in params)
        penalty = sum((p.grad**2).sum() for p in params)
        for p in params:
            p.grad = None
        penalty.backward()
        return [penalty.detach()] + [p.grad for p in params]

    assert_bitwise_with_remats(fn, engine, mode)


@pytest.mark.parametrize("mode", MODES, ids=["stress", "budget"])
@pytest.mark.parametrize("reset", [True, False], ids=["grads-reset", "grads-accumulate"])
def test_a_penalty_added_to_another_loss_contributes_its_gradient(engine, mode, reset):
    def fn():
        model = _mlp()
        x, x2 = torch.randn(64, 6), torch.randn(64, 6)
        model(x).pow(2).mean().backward(create_graph=True)
        params = list(model.parameters())
        penalty = sum((p.grad**2).sum() for p in params)
        if reset:
            for p in params:
                p.grad = None
        (model(x2).abs().mean() + 0.5 * penalty).backward()
        return [penalty.detach()] + [p.grad.detach() for p in params]

    assert_bitwise_with_remats(fn, engine, mode)


@pytest.mark.parametrize("mode", MODES, ids=["stress", "budget"])
def test_wgan_gp_penalty_through_backward_trains_the_critic(engine, mode):
    """The critic's gradient penalty at interpolates, taken with .backward(inputs=...)
    and create_graph=True, then the critic's loss backpropagated through it."""

    def fn():
        critic = _mlp()
        opt = torch.optim.SGD(critic.parameters(), lr=0.1)
        real, fake = torch.randn(64, 6), torch.randn(64, 6)
        eps = torch.rand(64, 1)
        x_hat = (eps * real + (1 - eps) * fake).requires_grad_()
        critic(x_hat).sum().backward(create_graph=True, inputs=[x_hat])
        gp = ((x_hat.grad.norm(2, dim=1) - 1) ** 2).mean()
        loss = critic(fake).mean() - critic(real).mean() + 10 * gp
        opt.zero_grad()
        loss.backward()
        grads = [p.grad.clone() for p in critic.parameters()]
        opt.step()
        return [gp.detach(), loss.detach()] + grads + [p.detach().clone() for p in critic.parameters()]

    assert_bitwise_with_remats(fn, engine, mode)

