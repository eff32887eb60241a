"""The bibliography of the API reference, collected from the package's docstrings.

Docstrings cite papers as ``[Key]_`` and define them in a references list, either
``.. [Key] Authors. "Title", venue year.`` or ``- [Key] Authors. ...``. This module collects
those definitions (`collect`), writes ``docs/references.md`` (``python -m docs.scripts.references``
or `write`), and the site hook (``mkdocs_hooks.py``) turns every ``[Key]_`` of a rendered page
into a link to its entry there. ``tests/test_docs.py`` checks that every cited key has an entry
and that the committed page is current.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEY = r"[A-Z][A-Za-z]*\d{2}[a-z]?"
CITE = re.compile(rf"\[({KEY})\]_")
_DEF = re.compile(rf"^\s*(?:\.\. |- )\[({KEY})\]\s+(.*)$")


def collect(package: Path = ROOT / "kernelapprox") -> dict[str, str]:
    """``{key: citation}`` from every references list under ``package`` (first definition wins)."""
    defs: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = _DEF.match(lines[i])
            if not m:
                i += 1
                continue
            text, j = [m.group(2).strip()], i + 1
            indent = len(lines[i]) - len(lines[i].lstrip())
            while (j < len(lines) and lines[j].strip() and not _DEF.match(lines[j])
                   and len(lines[j]) - len(lines[j].lstrip()) > indent
                   and not lines[j].strip().startswith('"""')):
                text.append(lines[j].strip())
                j += 1
            defs.setdefault(m.group(1), " ".join(text).rstrip('"').strip())
            i = j
    return defs


def cited(package: Path = ROOT / "kernelapprox") -> set[str]:
    """Every key cited as ``[Key]_`` under ``package``."""
    return {k for p in package.rglob("*.py") for k in CITE.findall(p.read_text(encoding="utf-8"))}


def render(defs: dict[str, str]) -> str:
    """The Markdown of ``docs/references.md``: one entry per key with an anchor ``#key``."""
    out = ["# References", "",
           "The papers the API reference cites as [Key]; each docstring names the ones it relies on.",
           ""]
    out += [f'- <a id="{k.lower()}"></a>**[{k}]** {defs[k]}' for k in sorted(defs, key=str.lower)]
    return "\n".join(out) + "\n"


def write(path: Path = ROOT / "docs" / "references.md") -> None:
    """Write the bibliography page."""
    path.write_text(render(collect()), encoding="utf-8")


if __name__ == "__main__":
    write()
