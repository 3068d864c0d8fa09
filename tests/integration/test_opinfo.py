"""PyTorch's OpInfo database under dtr's stress mode, compared with eager bit for bit.

Every op variant of ``op_db`` that runs on CPU in float32 or float64 is one test per
dtype (``test_op[add-float32]``). Each sample is computed twice by the same code: once
eagerly, once on the subclass engine, inside ``dtr.enable(stress=True, check=True,
engine="subclass")``, where every evictable value is evicted after every op, so the op,
its inputs and every backward op are recomputed each time a value is read again. Inside
the block each input tensor is the output of an op on the sample's tensor (a clone, or
``where`` for one that does not require grad), with the sample's strides, so the inputs
are managed values too. Outputs and gradients (vector-Jacobian products with fixed
random cotangents) must agree in every bit (NaNs compared as NaNs) and in strides, and
be plain tensors after the block.

The in-place form of each op that has one (``test_inplace[add-float32]`` runs
``x.add_(y)``) is checked the same way: it exercises new versions of managed tensors and
recipes that replay on a copy of the old value (docs/design.md, Invariant 4).

The same sweep runs under the native engine (``dtr.engines.native.session.enable(stress=True,
check=True)``; ``test_native_op``, ``test_native_inplace``), where managed tensors are a
C++ TensorImpl rather than a wrapper subclass.

Variants that cannot pass are listed in ``tests/integration/opinfo_expected.txt`` with a
category and a one-line reason (for one engine if the entry says so); the file is checked
both ways (a listed variant that passes fails).

By default each variant runs its first ``DTR_OPINFO_SAMPLES`` samples that hold data (8),
fewer once ``REMAT_BUDGET`` recomputations were made, and a listed variant more until it
shows what its entry claims: about 1.5 minutes on one core. ``DTR_OPINFO_FULL=1`` runs
every sample of every variant. ``-m "not opinfo"`` leaves the module out.
``python -m tests.integration.test_opinfo [--native] [op ...]`` runs the sweep outside
pytest (under the native engine with ``--native``) and prints every failure and the pass
rate per dtype.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import random
import sys
import time
import traceback
import warnings

import pytest
import torch
from torch.testing._comparison import default_tolerances
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import dtr
import dtr.engines.native.session
import dtr.engines.subclass.runtime
from dtr.engines.subclass.recipe import Recipe

pytestmark = [pytest.mark.opinfo, pytest.mark.slow]

DTYPES = (torch.float32, torch.float64)
EXPECTED_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "opinfo_expected.txt")
CATEGORIES = ("unsupported", "tolerance", "nondeterministic", "uninitialized", "limitation")
FULL = os.environ.get("DTR_OPINFO_FULL", "") == "1"
DEFAULT_SAMPLES = int(os.environ.get("DTR_OPINFO_SAMPLES", "8"))
REMAT_BUDGET = 5000
try:
    import dtr._C  # noqa: F401

    HAVE_NATIVE = True
except ImportError:  # the pure-Python build: no native engine
    HAVE_NATIVE = False


def op_key(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ====================================================================== expected file
@dataclasses.dataclass(frozen=True)
class Expected:
    key: str
    dtypes: tuple[str, ...]
    category: str
    reason: str
    line: int
    engine: str | None = None  # None: both engines

    @property
    def message(self) -> str:
        """For `unsupported` and `limitation`: the part of the error message the reason
        quotes."""
        start = self.reason.find('"')
        end = self.reason.find('"', start + 1)
        return self.reason[start + 1 : end] if 0 <= start < end else ""


def parse_expected(path: str = EXPECTED_FILE) -> dict[tuple[str, str, str | None], Expected]:
    """Lines ``<op variant>[@engine] <dtypes|*> <category> <reason>``; '#' starts a
    comment. Keyed by (variant, dtype, engine), engine None for an entry without one."""
    entries: dict[tuple[str, str, str | None], Expected] = {}
    with open(path) as f:
        for n, raw in enumerate(f, 1):
            line = raw.split(" #", 1)[0].strip() if not raw.startswith("#") else ""
            if not line:
                continue
            parts = line.split(None, 3)
            where = f"{path}:{n}"
            if len(parts) < 4:
                raise ValueError(f"{where}: want '<op> <dtypes|*> <category> <reason>'")
            key, dtypes, category, reason = parts
            key, _, engine = key.partition("@")
            if engine and engine not in ("subclass", "native"):
                raise ValueError(f"{where}: unknown engine {engine!r} (subclass or native)")
            names = tuple(dtype_name(d) for d in DTYPES) if dtypes == "*" else dtypes.split(",")
            if category not in CATEGORIES or not set(names) <= {dtype_name(d) for d in DTYPES}:
                raise ValueError(f"{where}: unknown category or dtype in {line!r}")
            entry = Expected(key, names, category, reason, n, engine or None)
            if category == "unsupported" and not entry.message.startswith("dtr:"):
                raise ValueError(f'{where}: quote the "dtr: ..." message the user gets')
            if category == "limitation" and not entry.message:
                raise ValueError(f'{where}: quote the "..." error the user gets')
            # an entry for both engines clashes with any other; one for an engine, with
            # one for both or for the same engine
            clashes = (None, engine) if engine else (None, "subclass", "native")
            for name in names:
                if any((key, name, e) in entries for e in clashes):
                    raise ValueError(f"{where}: {key} {name} listed twice")
                entries[(key, name, engine or None)] = entry
    return entries


EXPECTED = parse_expected()


def expected_entry(key: str, dtype: str, engine: str) -> Expected | None:
    """The entry for a variant under an engine: its own, else one for both."""
    return EXPECTED.get((key, dtype, engine)) or EXPECTED.get((key, dtype, None))


# ====================================================================== running a sample
def _copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh leaf with the same value, geometry and requires_grad as a sample tensor."""
    if t.layout != torch.strided:
        c = t.detach().clone()
    else:
        flat = t.detach().as_strided((_storage_numel(t),), (1,), 0)
        c = flat.clone().as_strided(t.size(), t.stride(), t.storage_offset())
    return c.requires_grad_(t.requires_grad)


def _storage_numel(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() // t.element_size()


def _copy_sample(sample):
    """Copies of the sample's tensors (one copy per distinct tensor, so that a tensor
    passed twice stays one tensor)."""
    memo: dict[int, torch.Tensor] = {}

    def copy(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in memo:
            memo[id(x)] = _copy(x)
        return memo[id(x)]

    return tree_map(copy, (sample.input, sample.args, sample.kwargs))


def _as_op_output(t: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """The same value and geometry as the leaf t, but computed by an op from it: inside
    dtr that op's output is managed, so it is evicted after every op and recomputed from
    t whenever the op under test (or its backward) reads it. A leaf that requires grad is
    cloned (its gradient flows through unchanged); any other tensor (indices, masks) is
    selected by ``where`` on a managed scalar, which makes it managed too."""
    if t.layout != torch.strided:
        return t  # dtr leaves sparse tensors plain

    def ident(x):
        return x.clone() if x.requires_grad else torch.where(anchor, x, x)

    y = ident(t)
    if y.stride() == t.stride() and y.storage_offset() == t.storage_offset():
        return y
    flat = t.as_strided((_storage_numel(t),), (1,), 0)
    return ident(flat).as_strided(t.size(), t.stride(), t.storage_offset())


def _as_op_outputs(tree):
    """_as_op_output of every tensor in the tree (a tensor passed twice stays one)."""
    anchor = torch.ones((), requires_grad=True) > 0  # managed inside the block
    memo: dict[int, torch.Tensor] = {}

    def convert(x):
        if isinstance(x, torch.Tensor) and id(x) not in memo:
            memo[id(x)] = _as_op_output(x, anchor)
        return memo[id(x)] if isinstance(x, torch.Tensor) else x

    return tree_map(convert, tree)


def _cotangent(o: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(o.shape, dtype=o.dtype, generator=gen)


@dataclasses.dataclass
class Result:
    outputs: list  # flattened op outputs: plain tensors or Python values
    grads: list | None  # gradients of the grad-requiring sample tensors, None if not run
    remats: int = 0
    managed: int = 0  # outputs and gradients that were dtr-managed and not empty
    unmanaged_inputs: int = 0  # strided inputs the op saw as plain tensors under dtr


def run_sample(op, sample, backward: bool, under: str = "eager") -> Result:
    """Run op on a copy of the sample and return its outputs and gradients as plain
    tensors. under: "eager"; "subclass" or "native" (that engine in stress mode, every
    invariant checked after every op); or "noop", eagerly under a dispatch mode that does
    nothing, which is what some backward formulas switch on (see the `tolerance`
    category)."""
    inp, args, kwargs = _copy_sample(sample)
    leaves = [t for t in tree_flatten((inp, args, kwargs))[0] if _requires_grad(t)]
    torch.manual_seed(1234)
    session = None
    if under == "subclass":
        session = dtr.enable(stress=True, check=True, engine="subclass")
    elif under == "native":
        session = dtr.engines.native.session.enable(stress=True, check=True)
    context = session or (_NoOpMode() if under == "noop" else contextlib.nullcontext())
    with context:
        minp, margs, mkwargs = _as_op_outputs((inp, args, kwargs))
        out = op(minp, *margs, **mkwargs)
        grads = _backward(sample, out, leaves) if backward else None
    flat = tree_flatten(out)[0]
    result = Result([_plain(o) for o in flat], None)
    if grads is not None:
        result.grads = [None if g is None else _plain(g) for g in grads]
    if session is not None:
        result.remats = session.stats().remats
        result.managed = sum(_is_managed(x) and x.numel() > 0 for x in flat + list(grads or ()))
        result.unmanaged_inputs = len(_plain_strided(tree_flatten((minp, margs, mkwargs))[0]))
    return result


def _plain_strided(xs: list) -> list:
    return [
        x
        for x in xs
        if type(x) is torch.Tensor
        and x.layout == torch.strided
        and not x.is_meta
        and not _is_managed(x)
    ]


def _is_managed(x) -> bool:
    """A tensor of either engine (dtr.enable's wrapper, or the native engine's)."""
    if isinstance(x, dtr.CheckpointTensor):
        return True
    return isinstance(x, torch.Tensor) and HAVE_NATIVE and dtr.engines.native.session.is_managed(x)


class _NoOpMode(TorchDispatchMode):
    """Runs every op unchanged. PyTorch's isTensorSubclassLike() is true whenever a
    dispatch mode is active, and a few backward formulas then take a composite-compliant
    path (prod_backward, masked_fill's value gradient): eager under this mode is what
    dtr, itself a dispatch mode, must equal bit for bit."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _requires_grad(x) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


def _backward(sample, out, leaves):
    """Vector-Jacobian products of the differentiable outputs (after the sample's own
    output_process_fn_grad) with fixed random cotangents, for every leaf."""
    diff = [o for o in tree_flatten(sample.output_process_fn_grad(out))[0] if _requires_grad(o)]
    if not diff or not leaves:
        return None
    gen = torch.Generator().manual_seed(4321)
    cotangents = [_cotangent(o, gen) for o in diff]
    return torch.autograd.grad(diff, leaves, cotangents, allow_unused=True)


def _plain(x):
    """After the block a managed tensor must hand out a plain tensor."""
    if not isinstance(x, torch.Tensor):
        return x
    value = dtr.materialize(x)
    if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
        raise AssertionError(f"got a {type(value).__name__} after the block, not a plain tensor")
    if _is_managed(value):
        raise AssertionError("dtr.materialize() handed out a managed tensor after the block")
    return value.detach()


# ====================================================================== comparing
def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, NaNs made one pattern (their payloads are arbitrary)."""
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    t = t.resolve_neg().resolve_conj()
    if not t.is_floating_point():
        return t
    canonical = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return canonical.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _meta_diff(a: torch.Tensor, b: torch.Tensor, strides: bool) -> str | None:
    for what in ("dtype", "layout", "shape"):
        if getattr(a, what) != getattr(b, what):
            return f"{what} {getattr(a, what)} != {getattr(b, what)}"
    if strides and a.layout == torch.strided and a.numel() > 1 and a.stride() != b.stride():
        return f"strides {a.stride()} != {b.stride()}"
    return None


def compare(expected, actual, mode: str, tol: tuple[float, float]) -> str | None:
    """None if equal under mode ('bitwise', 'tolerance' or 'metadata'), else what differs."""
    if isinstance(expected, torch.Tensor) != isinstance(actual, torch.Tensor):
        return f"{type(expected).__name__} != {type(actual).__name__}"
    if not isinstance(expected, torch.Tensor):
        same = expected == actual or (expected != expected and actual != actual)
        return None if same else f"{expected!r} != {actual!r}"
    diff = _meta_diff(expected, actual, strides=mode != "tolerance")
    if diff is not None or mode == "metadata":
        return diff
    if expected.layout != torch.strided:
        expected, actual = expected.to_dense(), actual.to_dense()
    if mode == "bitwise":
        return None if torch.equal(_bits(expected), _bits(actual)) else "values differ"
    try:
        torch.testing.assert_close(actual, expected, rtol=tol[0], atol=tol[1], equal_nan=True)
    except AssertionError as e:
        return str(e).splitlines()[0] + " (beyond tolerance)"
    return None


def compare_results(expected: Result, actual: Result, mode: str, tol) -> str | None:
    pairs = [("output", expected.outputs, actual.outputs)]
    if expected.grads is not None or actual.grads is not None:
        pairs.append(("gradient", expected.grads or [], actual.grads or []))
    for what, xs, ys in pairs:
        if len(xs) != len(ys):
            return f"{len(ys)} {what}s, eager has {len(xs)}"
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            if (x is None) != (y is None):
                return f"{what} {i}: {y!r} where eager has {x!r}"
            diff = None if x is None else compare(x, y, mode, tol)
            if diff is not None:
                return f"{what} {i}: {diff}"
    return None


def tolerance(op, dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol): torch.testing's defaults for the dtype, widened to the largest
    override any of the op's own OpInfo tests declares for it on CPU."""
    rtol, atol = default_tolerances(dtype)
    for info in op.decorators:
        if getattr(info, "device_type", None) not in (None, "cpu"):
            continue
        for d in getattr(info, "decorators", ()):
            override = getattr(d, "d", None)
            if not isinstance(override, dict) or dtype not in override:
                continue
            value = override[dtype]
            if type(d).__name__ == "precisionOverride":
                atol = max(atol, value)
            else:
                rtol, atol = max(rtol, value.rtol), max(atol, value.atol)
    return rtol, atol


# ====================================================================== one variant
@dataclasses.dataclass
class Outcome:
    samples: int = 0  # samples compared
    skipped: int = 0  # samples whose eager run raised (nothing to compare)
    remats: int = 0
    managed: int = 0
    unmanaged_inputs: int = 0
    mismatch: str | None = None  # first bitwise difference from eager
    beyond: str | None = None  # first difference beyond tolerance (or in metadata)
    noop_mismatch: str | None = None  # first bitwise difference from eager under _NoOpMode
    errors: list = dataclasses.field(default_factory=list)  # (sample, what dtr raised)

    @property
    def error(self) -> BaseException | None:
        return self.errors[0][1] if self.errors else None


def run_variant(
    op,
    dtype: torch.dtype,
    category: str | None,
    inplace: bool = False,
    full: bool = FULL,
    engine: str = "subclass",
) -> Outcome:
    """The variant's samples (of its in-place form if inplace) eagerly and under the
    engine, compared as the category of its entry in the expected file says (bitwise when it has
    none). Unless full: the first DEFAULT_SAMPLES samples, fewer once REMAT_BUDGET
    recomputations were made (stress mode recomputes quadratically on long iterative ops
    such as svd_lowrank), more for a listed variant until it shows what its entry claims."""
    backward = op.supports_autograd and dtype in op.supported_backward_dtypes("cpu")
    tol = tolerance(op, dtype)
    fn = op.inplace_variant if inplace else op
    outcome = Outcome()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        random.seed(0)  # some samples are drawn with Python's random (linalg.eigh's UPLO)
        counted = 0  # samples run that hold some data (empty ones come first for many ops)
        for i, sample in enumerate(op.sample_inputs("cpu", dtype, requires_grad=backward)):
            if not full and counted >= DEFAULT_SAMPLES and not _unproven(outcome, category):
                break
            if inplace and sample.broadcasts_input:
                continue  # an in-place op cannot broadcast its first argument
            _run_one(fn, sample, backward, category, tol, outcome, i, engine)
            counted += _holds_data(sample)
            if not full and outcome.remats >= REMAT_BUDGET and not _unproven(outcome, category):
                break
    return outcome


def _holds_data(sample) -> bool:
    leaves = tree_flatten((sample.input, sample.args, sample.kwargs))[0]
    return any(isinstance(t, torch.Tensor) and t.numel() > 0 for t in leaves)


def _unproven(outcome: Outcome, category: str | None) -> bool:
    """A listed variant has not yet shown what its category claims."""
    if category in ("unsupported", "limitation"):
        return outcome.error is None
    return category == "tolerance" and outcome.mismatch is None


def _eager(op, sample, backward: bool):
    """The eager result, and whether the backward ran (None: the forward raised too)."""
    try:
        return run_sample(op, sample, backward), backward
    except Exception:
        if not backward:
            return None, False
    try:  # e.g. a derivative PyTorch does not implement: compare the forward only
        return run_sample(op, sample, False), False
    except Exception:
        return None, False


def _run_one(
    op, sample, backward, category, tol, outcome: Outcome, index: int, engine: str
) -> None:
    eager, backward = _eager(op, sample, backward)
    if eager is None:
        outcome.skipped += 1
        return
    try:
        got = run_sample(op, sample, backward, engine)
    except Exception as e:
        outcome.errors.append((index, e))
        return
    where = f"sample {index}"
    outcome.samples += 1
    outcome.remats += got.remats
    outcome.managed += got.managed
    outcome.unmanaged_inputs += got.unmanaged_inputs
    if category == "uninitialized":
        _first(outcome, "beyond", where, compare_results(eager, got, "metadata", tol))
        return
    diff = compare_results(eager, got, "bitwise", tol)
    _first(outcome, "mismatch", where, diff)
    if diff is not None and category in ("tolerance", "nondeterministic"):
        _first(outcome, "beyond", where, compare_results(eager, got, "tolerance", tol))
    if diff is not None and category == "tolerance":
        noop = run_sample(op, sample, backward, "noop")
        _first(outcome, "noop_mismatch", where, compare_results(noop, got, "bitwise", tol))


def _first(outcome: Outcome, field: str, where: str, diff: str | None) -> None:
    if diff is not None and getattr(outcome, field) is None:
        setattr(outcome, field, f"{where}: {diff}")


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def verdict(outcome: Outcome, entry: Expected | None) -> list[str]:
    """What is wrong with this variant's outcome, given its entry in the expected file."""
    category = entry.category if entry is not None else None
    problems: list[str] = []
    if outcome.beyond is not None:
        problems.append(f"dtr differs from eager: {outcome.beyond}")
    if outcome.noop_mismatch is not None:
        problems.append(f"dtr differs from eager under a no-op mode: {outcome.noop_mismatch}")
    if outcome.mismatch is not None and category in (None, "unsupported", "limitation"):
        problems.append(f"not bitwise equal to eager: {outcome.mismatch}")
    problems += _error_problems(outcome, entry)
    stale = (category in ("unsupported", "limitation") and outcome.error is None) or (
        category == "tolerance" and outcome.mismatch is None
    )
    if stale:
        problems.append(f"listed as {category} (line {entry.line}) but passes: remove it")
    if outcome.unmanaged_inputs:
        problems.append(f"{outcome.unmanaged_inputs} inputs were plain tensors under dtr")
    if outcome.managed and not outcome.remats:
        problems.append("dtr recomputed nothing: the comparison would be vacuous")
    return problems


def _error_problems(outcome: Outcome, entry: Expected | None) -> list[str]:
    """An exception is expected only of listed variants, and must be the listed one."""
    category = entry.category if entry is not None else None
    for index, e in outcome.errors:
        where = f"sample {index}"
        if category not in ("unsupported", "limitation"):
            return [f"dtr raised on {where}: {_describe(e)}"]
        if category == "unsupported" and not (
            isinstance(e, dtr.DTRError) and str(e).startswith("dtr:")
        ):
            return [f"not a clear dtr error on {where}: {_describe(e)}"]
        if entry.message not in str(e):
            return [f"{where} raised {_describe(e)}, not {entry.message!r}"]
    return []


# ====================================================================== pytest
def variant_key(op, inplace: bool) -> str:
    """How the expected file names a variant: op[.variant], 'inplace:' before in-place forms."""
    return f"inplace:{op_key(op)}" if inplace else op_key(op)


def variants(inplace: bool):
    """(op, dtype) of every variant, of every in-place form if inplace."""
    for op in op_db:
        if inplace and op.inplace_variant is None:
            continue
        supported = op.supported_dtypes("cpu")
        yield from ((op, dtype) for dtype in DTYPES if dtype in supported)


def _params(inplace: bool):
    return [
        pytest.param(op, dtype, id=f"{op_key(op)}-{dtype_name(dtype)}")
        for op, dtype in variants(inplace)
    ]


def check_variant(
    op, dtype: torch.dtype, inplace: bool, engine: str = "subclass"
) -> tuple[Outcome, list[str]]:
    entry = expected_entry(variant_key(op, inplace), dtype_name(dtype), engine)
    category = entry.category if entry else None
    outcome = run_variant(op, dtype, category, inplace, engine=engine)
    return outcome, verdict(outcome, entry)


def _check(op, dtype, inplace: bool, engine: str = "subclass") -> None:
    outcome, problems = check_variant(op, dtype, inplace, engine)
    if not outcome.samples and outcome.error is None:
        pytest.skip(f"all {outcome.skipped} samples raise in eager PyTorch on CPU too")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("op", "dtype"), _params(inplace=False))
def test_op(op, dtype):
    _check(op, dtype, inplace=False)


@pytest.mark.parametrize(("op", "dtype"), _params(inplace=True))
def test_inplace(op, dtype):
    """The in-place form (x.add_(y) for add): new versions of managed tensors, recipes
    that replay on a copy of the old value or steal its storage (docs/design.md, Invariant 4)."""
    _check(op, dtype, inplace=True)


_needs_native = pytest.mark.skipif(not HAVE_NATIVE, reason="the native engine is C++")


@_needs_native
@pytest.mark.parametrize(("op", "dtype"), _params(inplace=False))
def test_native_op(op, dtype):
    """The same, under the native engine (dtr.engines.native.session.enable, stress and
    check modes)."""
    _check(op, dtype, inplace=False, engine="native")


@_needs_native
@pytest.mark.parametrize(("op", "dtype"), _params(inplace=True))
def test_native_inplace(op, dtype):
    _check(op, dtype, inplace=True, engine="native")


def test_expected_file_names_only_known_variants():
    known = {
        (variant_key(op, inplace), dtype_name(dtype))
        for inplace in (False, True)
        for op, dtype in variants(inplace)
    }
    unknown = sorted(
        f"{k} {d} (line {e.line})" for (k, d, _), e in EXPECTED.items() if (k, d) not in known
    )
    assert not unknown, f"{EXPECTED_FILE} lists variants op_db does not have: {unknown}"


def test_a_wrong_recomputation_fails_the_check(monkeypatch):
    """Recomputed values one ulp off are caught: the sweep is not vacuous."""
    # (on the Python path, whose recomputations go through Recipe.replay)
    monkeypatch.setattr(dtr.engines.subclass.runtime, "FAST_PATH", False)
    replay = Recipe.replay

    def one_ulp_off(self, *args, **kwargs):
        values = replay(self, *args, **kwargs)
        return [v.nextafter(v.new_tensor(math.inf)) if v.is_floating_point() else v for v in values]

    monkeypatch.setattr(Recipe, "replay", one_ulp_off)
    sin = next(op for op in op_db if op.name == "sin")
    _, problems = check_variant(sin, torch.float64, inplace=False)
    assert any("not bitwise equal to eager" in p for p in problems), problems


def test_listed_variants_are_held_to_their_entry():
    """An entry whose variant passes, or fails some other way, fails the test."""
    passing = Outcome(samples=1, remats=1, managed=1)
    for category in ("unsupported", "tolerance", "limitation"):
        entry = Expected("sin", ("float64",), category, 'why: "dtr: no"', 1)
        assert any("remove it" in p for p in verdict(passing, entry)), category
    crash = Outcome(samples=1, remats=1, managed=1, errors=[(0, RuntimeError("boom"))])
    entry = Expected("sin", ("float64",), "unsupported", 'why: "dtr: no"', 1)
    assert any("not a clear dtr error" in p for p in verdict(crash, entry))
    other = Outcome(
        samples=1, remats=1, managed=1, errors=[(0, dtr.UnsupportedError("dtr: other"))]
    )
    assert any("not 'dtr: no'" in p for p in verdict(other, entry))


# ====================================================================== report
PASSING = ("bitwise", "tolerance", "nondeterministic", "uninitialized")


def report(names: list[str], engine: str = "subclass") -> int:
    """Run the sweep (or the named ops) under the engine, outside pytest; print each
    failure, then per dtype how many variants end in each state and the pass rate.
    Returns 1 on failures."""
    start = time.perf_counter()
    remats = samples = failed = 0
    for inplace in (False, True):
        tally = {d: collections.Counter() for d in DTYPES}
        for op, dtype in variants(inplace):
            if not names or op.name in names or op_key(op) in names:
                state, outcome = _report_variant(op, dtype, inplace, engine)
                tally[dtype][state] += 1
                remats += outcome.remats
                samples += outcome.samples
        what = "in-place forms" if inplace else "op variants"
        for dtype, counts in tally.items():
            states = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            print(f"{what}, {dtype_name(dtype)}: {_rate(counts)}; {states}")
        print(f"{what}, all: {_rate(sum(tally.values(), collections.Counter()))}")
        failed += sum(counts["FAIL"] for counts in tally.values())
    print(f"{samples} samples, {remats} recomputations, {time.perf_counter() - start:.0f} s")
    return int(failed > 0)


def _report_variant(op, dtype, inplace: bool, engine: str) -> tuple[str, Outcome]:
    key = variant_key(op, inplace)
    entry = expected_entry(key, dtype_name(dtype), engine)
    outcome = Outcome()
    try:
        outcome, problems = check_variant(op, dtype, inplace, engine)
    except Exception:
        problems = ["harness error: " + traceback.format_exc(limit=-3)]
    if not outcome.samples and outcome.error is None and not problems:
        return "eager fails", outcome
    for p in problems:
        print(f"FAIL {key} {dtype_name(dtype)}: {p}", flush=True)
    return ("FAIL" if problems else entry.category if entry else "bitwise"), outcome


def _rate(counts: collections.Counter) -> str:
    """Variants whose every sample raises in eager too have nothing to compare: not counted."""
    passed = sum(counts[k] for k in PASSING)
    total = sum(counts.values()) - counts["eager fails"]
    return f"{passed}/{total} pass ({100.0 * passed / max(total, 1):.1f}%)"


if __name__ == "__main__":
    args = sys.argv[1:]
    engine = "subclass"
    if args[:1] == ["--native"]:
        engine, args = "native", args[1:]
    sys.exit(report(args, engine))
