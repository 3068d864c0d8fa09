"""Settings: budget syntax, environment variables, and the errors bad input gets."""

from __future__ import annotations

import math
import re

import pytest
import torch

import dtr
import dtr.device
from dtr.config import resolve
from tests.utils import REPO


@pytest.mark.parametrize(
    "value, expected",
    [
        (1000, 1000),
        ("800000B", 800_000),
        ("512MB", 512 * 10**6),
        ("512mb", 512 * 10**6),
        ("1.5GiB", int(1.5 * 2**30)),
        ("2 GiB", 2 * 2**30),
        ("64KiB", 64 * 1024),
        ("3TB", 3 * 10**12),
        ("1e6", 10**6),
        ("123", 123),
        (2.5e9, 2_500_000_000),
    ],
)
def test_budget_forms(value, expected):
    assert dtr.enable(budget=value).config.budget_bytes == expected


@pytest.mark.parametrize(
    "value",
    [
        "abc",
        "-1GB",
        "1.5XB",
        0,
        "0",
        True,
        False,
        math.nan,
        "nan",
        "inf",
        math.inf,
        -5,
        "",
        "12 G B",
        [1],
        "0.1B",
    ],
)
def test_bad_budgets_are_clear_errors(value):
    with pytest.raises(dtr.ConfigError) as info:
        dtr.enable(budget=value)
    msg = str(info.value)
    assert msg.startswith("dtr: invalid budget")
    assert repr(value) in msg
    assert "GiB" in msg  # says what is accepted


def test_env_budget_and_heuristic(monkeypatch):
    monkeypatch.setenv("DTR_MEMORY_BUDGET", "2GiB")
    monkeypatch.setenv("DTR_HEURISTIC", "lru")
    cfg = dtr.enable().config
    assert (cfg.budget_bytes, cfg.heuristic) == (2 * 2**30, "lru")
    cfg = dtr.enable(budget="1MB", heuristic="size").config  # explicit arguments win
    assert (cfg.budget_bytes, cfg.heuristic) == (10**6, "size")


def test_no_budget_anywhere_means_track_only():
    cfg = dtr.enable().config
    assert cfg.budget_bytes is None and cfg.heuristic == "dtr_held" == dtr.DEFAULT_HEURISTIC


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("DTR_MEMORY_BUDGET", "lots", "DTR_MEMORY_BUDGET"),
        ("DTR_MEMORY_BUDGET", "-3MB", "DTR_MEMORY_BUDGET"),
        ("DTR_HEURISTIC", "best", "DTR_HEURISTIC"),
        ("DTR_STRESS", "maybe", "DTR_STRESS"),
        ("DTR_FORCE_PYTHON", "2", "DTR_FORCE_PYTHON"),
        ("DTR_COST_MODEL", "guess", "cost_model"),
        ("DTR_MEASURE", "nvml", "DTR_MEASURE"),
    ],
)
def test_bad_env_values_name_the_variable(monkeypatch, name, value, match):
    monkeypatch.setenv(name, value)
    with pytest.raises(dtr.ConfigError, match=match):
        dtr.enable()


def test_unknown_heuristic_lists_the_valid_ones():
    with pytest.raises(dtr.ConfigError) as info:
        dtr.enable(heuristic="lfu")
    for name in dtr.HEURISTICS:
        assert name in str(info.value)


def test_unknown_option():
    with pytest.raises(dtr.ConfigError, match="unknown option.*budjet.*valid options"):
        dtr.enable(budjet="1GB")


@pytest.mark.parametrize(
    "options",
    [
        {"stress": "yes"},
        {"seed": -1},
        {"min_evict_bytes": 1.5},
        {"cost_model": "flops"},
        {"check": 1},
        {"measure": "nvml"},
    ],
)
def test_bad_option_values(options):
    with pytest.raises(dtr.ConfigError, match="dtr: "):
        dtr.enable(**options)


INT_OPTIONS = ("seed", "min_evict_bytes", "search_sample", "timeline")


@pytest.mark.parametrize("name", INT_OPTIONS)
@pytest.mark.parametrize("value", [2**63, 2**64 + 1, -1, 1.0, "7"])
def test_int_options_out_of_range_are_refused_at_enable(name, value):
    # The engines keep them in int64: a larger one failed in C++ when the block was entered.
    with pytest.raises(dtr.ConfigError, match=rf"^dtr: option {name} must be an int from 0 to"):
        dtr.enable(**{name: value})


@pytest.mark.parametrize("engine", ["subclass", "native"])
def test_int_options_end_at_int64(engine):
    # One past int64 is refused by enable(); int64's largest runs the block.
    if engine == "native":
        pytest.importorskip("dtr._C", reason="the native engine is C++")
    for name in INT_OPTIONS:
        with pytest.raises(dtr.ConfigError, match=f"option {name} must be an int"):
            dtr.enable(engine=engine, **{name: 2**63})
    with pytest.raises(dtr.ConfigError, match="option seed must be an int"):
        dtr.enable(engine=engine, seed=True)  # (timeline=True is its documented default)
    largest = {name: 2**63 - 1 for name in INT_OPTIONS}
    with dtr.enable(engine=engine, **largest) as session:
        (torch.ones(2, requires_grad=True) * 2).sum().backward()
    assert session.stats().ops > 0


@pytest.mark.parametrize("how", ["option", "env"])
def test_trace_path_that_is_a_folder_is_refused_at_enable(monkeypatch, tmp_path, how):
    options = {"trace": tmp_path} if how == "option" else {}
    if how == "env":
        monkeypatch.setenv("DTR_TRACE", str(tmp_path))
    with pytest.raises(dtr.ConfigError, match=r"option trace or DTR_TRACE\) is a folder"):
        dtr.enable(**options)


def test_env_flags(monkeypatch):
    assert resolve().cost_model == "roofline"  # the default: the same decisions every run
    monkeypatch.setenv("DTR_STRESS", "1")
    monkeypatch.setenv("DTR_COST_MODEL", "time")
    cfg = resolve()
    assert cfg.stress and cfg.cost_model == "time"
    assert resolve(cost_model="roofline").cost_model == "roofline"  # the argument wins
    assert not resolve(stress=False).stress


def test_check_option_and_its_env_variable_share_one_name(monkeypatch):
    assert not resolve().check
    monkeypatch.setenv("DTR_CHECK", "1")
    assert resolve().check and not resolve(check=False).check  # the argument wins
    monkeypatch.setenv("DTR_DEBUG", "0")  # the former name yields to the new one
    assert resolve().check
    monkeypatch.delenv("DTR_CHECK")
    monkeypatch.setenv("DTR_DEBUG", "1")
    with pytest.warns(DeprecationWarning, match="DTR_DEBUG is now called DTR_CHECK"):
        assert dtr.enable().config.check


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
@pytest.mark.parametrize("how", ["option", "env"])
def test_measure_allocator_without_cuda_is_a_config_error(monkeypatch, how):
    # The CPU allocator keeps no count to hold a budget to; said at enable() time.
    if how == "env":
        monkeypatch.setenv("DTR_MEASURE", "allocator")
    options = {"measure": "allocator"} if how == "option" else {}
    with pytest.raises(dtr.ConfigError, match="no CUDA device.*measure='dtr'"):
        dtr.enable(budget="1GiB", **options)
    assert resolve(measure="dtr").measure == "dtr"


def test_measure_allocator_is_refused_by_the_native_engine(monkeypatch):
    pytest.importorskip("dtr._C", reason="the native engine is C++")
    monkeypatch.setattr(dtr.device, "allocator_meter", lambda: lambda: 0)  # as if on CUDA
    with pytest.raises(dtr.ConfigError, match="native engine runs on the CPU"):
        dtr.enable(engine="native", measure="allocator")


def test_every_option_in_the_readme_is_taken_by_dtr_enable():
    # README's options table, and `cache` (the native engine's allocation cache, which
    # only dtr.engines.native.session.enable took)
    import pathlib

    readme = (pathlib.Path(REPO) / "README.md").read_text()
    table = readme.split("### Options and environment variables")[1].split("\n\n")[2]
    documented = {
        name
        for row in table.splitlines()[2:]
        for name in re.findall(r"`(\w+)[=`]", row.split("|")[1])
    }
    assert documented | {"cache"} <= set(dtr.config.OPTIONS) | {"budget", "heuristic"}


@pytest.mark.parametrize(("cache", "nbytes"), [(0, 0), ("2MiB", 2 << 20), (4096, 4096)])
def test_cache_through_dtr_enable(cache, nbytes):
    pytest.importorskip("dtr._C", reason="the native engine is C++")
    x = torch.randn(64, 64, requires_grad=True)
    with dtr.enable(engine="native", cache=cache, stress=True) as session:
        (x.tanh() * 2).sum().backward()
    assert session.cache_bytes == nbytes and session.stats().remats > 0
    assert (session.cache_stats is None) == (nbytes == 0)
    with dtr.enable(engine="native") as default:
        pass
    assert default.cache_bytes == 1 << 30


def test_cache_is_refused_by_the_subclass_engine_by_name():
    with pytest.raises(dtr.ConfigError, match="native engine's CPU allocation cache.*engine='native'"):
        dtr.enable(engine="subclass", cache=0)
    with pytest.raises(dtr.ConfigError, match="invalid cache"):
        dtr.enable(engine="native", cache="lots")


def test_errors_are_raised_at_enable_time_not_at_enter():
    with pytest.raises(dtr.ConfigError):
        dtr.enable(budget="nope")  # no `with` needed to see it


def test_session_stats_before_entering():
    session = dtr.enable()
    with pytest.raises(dtr.DTRError, match="not been entered"):
        session.stats()


def test_stats_are_loggable():
    import json

    import torch

    with dtr.enable(budget="1GiB") as session:
        (torch.randn(4, 4, requires_grad=True) * 2).sum().backward()
    stats = session.stats()
    data = json.loads(stats.to_json())
    assert data["budget_bytes"] == 2**30 and data["ops"] == stats.ops
    assert "1.00 GiB" in str(stats)


def test_missing_extension_warns_once_and_uses_the_twin(monkeypatch):
    import sys
    import warnings

    import torch

    from dtr import core

    monkeypatch.setitem(sys.modules, "dtr._C", None)  # makes `from . import _C` fail
    monkeypatch.setattr(core, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dtr.enable() as s1:
            (torch.ones(2, requires_grad=True) * 2).sum().backward()
        with dtr.enable() as s2:
            pass
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "dtr: the C++ core" in msgs[0] and "--no-build-isolation" in msgs[0]
    assert s1.stats().core == "python" and s2.stats().core == "python"


def test_extension_built_for_another_torch_is_not_used(monkeypatch):
    import warnings

    from dtr import core

    ext = core.load_extension()
    if ext is None:
        pytest.skip("the C++ core is not built")
    monkeypatch.setattr(ext, "TORCH_VERSION", "1.0.0")
    monkeypatch.setattr(core, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cls, kind = core.core_class(False)
    assert kind == "python"
    assert any("built for torch 1.0.0" in str(w.message) for w in caught)


def test_auto_engine_is_native_on_a_cpu_only_machine():
    pytest.importorskip("dtr._C", reason="the native engine is C++")
    if dtr.engines._accelerator_available():
        pytest.skip("this machine has an accelerator: auto picks the subclass engine")
    session = dtr.enable(budget="1GiB")
    assert session.engine == "native"
    assert isinstance(session, dtr.engines.native.session.NativeSession)
    with session:
        x = torch.randn(8, 8, requires_grad=True)
        y = x.exp().sum()
        assert dtr.engines.native.session.is_managed(x.exp())
        y.backward()
    assert session.stats().core == "c++"
    assert resolve(engine="auto").engine == "native"


@pytest.mark.parametrize("why", ["accelerator", "python core", "extension", "key taken"])
def test_auto_engine_falls_back_to_the_subclass_engine(monkeypatch, why):
    # Each thing that rules the native engine out: auto then runs the subclass engine,
    # and an explicit engine="native" is still honoured where it can run.
    from dtr import core, engines
    from dtr.engines.native import key as native_key

    monkeypatch.setattr(engines, "_accelerator_available", lambda: why == "accelerator")
    if why == "python core":
        monkeypatch.setenv("DTR_FORCE_PYTHON", "1")
    elif why == "extension":
        monkeypatch.setattr(core, "load_extension", lambda: None)
    elif why == "key taken":
        monkeypatch.setattr(native_key, "taken", lambda: "kernels are registered at PrivateUse3")
    engine, reason = engines.choose(dtr.config.force_python(), "dtr")
    assert engine == "subclass" and reason
    session = dtr.enable()
    assert session.engine == "subclass" and isinstance(session, dtr.Session)
    assert resolve(engine="subclass").engine == "subclass"
    assert engines.choose(False, "allocator")[0] == "subclass"


def test_engine_names(monkeypatch):
    assert dtr.enable(engine="subclass").engine == "subclass"
    with pytest.raises(dtr.ConfigError, match="unknown engine 'python'; valid: auto, native, sub"):
        dtr.enable(engine="python")
    with pytest.warns(DeprecationWarning, match="'default' is now called 'subclass'"):
        assert resolve(engine="default").engine == "subclass"
    monkeypatch.setenv("DTR_ENGINE", "default")
    with pytest.warns(DeprecationWarning):
        assert dtr.enable().engine == "subclass"
