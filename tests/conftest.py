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

from dtr.core import core_class  # noqa: E402

# One intra-op thread: these tests run small ops, and on a shared 2-core machine
# OpenMP's spinning threads starve each other (a stress run measured 113 s instead of
# 2.7 s under load). Eager and dtr runs in one comparison share the setting.
torch.set_num_threads(1)

# torchvision (installed for the zoo; transformers and timm import it) needs two schemas
# defined before it imports on the CPU-only torch (bench/thirdparty.py).
from bench.thirdparty import make_torchvision_importable  # noqa: E402

make_torchvision_importable()

from dtr import config as _config  # noqa: E402
from dtr import session as _session  # noqa: E402

# dtr's environment variables of the shell running the tests (a budget, a trace file,
# the pure-Python core) would change what every test measures; tests set their own.
# Cleared here as well as per test, for module-level constants and module fixtures.
DTR_ENV = tuple(getattr(_config, name) for name in dir(_config) if name.startswith("ENV_"))
for _name in DTR_ENV:
    os.environ.pop(_name, None)

HAVE_CPP = core_class(False)[1] == "c++"
CORES = ["c++", "python"] if HAVE_CPP else ["python"]


@pytest.fixture(params=CORES)
def core(request, monkeypatch):
    """Selects the core of the subclass engine (the one with two cores) that dtr.enable()
    uses for this test."""
    monkeypatch.setenv("DTR_ENGINE", "subclass")
    monkeypatch.setenv("DTR_FORCE_PYTHON", "1" if request.param == "python" else "0")
    return request.param


@pytest.fixture(params=["subclass", "native"])
def engine(request) -> str:
    """dtr.enable()'s engine; the native one needs the C++ extension."""
    if request.param == "native":
        pytest.importorskip("dtr._C", reason="the native engine is C++")
    return request.param


@pytest.fixture
def subclass_engine(monkeypatch):
    """dtr.enable() without an engine runs the subclass engine: for tests of its own
    machinery (the Python runtime, its fast path, OOM retry), which the engine
    dtr.enable() picks on a CPU-only machine (the native one) does not have."""
    monkeypatch.setenv("DTR_ENGINE", "subclass")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in DTR_ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    # A test that left its session open would fail every later one ("already active").
    left = _session.current()
    if left is not None:
        left.__exit__(None, None, None)
        pytest.fail("dtr: the test left a dtr.enable() session open")


@pytest.fixture
def logged(monkeypatch):
    """Keeps the eviction log of every live session's core (the subclass engine's)."""
    import dtr.engines.subclass.runtime

    monkeypatch.setenv("DTR_ENGINE", "subclass")
    cores = []
    init = dtr.engines.subclass.runtime.Runtime.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.core.log_evictions(True)
        cores.append(self.core)

    monkeypatch.setattr(dtr.engines.subclass.runtime.Runtime, "__init__", patched)
    return cores


# Markers by folder (setup.cfg describes them); CI runs every marker. A slow file marks
# itself (``pytestmark``), and a test run on a CUDA device is an accelerator test
# wherever it lies (the device-generic tests parametrize ``device`` over
# tests.utils.DEVICES).
TESTS = os.path.dirname(os.path.abspath(__file__))
FOLDER_MARKS = {
    "distributed": ("distributed",),
    "accelerator": ("accelerator",),
    "bench": ("bench",),
}


def _marks(item) -> tuple[str, ...]:
    folder = os.path.relpath(item.path, TESTS).split(os.sep)[0]
    marks = FOLDER_MARKS.get(folder, ())
    params = getattr(item, "callspec", None)
    if params is not None and str(params.params.get("device", "")).startswith("cuda"):
        marks += ("accelerator",)
    return marks


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in _marks(item):
            item.add_marker(getattr(pytest.mark, name))
