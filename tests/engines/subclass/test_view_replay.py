"""Views of a tensor written in place, whose backward autograd rebuilds after the write.

Eager rebuilds it as as_strided's backward (the base's layout); for the subclass engine's tensors
autograd replays the view's own ops (dtr/engines/subclass/view_replay.py). Where that could show in
a gradient the subclass engine refuses with a dtr: error; everywhere else, and on the native engine
always, gradients are eager's bit for bit under forced recomputation."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

import dtr
from dtr.engines.subclass import view_replay

from tests.utils import assert_bitwise_with_remats

pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")

# stress mode evicts after every op: each value read again is recomputed
STRESS = {"stress": True}


def _base():
    """A 16x16 value whose rows sum into a 16-vector leaf: its gradient is a reduction,
    whose summation order follows the layout of the gradient it is given."""
    g = torch.Generator().manual_seed(0)
    v0 = torch.randn(16, generator=g, requires_grad=True)
    w = torch.randn(16, 16, generator=g)
    return v0, v0.unsqueeze(1).expand(16, 16) * w


def _penalty(loss, leaf):
    """backward(create_graph=True), then the backward of sum(leaf.grad ** 2) alone."""
    loss.backward(create_graph=True)
    penalty = (leaf.grad**2).sum()
    leaf.grad = None
    penalty.backward()
    return [penalty.detach(), leaf.grad.detach()]


def _written_under_a_transposed_view():
    # Eager and the subclass engine's replayed view (a transposed gradient) differ in
    # the last bit of v0.grad here: this program is why the engine refuses.
    v0, base = _base()
    v = base.transpose(0, 1)
    base.mul_(0.5)
    (v * torch.linspace(0, 1, 16).exp()).sum().backward()
    return [v0.grad]


def _penalty_through_a_write_to_a_transposed_view():
    # Eager's second-order graph takes as_strided, the replayed one transpose: v0.grad
    # differs by an ulp on the subclass engine.
    v0 = torch.randn(16, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    base = v0 * 1.0
    v = base.transpose(0, 1)
    v.mul_(0.5)
    return _penalty(v0.sin().sum() + torch.logsumexp(v, dim=0).sum(), v0)


def _written_under_a_slice():
    v0, base = _base()
    v = base[3:]
    base.mul_(0.5)
    torch.logsumexp(v * 1.0, 0).sum().backward()
    return [v0.grad]


def _written_under_a_transposed_slice():
    v0, base = _base()
    v = base[1:].t()  # the slice's backward fills a base-shaped tensor: eager's layout
    base.mul_(0.5)
    torch.logsumexp(v * 1.0, 0).sum().backward()
    return [v0.grad]


def _written_through_a_transposed_view():
    # first order: CopySlices copies the gradient into the base's layout on both paths
    v0, base = _base()
    v = base.t()
    v.mul_(0.5)
    torch.logsumexp(v * 1.0, 0).sum().backward()
    return [v0.grad]


def _penalty_through_a_write_to_a_column():
    # The second-order graph through a written column narrow(1, 1, 1) (replayed as a
    # slice): v1.grad an ulp off eager's on the subclass engine.
    v1 = torch.randn(16, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    base = v1.clone()
    v = base.narrow(1, 1, 1)
    v.add_(1)
    return _penalty(v1.sum() + (v * 4).sum() + (v @ v.t() * 5).sum(), v1)


def _penalty_through_a_write_to_a_slice():
    # (as eager's here; refused all the same: a slice's second-order graph can differ)
    v0, base = _base()
    v = base[2:]
    v.mul_(0.5)
    return _penalty(torch.logsumexp(v * 1.0, 0).sum() + (base.sum(1) ** 2).sum(), v0)


def _checkpointed_after_a_write_to_a_slice():
    # torch.utils.checkpoint recomputes its forward inside backward, under grad mode: not a
    # create_graph backward (it keeps no graph), and served
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    h = x * 1.0
    h[:, :4].relu_()
    y = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(lin(t)), h, use_reentrant=False)
    y.sum().backward()
    return [x.grad, lin.weight.grad]


DIFFERING = [
    _written_under_a_transposed_view,
    _penalty_through_a_write_to_a_transposed_view,
    _penalty_through_a_write_to_a_column,
]
REFUSED = [*DIFFERING, _penalty_through_a_write_to_a_slice]
SERVED = [
    _written_under_a_slice,
    _written_under_a_transposed_slice,
    _written_through_a_transposed_view,
    _checkpointed_after_a_write_to_a_slice,
]


@pytest.mark.parametrize("fn", REFUSED, ids=lambda f: f.__name__.strip("_"))
def test_a_replay_that_could_differ_is_refused_on_the_subclass_engine(engine, fn):
    if engine == "native":
        assert_bitwise_with_remats(fn, engine, STRESS)
        return
    with pytest.raises(dtr.UnsupportedError, match=view_replay.NOTE) as info:
        with dtr.enable(engine=engine, **STRESS):
            fn()
    assert 'engine="native"' in str(info.value)


@pytest.mark.parametrize("fn", SERVED, ids=lambda f: f.__name__.strip("_"))
def test_a_replay_with_eagers_layout_is_served(engine, fn):
    assert_bitwise_with_remats(fn, engine, STRESS)


def test_the_refused_programs_do_differ_without_the_refusal(monkeypatch):
    """The refusals are needed: with the check off, the subclass engine's gradients are
    not eager's (if PyTorch ever replays views by as_strided for subclasses too, this
    fails, and the refusals can go)."""
    monkeypatch.setattr(view_replay.ViewReplay, "on_write", _note_only)
    monkeypatch.setattr(view_replay.ViewReplay, "check_graph", lambda self: None)
    for fn in DIFFERING:
        expected = [t.detach().clone() for t in fn()]
        with dtr.enable(engine="subclass"):
            got = [dtr.materialize(t).clone() for t in fn()]
        assert any(not torch.equal(g, e) for g, e in zip(got, expected, strict=True)), fn.__name__


def _note_only(self, op, k, node):
    pass
