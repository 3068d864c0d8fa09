"""Live feedback a user reads while training: the per-op memory timeline, per-step
summaries through the ``logging`` module, stats as JSON, and the plots drawn from them."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import dtr
from dtr import plot


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])


def _train(session_kwargs, steps=3, end_steps=False):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(256, 128)
    # roofline costs: the same evictions every run (measured ones depend on the machine)
    with dtr.enable(**{"cost_model": "roofline", **session_kwargs}) as session:
        for _ in range(steps):
            model(x).relu().sum().backward()
            opt.step()
            opt.zero_grad()
            if end_steps:
                session.end_step()
    return session


@pytest.fixture(scope="module")
def tight() -> int:
    """75% of the unbudgeted peak (the constants, 515 KiB, are a third of it): this
    forces evictions and recomputations in forward and backward. Module-scoped, so it
    is measured before a test's ``core`` fixture selects an engine, with dtr.enable()'s
    default one."""
    return int(0.75 * _train(dict(), steps=1).stats().peak_resident_bytes)


def test_timeline_records_every_op_boundary(core, tmp_path, tight):
    session = _train(dict(budget=tight, timeline=True))
    stats, tl = session.stats(), session.timeline()
    assert stats.evictions > 0 and stats.remats > 0
    assert len(tl) > 0 and tl.budget_bytes == tight
    assert all(len(getattr(tl, c)) == len(tl) for c in ("name", "backward", "remats"))
    assert max(tl.resident_bytes) <= tight  # settled op boundaries are within the budget
    assert all(b >= r for b, r in zip(tl.before_bytes, tl.resident_bytes, strict=True))
    assert max(tl.before_bytes) <= stats.max_transient_bytes
    assert tl.evictions == sorted(tl.evictions) and tl.remats == sorted(tl.remats)
    assert tl.evictions[-1] <= stats.evictions and tl.remats[-1] == stats.remats
    assert any(tl.backward) and not all(tl.backward)
    assert "aten.addmm.default" in tl.name
    assert list(tl.rows()[0]) == list(dtr.timeline.COLUMNS)
    out = plot.memory_timeline(tl, str(tmp_path / "timeline.png"))
    assert (tmp_path / "timeline.png").stat().st_size > 10_000 and out.endswith(".png")


def test_timeline_keeps_the_newest_rows():
    full = _train(dict(timeline=True)).timeline()
    last = _train(dict(timeline=10)).timeline()
    assert len(full) > 10 and len(last) == 10
    assert last.op == full.op[-10:] and last.name == full.name[-10:]


def test_timeline_needs_the_option():
    session = _train(dict())
    with pytest.raises(dtr.DTRError, match="timeline=True"):
        session.timeline()
    with dtr.enable() as live:
        with pytest.raises(dtr.DTRError, match="timeline=True"):
            live.timeline()


def test_log_steps_logs_one_line_per_optimizer_step(core, caplog, tight):
    caplog.set_level(logging.INFO, logger="dtr")
    session = _train(dict(budget=tight, log_steps=True))
    lines = [r.getMessage() for r in caplog.records if r.name == "dtr"]
    assert len(lines) == 3 and all(m.startswith(f"dtr step {i + 1}:") for i, m in enumerate(lines))
    steps, stats = session.steps(), session.stats()
    assert [s.step for s in steps] == [1, 2, 3]
    assert sum(s.ops for s in steps) == stats.ops  # nothing runs after the last step
    assert sum(s.remats for s in steps) == stats.remats and stats.remats > 0
    # the per-step peaks are within the budget, and the session's peak is their maximum
    assert max(s.peak_resident_bytes for s in steps) == stats.peak_resident_bytes <= tight
    assert stats.max_transient_bytes >= stats.peak_resident_bytes  # carried across steps
    assert all(s.budget_bytes == tight and s.seconds > 0 for s in steps)
    assert json.loads(steps[0].to_json())["step"] == 1


def test_end_step_by_hand_and_env_flag(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="dtr")
    session = _train(dict(), steps=2, end_steps=True)
    assert [s.step for s in session.steps()] == [1, 2]
    assert sum(1 for r in caplog.records if r.name == "dtr") == 2
    monkeypatch.setenv("DTR_LOG_STEPS", "1")
    assert len(_train(dict(), steps=2).steps()) == 2  # from the optimizer hook
    monkeypatch.setenv("DTR_LOG_STEPS", "maybe")
    with pytest.raises(dtr.ConfigError, match="DTR_LOG_STEPS"):
        dtr.enable()


def test_optimizer_hook_is_removed_after_the_block(caplog):
    caplog.set_level(logging.INFO, logger="dtr")
    _train(dict(log_steps=True), steps=1)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = len(caplog.records)
    model(torch.randn(2, 128)).sum().backward()
    opt.step()  # outside any session: no step is logged
    assert len(caplog.records) == before


def test_reset_peak_keeps_step_peaks_consistent():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dtr.enable(log_steps=True) as session:
        model(torch.randn(64, 128)).sum().backward()
        opt.step()
        opt.zero_grad()
        big = session.stats().peak_resident_bytes
        session.reset_peak()
        model(torch.randn(2, 128)).sum().backward()
        opt.step()
        assert session.stats().peak_resident_bytes < big
        assert session.steps()[1].peak_resident_bytes < big


@pytest.mark.parametrize("bad", [dict(timeline=-1), dict(timeline=1.5), dict(log_steps="yes")])
def test_bad_feedback_options(bad):
    with pytest.raises(dtr.ConfigError, match="dtr: option"):
        dtr.enable(**bad)


def test_stats_round_trip_through_json(tight):
    stats = _train(dict(budget=tight)).stats()
    data = json.loads(stats.to_json())
    assert data == stats.as_dict() and dtr.Stats(**data) == stats
