"""Composite ops whose C++ reads a tensor argument's memory before any op is dispatched.

``tensor_split(x, indices: Tensor)`` and ``ctc_loss(..., input_lengths: Tensor,
target_lengths: Tensor)`` are CompositeImplicitAutograd: their kernels run at the Autograd
key, above dtr's dispatch mode, and read those arguments through ``data_ptr()``. A
managed tensor is a wrapper with no memory of its own, so they failed inside PyTorch
("data is not allocated yet"). For these overloads only, a kernel of ours at the
AutogradCPU and AutogradCUDA keys (the devices the subclass engine runs on; the Autograd
alias would not do, since a CompositeImplicitAutograd kernel takes precedence over it)
hands each such argument over as its value (recomputed first if it is
evicted: a ``READ`` in the trace, which the simulator replays) and then runs PyTorch's
own C++ composite kernel, whose ops reach dtr as usual.

The kernel is registered by the first default-engine session and stays for the life of
the process (a registration cannot be scoped to one thread's block): on plain tensors
it runs the same composite, one Python call more, on these two rare overloads only. The
native engine does the same in C++ (``read_values_first`` in csrc/native/engine.cpp) at
AutogradPrivateUse3, a key-specific registration that takes precedence over this one.
"""

from __future__ import annotations

import threading

import torch

from .tensor import CheckpointTensor, materialize_ref

# overload -> positions of the arguments its composite kernel reads in C++
READ_FIRST: dict[str, tuple[int, ...]] = {
    "tensor_split.tensor_indices_or_sections": (1,),
    "ctc_loss.Tensor": (2, 3),
}

AUTOGRAD_KEYS = ("AutogradCPU", "AutogradCUDA")
# PyTorch's C++ composite kernel itself, as eager runs it (OpOverload.decompose would
# prefer a Python decomposition where one exists, whose checks raise AssertionError
# where eager raises RuntimeError).
COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
PYTHON_DISPATCHER = torch._C.DispatchKey.PythonDispatcher

_lock = threading.Lock()
_library: torch.library.Library | None = None


def _kernel(overload: torch._ops.OpOverload, positions: tuple[int, ...]):
    def kernel(*args, **kwargs):
        if any(isinstance(args[i], CheckpointTensor) for i in positions if i < len(args)):
            args = tuple(
                materialize_ref(a._dtr_ref)
                if i in positions and isinstance(a, CheckpointTensor)
                else a
                for i, a in enumerate(args)
            )
        if torch._C._dispatch_tls_is_dispatch_key_included(PYTHON_DISPATCHER):
            # Tracing (torch.compile, make_fx): what the Python dispatcher does for this
            # key when no kernel is registered at it, a Python decomposition that fake
            # tensors can run.
            return overload.decompose(*args, **kwargs)
        return overload._op_dk(COMPOSITE, *args, **kwargs)

    return kernel


def install() -> None:
    """Register the kernels (once per process; later calls do nothing)."""
    global _library
    with _lock:
        if _library is not None:
            return
        lib = torch.library.Library("aten", "IMPL")
        for name, positions in READ_FIRST.items():
            packet, _, overload = name.partition(".")
            kernel = _kernel(getattr(getattr(torch.ops.aten, packet), overload), positions)
            for key in AUTOGRAD_KEYS:
                lib.impl(name, kernel, key)
        _library = lib
