"""torch.profiler inside a dtr session, on both engines: no callback errors, the input
shapes eager's run reports, memory events, exports, and one ``dtr::remat`` range per
recomputation.

torch.profiler(record_shapes=True) reads the data pointer of every tensor input when an
op starts; an evicted value's storage refuses that read (the guard against reading freed
memory directly), which the profiler reported as an error per op and then failed its
own end callbacks. dtr lets the profiler read it as null while keeping the guard for
everyone else (csrc/native/engine.cpp, "torch.profiler").
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import dtr

# stress: every evictable value evicted after every op; budget: below the run's peak
MODES = {"none": {}, "budget": {"budget": 70_000}, "stress": {"stress": True}}
# the ops the program calls, whose input shapes must read as eager's
PROGRAM_OPS = ("aten::linear", "aten::addmm", "aten::relu", "aten::sum", "aten::mm")


def _model_and_input():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    return m, torch.randn(32, 64)


def _profiled(step):
    with profile(
        activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True, with_stack=True
    ) as prof:
        step()
    return prof


def _shapes(prof) -> dict[str, set[str]]:
    shapes: dict[str, set[str]] = {}
    for row in prof.key_averages(group_by_input_shape=True):
        if row.key in PROGRAM_OPS:
            shapes.setdefault(row.key, set()).add(str(row.input_shapes))
    return shapes


def _train(m, x):
    def step():
        for _ in range(2):
            m(x).sum().backward()

    return step


@pytest.mark.parametrize("mode", sorted(MODES))
def test_profiler_in_a_session_reports_eagers_shapes_and_remat_ranges(engine, mode, capfd, tmp_path):
    m, x = _model_and_input()
    eager = _profiled(_train(m, x))
    want_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    capfd.readouterr()

    with profile(
        activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True, with_stack=True
    ) as prof:
        with dtr.enable(engine=engine, cost_model="roofline", **MODES[mode]) as session:
            _train(m, x)()
    err = capfd.readouterr().err
    assert "RecordFunction" not in err and "metadata exhausted" not in err, err
    assert "dtr:" not in err, err

    stats = session.stats()
    if mode != "none":
        assert stats.remats > 0
    ranges = sum(e.name == "dtr::remat" for e in prof.events())
    assert ranges == stats.remats  # one range per recipe rerun, close's included
    assert _shapes(prof) == _shapes(eager)
    assert any(e.cpu_memory_usage != 0 for e in prof.events())  # profile_memory's events
    for p, want in zip(m.parameters(), want_grads, strict=True):
        assert torch.equal(p.grad, want)

    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    names = [e.get("name") for e in json.loads(trace.read_text())["traceEvents"]]
    assert names.count("dtr::remat") == stats.remats
    prof.export_memory_timeline(str(tmp_path / "memory.json"), device="cpu")
    assert (tmp_path / "memory.json").stat().st_size > 0


def test_evicted_memory_stays_guarded_while_profiling(capfd):
    # The profiler may read an evicted value's address (null); C++ reading its memory
    # directly (here TensorBase.data_ptr, which dtr's Python methods do not wrap) is still
    # refused with dtr's message, between ops and after the profiler's ranges.
    x = torch.randn(16, 16, requires_grad=True)
    with dtr.enable(engine="native", stress=True):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True):
            h = [x]
            for _ in range(4):
                h.append(torch.tanh(h[-1]) * 2)
            with pytest.raises(RuntimeError, match="dtr: this tensor's value is evicted"):
                torch._C.TensorBase.data_ptr(h[2])
            h[-1].sum().backward()
            with pytest.raises(RuntimeError, match="dtr: this tensor's value is evicted"):
                torch._C.TensorBase.data_ptr(h[2] * 3)
        with pytest.raises(RuntimeError, match="dtr: this tensor's value is evicted"):
            torch._C.TensorBase.data_ptr(h[2] * 3)
    assert "RecordFunction" not in capfd.readouterr().err
