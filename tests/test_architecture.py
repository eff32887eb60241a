"""The package layout, read from the source (AST, no import): the module import graph of
``kernelapprox/`` has no cycle, no module imports a room above its own (`ROOMS`, the order of
``docs/layout.md``), the attention primitive imports no statistics, private names stay inside
their module, and ``docs/layout.md`` names every module.

The graph is built from the ``import`` / ``from ... import`` statements that run when a module is
imported: module level and class bodies, including ``try``/``if`` blocks, but not function bodies
(deferred imports) nor ``if TYPE_CHECKING:`` blocks (annotations only). Relative imports are
resolved against the importing module; ``from package import name`` is an edge to
``package.name`` when that is a module, else to ``package``. Importing ``a.b`` also runs
``a/__init__``, which is not counted as an edge (every module would then depend on the root
package, which imports everything).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kernelapprox"

#: Modules whose private names other modules may import: the shared kits.
SHARED_KITS = frozenset({
    "kernelapprox._logdomain",
    "kernelapprox._validation",
    "kernelapprox.theory._common",
    "kernelapprox.recover._common",
})

#: The rooms, bottom up (``docs/layout.md``): a module imports (at module level) only from its own
#: room and those before it. A module is in the room of its longest matching prefix.
ROOMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kit", ("kernelapprox._validation", "kernelapprox._logdomain", "kernelapprox._io", "kernelapprox.backends")),
    ("samplers", ("kernelapprox.samplers",)),
    ("map contract", ("kernelapprox.maps.base",)),
    ("registry", ("kernelapprox.registry",)),
    ("maps", ("kernelapprox.maps",)),
    ("exact", ("kernelapprox.exact",)),
    ("attention", ("kernelapprox.attention",)),
    ("theory", ("kernelapprox.theory",)),
    ("statistics", ("kernelapprox.diagnose", "kernelapprox.montecarlo", "kernelapprox.testing",
                    "kernelapprox.plotting")),
    ("training", ("kernelapprox.training",)),
    ("layers", ("kernelapprox.nn", "kernelapprox.sklearn")),
    ("hf", ("kernelapprox.hf",)),
    ("recover", ("kernelapprox.recover",)),
    ("root", ("kernelapprox",)),
)

#: Deferred imports (inside a function) that reach a room above, as ``(importer, target)``:
#: each with its reason. The list only shrinks (the test says when one is gone).
UPWARD_DEFERRED = frozenset({
    # linear_attention(check=True) calls the closed-form check by name, on the first checked call
    ("kernelapprox.attention._common", "kernelapprox.diagnose"),
    # the dispatch module is the one place that loads a device kernel, lazily, when it chooses it
    ("kernelapprox.backends", "kernelapprox.maps.fused_exponential"),
})

#: Private names crossing a module boundary that are still awaited elsewhere, as
#: ``(importing module, source module, name)``. Each must still occur (the test says so when
#: one is gone), so the list only shrinks.
PENDING_PRIVATE = frozenset({
    # the chunked causal form pads [v, 1] to the GEMM width of the parallel form
    ("kernelapprox.attention.linear.chunk", "kernelapprox.attention.linear.parallel", "_GEMM_COLUMNS"),
})


@dataclass(frozen=True)
class Import:
    importer: str
    module: str  # the resolved absolute module of the statement
    name: str | None  # the imported name for ``from module import name``, None for ``import module``
    line: int
    deferred: bool  # inside a function body


def module_names(root: Path) -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (path, is_package)}`` of every module under the package ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _resolve(importer: str, is_pkg: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(importer: str, path: Path, is_pkg: bool, source: str | None = None) -> list[Import]:
    """Every import statement of a module, with whether it is deferred (in a function body);
    ``if TYPE_CHECKING:`` blocks are left out."""
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source, filename=str(path))
    found: list[Import] = []

    def visit(body: list[ast.stmt], deferred: bool) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, True)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    visit(node.body, deferred)
                visit(node.orelse, deferred)
            elif isinstance(node, ast.Import):
                found.extend(Import(importer, a.name, None, node.lineno, deferred) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                mod = _resolve(importer, is_pkg, node.module, node.level)
                found.extend(Import(importer, mod, a.name, node.lineno, deferred) for a in node.names)
            else:
                for field in ("body", "orelse", "finalbody"):
                    sub = getattr(node, field, None)
                    if isinstance(sub, list):
                        visit([s for s in sub if isinstance(s, ast.stmt)], deferred)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body, deferred)
                for case in getattr(node, "cases", []):
                    visit(case.body, deferred)

    visit(tree.body, False)
    return found


def import_graph(mods: dict[str, tuple[Path, bool]], sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module -> the package modules it imports when it is imported (see the module docstring)."""
    sources = sources or {}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, (path, is_pkg) in mods.items():
        for imp in imports_of(m, path, is_pkg, sources.get(m)):
            if imp.deferred:
                continue
            sub = f"{imp.module}.{imp.name}" if imp.name else None
            target = sub if sub in mods else imp.module
            if target in mods and target != m:
                graph[m].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: one shortest cycle through each strongly connected component with more
    than one module (Tarjan's algorithm, then a breadth-first search inside the component)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    out = []
    for comp in components:
        start = min(comp)
        parent: dict[str, str] = {}
        frontier, seen = [start], {start}
        path: list[str] = []
        while frontier and not path:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & comp):
                    if w == start:
                        path = [start]
                        u = v
                        while u != start:
                            path.insert(1, u)
                            u = parent[u]
                        break
                    if w not in seen:
                        seen.add(w)
                        parent[w] = v
                        nxt.append(w)
                if path:
                    break
            frontier = nxt
        out.append(path + [start])
    return out


def private_crossings(mods: dict[str, tuple[Path, bool]], sources: dict[str, str] | None = None) -> set[tuple[str, str, str]]:
    """``(importer, source module, name)`` for every private name (``_x``, not a module, not a
    dunder) imported from another package module, deferred imports included."""
    sources = sources or {}
    out = set()
    for m, (path, is_pkg) in mods.items():
        for imp in imports_of(m, path, is_pkg, sources.get(m)):
            name = imp.name
            if not name or not name.startswith("_") or name.startswith("__"):
                continue
            if imp.module in mods and f"{imp.module}.{name}" not in mods and imp.module != m:
                out.add((m, imp.module, name))
    return out


def _forbidden_private(crossings: set[tuple[str, str, str]]) -> set[tuple[str, str, str]]:
    return {c for c in crossings if c[1] not in SHARED_KITS} - PENDING_PRIVATE


@pytest.fixture(scope="module")
def mods() -> dict[str, tuple[Path, bool]]:
    return module_names(PACKAGE)


def test_the_walk_sees_the_package(mods):
    """The graph is built from the real tree: the modules it must know are there, and known edges
    (module level, relative, ``from package import module``) are found."""
    for must in ("kernelapprox", "kernelapprox.maps.base", "kernelapprox.theory._common", "kernelapprox.attention"):
        assert must in mods, must
    graph = import_graph(mods)
    assert "kernelapprox.maps.base" in graph["kernelapprox.registry"]
    assert "kernelapprox.maps.base" in graph["kernelapprox.maps.exponential"]
    assert "kernelapprox.maps" in graph["kernelapprox"]


def test_no_import_cycle(mods):
    found = cycles(import_graph(mods))
    assert not found, "import cycles in kernelapprox/:\n" + "\n".join(" -> ".join(c) for c in found)


def test_attention_imports_no_statistics(mods):
    """The attention primitive computes attention: no module of ``kernelapprox.attention``
    imports ``kernelapprox.diagnose`` or ``kernelapprox.theory`` (deferred imports included), but
    for the explicit call of ``check=True`` (`UPWARD_DEFERRED`)."""
    bad = []
    for m, (path, is_pkg) in mods.items():
        if m != "kernelapprox.attention" and not m.startswith("kernelapprox.attention."):
            continue
        for imp in imports_of(m, path, is_pkg):
            targets = [imp.module] + ([f"{imp.module}.{imp.name}"] if imp.name else [])
            for t in targets:
                if imp.deferred and (m, t) in UPWARD_DEFERRED:
                    break
                if t in ("kernelapprox.diagnose", "kernelapprox.theory") or t.startswith("kernelapprox.theory."):
                    bad.append(f"{m}:{imp.line} imports {t}")
                    break
    assert not bad, "\n".join(bad)


def test_no_private_name_crosses_modules(mods):
    crossings = private_crossings(mods)
    bad = _forbidden_private(crossings)
    assert not bad, "private names imported across modules (move them to a shared kit or make them public):\n" + "\n".join(
        f"{imp} imports {name} from {src}" for imp, src, name in sorted(bad)
    )
    gone = PENDING_PRIVATE - crossings
    assert not gone, f"no longer imported, remove from PENDING_PRIVATE: {sorted(gone)}"


def test_the_checks_catch_planted_violations(mods):
    """Each check fails on a planted violation (the sources are replaced in memory, nothing is
    written): an import of ``kernelapprox.theory`` at the top of ``registry`` closes a cycle
    (theory's closed forms import the registry); a private name from ``samplers`` imported by a
    map is a crossing; a deferred or ``TYPE_CHECKING`` import closes no cycle."""
    reg_path = mods["kernelapprox.registry"][0]
    reg = reg_path.read_text(encoding="utf-8")
    planted = {"kernelapprox.registry": "from kernelapprox.theory import moments\n" + reg}
    found = cycles(import_graph(mods, planted))
    assert any("kernelapprox.registry" in c and any(m.startswith("kernelapprox.theory") for m in c) for c in found), found
    deferred = {"kernelapprox.registry": reg + "\n\ndef _late():\n    from kernelapprox.theory import moments\n"}
    assert not cycles(import_graph(mods, deferred))
    typing_only = {"kernelapprox.registry": reg + "\n\nif TYPE_CHECKING:\n    from kernelapprox.theory import moments\n"}
    assert not cycles(import_graph(mods, typing_only))
    trig_path = mods["kernelapprox.maps.trig"][0]
    trig = trig_path.read_text(encoding="utf-8")
    leak = {"kernelapprox.maps.trig": trig + "\n\ndef _f():\n    from ..samplers import _private_helper\n"}
    assert ("kernelapprox.maps.trig", "kernelapprox.samplers", "_private_helper") in _forbidden_private(
        private_crossings(mods, leak)
    )
    kit = {"kernelapprox.maps.trig": trig + "\nfrom .._logdomain import _anything\n"}
    assert not _forbidden_private(private_crossings(mods, kit)) - _forbidden_private(private_crossings(mods))


def room_of(module: str) -> int:
    """Index in `ROOMS` of the room holding ``module`` (its longest matching prefix)."""
    best = (-1, -1)
    for i, (_, prefixes) in enumerate(ROOMS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best[1]:
                best = (i, len(p))
    if best[0] < 0:
        raise KeyError(f"{module} is in no room of ROOMS: add it (and a line to docs/layout.md)")
    return best[0]


def upward_imports(mods: dict[str, tuple[Path, bool]], sources: dict[str, str] | None = None
                   ) -> tuple[list[str], set[tuple[str, str]]]:
    """Module-level imports of a room above (as messages), and deferred ones as ``(importer, target)``."""
    sources = sources or {}
    top, deferred = [], set()
    for m, (path, is_pkg) in mods.items():
        for imp in imports_of(m, path, is_pkg, sources.get(m)):
            sub = f"{imp.module}.{imp.name}" if imp.name else None
            t = sub if sub in mods else imp.module
            if t not in mods or t == m or room_of(t) <= room_of(m):
                continue
            if imp.deferred:
                deferred.add((m, t))
            else:
                top.append(f"{m}:{imp.line} ({ROOMS[room_of(m)][0]}) imports {t} ({ROOMS[room_of(t)][0]})")
    return top, deferred


def test_every_module_has_a_room(mods):
    for m in mods:
        room_of(m)


def test_no_module_imports_a_room_above(mods):
    top, deferred = upward_imports(mods)
    assert not top, "imports of a room above (docs/layout.md):\n" + "\n".join(top)
    assert deferred <= UPWARD_DEFERRED, f"deferred imports of a room above: {sorted(deferred - UPWARD_DEFERRED)}"
    gone = UPWARD_DEFERRED - deferred
    assert not gone, f"no longer imported, remove from UPWARD_DEFERRED: {sorted(gone)}"


def test_the_room_check_catches_a_planted_violation(mods):
    """A map importing the attention forms at module level is refused (nothing is written)."""
    path = mods["kernelapprox.maps.hedgehog"][0]
    planted = {"kernelapprox.maps.hedgehog": "from ..attention import linear_attention\n" + path.read_text()}
    top, _ = upward_imports(mods, planted)
    assert any(line.startswith("kernelapprox.maps.hedgehog:1 ") for line in top), top


def test_layout_page_names_every_module(mods):
    """``docs/layout.md`` has a line for every module (by its path under ``kernelapprox/``; a
    module ``x.py`` may be named as the package ``x/`` it becomes) and every room."""
    page = (PACKAGE.parent / "docs" / "layout.md").read_text(encoding="utf-8")
    missing = []
    for path, _ in mods.values():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "__init__.py":
            continue
        names = {f"`{rel}`", f"`{rel.removesuffix('.py')}/`"}
        if not any(n in page for n in names) and not (
            rel.endswith("__init__.py") and f"`{rel.removesuffix('__init__.py')}`" in page
        ):
            missing.append(rel)
    assert not missing, f"docs/layout.md names no line for {missing}"
    for name, _ in ROOMS:
        assert f"| {name} |" in page, name


def _loaded_after_import(module: str) -> bool:
    code = f"import sys, kernelapprox; print({module!r} in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    return out.stdout.strip() == "True"


@pytest.mark.parametrize(
    "module",
    [
        "pandas",
        "scipy.stats",
        "torch._dynamo",
        "transformers",
        "peft",
        "triton",
        "fla",
        "kernelapprox.maps.fused_exponential",
    ],
)
def test_import_loads_no_heavy_module(module):
    """``import kernelapprox`` (in a fresh interpreter) loads neither pandas, nor scipy.stats, nor
    the compiler stack, nor transformers, peft, nor the GPU kernels (Triton, fla, the fused maps): each
    is imported by the functions that use it (`kernelapprox.backends` imports the GPU kernels on CUDA
    only)."""
    assert not _loaded_after_import(module), f"import kernelapprox loads {module}"


def test_kernel_error_needs_pandas_only_for_frames():
    """Without pandas (its import blocked), `kernel_error` returns its dict; only the per-metric
    ``summary`` table and ``as_frame=True`` need pandas, and say so."""
    code = (
        "import sys; sys.modules['pandas'] = None\n"
        "import torch, kernelapprox as ka\n"
        "fm = ka.PositiveRF(4, 8, seed=0)\n"
        "q = torch.randn(3, 4, dtype=torch.float64) / 4\n"
        "res = ka.montecarlo.kernel_error(fm, q, q, draws=20)\n"
        "assert res['mse'].shape == (3, 3) and res['draws'] == 20\n"
        "for call in (lambda: res['summary'], lambda: ka.montecarlo.kernel_error(fm, q, q, draws=20, as_frame=True)):\n"
        "    try:\n"
        "        call()\n"
        "    except ImportError:\n"
        "        pass\n"
        "    else:\n"
        "        raise AssertionError('pandas was not needed')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
