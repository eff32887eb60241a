"""MkDocs hooks: the site header names the package version read from ``pyproject.toml``, and
docstring citations ``[Key]_`` link to the bibliography page ``references.md``."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any


def on_config(config: Any, **kwargs: Any) -> Any:
    """``site_name`` becomes ``"kernelapprox <version>"`` (the version of ``pyproject.toml``)."""
    meta = tomllib.loads((Path(__file__).resolve().parent / "pyproject.toml").read_text())["project"]
    config["site_name"] = f"{meta['name']} {meta['version']}"
    return config


_CITE = re.compile(r"\[([A-Z][A-Za-z]*\d{2}[a-z]?)\]_")


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    """Every ``[Key]_`` citation of a docstring becomes a link to its entry in ``references.md``."""
    depth = page.url.count("/")
    target = "../" * depth + "references/"

    def link(m: re.Match[str]) -> str:
        return f'<a href="{target}#{m.group(1).lower()}">[{m.group(1)}]</a>'

    return _CITE.sub(link, html)
