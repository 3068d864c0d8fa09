"""The exceptions dtr raises. Every message starts with ``dtr:`` and says what to do."""

from __future__ import annotations

import torch


class DTRError(RuntimeError):
    """Base class of every error raised by dtr."""


class ConfigError(DTRError, ValueError):
    """A budget, heuristic, option or environment variable that dtr cannot accept."""


class BudgetError(DTRError, torch.OutOfMemoryError):
    """The memory budget cannot be met: everything that could be evicted has been.

    A subclass of ``torch.OutOfMemoryError``, so code that already handles running out of
    memory handles this too.
    """


class UnsupportedError(DTRError, NotImplementedError):
    """An operation dtr does not support on managed tensors (the message says which)."""


class InternalError(DTRError):
    """A broken invariant inside dtr; please report it with the message."""
