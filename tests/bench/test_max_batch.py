"""bench/max_batch.py's search (the GPU runs themselves need a device: bench/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from bench.max_batch import largest, main


@pytest.mark.parametrize("boundary", [1, 7, 16, 17, 1000, 5000])
def test_largest_finds_the_boundary_to_the_resolution(boundary):
    calls = []

    def fits(n):
        calls.append(n)
        return n <= boundary

    found = largest(fits, 16, 1 << 16, 0.05)
    assert found <= boundary and boundary - found <= max(1, int(found * 0.05))
    assert len(calls) == len(set(calls)) <= 30  # no size tried twice; logarithmic


def test_largest_when_nothing_or_everything_fits():
    assert largest(lambda n: False, 16, 1000, 0.05) == 0
    assert largest(lambda n: True, 16, 1000, 0.05) == 1000
    assert largest(lambda n: n <= 3, 1, 2, 0.05) == 2  # the limit, not beyond


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU machine gets")
def test_refuses_without_a_gpu_and_says_why():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(["--models", "mlp"])


def test_each_method_runs_with_its_options():
    # What each method passes to dtr.enable (validated as dtr.enable would, short of
    # the CUDA check that measure="allocator" makes at enable() time).
    import argparse

    import dtr.config
    from bench.max_batch import METHODS, _dtr_kwargs

    args = argparse.Namespace(budget_fraction=0.6, device_fraction=0.9)
    cap = 2 * 2**30
    got = {m: _dtr_kwargs(m, cap, args) for m in METHODS}
    assert got["eager"] is None
    assert got["dtr, no budget"] == {"cost_model": "roofline"}
    assert got["dtr, budget"]["budget"] == int(cap * 0.6)
    assert got["dtr, whole device"] == {
        "cost_model": "roofline",
        "budget": int(cap * 0.9),
        "measure": "allocator",
    }
    for kwargs in got.values():
        if kwargs is not None:
            options = {k: v for k, v in kwargs.items() if k != "budget"}
            config = dtr.config.DTRConfig(budget_bytes=kwargs.get("budget"), **options)
            assert config.cost_model == "roofline"
