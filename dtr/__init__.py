"""dtr: Dynamic Tensor Rematerialization for PyTorch.

Train under a memory budget with no model changes: when resident memory passes the
budget, dtr evicts the tensor that is cheapest to recompute per byte and stale, and
recomputes it from its lineage when it is needed again, backward included.

    import dtr
    with dtr.enable(budget="2GiB") as session:
        loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    print(session.stats())
"""

from .config import DTRConfig
from .core.reference import DEFAULT_HEURISTIC, HEURISTICS
from .engines.subclass.tensor import CheckpointTensor
from .errors import BudgetError, ConfigError, DTRError, InternalError, UnsupportedError
from .session import Session, enable, materialize
from .stats import Stats

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_HEURISTIC",
    "HEURISTICS",
    "BudgetError",
    "CheckpointTensor",
    "ConfigError",
    "DTRConfig",
    "DTRError",
    "InternalError",
    "Session",
    "Stats",
    "UnsupportedError",
    "enable",
    "materialize",
]
