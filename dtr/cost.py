"""Cost models: what recomputing an op costs, as the heuristics see it.

* ``roofline`` (default): a deterministic estimate of an op's wall time, the larger of
  compute time and memory time on a nominal machine: ``max(FLOPs / 100 GFLOP/s, bytes / 10 GB/s)``,
  with FLOPs from ``torch.utils.flop_counter`` for the ops it knows (matmuls,
  convolutions, attention) and bytes the sizes of the op's tensor inputs and outputs. The
  same program under the same budget then evicts the same tensors in the same order.
  Pricing memory traffic matters: counting FLOPs alone makes elementwise ops look free
  next to convolutions, and the heuristics then keep the wrong tensors.
* ``time``: the op's measured wall time, what the paper used. It varies from run to run,
  and so do the eviction decisions built on it (results never do: every recomputation is
  exact): how many evictions, and whether a tight budget is met at all. It is not the
  default because the same program under the same budget should behave the same way.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry

COST_MODELS = ("time", "roofline")
DEFAULT_COST_MODEL = "roofline"

FLOPS_PER_SECOND = 100e9
BYTES_PER_SECOND = 10e9


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


# FLOPs by call: most of torch's formulas see only their arguments' shapes (flop_counter's
# shape_wrapper, which functools.wraps them, maps each tensor to its shape), and that
# mapping costs a third of the op (38 us a call for a 64x64 mm, against 115 us for the mm
# itself), so each op and shapes is priced once. Cleared when full: a program with
# ever-new shapes starts again.
_FLOPS: dict[tuple, float] = {}
MAX_FLOPS_ENTRIES = 100_000


_NESTED = (list, tuple, torch.Tensor)


def _shapes(obj):
    """obj as the FLOP formulas see it (tensors as shapes), hashable."""
    if isinstance(obj, torch.Tensor):
        return obj.shape
    if isinstance(obj, (list, tuple)):
        # (a list, not a generator: this runs for every matmul and convolution)
        return tuple([_shapes(o) if isinstance(o, _NESTED) else o for o in obj])
    return obj


def _formula_flops(formula, args: tuple, kwargs: dict, out) -> float:
    try:
        return float(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not accept this overload's arguments
        return 0.0


def flops(func, args: tuple, kwargs: dict, out) -> float:
    """FLOPs of one call from torch's formulas; 0 for ops it has none for."""
    formula = flop_registry.get(func.overloadpacket)
    if formula is None:
        return 0.0
    if not hasattr(formula, "__wrapped__"):
        # registered with get_raw=True (the attention kernels): it reads tensor values
        # (a nested batch's sequence offsets), so shapes do not determine its number
        return _formula_flops(formula, args, kwargs, out)
    key = (func, _shapes(args), _shapes(tuple(kwargs.items())), _shapes(out))
    try:
        cached = _FLOPS.get(key)
    except TypeError:  # an argument that cannot be a key: priced every time
        return _formula_flops(formula, args, kwargs, out)
    if cached is None:
        if len(_FLOPS) >= MAX_FLOPS_ENTRIES:
            _FLOPS.clear()
        cached = _FLOPS[key] = _formula_flops(formula, args, kwargs, out)
    return cached


def roofline(func, args: tuple, kwargs: dict, out) -> float:
    """Estimated seconds of one call (see the module docstring)."""
    moved = _tensor_bytes(out) + sum(_tensor_bytes(a) for a in args)
    moved += sum(_tensor_bytes(v) for v in kwargs.values())
    return max(flops(func, args, kwargs, out) / FLOPS_PER_SECOND, moved / BYTES_PER_SECOND)
