"""Selects the bookkeeping core: the C++ one (``dtr._C``) or its pure-Python twin.

``DTR_FORCE_PYTHON=1`` forces the twin. When the extension is missing or was built for
another torch, dtr warns once, says why and how to rebuild, and uses the twin.
"""

from __future__ import annotations

import warnings

import torch

from ._pycore import PyCore
from .config import DTRConfig

_warned = False


def _load_extension():
    global _warned
    try:
        from . import _C
    except ImportError as exc:
        if not _warned:
            _warned = True
            warnings.warn(
                f"dtr: the C++ core (dtr._C) could not be loaded ({exc}); using the "
                f"pure-Python core, which makes the same decisions more slowly. It must be "
                f"built against the installed torch {torch.__version__}: run "
                f"`pip install --no-build-isolation -e .` in the dtr checkout.",
                RuntimeWarning, stacklevel=3)
        return None
    return _C


def core_class(force_python: bool):
    """(class, 'c++' or 'python')."""
    if not force_python:
        ext = _load_extension()
        if ext is not None:
            return ext.Core, "c++"
    return PyCore, "python"


def make_core(config: DTRConfig, budget: int):
    cls, kind = core_class(config.force_python)
    return cls(config.heuristic, budget, config.seed, config.min_evict_bytes), kind
