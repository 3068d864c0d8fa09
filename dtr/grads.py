"""Gradients handed to ``.grad`` as plain tensors, shared by both engines' gradient hooks.

Optimizers (foreach and fused paths included) must see plain gradients, so a managed
gradient accumulated into a leaf's ``.grad`` is replaced by its value: exported (pinned
in place) when it is private, copied when other live tensors share its memory, as
eager's AccumulateGrad copies a gradient something else holds. After
``backward(create_graph=True)`` that gradient is itself part of the graph (a gradient
penalty written as ``(p.grad ** 2).sum()``): the plain value then stays connected to it,
through ``_HandOut``, whose backward passes the incoming gradient on to the managed one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _HandOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grad: torch.Tensor, export: Callable[[torch.Tensor], torch.Tensor]):
        # A new tensor object: autograd gives the output its own grad_fn, and the engine's
        # value must not take one.
        return export(grad).detach()

    @staticmethod
    def backward(ctx, upstream: torch.Tensor):
        return upstream, None


def hand_out(grad: torch.Tensor, export: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The plain tensor to put in .grad for the managed gradient ``grad``; ``export``
    gives its plain value (pinned: the program may write to it)."""
    if grad.requires_grad and torch.is_grad_enabled():
        return _HandOut.apply(grad, export)
    return export(grad)
