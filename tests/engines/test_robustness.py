"""Crashes, hangs and unclear errors at the edges of a session: an interrupt while a
block is being entered, tensor memory handed out by storage, `set_` onto a managed
value, `torch.utils.swap_tensors` on tensors made in the block, managed tensors sent to
another process, and plain tensors built from managed scalars. Each result is compared
with eager PyTorch bitwise, on both engines; cases that could hang run with a timeout.
"""

from __future__ import annotations

import linecache
import sys
import time

import pytest
import torch
from torch.utils import _python_dispatch

import dtr
from dtr import session
from dtr.engines.native import key as native_key
from dtr.engines.native import session as native_session


def _chain(x: torch.Tensor) -> list[torch.Tensor]:
    h = torch.tanh(x * 2 + 1)
    out = (h * h).sum()
    out.backward()
    return [out.detach(), x.grad.clone()]


def _eager_chain() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return _chain(torch.randn(8, requires_grad=True))


# ====================================================================== interrupted entry


def _entry_files(engine: str) -> set[str]:
    """The source files whose every line an interrupt may land before, while a session
    of `engine` is entered."""
    from dtr import dlpack
    from dtr.engines.native import undispatched_reads as native_reads
    from dtr.engines.subclass import runtime
    from dtr.engines.subclass import session as subclass_session
    from dtr.engines.subclass import undispatched_reads as subclass_reads

    if engine == "native":
        modules = (native_session, native_reads, dlpack)
    else:
        modules = (subclass_session, runtime, subclass_reads, dlpack, _python_dispatch)
    return {m.__file__ for m in modules}


def _enter_interrupted_at(engine: str, line: int) -> bool:
    """Enters a session, raising KeyboardInterrupt before the line-th line run in its
    entry code; whether the interrupt landed (else the block ran to its end)."""
    files = _entry_files(engine)
    seen = 0
    withs = set()

    def local(frame, event, arg):
        nonlocal seen
        if event != "line":
            return local
        # The tracer stops where no signal handler runs (the interpreter checks for
        # signals at calls and backward jumps): on a `try:` line, a `return name` line,
        # and a `with` line seen again before its __exit__ is called. An exception raised
        # there skips the block's cleanup (a `with lock:` stays locked), which no signal
        # can do.
        where = (frame, frame.f_lineno)
        text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if (
            text == "try:"
            or (text.startswith("return ") and text[len("return ") :].isidentifier())
            or (text.startswith("with ") and where in withs)
        ):
            return local
        if text.startswith("with "):
            withs.add(where)
        seen += 1
        if seen == line:
            raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename in files else None

    s = dtr.enable(engine=engine, stress=True, cost_model="roofline")
    sys.settrace(tracer)
    try:
        with s:
            sys.settrace(None)
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def _process_state() -> tuple:
    """What a session changes in the process while it is open."""
    return (
        session.current(),
        dict(vars(torch.Tensor)),
        torch.utils.swap_tensors,
        torch._C._len_torch_dispatch_stack(),
        torch._C._dispatch_tls_is_dispatch_key_included(native_key.KEY),
        _python_dispatch._is_in_torch_dispatch_mode,
        _python_dispatch._is_in_non_infra_torch_dispatch_mode,
        torch._dynamo.eval_frame._stance.stance,
    )


def test_an_interrupt_anywhere_in_entry_leaves_no_session_behind(engine):
    # Ctrl-C (or a signal handler's exception) while `with dtr.enable():` is being entered:
    # whatever entry had installed is undone, so the process is as before and the next
    # dtr.enable() runs (a half-open native session refused every later one as nested).
    want = _eager_chain()
    # The first session of the process replaces some torch.Tensor methods for the life
    # of the process (dtr/plain_exports.py): the state compared is the one after it.
    with dtr.enable(engine=engine):
        pass
    before = _process_state()
    line = 0
    while True:
        line += 1
        landed = _enter_interrupted_at(engine, line)
        assert _process_state() == before, f"interrupted before line {line} of entry"
        with dtr.enable(engine=engine, stress=True, cost_model="roofline") as s:
            torch.manual_seed(0)
            got = _chain(torch.randn(8, requires_grad=True))
        assert s.stats().remats > 0
        for a, b in zip(got, want, strict=True):
            assert torch.equal(dtr.materialize(a), b)
        if not landed:
            break
    assert line > 10  # every line of entry was tried


# ====================================================================== untyped_storage


def test_untyped_storage_of_an_evicted_value_is_its_value(engine):
    # untyped_storage() hands out the value's memory: the value is rebuilt and pinned (as
    # data_ptr() and numpy() pin it), and the storage is the tensor's own, as in eager.
    torch.manual_seed(0)
    x = torch.randn(6, requires_grad=True)
    want = (x * 2).detach()
    with dtr.enable(engine=engine, stress=True, cost_model="roofline") as s:
        y = x * 2
        z = torch.tanh(y + 1)  # y is evicted after this op
        assert s.stats().evictions > 0
        storage = y.untyped_storage()
        assert storage.data_ptr() == y.data_ptr()
        assert bytes(storage) == bytes(want.untyped_storage())
        for _ in range(3):
            z = torch.tanh(z + 1)  # more evictions: y's memory is never freed under storage
        assert bytes(storage) == bytes(want.untyped_storage())
        assert storage.data_ptr() == y.data_ptr()


# ====================================================================== set_


@pytest.mark.parametrize("form", ["plain-onto-managed", "managed-onto-plain"])
def test_set_with_a_managed_tensor_is_refused(engine, form):
    # A plain tensor set_ onto a managed value's storage would read it freed once the
    # value is evicted or dropped; a managed tensor set_ onto another storage would lose
    # its lineage. Both engines refuse either with the same error.
    torch.manual_seed(0)
    x = torch.randn(6, requires_grad=True)
    with dtr.enable(engine=engine, stress=True, cost_model="roofline"):
        a = (x * 2).detach()
        plain = torch.zeros(6)
        with pytest.raises(dtr.UnsupportedError, match=r"^dtr: aten\.set_.*replaces the storage"):
            if form == "plain-onto-managed":
                plain.set_(a)
            else:
                a.set_(plain)
        assert torch.equal(plain, torch.zeros(6))
        assert torch.equal(dtr.materialize(a), (x * 2).detach())


# ====================================================================== torch.tensor of scalars


def _tensors_of_scalars(x: torch.Tensor) -> list[torch.Tensor]:
    # losses and counts as 0-dim tensors, gathered with torch.tensor / torch.as_tensor
    a, b = (x * 2).sum(), torch.tanh(x).mean()
    c, d = (x * 3).amax(), (x - 1).square().sum()
    n = (x > 0).sum()
    return [
        torch.tensor([a, b]),
        torch.tensor([[a, b], [c, d]]),
        torch.as_tensor([a, b]),
        torch.tensor([n, n + 1]),
        torch.tensor([a > 0, b < 0]),
        torch.tensor([a.double(), b]),
    ]


def test_torch_tensor_of_managed_scalars(engine):
    # torch.tensor reads each element through Python's number protocol with dispatch
    # modes excluded: on the subclass engine PyTorch's __float__ then read the wrapper's
    # memory ("data is not allocated yet").
    torch.manual_seed(0)
    x = torch.randn(16, requires_grad=True)
    want = _tensors_of_scalars(x)
    with dtr.enable(engine=engine, stress=True, cost_model="roofline") as s:
        got = _tensors_of_scalars(x)
    assert s.stats().evictions > 0
    for g, w in zip(got, want, strict=True):
        assert type(g) is torch.Tensor and g.dtype == w.dtype and torch.equal(g, w)


# ====================================================================== swap_tensors


def _swap_program() -> list[torch.Tensor]:
    # tensors made by zeros/ones/full in the block, swapped; a module built in the block
    # (LayerNorm fills its parameters with ones and zeros) converted with its parameters
    # swapped for the converted ones, as torch.__future__'s switch asks of Module._apply
    torch.manual_seed(0)
    a, b = torch.zeros(4), torch.full((4,), 2.0)
    torch.utils.swap_tensors(a, b)
    norm = torch.nn.LayerNorm(4)
    head = torch.nn.Linear(4, 2)
    torch.nn.init.ones_(head.bias)
    old_weight = norm.weight
    norm.double()
    head.double()
    assert norm.weight is old_weight  # the same Parameter object, with a new TensorImpl
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = head(torch.tanh(norm(x * a.double() + b.double()))).square().sum()
    out.backward()
    return [a, b, out.detach(), x.grad, norm.weight.grad, head.bias.grad, head.weight]


def test_swap_tensors_on_tensors_made_in_the_block(engine):
    # dtr remembers plain tensors made by zeros/ones/full (a fill, on the native engine),
    # which a recipe may make again instead of holding; a weak reference to such a tensor
    # made torch.utils.swap_tensors refuse it.
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        want = _swap_program()
        with dtr.enable(engine=engine, stress=True, cost_model="roofline") as s:
            got = _swap_program()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    assert s.stats().remats > 0
    for g, w in zip(got, want, strict=True):
        assert torch.equal(dtr.materialize(g), w)


# ====================================================================== torch.multiprocessing


def _child_reads(arg, q_in, q_out):
    # (bytes back, not tensors: a tensor sent back lives in this process's shared memory,
    # which goes when the process ends)
    got = q_in.get(timeout=60)
    q_out.put((bytes(arg.numpy()), bytes(got.detach().numpy()), got.requires_grad))


def _child_sees_writes(q_in, q_out):
    t = q_in.get(timeout=60)
    q_out.put("received")
    if q_in.get(timeout=60) == "written":
        q_out.put(bytes(t.numpy()))


def _answer(q, child, timeout=120.0):
    """The child's next answer on q. A child that died without one (it could not
    unpickle what it was sent) fails at once; a child that hangs, after timeout."""
    import queue

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            if not child.is_alive():
                try:  # an answer put just before it exited
                    return q.get(timeout=1)
                except queue.Empty:
                    pytest.fail(f"the child exited (code {child.exitcode}) without answering")
    pytest.fail(f"the child did not answer in {timeout:.0f} s")


def _end(child):
    child.join(timeout=30)
    if child.is_alive():
        child.kill()


def test_managed_tensors_sent_to_another_process(engine):
    # torch.multiprocessing's reductions move a tensor's storage to shared memory and
    # send that: the pinned value's (recomputed if evicted, also from a Queue's feeder
    # thread), shared as in eager and alive as long as the tensor (a spawned Process gets
    # its descriptors only after its arguments are pickled).
    import torch.multiprocessing as mp

    torch.manual_seed(0)
    x = torch.randn(64, requires_grad=True)
    want_y = bytes((x * 2).detach().numpy())
    want_z = bytes(torch.tanh(x * 2 + 1).detach().numpy())
    want_w = bytes(x.detach().numpy())
    ctx = mp.get_context("spawn")
    with dtr.enable(engine=engine, stress=True, cost_model="roofline") as s:
        y = (x * 2).detach()  # managed (what it reads requires grad); sent without grad
        z = torch.tanh(y + 1)
        torch.sigmoid(z)  # y and z are evicted
        w = torch.empty(64).copy_(x.detach()).requires_grad_()  # a managed leaf
        assert s.stats().evictions >= 2
        q_in, q_out = ctx.Queue(), ctx.Queue()

        def send(queued):  # y as the Process's argument, `queued` through the Queue
            child = ctx.Process(target=_child_reads, args=(y, q_in, q_out), daemon=True)
            child.start()
            try:
                q_in.put(queued)
                return _answer(q_out, child)
            finally:
                _end(child)

        got_z = send(z)
        got_w = send(w)  # a leaf that requires grad arrives requiring grad, as in eager
        assert s.stats().remats > 0
    assert got_z == (want_y, want_z, False)
    assert got_w == (want_y, want_w, True)


def test_write_after_sending_reaches_the_other_process(engine):
    # Eager's receiver maps the sender's memory: an in-place write after sending shows
    # there. A Queue sends from a feeder thread, outside dtr's mode on the subclass engine.
    import torch.multiprocessing as mp

    torch.manual_seed(0)
    x = torch.randn(64, requires_grad=True)
    want = bytes(((x * 2) * 3).detach().numpy())
    ctx = mp.get_context("spawn")
    with dtr.enable(engine=engine, stress=True, cost_model="roofline") as s:
        y = (x * 2).detach()
        torch.sigmoid(y + 1)  # y is evicted
        assert s.stats().evictions >= 1
        q_in, q_out = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=_child_sees_writes, args=(q_in, q_out), daemon=True)
        child.start()
        try:
            q_in.put(y)
            assert _answer(q_out, child) == "received"
            y.mul_(3)
            q_in.put("written")
            got = _answer(q_out, child)
        finally:
            _end(child)
    assert got == want


def test_sending_a_non_leaf_that_requires_grad_is_refused_as_in_eager(engine):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    x = torch.randn(8, requires_grad=True)
    with pytest.raises(RuntimeError, match="Cowardly refusing to serialize non-leaf") as eager:
        ctx.Process(target=print, args=(x * 2,), daemon=True).start()
    with dtr.enable(engine=engine, stress=True, cost_model="roofline"):
        h = x * 2
        child = ctx.Process(target=print, args=(h,), daemon=True)
        with pytest.raises(RuntimeError) as managed:
            child.start()
    assert str(managed.value) == str(eager.value)
