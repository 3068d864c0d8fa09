"""bench/vs_static.py, quickly: static checkpointing as the script applies it computes what
eager computes, bit for bit; its memory measure is bench.common's; the comparison runs
end to end on a test-size model (one step, no torch.compile: compiling takes minutes on
a CPU) and writes its table and plot."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from bench import vs_static
from bench.common import eager_peak_bytes
from bench.models import MODELS, batches, build
from dtr import plot
from tests.utils import make_optimizer


def _train(name, loss_fn_of, steps=2):
    """Two SGD steps with dropout drawing from a seeded generator: losses, gradients,
    parameters, buffers and the generator's next draw."""
    model = build(name)
    opt = make_optimizer("sgd", model.parameters())
    loss_fn = loss_fn_of(model)
    torch.manual_seed(3)
    losses, grads = [], []
    for batch in batches(name, steps):
        loss = loss_fn(batch)
        loss.backward()
        losses.append(loss.item())
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    state = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    return losses, grads, state, torch.rand(4)


def _equal(xs, ys):
    return len(xs) == len(ys) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(xs, ys, strict=True)
    )


@pytest.mark.parametrize("mode", ["sqrt", "block"])
@pytest.mark.parametrize("name", ["cnn", "transformer", "lstm", "tree", "mlp"])
def test_static_checkpointing_is_eager_bit_for_bit(name, mode):
    eager = _train(name, lambda model: lambda batch: MODELS[name].loss(model, batch))
    static = _train(name, lambda model: vs_static.static_loss(name, model, mode))
    assert static[0] == eager[0]  # losses
    assert all(_equal(a, b) for a, b in zip(static[1], eager[1], strict=True))  # gradients, every step
    assert _equal(static[2], eager[2])  # parameters and buffers (BatchNorm statistics)
    assert torch.equal(static[3], eager[3])  # the same random draws consumed


def test_static_checkpointing_saves_memory():
    """The wrapped forward really checkpoints: fewer tensors saved for backward."""
    model = build("transformer")
    batch = batches("transformer", 1)[0]
    counts = {}
    for kind in ("eager", "sqrt", "block"):
        saved = []

        def pack(t, saved=saved):
            saved.append(t.numel())
            return t

        fn = (
            (lambda b: MODELS["transformer"].loss(model, b))
            if kind == "eager"
            else vs_static.static_loss("transformer", model, kind)
        )
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(batch)
        counts[kind] = sum(saved)
    assert counts["block"] < counts["sqrt"] < counts["eager"]


def test_memory_measure_is_bench_commons():
    res = vs_static.measure(
        "mlp", 1, 1, 0, lambda model: lambda batch: MODELS["mlp"].loss(model, batch)
    )
    assert res["status"] == "ok" and res["step_s"] > 0
    assert res["peak"] == eager_peak_bytes("mlp", 1)


def test_infeasible_budget_is_a_row():
    res = vs_static.measure(
        "mlp",
        1,
        1,
        0,
        lambda model: lambda batch: MODELS["mlp"].loss(model, batch),
        dtr_kwargs={"budget": 1000},
    )
    assert res["status"] == "infeasible" and res["peak"] is None


def test_infeasible_budget_is_a_row_on_the_native_engine_too():
    pytest.importorskip("dtr._C", reason="the native engine is C++")
    loss = lambda model: lambda batch: MODELS["mlp"].loss(model, batch)  # noqa: E731
    res = vs_static.measure("mlp", 1, 1, 0, loss, dtr_kwargs={"budget": 1000}, engine="native")
    assert res["status"] == "infeasible" and res["peak"] is None
    res = vs_static.measure("mlp", 1, 1, 0, loss, dtr_kwargs={}, engine="native")
    assert res["status"] == "ok" and res["stats"].core == "c++" and res["peak"] > 0


def _dtr_rows(path) -> list[dict]:
    """The dtr rows of the CSV vs_static wrote at path, after checking its columns."""
    with open(path) as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == vs_static.HEADER
    return [r for r in rows if r["method"] == "dtr"]


def _held_its_budget(row: dict) -> None:
    """A dtr run at a budget it met: dtr's peak within it (the CSV rounds both to 0.1
    MiB), with evictions and recomputations made."""
    assert row["status"] == "ok", row
    assert float(row["dtr_peak_resident_mib"]) <= float(row["budget_mib"]), row
    assert int(row["evictions"]) > 0 and int(row["remats"]) > 0, row


def test_the_native_engine_end_to_end(tmp_path):
    pytest.importorskip("dtr._C", reason="the native engine is C++")
    out = tmp_path / "vs.csv"
    vs_static.main(
        ["--quick", "--models", "mlp", "--steps", "1", "--warmup", "0", "--calibrate", "0"]
        + ["--ratios", "0.5", "0.01", "--engine", "native", "--cost-model", "roofline"]
        + ["--out", str(out)]
    )
    rows = _dtr_rows(out)
    sweep = {r["setting"]: r["status"] for r in rows if "eager peak" in r["setting"]}
    assert sweep == {"0.5 x eager peak": "ok", "0.01 x eager peak": "infeasible"}
    _held_its_budget(next(r for r in rows if r["setting"] == "0.5 x eager peak"))


def test_native_engine_options_are_checked(capsys):
    with pytest.raises(SystemExit):
        vs_static.main(["--engine", "native", "--device", "cuda", "--quick"])
    err = capsys.readouterr().err
    # without a GPU the device is refused first
    assert "--engine native: CPU only" in err or "torch.cuda.is_available() is False" in err


def test_the_comparison_end_to_end(tmp_path, capsys):
    out = tmp_path / "vs.csv"
    vs_static.main(
        ["--quick", "--models", "cnn", "--steps", "1", "--warmup", "0", "--calibrate", "1"]
        + ["--ratios", "0.6", "0.01", "--out", str(out)]
    )
    with open(out) as f:
        rows = list(csv.DictReader(f))
    methods = [r["method"] for r in rows]
    assert methods[:3] == ["eager", "checkpoint", "checkpoint"] and "compile" not in methods
    assert all(r["status"] == "ok" and float(r["peak_mib"]) > 0 for r in rows[:3])
    assert rows[-1]["method"] == "eager" and rows[-1]["setting"] == "again, after the others"
    dtr_rows = [r for r in rows if r["method"] == "dtr"]
    assert dtr_rows[0]["setting"] == "no budget"
    assert any(r["setting"].startswith("@ checkpoint") for r in dtr_rows)
    sweep = {r["setting"]: r["status"] for r in dtr_rows if "eager peak" in r["setting"]}
    assert sweep == {"0.6 x eager peak": "ok", "0.01 x eager peak": "infeasible"}
    assert dtr_rows == _dtr_rows(out)
    _held_its_budget(next(r for r in dtr_rows if r["setting"] == "0.6 x eager peak"))
    with open(tmp_path / "vs.targets.csv") as f:
        assert len(list(csv.DictReader(f))) == 2  # one line per static point
    assert (tmp_path / "vs.png").stat().st_size > 10_000
    assert "Lowest memory reached" in capsys.readouterr().out


def test_confirm_times_each_static_point_and_its_dtr_run_again():
    rows = vs_static.compare(
        "cnn", 1, steps=1, warmup=0, compile_budgets=(), ratios=(0.6,), calibrate=1,
        confirm=2, verbose=False,
    )  # fmt: skip
    statics = [r for r in rows if r["method"] == "checkpoint"]
    points, _ = vs_static.targets(rows)
    confirmed = 0
    for s, p in zip(statics, points, strict=True):
        best = vs_static._dtr_at(rows, s)
        if best is None:
            assert "confirm" not in s and not p["met"]
            continue
        c = s["confirm"]
        assert c["repeats"] == 2 and c["dtr_setting"] == best["setting"]
        assert c["static_s"] > 0 and c["dtr_s"] > 0
        assert p["confirmed"] == c["dtr_s"] / c["static_s"]
        assert p["met"] == (p["confirmed"] <= vs_static.TARGET)
        confirmed += 1
    assert confirmed > 0


def test_uncompilable_model_is_a_row():
    rows = vs_static.compare(
        "tree", 1, steps=1, warmup=0, compile_budgets=(1.0,), ratios=(0.01,), verbose=False
    )
    (row,) = [r for r in rows if r["method"] == "compile"]
    assert row["status"] == "skipped" and "item()" in row["note"]
    points, lows = vs_static.targets(rows)
    assert len(points) == 2 and len(lows) == 1


def test_plot(tmp_path):
    rows = [
        dict(model="m", method="eager", peak=100 * 2**20, ratio=1.0, setting=""),
        dict(model="m", method="checkpoint", peak=60 * 2**20, ratio=1.3, setting="sqrt(n)"),
        dict(model="m", method="compile", peak=None, ratio=math.nan, setting="budget 0.5"),
        dict(model="m", method="dtr", peak=70 * 2**20, ratio=1.2, setting="a"),
        dict(model="m", method="dtr", peak=40 * 2**20, ratio=2.5, setting="b"),
        dict(model="n", method="eager", peak=10 * 2**20, ratio=1.0, setting=""),
    ]
    path = plot.step_time_vs_memory(rows, str(tmp_path / "p.png"))
    assert path.endswith("p.png") and (tmp_path / "p.png").stat().st_size > 10_000
    fig = plot.step_time_vs_memory(rows)
    assert len([ax for ax in fig.axes if ax.has_data()]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        vs_static.main(["--device", "cuda", "--quick", "--models", "mlp"])
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err
