"""``dtr.enable()``: the context manager that puts a block of code under dtr, on either
engine (dtr/engines/)."""

from __future__ import annotations

import torch

from . import open_sessions
from .config import resolve
from .engines.native import key as native_key
from .engines.native.session import NativeSession
from .engines.subclass.session import Session
from .engines.subclass.tensor import CheckpointTensor, materialize_ref
from .errors import ConfigError


def current():
    """The active session of either engine (a Session, or a
    dtr.engines.native.session.NativeSession), if any."""
    return open_sessions.current()


def enable(budget: object = None, heuristic: str | None = None, **options) -> Session:
    """Train under a memory budget: evict tensors when it is exceeded, recompute them
    from their lineage when they are needed again.

    Args:
        budget: bytes (int) or a string with a unit ("512MB", "1.5GiB", "800000B").
            None reads ``DTR_MEMORY_BUDGET``; if that is unset too, dtr tracks every
            tensor and evicts nothing.
        heuristic: which tensor to evict, one of ``dtr.HEURISTICS``: "dtr_held" (the
            default, or ``DTR_HEURISTIC``), "dtr" (the paper's), "dtr_eq", "dtr_local",
            "lru", "size", "msps", "msps_sqrt", "dtr_held34" or "random".
        **options: ``stress=True`` evicts every evictable tensor after every op (a
            testing mode that makes every reuse a recomputation); ``seed`` for the
            random heuristic; ``min_evict_bytes`` never evicts smaller pools;
            ``search_sample`` (default 512): exact victim search up to that many
            evictable pools, the best of that many sampled ones beyond (0: exact);
            ``check=True`` verifies the core's invariants after every op;
            ``cost_model`` "roofline" (the default: deterministic cost estimates, the
            same evictions every run) or "time" (measured wall time);
            ``trace="run.jsonl"`` records every op for the simulator (dtr.sim);
            ``timeline=True`` keeps resident bytes per op for :meth:`Session.timeline`;
            ``log_steps=True`` logs a summary per optimizer step
            (:meth:`Session.end_step`); ``engine`` (or
            ``DTR_ENGINE``): "auto" (the default) runs the block on the native engine
            (C++ per op, proven on the CPU; :mod:`dtr.engines.native.session`) unless the machine has an
            accelerator or something else rules it out (dtr/engines/__init__.py), else on the
            subclass engine (this module's :class:`Session`, any device); "native" or
            "subclass" choose one; ``thrash`` (or ``DTR_THRASH``; default 21, 0 with stress): a step
            whose recomputations pass (thrash - 1) x its ops (at least 1000) raises
            BudgetError, the budget being too small to be met at any sensible cost
            (0 or None: recompute without limit). A block that ends with a
            BudgetError does not rebuild what it evicted: reading it afterwards raises
            a dtr: error.

    Returns:
        A :class:`Session` (a :class:`dtr.engines.native.session.NativeSession` for the native engine,
        with the same methods); enter it with ``with``.

    Raises:
        dtr.ConfigError: unparsable or non-positive budget, unknown heuristic or option.

    Example:
        >>> with dtr.enable(budget="2GiB") as session:
        ...     loss = model(x).sum(); loss.backward(); opt.step()
        >>> print(session.stats())
    """
    config = resolve(budget, heuristic, **options)
    if config.engine == "native":
        try:
            from . import _C  # noqa: F401
        except ImportError as e:
            raise ConfigError(
                "dtr: engine 'native' needs dtr's C++ extension (dtr._C), which this "
                f"install lacks ({e}); build it (pip install -e .) or use engine='subclass'"
            ) from None
        return NativeSession(config)
    return Session(config)


def materialize(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a managed one (a plain tensor is returned as is). Inside
    the block the tensor is pinned from then on, since the program may write to it."""
    if isinstance(t, CheckpointTensor):
        return materialize_ref(t._dtr_ref, export=True)
    # the native engine's (dtr.engines.native.session), if it is one
    if isinstance(t, torch.Tensor) and torch._C._dispatch_keys(t).has(native_key.KEY):
        from . import _C

        return _C.native_materialize(t)
    return t
