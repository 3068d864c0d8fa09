"""Selects the bookkeeping core: the C++ one (``dtr._C``) or its pure-Python twin.

``DTR_FORCE_PYTHON=1`` forces the twin. When the extension is missing or was built for
another torch, dtr warns once, says why and how to rebuild, and uses the twin.
"""

from __future__ import annotations

import importlib
import warnings

import torch

from .reference import PyCore

_warned = False


def _fallback(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"dtr: the C++ core (dtr._C) {reason}; using the pure-Python core, which makes "
            f"the same decisions more slowly. Rebuild it against the installed torch "
            f"{torch.__version__}: `pip install --no-build-isolation -e .` in the dtr "
            f"checkout (or set DTR_FORCE_PYTHON=1 to silence this).",
            RuntimeWarning,
            stacklevel=4,
        )


def load_extension():
    try:
        _C = importlib.import_module("dtr._C")
    except ImportError as exc:
        _fallback(f"could not be loaded ({exc})")
        return None
    if getattr(_C, "TORCH_VERSION", None) != torch.__version__:
        _fallback(f"was built for torch {getattr(_C, 'TORCH_VERSION', '?')}")
        return None
    return _C


def core_class(force_python: bool):
    """(class, 'c++' or 'python')."""
    if not force_python:
        ext = load_extension()
        if ext is not None:
            return ext.Core, "c++"
    return PyCore, "python"
