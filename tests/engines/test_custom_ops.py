"""Ops of a user's library with no autograd kernel.

Eager runs such an op through autograd's fallback, which warns and lets the ops its
kernel calls record their own gradients. dtr runs a managed op as one call below
autograd, so that gradient would be lost: where an input requires grad, each engine
either serves it as eager does (the native engine, for a CompositeExplicitAutograd
kernel, which runs at its own key and whose ops it sees one by one) or refuses with a
dtr: error; never a missing or different gradient."""

from __future__ import annotations

import warnings

import pytest
import torch

import dtr

_LIB = torch.library.Library("dtr_test_custom", "DEF")
REGISTRATIONS = ("CPU", "CompositeExplicitAutograd")
for _key in REGISTRATIONS:
    _LIB.define(f"scaled_sin_{_key.lower()}(Tensor x) -> Tensor")
    _LIB.impl(f"scaled_sin_{_key.lower()}", lambda x: (x * 3.0).sin(), _key)


def _op(key: str):
    return getattr(torch.ops.dtr_test_custom, f"scaled_sin_{key.lower()}")


def _grad(key: str) -> torch.Tensor:
    w = torch.linspace(-1, 1, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's "no autograd kernel" warning
        y = _op(key)(w * 2.0)
        (y * y).sum().backward()
    return w.grad


@pytest.mark.parametrize("key", REGISTRATIONS)
def test_an_op_without_an_autograd_kernel_is_served_as_eager_or_refused(engine, key):
    want = _grad(key)
    assert want is not None and want.abs().sum() > 0  # eager's gradient flows through
    served = engine == "native" and key == "CompositeExplicitAutograd"
    try:
        with dtr.enable(engine=engine, stress=True) as session:
            got = dtr.materialize(_grad(key))
    except dtr.UnsupportedError as exc:
        assert not served, exc
        assert "no autograd kernel" in str(exc) and "register_autograd" in str(exc)
        return
    assert served, "served without the fallback's gradient"
    assert torch.equal(got, want)
    assert session.stats().remats > 0


@pytest.mark.parametrize("key", REGISTRATIONS)
def test_an_op_without_an_autograd_kernel_runs_where_nothing_requires_grad(engine, key):
    x = torch.linspace(-1, 1, 64)
    want = _op(key)(x * 2.0)
    with dtr.enable(engine=engine, stress=True):
        got = dtr.materialize(_op(key)(x * 2.0).exp())
        with torch.no_grad():
            w = torch.linspace(-1, 1, 64, requires_grad=True)
            no_grad = dtr.materialize(_op(key)(w * 2.0))
    assert torch.equal(got, want.exp())
    assert torch.equal(no_grad, want)
