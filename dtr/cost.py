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


def flops(func, args: tuple, kwargs: dict, out) -> float:
    """FLOPs of one call from torch's formulas; 0 for ops it has none for."""
    formula = flop_registry.get(func.overloadpacket)
    if formula is None:
        return 0.0
    try:
        return float(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not accept this overload's arguments
        return 0.0


def roofline(func, args: tuple, kwargs: dict, out) -> float:
    """Estimated seconds of one call (see the module docstring)."""
    moved = _tensor_bytes(out) + sum(_tensor_bytes(a) for a in args)
    moved += sum(_tensor_bytes(v) for v in kwargs.values())
    return max(flops(func, args, kwargs, out) / FLOPS_PER_SECOND, moved / BYTES_PER_SECOND)
