"""The dispatch key the native engine's managed tensors carry, named once for Python.

The engine takes PrivateUse3, a backend key that no backend of stock PyTorch claims:
out-of-tree accelerators (Ascend NPU and others) take PrivateUse1 and rename it, so the
engine runs beside them, whatever PrivateUse1 is called in the process. csrc/native/engine.cpp
derives its keys from the same backend (``kBackend``); ``check_extension`` makes sure the
two agree. The engine registers a fallback and kernels at this key once per process
(dtr/engines/native/session.py); ``taken()`` says whether something else registered there first.
"""

from __future__ import annotations

import torch

from ...errors import DTRError

NAME = "PrivateUse3"
KEY = getattr(torch._C.DispatchKey, NAME)
# every key the engine registers at: its own, its autograd key, and the other layouts'
# (a managed op's sparse, quantized or nested tensors, left plain)
REGISTERED_AT = tuple(
    prefix + NAME for prefix in ("", "Autograd", "Sparse", "SparseCsr", "Quantized", "NestedTensor")
)
# those whose kernels PyTorch lists by name (its parser knows only these of the backend's)
LISTED = (NAME, "Autograd" + NAME)

_ours = False  # dtr's own registrations hold the key (in this process, for its life)


def taken() -> str | None:
    """What other than dtr has registered at the engine's keys in this process (a
    fallback, or kernels, naming one), or None when they are free for the engine."""
    if _ours:
        return None
    for name in REGISTERED_AT:
        if torch._C._dispatch_has_backend_fallback(getattr(torch._C.DispatchKey, name)):
            return f"a fallback is registered at the {name} dispatch key"
    for name in LISTED:
        ops = torch._C._dispatch_get_registrations_for_dispatch_key(name)
        if ops:
            return f"kernels are registered at the {name} dispatch key ({sorted(ops)[0]}, ...)"
    return None


def check_extension(name: str) -> None:
    """Raise if the C++ extension's key (named `name`) is not this module's."""
    if name != NAME:
        raise DTRError(
            f"dtr: the C++ extension's native engine uses the {name} dispatch key and dtr's "
            f"Python side {NAME}; rebuild the extension (python setup.py build_ext --inplace)"
        )


def claim() -> None:
    """Record that dtr's registrations now hold the engine's keys."""
    global _ours
    _ours = True
