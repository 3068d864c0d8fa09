"""Reads an operator trace (ours or the DTR prototype's, gzip or plain) into a Program.
The format is described in ``dtr/engines/subclass/trace.py``."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import zlib

import numpy as np

from ..core.reference import FOLLOW, HEURISTICS, NEW, VERSION, VIEW
from ..errors import DTRError
from . import program as P


class TraceError(DTRError, ValueError):
    """A trace file dtr cannot read (the message gives the file and line)."""


INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1
# a decimal int; 20 digits hold any int64 or uint64 (and int() refuses very long strings)
_INT = re.compile(r"-?[0-9]{1,20}")
# START's settings a replay reads, and the largest each may be (the C++ core's types)
_SETTINGS = {"SEARCH_SAMPLE": INT64_MAX, "SEED": UINT64_MAX, "MIN_EVICT_BYTES": INT64_MAX}


def _short(value) -> str:
    """repr(value), cut short: a malformed record may hold anything."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _lines(path: str):
    """The file's lines as bytes (gzip or plain), so that a decoding error names its line."""
    with open(path, "rb") as f:
        magic = f.read(2)
    opener = gzip.open if magic == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        yield from f


def _records(path: str) -> list[tuple[int, dict]]:
    """(line number, record) for each non-blank line; any file that is not a readable
    sequence of JSON objects is a TraceError naming the file and, where it has one, the
    line."""
    if os.path.isdir(path):
        raise TraceError(f"dtr: {path}: a directory, not a trace file")
    if not os.path.exists(path):
        raise TraceError(f"dtr: no trace file at {path!r}")
    records, number = [], 0

    def fail(msg: str):
        raise TraceError(f"dtr: {path}:{number}: {msg}") from None

    try:
        for number, raw in enumerate(_lines(path), 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                fail("not UTF-8 text (a binary file?)")
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                fail(f"not JSON ({exc})")
            except RecursionError:
                fail("JSON nested too deeply for a trace record")
            if not isinstance(record, dict):
                fail(f"a record must be a JSON object, got {_short(record)}")
            records.append((number, record))
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        number += 1
        fail(f"the gzip stream is cut short or corrupt ({exc})")
    except OSError as exc:
        raise TraceError(f"dtr: {path}: cannot read it ({exc.strerror or exc})") from None
    return records


def _check_settings(path: str, number: int, meta: dict) -> None:
    """The run's settings in a START line, which a replay uses: each a known value."""

    def fail(msg: str):
        raise TraceError(f"dtr: {path}:{number}: {msg}")

    if "HEURISTIC" in meta and meta["HEURISTIC"] not in HEURISTICS:
        fail(f"HEURISTIC {_short(meta['HEURISTIC'])} is not one of {', '.join(HEURISTICS)}")
    for name, high in _SETTINGS.items():
        if name in meta and integer_value(meta[name], 0, high) is None:
            fail(f"{name} {_short(meta[name])} is not an int in [0, {high}]")
    if "BUDGET" in meta and integer_value(meta["BUDGET"], -1, INT64_MAX) is None:
        fail(f"BUDGET {_short(meta['BUDGET'])} is not a byte count or -1")


def integer_value(value, low: int, high: int) -> int | None:
    """value (an int, or a string of decimal digits) if it is an int in [low, high]."""
    if isinstance(value, str) and _INT.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        return None
    return value


def load(path: str, mode: int | None = None) -> P.Program:
    """Compile the trace at path. mode: program.PROTOTYPE or LIVE; by default LIVE for
    traces dtr wrote (their START line has a DTR key), PROTOTYPE otherwise. A file that
    is not a valid trace raises TraceError."""
    records = _records(path)
    starts = [
        i
        for i, (_, r) in enumerate(records)
        if r.get("INSTRUCTION") == "ANNOTATE" and r.get("ANNOTATION") == "START"
    ]
    meta = dict(records[starts[0]][1]) if starts else {}
    if starts:  # the prototype's traces may hold a warm-up before START
        _check_settings(path, records[starts[0]][0], meta)
        records = records[starts[0] + 1 :]
    if mode is None:
        mode = P.LIVE if "DTR" in meta else P.PROTOTYPE
    return _Compiler(path, mode).compile(records, meta)


class _Compiler:
    def __init__(self, path: str, mode: int):
        self.path = path
        self.mode = mode
        self.slots: dict[str, int] = {}
        self.nslots = 0
        self.code: list[int] = []
        self.budget_at: list[int] = []  # where the code has a BUDGET instruction
        self.costs: list[float] = []
        self.ops = 0
        # Every byte count the replay adds up (constants, fresh results, reservations),
        # kept within int64 so that no sum the cores make can overflow.
        self.total_bytes = 0

    def fail(self, number: int, msg: str):
        raise TraceError(f"dtr: {self.path}:{number}: {msg}")

    # ------------------------------------------------------------------ fields
    def field(self, number: int, r: dict, key: str):
        if key not in r:
            self.fail(number, f"{r.get('INSTRUCTION')} line without its {key} field")
        return r[key]

    def name(self, number: int, r: dict, key: str) -> str:
        value = self.field(number, r, key)
        if not isinstance(value, str):
            self.fail(number, f"{key} {_short(value)} is not a tensor name (a string)")
        return value

    def names(self, number: int, r: dict, key: str, default=None) -> list[str]:
        value = self.field(number, r, key) if default is None else r.get(key, default)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.fail(number, f"{key} {_short(value)} is not a list of tensor names (strings)")
        return value

    def integer(self, number: int, r: dict, key: str, low: int, high: int = INT64_MAX) -> int:
        value = integer_value(self.field(number, r, key), low, high)
        if value is None:
            self.fail(number, f"{key} {_short(r[key])} is not an int in [{low}, {high}]")
        return value

    def nbytes(self, number: int, r: dict, key: str) -> int:
        """A byte count the replay allocates (or reserves)."""
        value = self.integer(number, r, key, 0)
        self.total_bytes += value
        if self.total_bytes > INT64_MAX:
            self.fail(number, f"the trace's byte counts add up beyond {INT64_MAX}")
        return value

    # ------------------------------------------------------------------ slots
    def new_slot(self, name: str) -> int:
        self.slots[name] = self.nslots
        self.nslots += 1
        return self.nslots - 1

    def slot(self, number: int, name: str) -> int:
        s = self.slots.get(name)
        if s is None:
            self.fail(number, f"tensor {name!r} is used before it is defined")
        return s

    def compile(self, records, meta) -> P.Program:
        i, n = 0, len(records)
        ended = False
        while i < n:
            number, r = records[i]
            instr = r.get("INSTRUCTION")
            i += 1
            if instr == "CONSTANT":
                if i >= n or records[i][1].get("INSTRUCTION") != "MEMORY":
                    self.fail(number, "CONSTANT without its MEMORY line")
                name = self.name(number, r, "NAME")
                nbytes = self.nbytes(*records[i], "MEMORY")
                i += 1
                self.code += [P.CONST, self.new_slot(name), nbytes]
            elif instr == "COPY":
                src = self.slot(number, self.name(number, r, "SRC"))
                self.code += [P.COPY, self.new_slot(self.name(number, r, "DST")), src]
            elif instr == "RELEASE":
                name = self.name(number, r, "NAME")
                if name in self.slots:  # the prototype releases names it never defined
                    self.code += [P.RELEASE, self.slots[name]]
            elif instr == "CALL":
                i = self.call(records, i, number, r)
            elif instr == "MUTATE":
                self.mutate(number, r)
            elif instr == "COPY_FROM":
                dst = self.slot(number, self.name(number, r, "DST"))
                self.code += [P.COPY_FROM, dst, self.slot(number, self.name(number, r, "SRC"))]
            elif instr in ("INPUTS", "INVALIDATE"):
                args = [self.slot(number, a) for a in self.names(number, r, "ARGS")]
                self.code += [P.INPUTS if instr == "INPUTS" else P.INVALIDATE, len(args), *args]
                if "RESERVE" in r:
                    self.code += [P.RESERVE, self.nbytes(number, r, "RESERVE")]
            elif instr == "EXPORT" and "VERSION" in r:
                old = self.slot(number, self.name(number, r, "NAME"))
                self.code += [P.EXPORT_VERSION, old, self.new_slot(self.name(number, r, "VERSION"))]
            elif instr in ("READ", "EXPORT"):
                slot = self.slot(number, self.name(number, r, "NAME"))
                self.code += [P.READ if instr == "READ" else P.EXPORT, slot]
            elif instr == "ANNOTATE":
                if r.get("ANNOTATION") == "BACKWARD":
                    self.code.append(P.BACKWARD)
                elif r.get("ANNOTATION") == "END":
                    self.code.append(P.END)
                    ended = True
                elif r.get("ANNOTATION") == "BUDGET":
                    budget = self.integer(number, r, "BUDGET", -1)
                    self.budget_at.append(len(self.code))
                    self.code += [P.BUDGET, budget]
            elif instr in ("MEMORY", "ALIAS"):
                self.fail(number, f"{instr} line out of place")
            else:
                self.fail(number, f"unknown instruction {_short(instr)}")
        if not self.ops:
            raise TraceError(f"dtr: {self.path}: the trace has no operations")
        baseline = float(sum(self.costs))
        if not math.isfinite(baseline):
            raise TraceError(f"dtr: {self.path}: the ops' costs add up beyond a float's range")
        if not ended:
            self.code.append(P.END)
        return P.Program(
            code=np.asarray(self.code, dtype=np.int64),
            costs=np.asarray(self.costs, dtype=np.float64),
            nslots=self.nslots,
            mode=self.mode,
            baseline=baseline,
            ops=self.ops,
            name=os.path.basename(self.path),
            meta=meta,
            budget_at=tuple(self.budget_at),
        )

    def cost(self, number: int, r: dict) -> int:
        """The op's cost (COST, else TIME, else 0): a finite number >= 0."""
        key = "COST" if "COST" in r else "TIME"
        raw = r.get(key, 0)
        try:
            value = float(raw) if isinstance(raw, (str, int, float)) else math.nan
        except (ValueError, OverflowError):
            value = math.nan
        if isinstance(raw, bool) or not (math.isfinite(value) and value >= 0):
            self.fail(number, f"{key} {_short(raw)} is not a finite number >= 0")
        self.costs.append(value)
        self.ops += 1
        return len(self.costs) - 1

    def call(self, records, i, number, r) -> int:
        args = [self.slot(number, a) for a in self.names(number, r, "ARGS")]
        results = self.names(number, r, "RESULT")
        body = []
        for name in results:
            if i + 1 >= len(records):
                self.fail(number, "CALL without MEMORY and ALIAS lines for its results")
            (mem_number, mem), (alias_number, alias) = records[i], records[i + 1]
            if (
                (mem.get("INSTRUCTION"), alias.get("INSTRUCTION")) != ("MEMORY", "ALIAS")
                or mem.get("NAME") != name
                or alias.get("NAME") != name
            ):
                self.fail(number, f"result {name!r} lacks its MEMORY and ALIAS lines")
            i += 2
            ref = self.integer(alias_number, alias, "ALIAS", -1)
            # ALIAS: an argument's position, or len(ARGS) + j for this call's result j
            if ref >= len(args) + len(body) // 4:
                self.fail(
                    number,
                    f"result {name!r} aliases argument {ref} of {len(args)} "
                    f"(or an earlier result, numbered from {len(args)})",
                )
            if alias.get("VERSION") == "1" and ref >= len(args):
                self.fail(number, f"result {name!r} is a new version of a result")
            follows = alias.get("FOLLOWS") == "1"
            if follows and (ref < len(args) or body[4 * (ref - len(args)) + 1] != VERSION):
                self.fail(number, f"result {name!r} follows no new version of this call")
            if not follows and any(k == FOLLOW for k in body[1::4]):
                self.fail(number, f"result {name!r} comes after a pool version's followers")
            if follows:  # a pool version's follower: the core makes it (Core::follow)
                self.integer(mem_number, mem, "MEMORY", 0)
                kind, nbytes = FOLLOW, 0
            elif ref < 0:
                kind, nbytes = NEW, self.nbytes(mem_number, mem, "MEMORY")
            else:  # a view or a version: no storage of its own
                self.integer(mem_number, mem, "MEMORY", 0)
                kind, nbytes = (VERSION if alias.get("VERSION") == "1" else VIEW), 0
            body += [self.new_slot(name), kind, ref, nbytes]
        fresh = [self.slot(number, f) for f in self.names(number, r, "FRESH", default=[])]
        self.code += [
            P.CALL,
            self.cost(number, r),
            len(args),
            *args,
            len(results),
            *body,
            len(fresh),
            *fresh,
        ]
        return i

    def mutate(self, number, r) -> None:
        # The prototype's in-place op: each written argument gets a fresh tensor that
        # takes over its name (the paper's simulator made them copies).
        names = self.names(number, r, "ARGS")
        args = [self.slot(number, a) for a in names]
        written = self.field(number, r, "MUTATE")
        positions = written if isinstance(written, list) else [None]
        mutated = [integer_value(m, 0, len(args) - 1) for m in positions]
        if None in mutated:
            self.fail(number, f"MUTATE {_short(written)} is not a list of positions in ARGS")
        body = []
        for m in mutated:
            body += [m, self.new_slot(names[m])]
        self.code += [P.MUTATE, self.cost(number, r), len(args), *args, len(mutated), *body]
