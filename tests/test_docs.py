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
