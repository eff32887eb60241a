"""Render pages of the built docs site in headless Chromium, screenshot them, and check the math.

Usage (Chromium from the OS packages, e.g. Debian's ``chromium``)::

    python -m mkdocs build -d /tmp/site && (cd /tmp/site && python -m http.server 8765 &)
    python docs/scripts/check_site.py http://127.0.0.1:8765 /tmp/shots "" api/features/ theory/

For each page: a PNG screenshot, the number of math elements left by arithmatex and rendered
by KaTeX, and a count of raw TeX (\\|, \\,, :math:, $$, \\frac, \\varphi) in the visible text
(outside rendered math, code and scripts). Prints MATH OK when every page rendered its math.
"""
import html.parser
import pathlib
import re
import subprocess
import sys

BASE = sys.argv[1]
OUT = pathlib.Path(sys.argv[2])
OUT.mkdir(parents=True, exist_ok=True)
PAGES = sys.argv[3:]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--user-data-dir=/tmp/browser/profile", "--virtual-time-budget=8000", "--hide-scrollbars"]

class Visible(html.parser.HTMLParser):
    """Text outside rendered KaTeX, scripts, styles and code."""
    def __init__(self):
        super().__init__()
        self.stack = []
        self.text = []
        self.katex = 0
        self.arith = 0
    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class", "") or ""
        skip = ("katex" in cls.split()) or tag in ("script", "style", "code", "pre", "annotation")
        if "katex" in cls.split():
            self.katex += 1
        if "arithmatex" in cls.split():
            self.arith += 1
        if tag in ("br", "img", "meta", "link", "input", "hr", "wbr", "source", "path", "line", "rect"):
            return
        self.stack.append(skip or (self.stack[-1] if self.stack else False))
    def handle_endtag(self, tag):
        if tag in ("br", "img", "meta", "link", "input", "hr", "wbr", "source", "path", "line", "rect"):
            return
        if self.stack:
            self.stack.pop()
    def handle_data(self, data):
        if not (self.stack and self.stack[-1]):
            self.text.append(data)

ok = True
for page in PAGES:
    url = BASE.rstrip("/") + "/" + page
    name = page.strip("/").replace("/", "_") or "home"
    subprocess.run(["chromium", *FLAGS, "--window-size=1280,1600", f"--screenshot={OUT}/{name}.png", url],
                   capture_output=True, timeout=120)
    dom = subprocess.run(["chromium", *FLAGS, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    v = Visible()
    v.feed(dom)
    text = "".join(v.text)
    raw = {pat: len(re.findall(re.escape(pat), text)) for pat in ("\\|", "\\,", ":math:", "$$", "\\frac", "\\varphi")}
    print(f"{page or '/'}: {len(dom)} bytes DOM, {v.arith} arithmatex elements, {v.katex} rendered KaTeX elements, "
          f"raw TeX left in visible text: {raw}")
    ok &= v.arith == 0 or v.katex > 0
    ok &= all(n == 0 for n in raw.values())
print("MATH OK" if ok else "MATH PROBLEM")
