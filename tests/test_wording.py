"""The project's texts speak about the library, not about how it was written.

Every file a user reads (the package, the studies, the benchmarks, the tests, the documentation,
the committed reports and the README) is scanned for phrases that describe the development
process instead of the mathematics or the code: tracker numbers, internal notes, review rounds.
Such phrases mean nothing to a reader of the library, and a figure label or a results column
carrying one would propagate it into papers that cite the reports.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Built from pieces so that this file does not match itself.
_PHRASES = [
    r"the\s+" + "se" + r"ed's",
    "refer" + r"ence\s+sheet",
    "se" + "ed-linear",
    "sh" + "eet-linear",
    "se" + "ed-softmax",
    r"\biss" + r"ue\s+\d+",
    r"\bau" + r"dit\b",
    "written" + r"\s+in\s+parallel",
    "another" + r"\s+session",
]
PATTERN = re.compile("|".join(f"(?:{p})" for p in _PHRASES), re.IGNORECASE)

SCANNED = {
    "kernelapprox": (".py", ".md", ".mplstyle"),
    "studies": (".py", ".md"),
    "benchmarks": (".py", ".md"),
    "tests": (".py", ".md"),
    "docs": (".py", ".md", ".yml"),
    "reports": (".md", ".csv", ".json"),
}


def _files() -> list[Path]:
    out = [ROOT / "README.md", ROOT / "mkdocs.yml"]
    for folder, suffixes in SCANNED.items():
        base = ROOT / folder
        if base.is_dir():
            out += sorted(p for p in base.rglob("*") if p.is_file() and p.suffix in suffixes
                          and ".cache" not in p.parts and "__pycache__" not in p.parts)
    return [p for p in out if p.exists()]


def test_the_scan_covers_the_user_facing_files() -> None:
    files = {p.relative_to(ROOT).as_posix() for p in _files()}
    assert "README.md" in files
    assert any(f.startswith("kernelapprox/") for f in files)
    assert any(f.startswith("reports/") and f.endswith("summary.md") for f in files)
    assert any(f.startswith("docs/") for f in files)


@pytest.mark.parametrize("phrase", [
    "as the se" + "ed's three forms", "the refer" + "ence sheet's count", "ISS" + "UE 12",
    "au" + "dit of this study", "written in para" + "llel", "se" + "ed-linear",
])
def test_the_pattern_catches_each_phrase(phrase: str) -> None:
    assert PATTERN.search(phrase)


def test_no_development_process_words_in_user_facing_files() -> None:
    hits = []
    for path in _files():
        if path == Path(__file__).resolve():
            continue
        for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            m = PATTERN.search(line)
            if m:
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {m.group(0)!r}")
    assert not hits, "phrases about how the project was made:\n" + "\n".join(hits[:40])
