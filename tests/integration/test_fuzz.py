"""Property-based fuzzing: random programs of tensor ops run eagerly and under dtr, compared
bit for bit.

A program (drawn by hypothesis, see ``programs()``) starts from a few leaf parameters that
require grad and applies random steps: elementwise and binary ops with broadcasting,
matmul, reductions, views (transpose, narrow, strided slices, select, expand, unsqueeze,
squeeze, reshape, diagonal), in-place ops on fresh tensors and through views of them,
in-place ops on older values that autograd does not need (versions and aliased writes),
multi-output ops (split, chunk, unbind, max/sort/topk with gather, var_mean), RNG ops
(dropout, rand_like, randn_like, bernoulli, in-place uniform_/normal_/bernoulli_,
explicit generators, plain factories), cat/stack, where, index_select, masked_fill,
clamp, flip/roll, ``out=`` into a managed buffer, ``.item()`` control flow, ``no_grad``
blocks, a backward in the middle (graph retained or not), an SGD update of the leaves,
values reused after that backward, and a second backward. Steps that reach around dtr's
view of memory: a held value exported (``.numpy()``, ``torch.from_dlpack``, a tensor over
its ``untyped_storage()``) and written through the export, with readers made before and
after the write; plain inputs over NumPy memory (``torch.from_numpy``) refilled in place
through NumPy, also between a forward and its backward; ``out=`` into a managed tensor of
another shape (empty or wrong), which the op resizes; ``copy.deepcopy`` and
``torch.save``/``torch.load`` of views of one value (aliasing and ``requires_grad`` as
eager's); ops of a user namespace (``torch.library.custom_op``), pure and random; a
training loop on its own parameter carrying a running mean of the loss, updated in place
or by ``w.data = w.data - lr * g``; and in the middle, a gradient penalty
(``backward(create_graph=True)``, then a backward of the squared ``.grad``) or a
hand-written update ``p.data = p.data - lr * g`` with g from ``torch.autograd.grad``.

Each program runs eagerly, under dtr with no budget (which gives the peak P), and under
dtr with a random budget (a fraction of P, down to infeasible ones), heuristic, core
(C++ or the Python twin, through DTR_FORCE_PYTHON, or the native engine,
dtr.engines.native.session.enable), stress mode and invariant checking.
Every value the program holds, every loss, the gradients after each backward, the leaves
and the RNG stream afterwards must be bitwise equal to eager. A budget dtr cannot meet
may raise ``dtr.BudgetError`` and nothing else; the values held at that point must then
read back as eager computed them (the program run eagerly up to the failing step), and a
later session must work. Only the steps in ``REFUSABLE`` may be refused
(``dtr.UnsupportedError``, without a budget as well), with the same check after it.

Runs:

* CI (default): ``python -m pytest tests/integration/test_fuzz.py`` runs a fixed,
  derandomized set of 800 examples (the same programs on every run, no shrinking):
  about 25 s on 2 idle cores, a minute under load.
* Long run on demand:
  ``DTR_FUZZ_EXAMPLES=5000 python -m pytest tests/integration/test_fuzz.py -x -s`` draws
  fresh random programs (not derandomized; failures are shrunk, saved in
  ``.hypothesis/`` and replayed first next time); 4000 examples take ~15 minutes.
  ``DTR_FUZZ_SEED=<int>`` instead picks another fixed set of ``DTR_FUZZ_EXAMPLES``
  (default 800) examples. ``-s`` prints the totals (examples, evictions, remats, ...).

A failure prints the program as readable lines (``v7 = sin(v3)``) and the settings.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import math
import os
import warnings
from collections import Counter

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, reject, seed, settings

import dtr
import dtr.engines.native.session
from dtr.engines.subclass import view_replay
from dtr.engines.subclass.tensor import LOST_MESSAGE
from tests.conftest import CORES, HAVE_CPP

pytestmark = pytest.mark.slow

# Where a program runs under dtr: dtr.enable() on either core, or the native engine
# (dtr.engines.native.session.enable, C++ only).
ENGINES = (*CORES, "native") if HAVE_CPP else CORES

CI_EXAMPLES = 800
EXAMPLES = int(os.environ.get("DTR_FUZZ_EXAMPLES", CI_EXAMPLES))
SEED = os.environ.get("DTR_FUZZ_SEED")
# Fresh programs on each long run; the CI set is fixed so that a failure is never a
# matter of luck and the runtime stays bounded.
LONG = "DTR_FUZZ_EXAMPLES" in os.environ and SEED is None

DIMS = (16, 24, 40)


# ====================================================================== programs
@dataclasses.dataclass(frozen=True)
class Program:
    shapes: tuple[tuple[int, int], ...]  # leaf parameters
    seed: int
    steps: tuple[tuple[str, int, int, int], ...]  # (action, three integer choices)


STEP_KINDS = (
    "unary",
    "binary",
    "scalar",
    "matmul",
    "reduce",
    "view",
    "inplace_fresh",
    "inplace_old",
    "nograd",
    "detach_clone",
    "multi",
    "rng",
    "cat",
    "item",
    "misc",
    "export",
    "np_input",
    "refill",
    "out_resize",
    "copies",
    "custom",
    "train",
)
# How often each kind is drawn, relative to the others (1 when not listed): the steps
# that run several ops or a training loop are drawn less often, to keep CI's fixed set
# fast; refills need a NumPy input first, so they come as often as the inputs.
WEIGHTS = {kind: 4 for kind in STEP_KINDS[:15]}
WEIGHTS.update({"export": 2, "refill": 2, "out_resize": 2, "custom": 2})
KIND_TABLE = tuple(kind for kind in STEP_KINDS for _ in range(WEIGHTS.get(kind, 1)))
# A refusal (dtr.UnsupportedError) is accepted from these steps only: each does
# something a dtr may refuse by design (resizing a managed out tensor, `.data =` on a
# managed tensor); the values held at that point must still read back as eager's.
REFUSABLE = ("out_resize", "train")
# Steps that may have done part of their writes to held values when they fail.
PARTIAL = ("inplace_old", "sgd", "export", "grad_sgd")


@st.composite
def programs(draw) -> Program:
    n_leaves = draw(st.integers(1, 3))
    shapes = tuple(
        (draw(st.sampled_from(DIMS)), draw(st.sampled_from(DIMS))) for _ in range(n_leaves)
    )
    choice = st.integers(0, 255)
    step = st.tuples(st.sampled_from(KIND_TABLE), choice, choice, choice)
    first = draw(st.lists(step, min_size=1, max_size=14))
    # A backward in the middle: "backward_retain" keeps the graph, so later losses may
    # reach through it; "backward" frees it, so later steps read the earlier values
    # detached, and may also update the leaves in place first (an SGD step);
    # "penalty" is backward(create_graph=True) and a second backward of a penalty on
    # the leaves' .grad; "grad_sgd" takes torch.autograd.grad and updates the leaves
    # by hand (p.data = p.data - lr * g).
    middle = draw(
        st.sampled_from(
            [
                [],
                [("backward_retain", 0, 0, 0)],
                [("backward", 0, 0, 0)],
                [("backward", 0, 0, 0), ("sgd", 0, 0, 0)],
                [("penalty", 0, 0, 0)],
                [("grad_sgd", 0, 0, 0)],
            ]
        )
    )
    second = draw(st.lists(step, max_size=10)) if middle else []
    end = [("backward", draw(choice), 0, 0)]
    return Program(shapes, draw(st.integers(0, 2**16)), tuple(first + middle + second + end))


# ====================================================================== custom ops
# Two ops of a user namespace, which dtr knows nothing about: a pure one and one that
# draws from the default generator (replayed as it is, it would draw other numbers).
@torch.library.custom_op("dtrfuzz::scale2", mutates_args=())
def scale2(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.library.custom_op("dtrfuzz::noisy", mutates_args=())
def noisy(x: torch.Tensor) -> torch.Tensor:
    return x + torch.randn_like(x) * 0.1


def _fake(x):
    return torch.empty_like(x)


def _no_context(ctx, inputs, output):
    pass


scale2.register_fake(_fake)
noisy.register_fake(_fake)
scale2.register_autograd(lambda ctx, grad: grad * 2, setup_context=_no_context)
noisy.register_autograd(lambda ctx, grad: grad, setup_context=_no_context)


# ====================================================================== interpreter
class Family:
    """Values sharing one storage. ``saved`` once autograd may have saved a member, after
    which writing to it in place would (rightly) make eager backward fail."""

    def __init__(self):
        self.saved = False


@dataclasses.dataclass
class Entry:
    name: str
    t: torch.Tensor
    fam: Family


class Interp:
    """Runs a program; decisions depend only on the program and on shapes, never on
    values or on whether dtr is active, so every run executes the same ops."""

    def __init__(self, program: Program):
        self.program = program
        self.pool: list[Entry] = []
        self.lines: list[str] = []
        self.losses: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.branches: list[bool] = []
        self.count = 0
        self.step = 0  # the step running (or that failed)
        self.leaves: list[torch.Tensor] = []
        self.buffers: list[np.ndarray] = []  # NumPy memory under the program's inputs
        self.flags: list[bool] = []  # requires_grad of tensors a step made by copying

    # ---------------------------------------------------------------- helpers
    def add(self, t: torch.Tensor, text: str, fam: Family | None = None) -> Entry:
        e = Entry(f"v{self.count}", t, fam if fam is not None else Family())
        self.count += 1
        self.pool.append(e)
        self.lines.append(f"{e.name} = {text}")
        return e

    def pick(self, i: int, pred=None) -> Entry | None:
        cands = [e for e in self.pool if pred is None or pred(e)]
        return cands[i % len(cands)] if cands else None

    def floats(self, i: int) -> Entry | None:
        return self.pick(i, lambda e: e.t.is_floating_point())

    def used(self, *entries: Entry) -> None:
        # Any op run with grad on and an input that requires grad may save its inputs.
        if torch.is_grad_enabled() and any(e.t.requires_grad for e in entries):
            for e in entries:
                e.fam.saved = True

    def partner(self, a: Entry, i: int) -> Entry:
        """A float value broadcastable with a (not one of its aliases), else a itself."""
        cands = [
            e
            for e in self.pool
            if e.t.is_floating_point()
            and e.fam is not a.fam
            and _broadcasts(e.t.shape, a.t.shape) is not None
        ]
        return cands[i % len(cands)] if cands else a

    # ---------------------------------------------------------------- steps
    def unary(self, a: int, b: int, c: int) -> None:
        x = self.floats(a)
        names = ("sin", "tanh", "sigmoid", "relu", "exp", "neg", "abs", "square", "sqrt_abs")
        name = names[b % len(names)]
        self.used(x)
        t = x.t
        if name == "square":
            y = t * t
        elif name == "sqrt_abs":
            y = t.abs().add(1).sqrt()
        elif name == "exp":
            y = t.tanh().exp()  # bounded: no inf piling up
        else:
            y = getattr(torch, name)(t)
        self.add(y, f"{name}({x.name})")

    def binary(self, a: int, b: int, c: int) -> None:
        x = self.floats(a)
        y = self.partner(x, b)
        names = ("add", "sub", "mul", "div", "maximum", "atan2")
        name = names[c % len(names)]
        self.used(x, y)
        if name == "div":
            out = x.t / (y.t.abs() + 1)
        else:
            out = getattr(torch, name)(x.t, y.t)
        self.add(out, f"{name}({x.name}, {y.name})")

    def scalar(self, a: int, b: int, c: int) -> None:
        x = self.floats(a)
        self.used(x)
        k = (b % 7 - 3) * 0.25 + 0.125
        out = x.t * k + (c % 5) * 0.5 if c % 2 else x.t.add(k)
        self.add(out, f"affine({x.name}, {k}, {c})")

    def matmul(self, a: int, b: int, c: int) -> None:
        x = self.pick(a, lambda e: e.t.is_floating_point() and e.t.dim() == 2)
        if x is None:
            return self.unary(a, b, c)
        n = x.t.shape[1]
        ys = [e for e in self.pool if e.t.is_floating_point() and e.t.dim() == 2]
        ys = [e for e in ys if n in (e.t.shape[0], e.t.shape[1])]
        y = ys[b % len(ys)]  # x itself qualifies, so ys is never empty
        self.used(x, y)
        if y.t.shape[0] == n and (c % 2 or y.t.shape[1] != n):
            self.add(x.t @ y.t, f"{x.name} @ {y.name}")
        else:
            self.add(torch.mm(x.t, y.t.t()), f"{x.name} @ {y.name}.t()")

    def reduce(self, a: int, b: int, c: int) -> None:
        x = self.floats(a)
        self.used(x)
        t = x.t
        if t.dim() == 0:
            self.add(t * 2, f"{x.name} * 2")
            return
        d = b % t.dim()
        names = ("sum", "mean", "amax", "logsumexp", "softmax", "log_softmax", "cumsum", "var")
        name = names[c % len(names)]
        keep = bool(c // len(names) % 2)
        if name in ("softmax", "log_softmax", "cumsum"):
            out = getattr(torch, name)(t, d)
        elif name == "var":
            out = t.var(d, keepdim=keep) if t.shape[d] > 1 else t.sum(d, keepdim=keep)
        else:
            out = getattr(torch, name)(t, d, keepdim=keep)
        self.add(out, f"{name}({x.name}, dim={d}, keepdim={keep})")

    def _view(self, t: torch.Tensor, b: int, c: int) -> tuple[torch.Tensor, str]:
        """A view of t chosen by b and c (t itself when none applies)."""
        kinds = (
            "t",
            "narrow",
            "step",
            "select",
            "unsqueeze",
            "squeeze",
            "reshape",
            "expand",
            "diagonal",
        )
        kind = kinds[b % len(kinds)]
        nd = t.dim()
        if nd == 0:
            return t.unsqueeze(0), "unsqueeze(0)"
        d = c % nd
        size = t.shape[d]
        if kind == "t" and nd >= 2:
            return t.transpose(0, nd - 1), f"transpose(0, {nd - 1})"
        if kind == "narrow" and size > 1:
            start = c // 3 % size
            length = max(1, (size - start) // 2)
            return t.narrow(d, start, length), f"narrow({d}, {start}, {length})"
        if kind == "step" and size > 1:
            return t[::2], "[::2]"
        if kind == "select" and nd >= 2:
            return t.select(d, c // 5 % size), f"select({d}, {c // 5 % size})"
        if kind == "unsqueeze" and nd < 4:
            return t.unsqueeze(c % (nd + 1)), f"unsqueeze({c % (nd + 1)})"
        if kind == "squeeze" and 1 in t.shape:
            d1 = list(t.shape).index(1)
            return t.squeeze(d1), f"squeeze({d1})"
        if kind == "reshape" and t.is_contiguous():
            return t.view(-1), "view(-1)"
        if kind == "expand" and nd < 4:
            return t.unsqueeze(0).expand(2, *t.shape), "unsqueeze(0).expand(2, ...)"
        if kind == "diagonal" and nd >= 2:
            return t.diagonal(), "diagonal()"
        return t.transpose(0, -1), "transpose(0, -1)"

    def view(self, a: int, b: int, c: int) -> None:
        x = self.pick(a)
        self.used(x)
        v, text = self._view(x.t, b, c)
        self.add(v, f"{x.name}.{text}", fam=x.fam)

    def _inplace_chain(self, target: torch.Tensor, fam: Family, b: int, c: int) -> str:
        """One to three in-place ops on target (of family fam); ops whose backward reads
        their output or input (exp_, clamp_, mul_ by a tensor) come only last, so eager
        autograd never objects. The other operand never aliases the target."""
        other = self.partner(Entry("", target, fam), b)
        ok = other.fam is not fam and _broadcasts(other.t.shape, target.shape) == tuple(
            target.shape
        )
        if ok and torch.is_grad_enabled() and (target.requires_grad or other.t.requires_grad):
            other.fam.saved = True  # mul_(other) saves it for the target's backward
        texts = []
        n = 1 + c % 3
        for k in range(n):
            op = (b + 7 * k + c) % 13
            last = k == n - 1
            if op == 0:
                target.mul_(0.5)
                texts.append("mul_(0.5)")
            elif op == 1 and ok:
                target.add_(other.t)
                texts.append(f"add_({other.name})")
            elif op == 2 and ok:
                target.sub_(other.t, alpha=2)
                texts.append(f"sub_({other.name}, alpha=2)")
            elif op == 3:
                target.uniform_(-1, 1)
                texts.append("uniform_(-1, 1)")
            elif op == 4:
                target.normal_()
                texts.append("normal_()")
            elif op == 5:
                target.bernoulli_(0.5)
                texts.append("bernoulli_(0.5)")
            elif op == 6 and ok:
                target.copy_(other.t)
                texts.append(f"copy_({other.name})")
            elif op == 7:
                target.zero_()
                texts.append("zero_()")
            elif op == 8 and last:
                target.exp_()
                texts.append("exp_()")
            elif op == 9 and last:
                target.clamp_(-0.5, 0.5)
                texts.append("clamp_(-0.5, 0.5)")
            elif op == 10 and last and ok:
                target.mul_(other.t)
                texts.append(f"mul_({other.name})")
            elif op == 11:
                target.masked_fill_(target > 0, 0.25)
                texts.append("masked_fill_(>0, 0.25)")
            else:
                target.add_(1)
                texts.append("add_(1)")
        return ".".join(texts)

    def inplace_fresh(self, a: int, b: int, c: int) -> None:
        x = self.floats(a)
        self.used(x)
        how = c % 3
        base = x.t.clone() if how == 0 else x.t * 1.5 if how == 1 else x.t + 1
        fam = Family()
        through_view = b % 2
        if through_view:
            target, vtext = self._view(base, b // 2, c // 3)
            if vtext.startswith("unsqueeze(0).expand"):  # cannot write to an expanded view
                target, vtext = base, ""
        else:
            target, vtext = base, ""
        text = self._inplace_chain(target, fam, b // 3, c // 3)
        keep_base = not (through_view and c % 2)  # sometimes only the view is kept
        if keep_base:
            self.add(base, f"fresh({x.name}, {how}); {'.' + vtext if vtext else ''}.{text}", fam)
        if target is not base:
            self.add(target, f"(fresh base).{vtext}  # written by {text}", fam)

    def inplace_old(self, a: int, b: int, c: int) -> None:
        """Write to a value the program made earlier (and other values' lineage may read),
        directly or through a view: dtr makes a version or pins the aliased pool."""
        x = self.pick(
            a,
            lambda e: (
                e.t.is_floating_point()
                and not e.t.requires_grad
                and not e.fam.saved
                and e.t.dim() > 0
            ),
        )
        if x is None:
            return self.inplace_fresh(a, b, c)
        target = x.t
        vtext = ""
        if b % 2:
            target, vtext = self._view(x.t, b // 2, c)
            if vtext.startswith("unsqueeze(0).expand") or target.dim() == 0:
                target, vtext = x.t, ""
            # A view of an expanded value overlaps itself: skip such writes.
        if _overlaps(target):
            return
        with torch.no_grad():
            text = self._inplace_chain(target, x.fam, b // 3, c // 3)
        self.lines.append(f"{x.name}{'.' + vtext if vtext else ''}.{text}")

    def nograd(self, a: int, b: int, c: int) -> None:
        with torch.no_grad():
            if c % 2:
                self.binary(a, b, c // 2)
            else:
                self.unary(a, b, c // 2)
        self.lines[-1] += "  # no_grad"

    def detach_clone(self, a: int, b: int, c: int) -> None:
        x = self.floats(a)
        self.used(x)
        y = x.t.detach().clone() if c % 2 else x.t.detach() * 2
        self.add(y, f"{x.name}.detach() {'clone' if c % 2 else '* 2'}")

    def multi(self, a: int, b: int, c: int) -> None:
        x = self.pick(a, lambda e: e.t.is_floating_point() and e.t.dim() > 0)
        if x is None:
            return self.unary(a, b, c)
        self.used(x)
        t = x.t
        d = b % t.dim()
        size = t.shape[d]
        kind = ("split", "chunk", "unbind", "max", "sort", "topk", "var_mean")[c % 7]
        if kind == "split":
            k = 1 + c // 7 % size
            for i, part in enumerate(torch.split(t, k, d)):
                self.add(part, f"split({x.name}, {k}, {d})[{i}]", fam=x.fam)
        elif kind == "chunk":
            for i, part in enumerate(torch.chunk(t, 2, d)):
                self.add(part, f"chunk({x.name}, 2, {d})[{i}]", fam=x.fam)
        elif kind == "unbind":
            parts = torch.unbind(t, d)
            for i in range(min(len(parts), 3)):
                self.add(parts[i], f"unbind({x.name}, {d})[{i}]", fam=x.fam)
        elif kind in ("max", "sort", "topk"):
            if kind == "max":
                values, idx = torch.max(t, d, keepdim=True)
            elif kind == "sort":
                values, idx = torch.sort(t, stable=True, dim=d, descending=bool(c // 7 % 2))
            else:
                values, idx = torch.topk(t, 1 + c // 7 % size, d)
            self.add(values, f"{kind}({x.name}, {d}).values")
            self.add(idx, f"{kind}({x.name}, {d}).indices")
            y = self.partner(x, c // 7)
            src = y.t if y.t.shape == t.shape else t
            self.used(y)
            self.add(torch.gather(src * 2, d, idx), f"gather(2 * source, {d}, indices)")
        else:
            var, mean = torch.var_mean(t, d, correction=0)
            self.add(var, f"var_mean({x.name}, {d})[0]")
            self.add(mean, f"var_mean({x.name}, {d})[1]")

    def rng(self, a: int, b: int, c: int) -> None:
        x = self.floats(a)
        self.used(x)
        t = x.t
        kind = ("dropout", "rand_like", "randn_like", "bernoulli", "factory", "generator")[b % 6]
        if kind == "dropout":
            p = (0.2, 0.5, 0.9)[c % 3]
            out = F.dropout(t, p, training=True)
        elif kind == "rand_like":
            out = t * torch.rand_like(t)
        elif kind == "randn_like":
            out = t + torch.randn_like(t)
        elif kind == "bernoulli":
            out = torch.bernoulli(torch.sigmoid(t)) * t
        elif kind == "factory":
            out = t + torch.randn(t.shape)  # a plain factory draws from the same stream
        else:
            g = torch.Generator().manual_seed(c)
            out = t * torch.empty_like(t).uniform_(generator=g) + torch.rand(1, generator=g)
        self.add(out, f"{kind}({x.name}, {c})")

    def cat(self, a: int, b: int, c: int) -> None:
        x = self.floats(a)
        t = x.t
        if t.dim() == 0:
            self.used(x)
            self.add(torch.stack([t, t * 2]), f"stack([{x.name}, 2 * {x.name}])")
            return
        d = c % t.dim()
        fits = [
            e
            for e in self.pool
            if e.t.is_floating_point()
            and e.t.dim() == t.dim()
            and all(e.t.shape[k] == t.shape[k] for k in range(t.dim()) if k != d)
        ]
        y = fits[b % len(fits)]  # x itself fits
        self.used(x, y)
        if c // 7 % 2 and y.t.shape == t.shape:
            self.add(torch.stack([t, y.t], d), f"stack([{x.name}, {y.name}], {d})")
        else:
            self.add(torch.cat([t, y.t], d), f"cat([{x.name}, {y.name}], {d})")

    def misc(self, a: int, b: int, c: int) -> None:
        """Selection, indexing, layout and out= ops."""
        x = self.pick(a, lambda e: e.t.is_floating_point() and e.t.dim() > 0)
        if x is None:
            return self.unary(a, b, c)
        t = x.t
        d = b % t.dim()
        kind = ("where", "index_select", "masked_fill", "clamp", "contiguous", "flip", "out")
        kind = kind[c % len(kind)]
        if kind == "where":
            y = self.partner(x, b)
            self.used(x, y)
            out = torch.where(t > 0, t, y.t)
            self.add(out, f"where({x.name} > 0, {x.name}, {y.name})")
        elif kind == "index_select":
            self.used(x)
            idx = torch.arange(t.shape[d] - 1, -1, -2)  # a plain index tensor
            self.add(t.index_select(d, idx), f"index_select({x.name}, {d}, [..., 2, 0])")
        elif kind == "masked_fill":
            self.used(x)
            self.add(t.masked_fill(t.abs() > 0.5, -1.0), f"masked_fill({x.name})")
        elif kind == "clamp":
            self.used(x)
            self.add(t.clamp(-0.5, 0.25), f"clamp({x.name})")
        elif kind == "contiguous":
            self.used(x)
            v = t.transpose(0, -1)
            self.add(v.contiguous(), f"{x.name}.transpose(0, -1).contiguous()")
        elif kind == "flip":
            self.used(x)
            self.add(t.flip(d).roll(1, d), f"{x.name}.flip({d}).roll(1, {d})")
        else:
            # out= into a managed buffer, outside autograd (out= does not record grads).
            with torch.no_grad():
                buf = t * 0
                torch.mul(t, 3, out=buf)
            self.add(buf, f"mul({x.name}, 3, out=buf)  # no_grad")

    def item(self, a: int, b: int, c: int) -> None:
        # Data-dependent control flow: which branch runs depends on a value.
        x = self.floats(a)
        self.used(x)
        positive = x.t.sum().item() > 0
        self.branches.append(positive)
        self.add(x.t * 2 if positive else x.t.sin(), f"{x.name} * 2 if sum > 0 else sin")

    def export(self, a: int, b: int, c: int) -> None:
        """Hand a held value out by address and write through the handle: readers made
        before the write keep the old contents, readers made after see the new ones, and
        the value and its aliases read back written (no version counter sees it)."""
        x = self.pick(
            a,
            lambda e: (
                e.t.is_floating_point()
                and e.t.dim() > 0
                and not e.fam.saved
                and not _overlaps(e.t)
            ),
        )
        if x is None:
            return self.unary(a, b, c)
        with torch.no_grad():
            self.add(x.t * 1.5 + 0.25, f"{x.name} * 1.5 + 0.25  # no_grad, before export")
        route = ("numpy", "dlpack", "storage")[b % 3]
        t = x.t.detach() if x.t.requires_grad else x.t  # an alias, or the value itself
        if route == "numpy":
            handle = t.numpy()
        elif route == "dlpack":
            handle = torch.from_dlpack(t)
        else:
            handle = torch.empty(0, dtype=t.dtype).set_(
                x.t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
            )
        write = ("scale", "fill", "first")[c % 3]
        if write == "scale":
            handle *= 2
        elif write == "fill":
            handle[...] = 0.75
        else:
            handle[0] = -0.5
        self.lines.append(f"h = {route} export of {x.name}; write {write} through h")
        self.used(x)
        self.add(x.t * 2 if c // 3 % 2 else x.t.clone(), f"{x.name} read after the write")
        if c // 6 % 2:
            handle += 1
            self.lines.append("h += 1  # a second write, after that reader")

    def np_input(self, a: int, b: int, c: int) -> None:
        """A plain input over NumPy memory (torch.from_numpy), read at once; "refill"
        steps overwrite the buffer later, as a reused batch buffer is."""
        x = self.floats(a)
        buf = _normal(c, x.t.shape)
        self.buffers.append(buf)
        inp = self.add(torch.from_numpy(buf), f"from_numpy(buffer {len(self.buffers) - 1})")
        self.used(x, inp)
        self.add(x.t * inp.t if b % 2 else x.t + inp.t.sin(), f"{x.name} with {inp.name}")

    def refill(self, a: int, b: int, c: int) -> None:
        if not self.buffers:
            return self.np_input(a, b, c)
        k = a % len(self.buffers)
        buf = self.buffers[k]
        if b % 2:
            buf[...] = _normal(c + 256, buf.shape)
        else:
            buf *= -0.5
        self.lines.append(f"buffer {k} refilled in place through NumPy ({b % 2})")

    def out_resize(self, a: int, b: int, c: int) -> None:
        """out= into a tensor of another shape made from a held value (managed under dtr
        where the value is), which the op resizes."""
        x = self.pick(a, lambda e: e.t.is_floating_point() and e.t.dim() > 0)
        if x is None:
            return self.unary(a, b, c)
        t = x.t
        how = ("new_empty(0)", "[:0].clone()", "new_zeros(3)")[b % 3]
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager warns when resizing a non-empty out
            if how == "new_empty(0)":
                out = t.new_empty(0)
            elif how == "[:0].clone()":
                out = t[:0].clone()
            else:
                out = t.new_zeros(3)
            if c % 2:
                y = self.partner(x, c // 2)
                torch.add(t, y.t, out=out)
                text = f"add({x.name}, {y.name}, out=x.{how})"
            else:
                torch.cat([t, t * 2], c // 2 % t.dim(), out=out)
                text = f"cat([{x.name}, 2 * {x.name}], out=x.{how})"
        o = self.add(out, text + "  # no_grad")
        self.add(o.t * 0.5 - 1, f"{o.name} * 0.5 - 1")

    def copies(self, a: int, b: int, c: int) -> None:
        """copy.deepcopy or torch.save/torch.load of views of one value: the copies share
        one storage as eager's do (a write to one shows in the others), and loaded
        tensors require grad where eager's do."""
        x = self.pick(
            a, lambda e: e.t.is_floating_point() and e.t.dim() > 0 and not _overlaps(e.t)
        )
        if x is None:
            return self.unary(a, b, c)
        self.used(x)
        if c % 2:
            w = x.t.detach()  # deepcopy refuses non-leaves that require grad
            made = copy.deepcopy([w, w[0], w.transpose(0, -1)])
            how = "deepcopy"
        else:
            f = io.BytesIO()
            torch.save([x.t, x.t[0], x.t.transpose(0, -1)], f)
            f.seek(0)
            made = torch.load(f)
            how = "torch.save/load"
        self.flags.extend(m.requires_grad for m in made)
        with torch.no_grad():
            made[b % 3].mul_(-2)
        fam = Family()
        for k, m in enumerate(made):
            self.add(m, f"{how}([{x.name}, {x.name}[0], {x.name}.t])[{k}]", fam=fam)
        self.lines.append(f"copy {b % 3} *= -2  # no_grad")

    def custom(self, a: int, b: int, c: int) -> None:
        x = self.floats(a)
        self.used(x)
        name, op = (("scale2", scale2), ("noisy", noisy))[b % 2]
        self.add(op(x.t), f"dtrfuzz.{name}({x.name})")

    def train(self, a: int, b: int, c: int) -> None:
        """A small training loop inside the program, on its own parameter: forward,
        gradient, update (in place, by an optimizer, or by assigning .data), and a running
        mean of the loss carried across iterations."""
        x = self.floats(a)
        inp = x.t.detach()
        styles = ("in-place", "optimizer", ".data, NumPy parameter", ".data, computed parameter")
        style = styles[b % 4]
        if style == ".data, NumPy parameter":
            # A parameter over NumPy memory is plain under dtr too; one computed from a
            # managed value is managed.
            w = torch.from_numpy(_normal(c, inp.shape)).requires_grad_()
        else:
            w = (inp * 0.5).requires_grad_()
        # optimizer.step() ends a step for dtr, which may cut lineage reaching into it.
        opt = torch.optim.SGD([w], lr=0.1) if style == "optimizer" else None
        run = torch.zeros(())
        self.lines.append(f"train on {x.name}: {2 + c % 2} iterations, updates: {style}")
        for _ in range(2 + c % 2):
            loss = torch.tanh(w * inp + 0.5).sum() * 0.1 + (w * w).sum() * 0.01
            self.losses.append(loss.detach())
            if style == "in-place":
                loss.backward()
                with torch.no_grad():
                    w.sub_(w.grad, alpha=0.1)
                w.grad = None
            elif opt is not None:
                opt.zero_grad()
                loss.backward()
                opt.step()
            else:
                (g,) = torch.autograd.grad(loss, [w])
                w.data = w.data - 0.1 * g
            run = 0.9 * run + 0.1 * loss.detach()
        self.add(run, "running mean of the loss")
        self.add(w, "trained parameter")

    # ---------------------------------------------------------------- phases
    def loss(self, mask: int) -> torch.Tensor:
        total = self.leaves[0].sum() * 0
        for i, e in enumerate(self.pool):
            if (
                e.t.is_floating_point()
                and e.t.requires_grad
                and (mask >> (i % 8)) & 1
                or (i == len(self.pool) - 1 and e.t.is_floating_point())
            ):
                total = total + e.t.sum() * (1.0 / (i + 1))
        return total

    def backward(self, mask: int, retain: bool) -> None:
        loss = self.loss(mask | 1)
        self.lines.append(f"loss = weighted sum of pool (mask {mask}); backward")
        self.losses.append(loss.detach())
        if loss.requires_grad:
            loss.backward(retain_graph=retain)
        for p in self.leaves:
            self.grads.append(p.grad.clone() if p.grad is not None else torch.zeros(0))
        if not retain:
            self._graph_freed()

    def _graph_freed(self) -> None:
        """After a backward that freed the graph, later steps reuse the values detached."""
        for e in self.pool:
            if e.t.requires_grad and not e.t.is_leaf:
                e.t = e.t.detach()
                e.fam.saved = True  # shares a version counter with saved tensors

    def penalty(self) -> None:
        """A gradient penalty: backward(create_graph=True), then a second backward of
        the squared gradients, which reaches the leaves through their .grad."""
        loss = self.loss(1)
        self.lines.append("loss = weighted sum of pool; backward(create_graph=True)")
        self.losses.append(loss.detach())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reference cycle .grad makes
            if loss.requires_grad:
                loss.backward(create_graph=True)
            grads = [p.grad for p in self.leaves if p.grad is not None]
            pen = sum(((g * g).sum() for g in grads if g.requires_grad), torch.zeros(()))
            self.lines.append("penalty = sum of p.grad ** 2; penalty.backward()")
            self.losses.append(pen.detach())
            if pen.requires_grad:
                pen.backward()
        for p in self.leaves:
            self.grads.append(p.grad.detach().clone() if p.grad is not None else torch.zeros(0))
            if p.grad is not None:
                p.grad = p.grad.detach()
        self._graph_freed()

    def grad_sgd(self) -> None:
        """torch.autograd.grad of a loss and a hand-written update of the leaves."""
        loss = self.loss(3)
        self.lines.append("g = autograd.grad(loss, leaves); p.data = p.data - 0.1 * g")
        self.losses.append(loss.detach())
        if not loss.requires_grad:
            return
        gs = torch.autograd.grad(loss, self.leaves, allow_unused=True)
        for p, g in zip(self.leaves, gs, strict=True):
            self.grads.append(g.clone() if g is not None else torch.zeros(0))
            if g is not None:
                p.data = p.data - 0.1 * g
        self._graph_freed()

    def sgd(self) -> None:
        with torch.no_grad():
            for p in self.leaves:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.1)
                    p.grad = None
        self.lines.append("sgd step on the leaves")

    def run(self, leaves: list[torch.Tensor], upto: int | None = None) -> None:
        self.leaves = leaves
        for p in leaves:
            self.pool.append(Entry(f"v{self.count}", p, Family()))
            self.lines.append(f"v{self.count} = leaf {tuple(p.shape)}")
            self.count += 1
        torch.manual_seed(self.program.seed)
        steps = self.program.steps if upto is None else self.program.steps[:upto]
        for self.step, (kind, a, b, c) in enumerate(steps):
            if kind == "backward":
                self.backward(a, retain=False)
            elif kind == "backward_retain":
                self.backward(a, retain=True)
            elif kind in ("sgd", "penalty", "grad_sgd"):
                getattr(self, kind)()
            else:
                getattr(self, kind)(a, b, c)
        self.after = torch.rand(4)  # the RNG stream the program sees afterwards


def _normal(seed: int, shape) -> np.ndarray:
    """float32 NumPy memory of standard normal values (a 0-d array for shape ())."""
    values = np.random.default_rng(seed).standard_normal(tuple(shape))
    return np.array(values, dtype=np.float32)


def _broadcasts(a, b):
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


def _overlaps(t: torch.Tensor) -> bool:
    return any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape, strict=True))


# ====================================================================== running
def make_leaves(program: Program) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(program.seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in program.shapes]


@contextlib.contextmanager
def core_env(core: str):
    old = os.environ.get("DTR_FORCE_PYTHON")
    os.environ["DTR_FORCE_PYTHON"] = "1" if core == "python" else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["DTR_FORCE_PYTHON"]
        else:
            os.environ["DTR_FORCE_PYTHON"] = old


def run_eager(program: Program, upto: int | None = None) -> Interp:
    it = Interp(program)
    it.run(make_leaves(program), upto)
    return it


def run_dtr(program: Program, core: str, **kwargs) -> tuple[Interp, dtr.Stats]:
    """The program under dtr (core: "c++" or "python" for the subclass engine's core,
    "native" for the native engine). Raises BudgetError when the budget cannot be met and
    UnsupportedError when a step is refused, with .interp and .stats attached."""
    it = Interp(program)
    if core == "native":
        session = dtr.engines.native.session.enable(cost_model="roofline", **kwargs)
    else:
        with core_env(core):
            session = dtr.enable(cost_model="roofline", engine="subclass", **kwargs)
    try:
        with session:
            it.run(make_leaves(program))
    except (dtr.BudgetError, dtr.UnsupportedError) as exc:
        exc.interp = it
        exc.stats = session.stats()
        raise
    return it, session.stats()


def plain(t: torch.Tensor) -> torch.Tensor:
    return dtr.materialize(t)  # a plain tensor is returned as it is


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaNs included (torch.equal says NaN != NaN)."""
    a, b = plain(a).detach(), plain(b).detach()
    if type(a) is not torch.Tensor or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(ints), b.contiguous().view(ints)
    return torch.equal(a, b)


def lost(t: torch.Tensor) -> bool:
    """Whether t was evicted when a block ended with a BudgetError (it is not rebuilt
    then: reading it is refused with dtr.engines.subclass.tensor.LOST_MESSAGE, never wrong)."""
    try:
        plain(t).detach().sum()
    except (RuntimeError, dtr.DTRError) as exc:
        if str(exc).startswith(LOST_MESSAGE):
            return True
        raise
    return False


def compare(
    got: Interp, expected: Interp, what: str, entries_only: bool = False, failed: bool = False
) -> None:
    """got's values are expected's, bitwise; failed: got's block ended with a
    BudgetError, after which a value it evicted may be lost (refused when read)."""
    program = "\n  ".join(expected.lines)
    assert len(got.pool) == len(expected.pool), f"{what}: pool sizes differ\n  {program}"
    for g, e in zip(got.pool, expected.pool, strict=True):
        if failed and lost(g.t):
            continue
        assert same_bits(g.t, e.t), f"{what}: {e.name} differs from eager\n  {program}"
        flag = g.t.requires_grad == e.t.requires_grad
        assert flag, f"{what}: {e.name}.requires_grad differs from eager\n  {program}"
    if entries_only:
        return
    for k, (g, e) in enumerate(zip(got.grads, expected.grads, strict=True)):
        assert same_bits(g, e), f"{what}: gradient {k} differs from eager\n  {program}"
    for k, (g, e) in enumerate(zip(got.losses, expected.losses, strict=True)):
        assert same_bits(g, e), f"{what}: loss {k} differs from eager\n  {program}"
    assert got.branches == expected.branches, f"{what}: .item() branches differ\n  {program}"
    assert got.flags == expected.flags, f"{what}: requires_grad of copies differs\n  {program}"
    assert same_bits(got.after, expected.after), f"{what}: RNG stream shifted\n  {program}"
    for g, e in zip(got.leaves, expected.leaves, strict=True):
        assert same_bits(g, e), f"{what}: leaf differs\n  {program}"


def check_held(exc: dtr.DTRError, program: Program, what: str) -> None:
    """After a run stopped with exc (attached by run_dtr): no session is left active, and
    the values held read back as eager computed them up to the failing step (unless that
    step may have done part of its writes to them), or, when the block ended with a
    BudgetError and had evicted them, are refused when read (never wrong)."""
    assert dtr.session.current() is None, "a failed session stayed active"
    it = exc.interp
    if program.steps[it.step][0] in PARTIAL:
        return
    before = run_eager(program, it.step)
    del it.pool[len(before.pool) :]  # values the failing step made before failing
    compare(it, before, what, entries_only=True, failed=True)


def refused(exc: Exception, program: Program, core: str) -> bool:
    """Whether exc is a refusal dtr may give by design, from a step that may get one (or,
    on the subclass engine, from any step: the views autograd replays by op,
    dtr/engines/subclass/view_replay.py)."""
    if not isinstance(exc, dtr.UnsupportedError) or not str(exc).startswith("dtr:"):
        return False
    if core != "native" and view_replay.NOTE in str(exc):
        return True
    return program.steps[exc.interp.step][0] in REFUSABLE


def check_program(program: Program, setting: dict, totals: Counter) -> None:
    """One example: eager, dtr without a budget, dtr under the drawn setting."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = run_eager(program)
    except RuntimeError:
        # The interpreter avoids programs eager autograd refuses (writes to saved
        # values); this is the backstop, and the aggregate check bounds how often.
        totals["rejected"] += 1
        reject()
    core, fraction = setting["core"], setting["fraction"]
    try:
        free, free_stats = run_dtr(program, core, check=setting["check"])
    except dtr.UnsupportedError as exc:
        if not refused(exc, program, core):
            raise
        totals["refused"] += 1
        totals["refused_view_replay"] += view_replay.NOTE in str(exc)
        check_held(exc, program, f"values held at a refusal (no budget, core {core})")
        return
    compare(free, expected, "dtr, no budget")
    assert free_stats.evictions == 0
    totals["examples"] += 1
    if fraction is None and not setting["stress"]:
        return
    budget = (
        None if fraction is None else max(1, math.floor(free_stats.peak_resident_bytes * fraction))
    )
    kwargs = {
        "budget": budget,
        "heuristic": setting["heuristic"],
        "stress": setting["stress"],
        "check": setting["check"],
    }
    desc = f"{kwargs}, core {core}, peak {free_stats.peak_resident_bytes}"
    try:
        got, stats = run_dtr(program, core, **kwargs)
    except dtr.UnsupportedError as exc:
        # The unbudgeted run served every step: a budget may not add refusals.
        raise AssertionError(f"refused under a budget only ({desc})") from exc
    except dtr.BudgetError as exc:
        totals["budget_errors"] += 1
        # Without stress mode, a budget at the unbudgeted peak never needs an eviction.
        # Stress mode may: a recomputation needs its inputs resident, where the
        # unbudgeted run had kept the value and freed them.
        assert budget is not None, desc
        assert setting["stress"] or budget < free_stats.peak_resident_bytes, desc
        check_held(exc, program, f"values held at a BudgetError ({desc})")
        return
    compare(got, expected, desc)
    totals["evictions"] += stats.evictions
    totals["remats"] += stats.remats
    if budget is not None:
        assert stats.peak_resident_bytes <= budget, desc  # Invariant 6
        if budget < free_stats.peak_resident_bytes:
            # The same program stayed below its unbudgeted peak: something was evicted.
            assert stats.evictions > 0, desc
            totals["tight"] += 1
            totals["tight_remats"] += stats.remats > 0
    if setting["stress"]:
        assert stats.evictions > 0 or stats.ops == 0, desc
        totals["stress_remats"] += stats.remats > 0


settings_strategy = st.fixed_dictionaries(
    {
        # A third unbudgeted, a third in the range where most programs are feasible
        # with evictions, a third mostly infeasible (RNG states and constants dominate).
        "fraction": st.one_of(st.none(), st.floats(0.5, 1.0), st.floats(0.01, 0.5)),
        "heuristic": st.sampled_from(dtr.HEURISTICS),
        "core": st.sampled_from(ENGINES),
        "stress": st.booleans(),
        "check": st.booleans(),
    }
)


def _fuzz_settings():
    kwargs = dict(
        max_examples=EXAMPLES,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    if not LONG:
        kwargs.update(derandomize=SEED is None, database=None)
        # Shrinking a CI failure would take minutes; the program is printed as is.
        kwargs["phases"] = (Phase.explicit, Phase.generate)
    return settings(**kwargs)


def test_random_programs_match_eager():
    totals: Counter = Counter()

    @_fuzz_settings()
    @given(program=programs(), setting=settings_strategy)
    def fuzz(program, setting):
        check_program(program, setting, totals)

    if SEED is not None:
        fuzz = seed(int(SEED))(fuzz)
    fuzz()
    print(f"\nfuzz totals: {dict(totals)}")
    # The programs must really exercise dtr: budgets that force evictions, evicted
    # values recomputed, few rejected programs, and infeasible budgets among them.
    assert totals["examples"] + totals["refused"] >= EXAMPLES * 0.9, totals
    assert totals["rejected"] <= EXAMPLES * 0.05, totals
    assert totals["tight"] >= EXAMPLES * 0.1, totals
    assert totals["tight_remats"] >= totals["tight"] * 0.5, totals
    assert totals["stress_remats"] >= EXAMPLES * 0.1, totals
    assert totals["budget_errors"] >= 1, totals
    assert totals["remats"] > 0 and totals["evictions"] > 0, totals


@pytest.mark.parametrize("core", ENGINES)
def test_interpreter_is_deterministic_and_runs_every_kind(core):
    # A program with every step kind, run twice eagerly and under dtr in stress mode: the
    # interpreter itself must be deterministic, or the fuzz would compare noise.
    steps = tuple((k, 11 * i + 3, 5 * i + 1, 7 * i + 2) for i, k in enumerate(STEP_KINDS * 2))
    steps += tuple(("multi", i, i, i) for i in range(7))  # each multi-output op
    steps += tuple(("rng", i, i, i) for i in range(6))  # each RNG op
    steps += tuple(("misc", i, i, i) for i in range(7))  # each selection/layout/out= op
    steps += tuple(("export", i, i, i) for i in range(12))  # each route, write, reader
    steps += tuple(("out_resize", i, i, i) for i in range(6))  # each out tensor and op
    steps += tuple(("copies", i, i, i) for i in range(6))  # deepcopy and save, each write
    steps += (("np_input", 0, 1, 0), ("refill", 0, 0, 1), ("refill", 0, 1, 1))
    steps += (("custom", 0, 0, 0), ("custom", 0, 1, 0), ("train", 0, 0, 0), ("train", 0, 1, 1))
    steps += (("backward", 5, 0, 0), ("sgd", 0, 0, 0)) + steps[:8]
    steps += (("penalty", 0, 0, 0),) + steps[:8] + (("refill", 1, 1, 7),)
    steps += (("grad_sgd", 0, 0, 0),) + steps[:8] + (("backward", 0, 0, 0),)
    program = Program(((4, 6), (6, 4)), 3, steps)
    first, second = run_eager(program), run_eager(program)
    compare(second, first, "eager twice")
    if core == "native":
        got, stats = run_dtr(program, core, stress=True, check=True)
        compare(got, first, "stress")
    else:
        # The subclass engine refuses the penalty's create_graph backward after this program's
        # in-place writes to views (dtr/engines/subclass/view_replay.py): the rest runs there.
        rest = Program(program.shapes, program.seed, tuple(s for s in steps if s[0] != "penalty"))
        got, stats = run_dtr(rest, core, stress=True, check=True)
        compare(got, run_eager(rest), "stress")
    assert stats.remats > 0
    executed = "\n".join(first.lines)
    needles = ("split(", "sort(", "topk(", "dropout(", "generator(", "_(", "cat(", "sgd step")
    needles += ("no_grad", "sum > 0", "gather(", "out=buf", "where(", "export", "refilled")
    needles += ("out=x.", "deepcopy", "torch.save", "dtrfuzz.noisy", "running mean")
    needles += ("create_graph", "autograd.grad", "updates: .data", "updates: optimizer")
    for needle in needles:
        assert needle in executed, needle
