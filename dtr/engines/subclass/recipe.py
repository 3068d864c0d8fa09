"""A recipe: everything needed to run one op call again.

One recipe per op call, shared by all its outputs (a multi-output op is rerun once and
refills every output that is still kept). It holds the op, its non-tensor arguments, and
for each tensor argument either the Node of a managed input or the plain tensor of a
constant; never a wrapper, so a recipe does not keep a program's handle alive.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from ...errors import UnsupportedError
from . import rng
from .storage_keys import freed, storage_key
from .tensor import Node
from .tensor_args import substitute

# An output spec is (return index, list index) for a tensor the op returned, or
# (-1, leaf index) for the new version of an argument the op updated in place.
VERSION_SPEC = -1


class Recipe:
    __slots__ = (
        "func",
        "args",
        "kwargs",
        "where",
        "inputs",
        "clone",
        "specs",
        "rng",
        "outputs",
        "facts",
        "grad",
        "versions",
    )

    def __init__(
        self, func, facts, args, kwargs, where, inputs, clone, specs, captured, grad: bool
    ):
        # csrc/subclass/fastpath.cpp (new_recipe) fills these slots itself for ops without a
        # non_blocking argument: change both.
        self.func = func
        self.facts = facts
        k = facts.arg_index.get("non_blocking")
        if k is not None:
            # dtr reads a recomputed value at once, with none of the synchronization the
            # program wrote after its own asynchronous copy (a device-to-host copy lands
            # in pinned memory later): replay it blocking; the values are the same.
            if kwargs.get("non_blocking"):
                kwargs = {**kwargs, "non_blocking": False}
            elif k < len(args) and args[k] is True:
                args = (*args[:k], False, *args[k + 1 :])
        self.args = args  # tensors replaced by None
        self.kwargs = kwargs
        self.where = where
        self.inputs = inputs  # per leaf: Node (managed) or torch.Tensor (constant)
        self.clone = clone  # leaves the op writes: replay works on a copy (Invariant 4)
        self.specs = specs
        self.rng = captured
        self.grad = grad  # some kernels behave differently with grad mode on (mkldnn RNNs)
        self.outputs: list[Node] = []  # aligned with the core's outputs of this recipe
        # (leaf, version or -1 for an inference tensor, storage key) of each plain tensor
        # it reads. Every write dtr sees to one of them pins what depends on it first
        # (Invariant 4), so a changed version at replay is a write dtr could not see
        # (another thread; code outside any dispatch), and another storage is one
        # swapped in with no op at all (`p.data = ...`, Module.half()). The runtime
        # keeps each constant's storage alive, so a key is not reused while a recipe
        # holds it.
        self.versions = tuple(
            (k, -1 if x.is_inference() else x._version, storage_key(x))
            for k, x in enumerate(inputs)
            if isinstance(x, torch.Tensor)  # a Node is not one
        )

    def replay(self, stolen=(), on_oom=None) -> list[torch.Tensor]:
        """Run the op again on the current values of its inputs; returns the values of
        its outputs in core order. The caller has materialized and locked the inputs.
        Outputs listed in stolen are computed in place in their old version's storage
        (the core allowed it); other written arguments are copied first (Invariant 4).
        on_oom(exc, func, args, kwargs, retry, rng), when given, handles an allocator
        out-of-memory error (the runtime evicts and runs the op again)."""
        vals = [
            x.value if type(x) is Node else x.get() if type(x) in _MADE_AT_REPLAY else x
            for x in self.inputs
        ]
        sparse = False
        for x in self.inputs:
            if isinstance(x, torch.Tensor):
                if freed(x):
                    raise freed_error(self.facts.name, x)
                sparse = sparse or x.layout is not torch.strided
            elif type(x) is Rebuilt:
                sparse = True
        for k, version, key in self.versions:
            x = self.inputs[k]
            if storage_key(x) != key:
                raise replaced_error(self.facts.name, x)
            if version >= 0 and x._version != version:
                raise written_error(self.facts.name, x)
        in_place = {self.specs[k][1] for k in stolen}
        for k in self.clone:
            if k not in in_place:
                vals[k] = copy_preserving_layout(vals[k])
        args, kwargs = substitute(self.args, self.kwargs, self.where, vals)
        with (
            rng.replaying(self.rng),
            torch.set_grad_enabled(self.grad),
            sparse_kernels() if sparse else contextlib.nullcontext(),
            Quiet() if self.facts.out_form else contextlib.nullcontext(),
        ):
            try:
                out = self.func(*args, **kwargs)
            except torch.OutOfMemoryError as exc:
                if on_oom is None:
                    raise
                # not retried when the op wrote into an input's own storage (a stolen one)
                out = on_oom(exc, self.func, args, kwargs, not in_place, self.rng)
        rets = (out,) if self.facts.nreturns == 1 else out
        produced = []
        for i, j in self.specs:
            if i == VERSION_SPEC:
                produced.append(vals[j])
            else:
                produced.append(rets[i] if j < 0 else rets[i][j])
        return produced


class Quiet:
    """Where an out= op replays: it would warn again that it resizes its out tensor, where
    eager warned once, when the program ran it (and under warnings-as-errors the
    recomputation would raise). csrc/subclass/fastpath_remat.cpp enters it too."""

    def __enter__(self):
        self._caught = warnings.catch_warnings()
        self._caught.__enter__()
        warnings.simplefilter("ignore")
        return self

    def __exit__(self, *exc):
        return self._caught.__exit__(*exc)

    def close(self) -> None:
        self.__exit__(None, None, None)


def sparse_kernels():
    """Where a recipe that reads a sparse constant replays its op. Replays run below
    autograd, and there PyTorch's sparse compressed kernels bump their input's version
    counter (measured: `torch.mm(csr.t(), dense)` bumps `csr`'s by 3 under
    `torch.inference_mode()` or below autograd, by 0 in plain eager) with no change to
    its value. Autograd, which saved that tensor for a backward that has not run yet,
    would then refuse it as modified in place. With the ADInplaceOrView key excluded,
    as it is when the op first runs, the kernel bumps nothing."""
    return torch._C._ExcludeDispatchKeyGuard(
        torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
    )


def _input_error(name: str, t: torch.Tensor, what: str) -> UnsupportedError:
    """A recipe cannot be replayed because of what happened to a plain tensor it reads."""
    return UnsupportedError(
        f"dtr: cannot recompute {name}: it reads a plain tensor of shape {list(t.shape)} {what}"
    )


def freed_error(name: str, t: torch.Tensor) -> UnsupportedError:
    # A plain tensor's storage can be freed without any op reaching dtr
    # (untyped_storage().resize_(0)); FSDP2 does this to unsharded parameters after
    # each forward and backward. Replaying would fail deep in a kernel with an error
    # that does not say why.
    return _input_error(
        name,
        t,
        "whose storage has since been freed outside dtr's view (storage resize_(0), as "
        "FSDP2's fully_shard does to unsharded parameters). Keep such code out of "
        "dtr.enable(), or run without a budget; see docs/distributed.md, 'Composing with DDP "
        "and FSDP'",
    )


def replaced_error(name: str, t: torch.Tensor) -> UnsupportedError:
    return _input_error(
        name,
        t,
        "whose storage has since been replaced without any op dtr could see (`p.data = "
        "...`, or Module.half()/.to() converting parameters that way), so recomputing "
        "would use the new value where the program used the old one. Update tensors in "
        "place instead (`with torch.no_grad(): p.copy_(new)` or `p.sub_(...)`), or "
        "convert the model before dtr.enable()",
    )


def written_error(name: str, t: torch.Tensor) -> UnsupportedError:
    return _input_error(
        name,
        t,
        "that has since been written in place where dtr could not see it (on another "
        "thread, or by code that bypasses dispatch), so recomputing would use the new "
        "value where the program used the old one. Update parameters on the thread that "
        "runs dtr.enable(), or between steps",
    )


class StandIn:
    """The metadata of a tensor argument of a meta-only op (empty_like, zeros_like, ...):
    replayed as a meta tensor, so the recipe depends on no value."""

    __slots__ = ("size", "stride", "dtype")

    def __init__(self, t: torch.Tensor):
        self.size = t.size()
        self.stride = t.stride()
        self.dtype = t.dtype

    def get(self) -> torch.Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device="meta")


class Rebuilt:
    """A plain sparse tensor a recipe reads, made again when the recipe replays from the plain
    sparse tensor it was made from (args[0]) instead of held: autograd's adj.t() per backward
    product of torch.sparse.mm (dtr/engines/subclass/rebuildable_plain.py, FreshTransposes). Holding
    each such copy kept a COO graph network from training under any budget."""

    __slots__ = ("func", "args", "kwargs", "reader", "version")

    def __init__(self, func, args: tuple, kwargs: dict, reader: str):
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.reader = reader  # the op whose recipe reads it, for errors
        source = args[0]
        self.version = -1 if source.is_inference() else source._version

    def get(self) -> torch.Tensor:
        source = self.args[0]
        # the checks Recipe.replay makes of a constant it holds, on the source
        if freed(source):
            raise freed_error(self.reader, source)
        if self.version >= 0 and source._version != self.version:
            raise written_error(self.reader, source)
        with sparse_kernels():
            return self.func(*self.args, **self.kwargs)


def copy_preserving_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy with the same sizes and strides, so that ops on it see the same layout
    (and give bitwise the same results) as on the original."""
    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


_MADE_AT_REPLAY = (StandIn, Rebuilt)  # recipe inputs whose value get() makes
