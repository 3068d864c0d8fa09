"""Shared fixtures: the bench models are importable, and ``core`` runs a test against the
C++ core and against its pure-Python twin."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from dtr._core import core_class  # noqa: E402

# One intra-op thread: these tests run small ops, and on a shared 2-core machine
# OpenMP's spinning threads starve each other (a stress run measured 113 s instead of
# 2.7 s under load). Eager and dtr runs in one comparison share the setting.
torch.set_num_threads(1)

HAVE_CPP = core_class(False)[1] == "c++"
CORES = ["c++", "python"] if HAVE_CPP else ["python"]


@pytest.fixture(params=CORES)
def core(request, monkeypatch):
    """Selects the core dtr.enable() uses for this test."""
    monkeypatch.setenv("DTR_FORCE_PYTHON", "1" if request.param == "python" else "0")
    return request.param


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("DTR_MEMORY_BUDGET", "DTR_HEURISTIC", "DTR_STRESS", "DTR_DEBUG", "DTR_COST_MODEL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def logged(monkeypatch):
    """Keeps the eviction log of every live session's core."""
    import dtr.runtime

    cores = []
    init = dtr.runtime.Runtime.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.core.log_evictions(True)
        cores.append(self.core)

    monkeypatch.setattr(dtr.runtime.Runtime, "__init__", patched)
    return cores
