"""Importing torchvision (and what imports it: timm, parts of transformers) on a CPU-only
torch.

The torchvision build that keeps torch 2.13 is a CUDA build: its C ops cannot load on the
CPU wheel, and its import then fails registering fake kernels for ``torchvision::nms`` and
``qnms``, which no library defined. Defining those two schemas first lets the import
finish; the models need none of torchvision's C ops (detection's NMS is not used here).
"""

from __future__ import annotations

import importlib
import types

import torch

_library: torch.library.Library | None = None  # kept alive: dropping it removes the schemas


def make_torchvision_importable() -> None:
    """Define the two schemas torchvision's import needs, on a CPU-only torch (idempotent)."""
    global _library
    if _library is not None or torch.version.cuda is not None:
        return  # a CUDA torch loads torchvision's own ops
    try:
        torch._C._dispatch_find_schema_or_throw("torchvision::nms", "")
        return  # defined already (torchvision's ops loaded, or defined elsewhere)
    except RuntimeError:
        pass
    _library = torch.library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        _library.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def require(module: str) -> types.ModuleType:
    """Import `module` (torchvision, timm, transformers, ...), torchvision made importable
    first; a missing package is an ImportError naming the install command."""
    make_torchvision_importable()
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{module} is not installed: pip install --no-deps torchvision==0.28.0 timm "
            "(README's test command installs them)"
        ) from exc
