"""The native engine's dispatch key (dtr/engines/native/key.py, kBackend in csrc/native/engine.cpp):
PrivateUse3, so the engine runs in a process whose PrivateUse1 backend is an accelerator
plug-in's, and refuses to start where something else registered at its key first.
Renaming a backend and registering kernels last as long as the process, so those cases
run in a process of their own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from dtr import engines
from dtr.engines.native import key as native_key
from dtr.engines.native import session as native
from tests.utils import REPO, assert_bitwise_with_remats

pytest.importorskip("dtr._C", reason="the native engine is C++")


def _run(script: str) -> str:
    """`script` in a fresh Python process at the repository's root; its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_managed_tensors_carry_the_key_the_python_side_names():
    from dtr import _C

    assert _C.native_dispatch_key() == native_key.NAME
    with native.enable(stress=True):
        t = torch.randn(3, requires_grad=True).exp()
        keys = torch._C._dispatch_keys(t)
        assert native.is_managed(t) and keys.has(native_key.KEY)
        assert not keys.has(torch._C.DispatchKey.PrivateUse1)
        assert torch._C._dispatch_tls_is_dispatch_key_included(native_key.KEY)
    assert not torch._C._dispatch_tls_is_dispatch_key_included(native_key.KEY)


def test_the_native_engine_runs_beside_a_renamed_privateuse1_backend():
    # An accelerator plug-in renames PrivateUse1 (Ascend's "npu"); the native engine,
    # chosen by engine="auto", trains a small model bitwise as eager under stress.
    out = _run(
        """
        import types
        import torch
        torch.set_num_threads(1)
        torch.utils.rename_privateuse1_backend("emu")
        assert torch._C._get_privateuse1_backend_name() == "emu"
        import dtr
        from dtr import engines
        from tests.utils import assert_bitwise_with_remats

        # no device module yet: torch cannot tell whether an "emu" device is there
        print(engines.choose(False, "dtr")[0])
        emu = types.ModuleType("emu")
        emu.is_available = lambda: False  # the plug-in is installed, its device absent
        emu.device_count = lambda: 0
        torch._register_device_module("emu", emu)
        print(engines.choose(False, "dtr")[0])

        def step():
            model = torch.nn.Sequential(
                torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                torch.nn.GELU(), torch.nn.Linear(32, 4),
            )
            x = torch.randn(8, 16)
            loss = model(x).pow(2).mean()
            loss.backward()
            return [loss.detach()] + [p.grad for p in model.parameters()]

        stats = assert_bitwise_with_remats(step, "native", {"stress": True})
        print(stats.core, stats.remats)
        with dtr.enable() as session:
            pass
        print(session.engine)
        """
    )
    unknown, chosen, stats_line, auto_engine = out.split("\n")[:4]
    assert unknown == "subclass"
    assert chosen == "native" and auto_engine == "native"
    core, remats = stats_line.split()
    assert core == "c++" and int(remats) > 0


def test_the_native_engine_refuses_a_key_something_else_registered_at():
    # A library with kernels at PrivateUse3 in the process: the native engine would take
    # over that backend's tensors (or lose its own to its kernels), so it refuses, and
    # engine="auto" runs the subclass engine.
    out = _run(
        """
        import torch
        lib = torch.library.Library("aten", "IMPL", "PrivateUse3")
        lib.impl("add.Tensor", lambda a, b, alpha=1: a)
        import dtr
        from dtr import engines

        engine, why = engines.choose(False, "dtr")
        print(engine)
        print(why)
        try:
            with dtr.enable(engine="native"):
                pass
        except dtr.UnsupportedError as e:
            print(e)
        with dtr.enable(stress=True) as session:
            x = torch.randn(4, requires_grad=True)
            (x.exp() * 2).sum().backward()
        print(session.engine, torch.equal(x.grad, x.detach().exp() * 2))
        """
    )
    engine, why, refusal, auto = out.split("\n")[:4]
    assert engine == "subclass"
    assert "PrivateUse3" in why and "aten::add.Tensor" in why
    assert refusal.startswith("dtr: the native engine needs the PrivateUse3 dispatch key")
    assert "aten::add.Tensor" in refusal and "engine='subclass'" in refusal
    assert auto == "subclass True"


def test_the_engines_own_registrations_leave_the_key_free():
    # after the engine registered its fallback and kernels, the key is still its own
    with native.enable():
        pass
    assert native_key.taken() is None
    assert engines.choose(False, "dtr")[0] == "native"


# A custom op with a CPU kernel and no autograd kernel, as FSDP's fsdp:: ops are.
_custom = torch.library.Library("dtr_native_key_test", "DEF")
_custom.define("scaled(Tensor x) -> Tensor")
_custom.impl("scaled", lambda x: x * 3, "CPU")


def test_a_custom_op_without_an_autograd_kernel(engine):
    # PyTorch's autograd fallback serves such an op at AutogradCPU; at the native engine's
    # autograd key the engine registers the same one. Its input needs no gradient here
    # (as FSDP calls its ops): what the fallback does for one that needs a gradient is
    # not dtr's to change.
    def step():
        x = torch.randn(6, 5, requires_grad=True)
        y = x.exp()
        z = torch.ops.dtr_native_key_test.scaled(y.detach()).tanh()
        (z * y).sum().backward()
        return [z, x.grad]

    assert_bitwise_with_remats(step, engine, {"stress": True})
