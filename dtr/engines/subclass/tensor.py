"""CheckpointTensor: the wrapper the program holds in place of a managed tensor.

A wrapper subclass sits below autograd: autograd saves the wrapper, so backward ops reach
dtr like any other op and recompute evicted values transparently. Sizes, strides, dtype
and device live in the wrapper itself, so metadata queries never rematerialize.

The chain is ``CheckpointTensor -> Ref -> Node -> value``:

* ``Node``: one immutable value known to the core (a tid). ``value`` is the plain tensor
  while materialized, None while evicted.
* ``Ref``: the program's handle on a node. When the tensor is updated in place the core
  makes a new version and the Ref moves to it; ``detach`` shares the Ref, so aliases that
  autograd makes of a saved tensor see the same value, evicted or not. When the last
  wrapper holding a Ref dies, the runtime is told (at the next op boundary).
"""

from __future__ import annotations

import functools
import itertools
import sys
from multiprocessing.reduction import ForkingPickler

import torch

from ... import copying
from ...errors import DTRError
from ...schema import op_facts
from .tensor_args import TensorArgs, substitute

_serials = itertools.count()


class Node:
    # csrc/subclass/fastpath.cpp (new_node) fills the slots without __init__: change both.
    __slots__ = ("tid", "value", "name", "shape", "serial")

    def __init__(self, tid: int, value: torch.Tensor | None, name: str, shape):
        self.tid = tid
        self.value = value
        self.name = name
        self.shape = shape
        self.serial = next(_serials)  # unique for the life of the process (trace names)

    @property
    def label(self) -> str:
        return f"x{self.serial}"

    def describe(self) -> str:
        shape = "x".join(str(s) for s in self.shape) if self.shape is not None else "?"
        return f"{self.name}[{shape}]"


class Ref:
    # csrc/subclass/fastpath.cpp (new_ref) fills the slots without __init__: change both.
    __slots__ = ("node", "runtime")

    def __init__(self, node: Node, runtime):
        self.node = node
        self.runtime = runtime

    def __del__(self):
        rt = self.runtime
        if rt is not None and rt.is_open:
            rt.pending_refs.append(self.node)


class CheckpointTensor(torch.Tensor):
    """A tensor whose value dtr may evict and recompute. Behaves like a plain tensor."""

    _dtr_ref: Ref
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, ref: Ref, like: torch.Tensor, requires_grad: bool = False):
        # csrc/subclass/fastpath.cpp (new_wrapper) builds wrappers the same way: change both.
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            like.size(),
            strides=like.stride(),
            storage_offset=like.storage_offset(),
            dtype=like.dtype,
            device=like.device,
            layout=like.layout,
            requires_grad=requires_grad,
        )
        # Lazy conjugation and negation are bits on the tensor, not in its data: the
        # wrapper must carry the inner value's bits for kernels to see them.
        if like.is_conj():
            torch._C._set_conj(t, True)
        if like.is_neg():
            torch._C._set_neg(t, True)
        t._dtr_ref = ref
        return t

    def __init__(self, *args, **kwargs):
        pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached only when dtr's mode is not on the stack: after the block ended, or on
        # another thread. The runtime of the first wrapper decides.
        return dispatch_without_mode(func, args, kwargs or {})

    # Python-level methods that read data directly and would fail on a wrapper.
    def tolist(self):
        return _plain(self).tolist()

    def numpy(self, *, force: bool = False):
        if self.requires_grad and not force:  # the plain value does not require grad
            raise RuntimeError(
                "Can't call numpy() on Tensor that requires grad. "
                "Use tensor.detach().numpy() instead."
            )
        # The array shares the value's memory, as in eager, for as long as it lives: a
        # write through it must reach the tensor, so the value is pinned (never evicted
        # and recomputed without the write), as dtr.materialize does.
        return _plain(self, export=True).numpy(force=force)

    def __dlpack__(self, *args, **kwargs):
        # PyTorch's method would export the wrapper, whose memory is address 0 (reading the
        # capsule crashed); the value is exported instead, pinned as numpy() pins it.
        if self.requires_grad:  # PyTorch's check: the plain value does not require grad
            raise BufferError("Can't export tensors that require gradient, use tensor.detach()")
        return _plain(self, export=True).__dlpack__(*args, **kwargs)

    def data_ptr(self) -> int:
        # The wrapper's own is 0, which made every managed tensor look like every other
        # to code that compares addresses. The value's address holds for the tensor's
        # life only if the value is never evicted and rebuilt elsewhere: pinned, as
        # numpy() pins it.
        return _plain(self, export=True).data_ptr()

    def const_data_ptr(self) -> int:
        return self.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        # The wrapper's own storage has no memory: reading it through another tensor
        # (torch.empty(0).set_(t.untyped_storage())) or share_memory_() (which goes
        # through it) crashed the process. The value's storage, pinned as numpy() pins it.
        # One caller reads only the size: a nested jagged tensor's constructor
        # (`storage_size=values.untyped_storage().size()`, for every op on it), and the
        # pins made every jagged tensor's values unevictable. It gets a meta storage of
        # the value's size instead, while the block is open.
        ref = self._dtr_ref
        if sys._getframe(1).f_code is jagged_new_code() and ref.runtime.is_open:
            nbytes = ref.runtime.core.pool_bytes(ref.node.tid)
            return torch.UntypedStorage(nbytes, device="meta")
        return _plain(self, export=True).untyped_storage()

    # apply_/map_/map2_ run a Python function over the memory itself, below dispatch:
    # on the wrapper (address 0) apply_ crashed the process, and a write dtr does not
    # see would be lost at the next recomputation. They run on a copy of the value,
    # which a copy_ then writes back, recorded as any in-place op.
    def apply_(self, callable):
        return _write_back(self, "apply_", callable)

    def map_(self, tensor, callable):
        return _write_back(self, "map_", tensor, callable)

    def map2_(self, x, y, callable):
        return _write_back(self, "map2_", x, y, callable)

    # Python's number protocol: torch.tensor([loss_a, loss_b]) reads each element through
    # it with dtr's mode excluded, where PyTorch's own methods read the wrapper's memory
    # (it has none). The value answers instead.
    def __float__(self):
        return _number(self, "__float__")

    def __int__(self):
        return _number(self, "__int__")

    def __index__(self):
        return _number(self, "__index__")

    def __bool__(self):
        return _number(self, "__bool__")

    def __complex__(self):
        return _number(self, "__complex__")

    def __repr__(self, *, tensor_contents=None):
        text = repr(_plain(self))
        suffix = ""
        if self.grad_fn is not None:
            suffix = f", grad_fn=<{type(self.grad_fn).__name__}>"
        elif self.requires_grad:
            suffix = ", requires_grad=True"
        return text[:-1] + suffix + ")" if suffix and text.endswith(")") else text

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return self.item().__format__(spec)
        return repr(self) if not spec else _plain(self).__format__(spec)

    # torch.save / pickle / deepcopy see plain tensors (DESIGN.md 1), views of one storage
    # over one copy of it, as eager's (dtr/copying.py)
    def __reduce_ex__(self, protocol):
        return copying.reduced(self, _storage_key(self), _whole).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return copying.deepcopy(
            self, memo, _storage_key(self), _whole, torch.Tensor.__deepcopy__
        )

    def decheckpoint(self) -> torch.Tensor:
        """The plain tensor behind this wrapper (see :func:`dtr.materialize`)."""
        return _plain(self)


# torch.multiprocessing (Queue, Process arguments, DataLoader workers) shares the storage
ForkingPickler.register(CheckpointTensor, copying.reduce_for_process)


def own_tensor(value: torch.Tensor) -> torch.Tensor:
    """A tensor of its own (not a view) over value's storage, with value's geometry: a
    kernel that resizes it leaves value as it was."""
    t = value.new_empty(0).set_(
        value.untyped_storage(), value.storage_offset(), value.size(), value.stride()
    )
    if value.is_conj():
        torch._C._set_conj(t, True)
    if value.is_neg():
        torch._C._set_neg(t, True)
    return t


def take_geometry(t: CheckpointTensor, value: torch.Tensor) -> None:
    """The wrapper t takes value's sizes, strides and offset (an out= op resized the value
    in its storage), as eager's out tensor does; its version counter is left as the op
    left it."""
    size, stride, offset = value.size(), value.stride(), value.storage_offset()
    if (t.size(), t.stride(), t.storage_offset()) == (size, stride, offset):
        return
    # a storage with no memory, of the size value's geometry needs (the wrapper's own is
    # of the old size, which set_ would refuse)
    room = torch.Tensor._make_wrapper_subclass(
        CheckpointTensor,
        size,
        strides=stride,
        storage_offset=offset,
        dtype=t.dtype,
        device=t.device,
    )
    storage = torch._C.TensorBase.untyped_storage(room)
    version = t._version
    with torch._C._DisableTorchDispatch(), torch.no_grad():
        torch._C.TensorBase.set_(t, storage, offset, size, stride)
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))


def _write_back(t: CheckpointTensor, method: str, *args) -> CheckpointTensor:
    if t.requires_grad:  # PyTorch's check, which the plain copy would not make
        raise RuntimeError(
            f"Can't call {method}() on Variable that requires grad. "
            f"Use var.detach().{method}() instead."
        )
    value = _plain(t).clone()
    args = [_plain(a) if isinstance(a, CheckpointTensor) else a for a in args]
    getattr(value, method)(*args)
    return t.copy_(value)


def _number(t: CheckpointTensor, method: str):
    value = _plain(t)
    if t.requires_grad:  # PyTorch's warning about converting a tensor that requires grad
        value = value.detach().requires_grad_(True)
    return getattr(value, method)()


@functools.cache
def jagged_new_code():
    """The code of torch's NestedTensor.__new__ (jagged layout), or None."""
    try:
        from torch.nested._internal.nested_tensor import NestedTensor
    except ImportError:  # a torch without it
        return None
    return getattr(NestedTensor.__new__, "__code__", None)


def _storage_key(t: CheckpointTensor):
    """Names t's storage for as long as t lives (dtr/copying.py): its pool in the block
    (values move to new storages when recomputed), its value's storage after it."""
    ref = t._dtr_ref
    rt = ref.runtime
    with rt.lock:
        if rt.is_open:
            return ("dtr", rt.core.pool_of(ref.node.tid))
    return _plain(t).untyped_storage()._cdata


def _whole(t: CheckpointTensor) -> torch.Tensor:
    """A plain tensor with t's geometry over a copy of its value's whole storage."""
    value = _plain(t)
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        value.untyped_storage().clone(), t.storage_offset(), t.size(), t.stride()
    )


def _plain(t: CheckpointTensor, export: bool = False) -> torch.Tensor:
    return materialize_ref(t._dtr_ref, export=export)


# ====================================================================== outside the mode
def materialize_ref(ref: Ref, export: bool = False) -> torch.Tensor:
    rt = ref.runtime
    if rt.is_open:
        return rt.export(ref) if export else rt.read(ref)
    value = ref.node.value
    if value is None:
        raise DTRError(LOST_MESSAGE)
    return value


# An evicted tensor the program still held when its block ended with a BudgetError, or
# whose recomputation failed when it ended (csrc/native/engine.cpp's kLostMsg is the same text).
LOST_MESSAGE = (
    "dtr: this tensor was evicted when its dtr.enable() block ended with a BudgetError, and "
    "is not rebuilt after it (that would take memory past the budget); compute it again "
    "(in a block with a larger budget)"
)


def dispatch_without_mode(func, args: tuple, kwargs: dict):
    """An op on a CheckpointTensor with dtr's mode not active on this thread: after the
    block ended (plain semantics: run on the values, return plain tensors), or on
    another thread while it is active (served by the same runtime, under its lock)."""
    facts = op_facts(func)
    call = TensorArgs(facts, args, kwargs)
    for t in call.leaves:
        if isinstance(t, CheckpointTensor) and t._dtr_ref.runtime.is_open:
            return t._dtr_ref.runtime.handle(func, args, kwargs)
    values = [
        materialize_ref(t._dtr_ref) if isinstance(t, CheckpointTensor) else t for t in call.leaves
    ]
    new_args, new_kwargs = substitute(call.args, call.kwargs, call.where, values)
    return func(*new_args, **new_kwargs)
