// Render the math that pymdownx.arithmatex (generic mode) leaves in <span|div class="arithmatex">,
// with the KaTeX copy shipped in docs/assets/katex (no network needed).
function renderMath() {
  renderMathInElement(document.body, {
    delimiters: [
      { left: "$$", right: "$$", display: true },
      { left: "$", right: "$", display: false },
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
    ignoredClasses: ["highlight", "language-python", "language-bash"],
    throwOnError: false,
  });
}
if (typeof document$ !== "undefined") {
  document$.subscribe(renderMath); // mkdocs-material instant navigation
} else {
  document.addEventListener("DOMContentLoaded", renderMath);
}
