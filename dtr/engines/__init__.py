"""Which engine runs a session: the rule behind ``engine="auto"``, dtr.enable()'s default.

dtr has two engines that make the same decisions with the same core (docs/design.md):

- "native": managed tensors are a C++ TensorImpl and every op goes to one C++ fallback
  (dtr/engines/native/session.py, csrc/native/engine.cpp); 0.9-1.8 us added per small op, whole
  steps within 1.05x of eager. It needs dtr's C++ extension and its dispatch key (PrivateUse3,
  dtr/engines/native/key.py) free; it is proven on the CPU and on the tests' emulated
  accelerator (tests/accelerator/test_native_on_emu.py), not yet on CUDA.
- "subclass": managed tensors are a Python wrapper subclass seen by a dispatch mode, with
  a C++ fast path per op (dtr/engines/subclass/runtime.py, csrc/subclass/fastpath.cpp); 9-13 us per
  small op. Any device (CUDA with OOM retry and the allocator's measure), and it runs on the
  pure-Python core as well.

"auto" takes the native engine wherever it can serve the program, which it can tell only
from the machine: the native engine is proven on no real accelerator yet, so a machine with
one gets the subclass engine (pass engine="native" to use the native engine there).
"""

from __future__ import annotations

import torch

from .. import core
from .native import key as native_key

ENGINES = ("auto", "native", "subclass")
RUNNABLE = ("native", "subclass")  # what "auto" resolves to
# An older name of the subclass engine, still accepted behind a DeprecationWarning.
OLD_NAMES = {"default": "subclass"}


def choose(force_python: bool, measure: str) -> tuple[str, str]:
    """("native" or "subclass", why) for engine="auto" under these settings."""
    if force_python:
        return "subclass", "the pure-Python core was asked for (DTR_FORCE_PYTHON)"
    if measure != "dtr":
        return "subclass", f"measure={measure!r} reads an accelerator's allocator"
    if _accelerator_available():
        return "subclass", "an accelerator is available (the native engine is proven on the CPU)"
    if core.load_extension() is None:
        return "subclass", "dtr's C++ extension (dtr._C) is not built"
    taken = native_key.taken()
    if taken is not None:
        return "subclass", f"the native engine's dispatch key is taken: {taken}"
    return "native", "CPU only, C++ extension built"


def _accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        try:
            return bool(accelerator.is_available())
        except RuntimeError:
            # a backend torch cannot ask (PrivateUse1 renamed, with no device module
            # registered yet): its tensors may still come, so it counts as available
            return True
    return torch.cuda.is_available()
