"""``t.data = new`` while a session is open (both engines).

PyTorch swaps the tensor's storage and metadata with no op, so neither engine would see
it. While a session is open ``torch.Tensor.data`` is a property of ours (process-wide,
PyTorch's descriptor put back at exit) whose setter:

* on a plain tensor (a hand-written SGD step ``p.data = p.data - lr * g``,
  ``Module.half()``), first has what recipes read of the tensor's old value materialized
  and pinned, as before an op writes it (Invariant 4), so nothing computed from the old
  value is recomputed from the new one; a managed ``new`` is handed over as its plain
  value (pinned, as ``dtr.materialize`` does: the tensor shares its memory as in eager),
  never as the engine's tensor, which a plain parameter cannot hold;
* on a managed tensor, is refused: its value would change behind the engine's back.

The getter is PyTorch's. Swaps made from C++ are not seen here; a recipe that reads a
plain tensor refuses to replay after one (dtr/engines/subclass/recipe.py, replaced_error).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .errors import UnsupportedError

_DATA = torch._C.TensorBase.data  # PyTorch's descriptor
_MISSING = object()


@dataclass(frozen=True)
class Hooks:
    """What the open session's engine does for the setter."""

    is_managed: Callable[[torch.Tensor], bool]
    plain_value: Callable[[torch.Tensor], torch.Tensor]  # pinned, sharing its memory
    plain_written: Callable[[torch.Tensor], None]  # pins what reads its old value


_hooks: Hooks | None = None
_saved: object = _MISSING


def refused() -> UnsupportedError:
    return UnsupportedError(
        "dtr: `t.data = x` on a tensor dtr manages would replace its value behind dtr's "
        "back; write the new value into it instead (`with torch.no_grad(): t.copy_(x)`), "
        "or bind the name to x (`t = x`)"
    )


def _get(self):
    return _DATA.__get__(self, type(self))


def _set(self, new) -> None:
    hooks = _hooks
    if hooks is not None:
        if hooks.is_managed(self):
            raise refused()
        if isinstance(new, torch.Tensor) and hooks.is_managed(new):
            new = hooks.plain_value(new)
        hooks.plain_written(self)
    _DATA.__set__(self, new)


def install(hooks: Hooks) -> None:
    """Put the property on torch.Tensor (at session enter)."""
    global _hooks, _saved
    _saved = torch.Tensor.__dict__.get("data", _MISSING)
    _hooks = hooks
    torch.Tensor.data = property(_get, _set, doc=_DATA.__doc__)


def remove() -> None:
    """Put PyTorch's attribute back (at session exit)."""
    global _hooks, _saved
    if _saved is _MISSING:
        if "data" in torch.Tensor.__dict__:
            del torch.Tensor.data
    else:
        torch.Tensor.data = _saved
    _hooks = None
    _saved = _MISSING
