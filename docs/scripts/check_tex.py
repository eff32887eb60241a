"""Fail on raw TeX left in a built site: text outside rendered math, code and scripts that still
holds ``$$`` or a TeX command (a formula Markdown did not hand to the math renderer, e.g. a
display block indented inside a list item, where ``\\!`` then shows as "!" and ``\\|a\\|`` as
"|a|").

Usage (CI runs it on the site it builds)::

    python -m mkdocs build -d /tmp/site && python docs/scripts/check_tex.py /tmp/site
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

#: Raw TeX that never belongs in visible text.
PATTERN = re.compile(r"\$\$|\\(?:frac|tfrac|dfrac|varphi|operatorname|mathrm|mathbb|qquad|sum|prod|top|big|Big|left"
                     r"|right|sqrt|exp|log|cdot|le|ge|in|pm|mid|langle|rangle|lVert|rVert|\||,|!)(?![A-Za-z])")
_DROP = re.compile(r"<(script|style|pre|code|textarea)\b[^>]*>.*?</\1>"
                   r"|<(span|div)\s+class=\"arithmatex\"[^>]*>.*?</\2>", re.S)


def raw_tex(page_html: str) -> list[str]:
    """The raw TeX fragments (with some context) in the visible text of one page."""
    text = html.unescape(re.sub(r"<[^>]+>", "", _DROP.sub("", page_html)))
    return [text[max(0, m.start() - 40): m.end() + 40].replace("\n", " ") for m in PATTERN.finditer(text)]


def main(site: str) -> int:
    root = Path(site)
    pages = sorted(root.rglob("*.html"))
    if not pages:
        print(f"check_tex: no HTML pages under {root}", file=sys.stderr)
        return 2
    bad = 0
    for page in pages:
        hits = raw_tex(page.read_text(encoding="utf-8", errors="replace"))
        for h in hits[:5]:
            print(f"{page.relative_to(root)}: raw TeX: ...{h}...", file=sys.stderr)
        bad += bool(hits)
    print(f"check_tex: {len(pages)} pages, {bad} with raw TeX")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
