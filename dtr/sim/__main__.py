"""python -m dtr.sim TRACE [--heuristic H] [--budget-ratio R | --budget BYTES] [--sweep]

Replays an operator trace (dtr's own, or the DTR prototype's, gzip or plain) and prints
one JSON object per result; the last line is the result asked for. TRACE is a path, or the
start of a file name in --traces (default: the prototype's published traces), e.g.
``python -m dtr.sim resnet32 --budget-ratio 0.3``.

Exit status: 0; 1 for a trace that is not valid (one line on stderr: ``dtr: FILE:LINE:
what is wrong``); 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from ..config import parse_budget
from ..errors import DTRError
from . import (
    DEFAULT_HEURISTIC,
    HEURISTICS,
    PROTOTYPE_DIR,
    SWEEP_RATIOS,
    TraceError,
    check_int,
    check_ratio,
    check_thrash,
    load,
    program,
    recorded_heuristic,
    simulate,
)


def find_trace(name: str, traces: str) -> str:
    if os.path.exists(name):
        return name
    matches = sorted(glob.glob(os.path.join(traces, name + "*")))
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise DTRError(
            f"dtr: no trace {name!r}: not a file, and nothing in {traces} starts with it"
        )
    raise DTRError(
        f"dtr: {name!r} matches several traces in {traces}: "
        + ", ".join(os.path.basename(m) for m in matches)
    )


def _row(trace: str, heuristic: str, ratio, res) -> str:
    """The result as one line of JSON (strict: NaN and infinities are not JSON)."""
    out = {"trace": os.path.basename(trace), "heuristic": heuristic, "budget_ratio": ratio}
    out.update(res.as_dict())
    try:
        return json.dumps(out, allow_nan=False)
    except ValueError:
        raise TraceError(
            f"dtr: {trace}: the replay's compute overflows a float (the trace's costs are "
            "too large)"
        ) from None


def _argument(check, convert):
    """An argparse type= function: convert the text, then check the value; a value
    either refuses is an argparse error (exit status 2) with check's message."""

    def parse(text: str):
        try:
            return check(convert(text))
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        except DTRError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("dtr: ")) from None

    return parse


class _Parser(argparse.ArgumentParser):
    """Usage errors as dtr's other errors read: one line starting "dtr: "."""

    def error(self, message: str):
        self.exit(2, f"dtr: {message} (python -m dtr.sim --help for usage)\n")


def main(argv=None) -> int:
    parser = _Parser(prog="python -m dtr.sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="trace file, or the start of a name in --traces")
    parser.add_argument("--traces", default=PROTOTYPE_DIR, help="folder of named traces")
    parser.add_argument(
        "--heuristic",
        default=None,
        choices=HEURISTICS,
        help="default: the one the trace was recorded with, else " + DEFAULT_HEURISTIC,
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--budget-ratio",
        type=_argument(check_ratio, float),
        default=None,
        help="fraction of the unconstrained replay's peak",
    )
    group.add_argument("--budget", default=None, help="bytes, e.g. 4GiB")
    parser.add_argument(
        "--sweep", action="store_true", help="every heuristic at ratios 1.0 .. 0.05 (one line each)"
    )
    parser.add_argument(
        "--mode",
        choices=["auto", "prototype", "live"],
        default="auto",
        help="replay semantics (auto: live for traces dtr wrote)",
    )
    parser.add_argument("--stress", action="store_true")
    parser.add_argument(
        "--thrash",
        type=_argument(check_thrash, float),
        default=2.0,
        help="stop when total compute exceeds this x the baseline (0: never)",
    )
    parser.add_argument(
        "--core",
        choices=["c++", "python", "python+c++core"],
        default="c++",
        help="c++: the compiled replay loop on the C++ core; python: the Python replay on "
        "the pure-Python core; python+c++core: the Python replay on the C++ core",
    )
    parser.add_argument(
        "--sample",
        type=_argument(lambda n: check_int("sample", n), int),
        default=None,
        help="victim search: best of N sampled candidates when more are evictable (0: exact; "
        "default: as the trace was recorded, exact for the prototype's traces)",
    )
    args = parser.parse_args(argv)
    try:
        path = find_trace(args.trace, args.traces)
        mode = {"auto": None, "prototype": program.PROTOTYPE, "live": program.LIVE}[args.mode]
        prog = load(path, mode)
        common = dict(
            stress=args.stress, thrash=args.thrash, core=args.core, sample=args.sample
        )
        if args.sweep:
            for heuristic in HEURISTICS:
                for ratio in SWEEP_RATIOS:
                    res = simulate(prog, heuristic, ratio=ratio, **common)
                    print(_row(path, heuristic, ratio, res), flush=True)
            return 0
        heuristic = args.heuristic or recorded_heuristic(prog)
        if args.budget is not None:
            budget = parse_budget(args.budget, "--budget")
            res = simulate(prog, heuristic, budget=budget, **common)
            ratio = None
        else:
            ratio = 1.0 if args.budget_ratio is None else args.budget_ratio
            res = simulate(prog, heuristic, ratio=ratio, **common)
        print(_row(path, heuristic, ratio, res))
        return 0
    except TraceError as exc:  # the trace is bad
        print(str(exc), file=sys.stderr)
        return 1
    except DTRError as exc:  # an argument is
        print(str(exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
