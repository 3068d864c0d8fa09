"""Product files say what the code does and why, not when or in which sitting of the work
it changed: no numbered sittings ("the sixth session"), issue numbers, dates, "found in
..." or "until ... became the default". "session" meaning a dtr session (what
``dtr.enable()`` returns) is API and stays."""

import pathlib
import re

import pytest

from tests.utils import REPO

ROOT = pathlib.Path(REPO)
DIRS = ("dtr", "csrc", "bench", "tests", "notebooks", "docs")
SUFFIXES = {".py", ".cpp", ".h", ".md", ".sh", ".ipynb", ".txt"}
# Measurement records (raw logs, CSVs) are data stamped when they were taken.
EXCLUDED = ("bench/results/",)

_ORDINAL = (
    r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
    r"|\d+(?:st|nd|rd|th)"
)
_MONTH = r"Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
FORBIDDEN = [
    ("numbered sitting", re.compile(rf"\b(?:{_ORDINAL}) sessions?\b(?! of the)", re.I)),
    ("numbered sitting", re.compile(r"\bsessions? (?:\d+|N)\b")),
    (
        "sitting",
        re.compile(r"\bthis session's (?:run|build|machine)\b|\brun to run this session\b", re.I),
    ),
    ("issue number", re.compile(r"\bissues? #?\d+", re.I)),
    ("date", re.compile(r"\b20\d\d-[01]\d(?:-[0-3]\d)?(?![-\d])")),
    ("date", re.compile(rf"\b(?:{_MONTH})[a-z]* 20\d\d\b")),
    (
        "before/after the N-th",
        re.compile(
            rf"\b(?:before|after|until|since) the (?:{_ORDINAL})(?:'s)? "
            r"(?:session|sitting|run|build|fix)",
            re.I,
        ),
    ),
    (
        "found in",
        re.compile(r"\b[Ff]ound (?:in|by) (?:the |a )?(?:fuzz|sweep|session|review|reading)"),
    ),
    ("until ... became the default", re.compile(r"\buntil\b[^.]{0,80}\bbecame the default")),
]


def hits(text: str, where: str) -> list[str]:
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN:
            m = pattern.search(line)
            if m:
                out.append(f"{where}:{number}: {what}: {m.group(0)!r}")
    return out


def product_files():
    for top in ["README.md", *DIRS]:
        path = ROOT / top
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            if f.is_file() and f.suffix in SUFFIXES and not rel.startswith(EXCLUDED):
                if rel != "tests/unit/test_no_history.py":
                    yield rel, f


def test_product_files_carry_no_history():
    found = [h for rel, f in product_files() for h in hits(f.read_text(errors="replace"), rel)]
    assert not found, "history in product files:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "the ninth session's run (the build that made the native engine the default)",
        "Ties (sixth session): exact ties are common",
        "steps on this machine moved by 10% from run to run this session",
        "a limit until session 4",
        "in simulation it meets issue 3's rule for a heuristic of our own",
        "The subclass engine's name until the native engine became the default (2026-12).",
        "The previous run of this engine (2026-11-30 evening, heuristic dtr)",
        "measured (Dec 2026) on the VM",
        "1.8% to 12.6% before the sixth session's tie order",
        "Found by the fuzz.",
    ],
)
def test_each_pattern_catches_history(line):
    assert hits(line, "x")


@pytest.mark.parametrize(
    "line",
    [
        "dtr: this session has not been entered yet; use it in a `with` statement",
        "with dtr.enable(stress=True) as session:  # a later session works",
        "The first session of the process replaces some torch.Tensor methods",
        "HiGHS stopped otherwise: with no schedule found in time",
        "unet-6-8000000000.0-2020-10-1-10-57-18-default.log.gz",
    ],
)
def test_api_sessions_and_plain_words_pass(line):
    assert not hits(line, "x")

