"""Facts about an op overload that the runtime needs on every call, computed once.

The schema says which arguments an op writes (``Tensor(a!)``), whether it draws random
numbers (``nondeterministic_seeded``; an op outside aten may draw without the tag), and
which argument is its generator. A few ops
write arguments without saying so in their schema; ``_HIDDEN_WRITES`` lists them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class OpFacts:
    name: str
    arg_names: tuple[str, ...]
    arg_index: dict[str, int]
    writes: frozenset[int]  # schema positions of the arguments the op mutates
    seeded: bool  # draws random numbers: its RNG state is captured and replayed
    may_draw: bool  # may draw without the tag: the runtime watches its generator (rng.drew)
    generator: int  # schema position of its Generator argument, -1 if none
    metadata_inplace: bool  # changes its argument's storage in place (set_, resize_)
    view_inplace: object  # for t_, squeeze_, ...: the out-of-place view op, else None
    fresh_returns: bool  # returns at least one tensor that is not a mutated argument
    nreturns: int
    view: bool  # every return aliases an argument it does not write (t, view, split, ...)
    meta_only: bool  # reads only the sizes/strides/dtype of its tensors (empty_like, ...)
    hidden_writes: Callable[[list], tuple[int, ...]] | None
    plain_returns: frozenset[int]  # returns left plain tensors (see _PLAIN_RETURNS)
    collective: bool  # a torch.distributed collective: never recorded (see COLLECTIVE_NAMESPACES)
    out_form: bool  # writes an out= argument, which it may resize (torch.cat(xs, out=c))
    no_autograd: bool  # an op of a library with no autograd kernel (see lacks_autograd)


def _bn_writes(vals: list) -> tuple[int, ...]:
    # native_batch_norm(input, weight, bias, running_mean, running_var, training, ...)
    # updates the running statistics in training mode, without a (a!) in its schema.
    if len(vals) > 5 and vals[5] and vals[3] is not None:
        return (3, 4)
    return ()


def _rnn_writes(dropout: int, train: int, state: int, reserve: int = -1):
    """Hidden writes of cuDNN's (and MIOpen's) RNN kernels, by schema position.

    _cudnn_rnn(..., float dropout, bool train, ..., Tensor? dropout_state), in training
    with dropout, draws its masks from the RNG state held in dropout_state (cuDNN's own,
    cached by PyTorch, not a torch.Generator) and advances that state in place. On an
    H200, with the forward's state kept, an LSTM in stress mode still drew other masks
    than eager from its second step on: the recomputed backward calls, which read the
    live state, must advance it too (inferred; not yet rerun on a GPU with this fix). The
    backward also writes the forward's reserve space (its backward-data pass leaves there
    what the weight pass reads). As writes, each recipe
    keeps the state it saw (a snapshot: 6.2 MiB on an H200) and replays on a copy,
    leaving the live state where eager left it; the reserve gets a new version."""

    def writes(vals: list) -> tuple[int, ...]:
        out: tuple[int, ...] = ()
        if vals[train] and vals[dropout] > 0 and vals[state] is not None:
            out = (state,)
        if reserve >= 0 and vals[reserve] is not None:
            out += (reserve,)
        return out

    return writes


_HIDDEN_WRITES: dict[str, Callable[[list], tuple[int, ...]]] = {
    "aten::native_batch_norm": _bn_writes,
    "aten::cudnn_batch_norm": _bn_writes,
    "aten::miopen_batch_norm": _bn_writes,
    "aten::_cudnn_rnn": _rnn_writes(11, 12, 15),
    "aten::_cudnn_rnn_backward": _rnn_writes(15, 16, 19, reserve=20),
    "aten::miopen_rnn": _rnn_writes(9, 10, 13),
}

# Returns that stay plain tensors: metadata that C++ composite kernels read through
# data_ptr() before any dispatch, which a wrapper (no storage) cannot serve. A packed
# sequence's batch_sizes is read so by lstm.data, gru.data and the rnn_*.data ops (it
# depends only on the lengths, a plain tensor, so no lineage is lost).
_PLAIN_RETURNS = {"aten::_pack_padded_sequence": frozenset({1})}

# Collectives: the other ranks take part, so no rank can rerun one alone, and c10d's
# in-place ones (allreduce_, broadcast_, allgather_, ...) write their tensors without a
# (a!) in their schemas (``allreduce_(Tensor[] tensors, ...)``), asynchronously.
COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional"}

# Namespaces whose random ops are tagged nondeterministic_seeded, all of them.
_TAGGED_NAMESPACES = {"aten", "prims"}

# Ops that read nothing but their tensor arguments' metadata. Their recipes depend on no
# value, so recomputing an ``empty_like(x)`` never recomputes x (dropout's mask starts so).
_META_ONLY = {
    "aten::empty_like",
    "aten::zeros_like",
    "aten::ones_like",
    "aten::full_like",
    "aten::rand_like",
    "aten::randn_like",
    "aten::randint_like",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::new_zeros",
    "aten::new_ones",
    "aten::new_full",
}

_METADATA_INPLACE = {"aten::set_", "aten::resize_", "aten::resize_as_", "aten::resize_as_sparse_"}

# In-place ops that change only their argument's sizes and strides, never its data.
VIEW_INPLACE = {
    "aten::as_strided_",
    "aten::t_",
    "aten::transpose_",
    "aten::unsqueeze_",
    "aten::squeeze_",
    "aten::swapdims_",
    "aten::swapaxes_",
    "aten::detach_",
}


def out_of_place(func):
    """The view op an in-place view op stands for: squeeze_.dim -> squeeze.dim."""
    schema = func._schema
    packet = getattr(torch.ops.aten, schema.name.split("::")[1][:-1])
    want = [(a.name, str(a.type)) for a in schema.arguments[1:]]
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        args = candidate._schema.arguments
        if [(a.name, str(a.type)) for a in args[1:]] == want:
            return candidate
    raise LookupError(f"dtr: no out-of-place form of {func}")


_CACHE: dict[object, OpFacts] = {}


def op_facts(func) -> OpFacts:
    facts = _CACHE.get(func)
    if facts is None:
        facts = _CACHE[func] = _compute(func)
    return facts


def _compute(func) -> OpFacts:
    schema = func._schema
    names = tuple(a.name for a in schema.arguments)
    writes = frozenset(
        i
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )
    generator = next(
        (
            i
            for i, a in enumerate(schema.arguments)
            if str(a.type).startswith("Optional[Generator]") or str(a.type) == "Generator"
        ),
        -1,
    )
    namespace = schema.name.split("::")[0]
    if namespace == "c10d":  # in-place collectives: every tensor argument may be written
        writes = frozenset(i for i, a in enumerate(schema.arguments) if "Tensor" in str(a.type))
    tags = getattr(func, "tags", ())
    seeded = torch.Tag.nondeterministic_seeded in tags
    fresh = any(
        r.alias_info is None or not r.alias_info.is_write
        for r in schema.returns
        if "Tensor" in str(r.type)
    )
    return OpFacts(
        name=str(func),
        arg_names=names,
        arg_index={n: i for i, n in enumerate(names)},
        writes=writes,
        seeded=seeded,
        # aten's and prims' random ops all carry the tag; an op of another namespace
        # (torch.library, TORCH_LIBRARY) need not, though its kernel may draw
        # (csrc/native/engine.cpp's may_draw)
        may_draw=not seeded and namespace not in _TAGGED_NAMESPACES | COLLECTIVE_NAMESPACES,
        generator=generator,
        metadata_inplace=schema.name in _METADATA_INPLACE,
        view_inplace=out_of_place(func) if schema.name in VIEW_INPLACE else None,
        fresh_returns=fresh,
        nreturns=len(schema.returns),
        view=bool(schema.returns)
        and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns),
        meta_only=schema.name in _META_ONLY and "device" in names,
        hidden_writes=_HIDDEN_WRITES.get(schema.name),
        plain_returns=_PLAIN_RETURNS.get(schema.name, frozenset()),
        collective=namespace in COLLECTIVE_NAMESPACES,
        out_form=any(schema.arguments[i].kwarg_only for i in writes),
        no_autograd=lacks_autograd(schema.name),
    )


# Where a kernel makes an op differentiable: a formula for every backend, the CPU's or
# CUDA's, or a decomposition autograd sees through.
_AUTOGRAD_KEYS = ("Autograd", "AutogradCPU", "AutogradCUDA", "CompositeImplicitAutograd")


def lacks_autograd(name: str) -> bool:
    """Whether an op of a library other than PyTorch's (torch.library, TORCH_LIBRARY) has
    no autograd kernel. Eager runs such an op through autograd's fallback, which warns
    and lets the ops its kernel calls record their own gradients; dtr runs the op as one,
    below autograd, and those gradients would be lost: the engines refuse it when an
    input requires grad (errors.no_autograd_message). The native engine asks this too
    (csrc/native/engine.cpp), once per op overload."""
    if name.split("::")[0] in _TAGGED_NAMESPACES | COLLECTIVE_NAMESPACES | _OWN_NAMESPACES:
        return False
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    try:
        return not any(has(name, key) for key in _AUTOGRAD_KEYS)
    except RuntimeError:  # not the dispatcher's (TorchScript's prim::layout and kin)
        return False


# PyTorch's own namespaces besides aten/prims/collectives, whose ops autograd handles
_OWN_NAMESPACES = {"_c10d_functional_autograd", "fsdp", "quantized", "dtr"}
