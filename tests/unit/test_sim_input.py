"""The simulator on bad input: every malformed trace or argument is one line on stderr
starting ``dtr: `` (naming the file and line for a trace), an exit status of 1 (a bad
trace) or 2 (a bad argument), never a traceback, the same from every replay core and
from the Python API; and what it prints is strict JSON."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

import dtr.sim as sim
from dtr.errors import ConfigError
from tests.utils import REPO

SHIPPED_GZ = os.path.join(REPO, "bench", "results", "traces", "mlp.jsonl.gz")
CORES = ["c++", "python", "python+c++core"]
START = {"INSTRUCTION": "ANNOTATE", "ANNOTATION": "START"}


def call(name, args, result, memory="8", alias="-1", **fields):
    """A CALL with one result: three records."""
    return [
        {"INSTRUCTION": "CALL", "NAME": name, "ARGS": args, "RESULT": [result], "TIME": "1"}
        | fields,
        {"INSTRUCTION": "MEMORY", "NAME": result, "MEMORY": memory},
        {"INSTRUCTION": "ALIAS", "NAME": result, "ALIAS": alias},
    ]


def lines(*records):
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def cut_gzip(path):
    with open(SHIPPED_GZ, "rb") as f:
        data = f.read()
    path.write_bytes(data[: len(data) // 2])


def without(record, key):
    return {k: v for k, v in record.items() if k != key}


def costly_remats():
    """An op whose cost is near float's largest, recomputed three times (LRU, 16 bytes):
    the total compute overflows, though every cost and their sum are finite."""
    recs = [START, *call("big", [], "a", TIME="1.5e308")]
    for k in range(3):
        recs += call("use", ["a"], f"u{k}")
        recs += call("other", [], f"c{k}") + call("other", [], f"d{k}")
        recs += [{"INSTRUCTION": "RELEASE", "NAME": n} for n in (f"u{k}", f"c{k}", f"d{k}")]
    return lines(*recs)


# name: (contents: text, bytes, or a function of the path that writes it; the line the
# error names, None for the file alone; what the message says; extra CLI arguments)
TRACES = {
    "truncated gzip": (cut_gzip, "any", "gzip stream is cut short", []),
    "binary file": (b"\x00\x01\xff\xfe\x80binary\n", 1, "not UTF-8 text", []),
    "not an object": (lines(START, "[1, 2]"), 2, "must be a JSON object", []),
    "string record": (lines('"CALL"'), 1, "must be a JSON object", []),
    "CALL without ARGS": (
        lines(START, without(call("op", [], "a")[0], "ARGS"), *call("op", [], "a")[1:]),
        2,
        "without its ARGS field",
        [],
    ),
    "CALL without RESULT": (
        lines(START, without(call("op", [], "a")[0], "RESULT")),
        2,
        "without its RESULT field",
        [],
    ),
    "ARGS a string": (lines(START, *call("op", "abc", "a")), 2, "not a list of tensor", []),
    "NAME not a string": (
        lines(START, {"INSTRUCTION": "RELEASE", "NAME": ["x"]}, *call("op", [], "a")),
        2,
        "not a tensor name",
        [],
    ),
    "MEMORY nan": (lines(START, *call("op", [], "a", memory="nan")), 3, "MEMORY 'nan'", []),
    "MEMORY beyond int64": (
        lines(START, *call("op", [], "a", memory=str(2**63))),
        3,
        f"MEMORY '{2**63}'",
        [],
    ),
    "MEMORY 5000 digits": (
        lines(START, *call("op", [], "a", memory="9" * 5000)),
        3,
        "MEMORY '999",
        [],
    ),
    "MEMORY negative": (lines(START, *call("op", [], "a", memory="-8")), 3, "MEMORY '-8'", []),
    "MEMORY a float": (lines(START, *call("op", [], "a", memory=8.5)), 3, "MEMORY 8.5", []),
    "constant MEMORY negative": (
        lines(
            START,
            {"INSTRUCTION": "CONSTANT", "NAME": "w"},
            {"INSTRUCTION": "MEMORY", "NAME": "w", "MEMORY": "-1"},
            *call("op", ["w"], "a"),
        ),
        3,
        "MEMORY '-1'",
        [],
    ),
    "sizes add up beyond int64": (
        lines(
            START,
            *call("op", [], "a", memory=str(2**62)),
            *call("op", [], "b", memory=str(2**62)),
        ),
        6,
        "add up beyond",
        [],
    ),
    "RESERVE beyond int64": (
        lines(START, {"INSTRUCTION": "INPUTS", "ARGS": [], "RESERVE": str(2**64)}),
        2,
        "RESERVE",
        [],
    ),
    "ALIAS not an int": (lines(START, *call("op", [], "a", alias="x")), 4, "ALIAS 'x'", []),
    "ALIAS below -1": (lines(START, *call("op", [], "a", alias="-2")), 4, "ALIAS '-2'", []),
    "COST negative": (lines(START, *call("op", [], "a", COST="-1.0")), 2, "COST '-1.0'", []),
    "TIME negative": (lines(START, *call("op", [], "a", TIME="-5")), 2, "TIME '-5'", []),
    "COST inf": (lines(START, *call("op", [], "a", COST="inf")), 2, "COST 'inf'", []),
    "COST nan": (lines(START, *call("op", [], "a", COST="nan")), 2, "COST 'nan'", []),
    "COST a JSON NaN": (
        lines(
            START,
            json.dumps(call("op", [], "a")[0] | {"COST": math.nan}),
            *call("op", [], "a")[1:],
        ),
        2,
        "COST nan",
        [],
    ),
    "costs add up to inf": (
        lines(START, *call("op", [], "a", TIME="1e308"), *call("op", [], "b", TIME="1e308")),
        None,
        "costs add up beyond",
        [],
    ),
    "recomputation overflows": (
        costly_remats(),
        None,
        "overflows a float",
        ["--heuristic", "lru", "--budget", "16", "--thrash", "0"],
    ),
    "MUTATE position out of range": (
        lines(
            START,
            *call("op", [], "a"),
            {"INSTRUCTION": "MUTATE", "NAME": "relu_", "ARGS": ["a"], "MUTATE": [3], "TIME": "1"},
        ),
        5,
        "MUTATE [3]",
        [],
    ),
    "START setting not an int": (
        lines(START | {"DTR": "1", "SEARCH_SAMPLE": "²"}, *call("op", [], "a")),
        1,
        "SEARCH_SAMPLE '²'",
        [],
    ),
    "START heuristic unknown": (
        lines(START | {"DTR": "1", "HEURISTIC": "nope"}, *call("op", [], "a")),
        1,
        "HEURISTIC 'nope'",
        [],
    ),
    "BUDGET beyond int64": (
        lines(
            START,
            {"INSTRUCTION": "ANNOTATE", "ANNOTATION": "BUDGET", "BUDGET": str(2**63)},
            *call("op", [], "a"),
        ),
        2,
        "BUDGET",
        [],
    ),
    "nested thousands deep": (
        '{"INSTRUCTION": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
        1,
        "nested too deeply",
        [],
    ),
    "a directory": (None, None, "a directory, not a trace file", []),
    "empty file": ("", None, "the trace has no operations", []),
    "START only": (lines(START), None, "the trace has no operations", []),
}


def write(tmp_path, name) -> str:
    contents = TRACES[name][0]
    path = tmp_path / ("trace.jsonl.gz" if name == "truncated gzip" else "trace.jsonl")
    if contents is None:
        path.mkdir()
    elif callable(contents):
        contents(path)
    elif isinstance(contents, bytes):
        path.write_bytes(contents)
    else:
        path.write_text(contents, encoding="utf-8")
    return str(path)


def where(path: str, line) -> str:
    """The start of the message: "dtr: FILE:LINE: " (a pattern where any line will do)."""
    if line is None:
        return f"dtr: {path}: "
    return f"dtr: {path}:{line}: "


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "dtr.sim", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def main(capsys, *args):
    """python -m dtr.sim in this process (every core without a process each): (exit
    status, stdout, stderr)."""
    from dtr.sim.__main__ import main as sim_main

    try:
        status = sim_main(list(args))
    except SystemExit as exc:  # argparse's exit
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


def outcome(process):
    return process.returncode, process.stdout, process.stderr


def assert_one_dtr_line(out, status):
    assert out.returncode == status, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("dtr: "), out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stdout == ""


def assert_names_place(message: str, path: str, line) -> None:
    if line == "any":
        prefix, rest = f"dtr: {path}:", message[len(f"dtr: {path}:") :]
        assert message.startswith(prefix) and rest.split(":")[0].isdigit(), message
    else:
        assert message.startswith(where(path, line)), message


@pytest.mark.parametrize("name", list(TRACES))
def test_bad_trace_is_one_line_naming_file_and_line(tmp_path, capsys, name):
    _, line, says, extra = TRACES[name]
    path = write(tmp_path, name)
    out = cli(path, *extra)
    assert_one_dtr_line(out, 1)
    assert_names_place(out.stderr, path, line)
    assert says in out.stderr, out.stderr
    for core in CORES:
        assert main(capsys, path, "--core", core, *extra) == outcome(out)


@pytest.mark.parametrize("name", [n for n, case in TRACES.items() if not case[3]])
def test_load_raises_the_clis_error(tmp_path, capsys, name):
    path = write(tmp_path, name)
    with pytest.raises(sim.TraceError) as info:
        sim.load(path)
    assert main(capsys, path) == (1, "", str(info.value) + "\n")


@pytest.fixture
def good_trace(tmp_path):
    path = tmp_path / "good.jsonl"
    path.write_text(lines(START, *call("op", [], "a"), *call("op", ["a"], "b")))
    return str(path)


ARGUMENTS = [
    ("--budget-ratio", "inf"),
    ("--budget-ratio", "nan"),
    ("--budget-ratio", "0"),
    ("--budget-ratio", "-0.5"),
    ("--budget-ratio", "x"),
    ("--sample", str(2**63)),
    ("--thrash", "nan"),
    ("--thrash", "inf"),
    ("--thrash", "-1"),
]


@pytest.mark.parametrize("option, value", ARGUMENTS)
def test_bad_argument_is_one_line_naming_the_option(good_trace, capsys, option, value):
    out = cli(good_trace, option, value)
    assert_one_dtr_line(out, 2)
    assert f"argument {option}: " in out.stderr and value in out.stderr, out.stderr
    for core in CORES:
        assert main(capsys, good_trace, "--core", core, option, value) == outcome(out)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize(
    "options",
    [
        dict(ratio=math.inf),
        dict(ratio=1e300),  # a budget beyond int64
        dict(thrash=math.nan),
        dict(thrash=-1.0),
        dict(sample=2**63),
        dict(sample=-1),
        dict(seed=2**64),
        dict(min_evict_bytes=2**63),
        dict(budget=2**63),
        dict(budget=-2),
    ],
)
def test_simulate_refuses_bad_options(good_trace, options, core):
    prog = sim.load(good_trace)
    with pytest.raises(ConfigError, match="^dtr: "):
        sim.simulate(prog, "dtr", core=core, **options)
