"""The exceptions dtr raises. Every message starts with ``dtr:`` and says what to do."""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from .units import format_bytes

_last = threading.local()


class DTRError(RuntimeError):
    """Base class of every error raised by dtr."""


def note_raised(exc: BaseException) -> None:
    """Called with every exception that leaves dtr's dispatch mode on this thread (a
    dtr error, or a kernel's own), for from_torchscript(). Only its type and arguments
    are kept: the exception's traceback holds the frames of the code that failed, and
    with them the program's tensors (a BudgetError caught in the block kept them
    resident and unevictable)."""
    _last.raised = (type(exc), exc.args)
    _last.count = getattr(_last, "count", 0) + 1


def raised_count() -> int:
    """How many exceptions have left dtr's dispatch mode on this thread (a session notes
    it when it starts)."""
    return getattr(_last, "count", 0)


def from_torchscript(exc: BaseException | None, since: int):
    """The error behind exc, if exc is TorchScript's report of an op that failed in
    dtr's dispatch mode; else None.

    An error raised inside a scripted module (torch.jit.script or trace) reaches the
    program as the interpreter's RuntimeError ("The following operation failed in the
    TorchScript interpreter"), whose last line is the op's own error. For the default
    engine's ops that line is empty ("RuntimeError: "): the interpreter cannot read an
    error raised in Python below it, so a BudgetError, or a kernel's shape error, read
    as nothing at all; it is the last exception that left the mode on this thread,
    made again from its type and arguments, if one did after since (a raised_count()).
    The native engine's errors keep their message but reach the program as a plain
    RuntimeError; a budget's becomes a BudgetError again. A session that ends with such
    an error raises this one instead, from it."""
    if type(exc) is not RuntimeError:
        return None
    msg = str(exc)
    if "TorchScript interpreter" not in msg:
        return None
    text = msg.rstrip().rsplit("\n", 1)[-1].split("RuntimeError:", 1)[-1].strip()
    if not text and raised_count() > since:
        cls, args = _last.raised
        try:
            return cls(*args)
        except Exception:  # an exception type that cannot be made from its args alone
            return RuntimeError(*args)
    if text.startswith(BudgetError.PREFIX):
        return BudgetError(text)
    return None


class ConfigError(DTRError, ValueError):
    """A budget, heuristic, option or environment variable that dtr cannot accept."""


class BudgetError(DTRError, torch.OutOfMemoryError):
    """The memory budget cannot be met: everything that could be evicted has been.

    A subclass of ``torch.OutOfMemoryError``, so code that already handles running out of
    memory handles this too.
    """

    PREFIX = "dtr: cannot stay within the memory budget"  # how each engine's message starts


def is_budget_error(exc: BaseException | None) -> bool:
    """exc is a BudgetError, or one that reached the program as another type (the
    native engine's, through autograd's engine or TorchScript: a RuntimeError with its
    message)."""
    if isinstance(exc, BudgetError):
        return True
    return isinstance(exc, RuntimeError) and BudgetError.PREFIX in str(exc)


class Floor(NamedTuple):
    """The op-level floor a core has seen (Core::note_need): no budget below nbytes can
    run the program, whose op `op` needs `need` bytes at once on top of the constants;
    in_step: it was seen in the step being run; free_peak: the most a step that evicted
    nothing had resident (-1: none closed)."""

    nbytes: int = 0
    need: int = 0
    op: str = ""
    in_step: bool = False
    free_peak: int = -1


def floor_of(core) -> Floor:
    """The floor a core (csrc/core/core.cpp's or dtr.core.reference's) has seen so far."""
    return Floor(
        core.op_floor_bytes,
        core.floor_need_bytes,
        core.floor_op,
        core.floor_step == core.step,
        core.free_peak_bytes,
    )


def budget_advice(
    budget: int, constants: int, what: str, requested: int, floor: Floor = Floor()
) -> str:
    """The end of a BudgetError's message, both engines': what the constants (parameters
    and inputs, never evictable) take, what the op that did not fit needed, the op-level
    floor (no budget below it can work) and the peak of a step without eviction when one
    is known, and advice that fits: below the constants no budget works and a smaller
    batch would not shrink the parameters; below the floor the budget must reach it;
    above it a schedule may exist nearer the peak."""
    text = (
        f" The parameters and inputs (constants) take {format_bytes(constants)}; {what} "
        f"needed {format_bytes(requested)}."
    )
    if floor.nbytes > 0:
        span = "this step" if floor.in_step else "the steps so far"
        text += (
            f" No budget below {format_bytes(floor.nbytes)} can run {span} ({floor.op} "
            f"needs {format_bytes(floor.need)} at once on top of the constants)."
        )
    if floor.free_peak >= 0:
        text += f" A step that evicted nothing peaked at {format_bytes(floor.free_peak)}."
    if constants >= budget:
        least = max(constants + requested, floor.nbytes)
        return (
            f"{text} The parameters and inputs alone take {constants} bytes: a budget below "
            f"that cannot work; give at least {least} ({format_bytes(least)})."
        )
    if floor.nbytes > budget:
        return (
            f"{text} Raise the budget to at least {floor.nbytes} bytes "
            f"({format_bytes(floor.nbytes)}), or reduce the batch size."
        )
    if floor.free_peak > budget:
        return (
            f"{text} Raise the budget toward {format_bytes(floor.free_peak)} (where nothing "
            "is evicted), or reduce the batch size."
        )
    return f"{text} Raise the budget or reduce the batch size."


def no_autograd_message(name: str) -> str:
    """Both engines' refusal of an op with no autograd kernel (dtr/schema.py's
    lacks_autograd) whose input requires grad."""
    return (
        f"dtr: {name} has no autograd kernel and an input requires grad: eager PyTorch "
        "warns and records the ops its kernel calls, which dtr cannot see (it runs the op "
        "as one), so the gradient would be lost. Register its backward "
        "(torch.library.register_autograd), or define it with torch.library.custom_op"
    )


class UnsupportedError(DTRError, NotImplementedError):
    """An operation dtr does not support on managed tensors (the message says which)."""


class InternalError(DTRError):
    """A broken invariant inside dtr; please report it with the message."""
