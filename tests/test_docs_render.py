"""The raw-TeX check that CI runs on the built site (``docs/scripts/check_tex.py``): it finds a
display formula that Markdown did not hand to the math renderer, and passes rendered math, code
and plain text."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "docs" / "scripts" / "check_tex.py"


def _checker():
    spec = importlib.util.spec_from_file_location("check_tex", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_raw_display_math_is_found_and_rendered_math_is_not(tmp_path: Path) -> None:
    mod = _checker()
    broken = "<li>gives</li></ul><p>$$\n E\\, e^{a} = {}_1F_1!\\big(d;\\tfrac d2\\big)\n$$</p>"
    assert mod.raw_tex(broken)
    fine = ('<p>the kernel <span class="arithmatex">\\(\\varphi(x)^\\top\\varphi(y)\\)</span> and</p>'
            '<div class="arithmatex">\\[\\frac{a}{b}\\]</div><pre><code>$$ \\frac{x}{y} $$</code></pre>'
            "<p>costs $3 and 4$ apples, C:/path and a | b.</p>")
    assert mod.raw_tex(fine) == []
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "index.html").write_text(fine)
    assert mod.main(str(tmp_path)) == 0
    (tmp_path / "b.html").write_text(broken)
    assert mod.main(str(tmp_path)) == 1
