"""Packaging: the wheel holds the library and its metadata, nothing else, and installs cleanly.

The wheel is built once per module (``pip wheel --no-deps --no-build-isolation``, ~5 s: the
installed setuptools, no download) from a temporary copy of the build inputs, so that nothing is
left in the working tree, and installed with ``--no-deps`` into a new virtual
environment without system site-packages, where only import *resolution* is checked (importing
kernelapprox would need torch, which that clean environment does not have).
"""

from __future__ import annotations

import email
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


#: What the build reads: the package, its metadata and the files pyproject.toml names.
BUILD_INPUTS = ("pyproject.toml", "LICENSE", "README.md", "docs/pypi.md", "kernelapprox", "_build")


def _tree(root: Path) -> set[str]:
    return {p.name for p in root.iterdir()}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a fresh copy of the build inputs: setuptools' ``build/`` and
    ``*.egg-info`` stay in the copy (a ``build/lib`` in the working tree would ship modules
    deleted since into every later wheel)."""
    import shutil

    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif (REPO / name).exists():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    # a stale build/lib of an earlier build, holding a module deleted since
    (src / "build" / "lib" / "kernelapprox").mkdir(parents=True)
    (src / "build" / "lib" / "kernelapprox" / "deleted_since.py").write_text("x = 1\n")
    out = tmp_path_factory.mktemp("wheel")
    before = _tree(REPO)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True, capture_output=True, timeout=300,
    )
    _TREES["before"], _TREES["after"] = before, _tree(REPO)
    (whl,) = out.glob("kernelapprox-*.whl")
    return whl


_TREES: dict[str, set[str]] = {}


def test_the_build_leaves_the_working_tree_as_it_was(wheel: Path) -> None:
    """Nothing appears in the working tree during the build (an editable install's own
    ``*.egg-info`` may be there before; the build adds no ``build/`` and no other metadata)."""
    assert _TREES["after"] == _TREES["before"], sorted(_TREES["after"] ^ _TREES["before"])
    assert not list((REPO / "kernelapprox").glob("*.egg-info"))


def test_a_deleted_module_does_not_ship(wheel: Path) -> None:
    """Only the modules of the tree are in the wheel: nothing from an earlier build (the build
    tree held a stale ``build/lib/kernelapprox/deleted_since.py``; the backend clears it)."""
    names = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    assert "kernelapprox/deleted_since.py" not in names
    tree = {p.relative_to(REPO).as_posix() for p in (REPO / "kernelapprox").rglob("*.py")
            if "__pycache__" not in p.parts}
    assert names == tree, sorted(names ^ tree)


def test_wheel_contents(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"kernelapprox", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for must in ("kernelapprox/__init__.py", "kernelapprox/py.typed", "kernelapprox/hf/__init__.py",
                 "kernelapprox/attention/linear/chunk.py", "kernelapprox/theory/moments.py",
                 "kernelapprox/maps/base.py", "kernelapprox/kernelapprox.mplstyle"):
        assert must in names, must
    # the reproduction harness, the benchmarks, the tests and the root conftest stay in the repository
    assert not any(n.startswith(("studies/", "benchmarks/", "tests/")) or n == "conftest.py" for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_wheel_metadata(wheel: Path) -> None:
    z = zipfile.ZipFile(wheel)
    (meta_name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
    meta = email.message_from_bytes(z.read(meta_name))
    assert meta["License-Expression"] == "MIT"  # PEP 639
    assert "LICENSE" in meta.get_all("License-File")
    classifiers = meta.get_all("Classifier")
    assert "Typing :: Typed" in classifiers
    assert not any(c.startswith("License ::") for c in classifiers)  # superseded by the expression
    extras = set(meta.get_all("Provides-Extra"))
    assert {"studies", "dev", "real"} <= extras
    # the index page renders no LaTeX: the long description carries no math markup
    body = meta.get_payload()
    assert body.startswith("# kernelapprox")
    assert "$" not in body and "\\mathrm" not in body and ":math:" not in body


def test_wheel_installs_in_a_clean_venv(wheel: Path, tmp_path: Path) -> None:
    env = tmp_path / "venv"
    venv.create(env, with_pip=True, system_site_packages=False)
    py = env / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    probe = (
        "import importlib.util, importlib.metadata as md;"
        "s = importlib.util.find_spec('kernelapprox');"
        "print(s.origin);"
        "print(importlib.util.find_spec('studies'));"
        "print(importlib.util.find_spec('benchmarks'));"
        "print(md.version('kernelapprox'))"
    )
    out = subprocess.run([str(py), "-c", probe], check=True, capture_output=True, text=True,
                         cwd=tmp_path, timeout=60).stdout.split("\n")
    assert out[0].startswith(str(env)), out  # resolved inside the new environment
    assert out[1] == "None"  # no top-level `studies` package installed
    assert out[2] == "None"  # nor `benchmarks`
    assert out[3] == "0.1.0"
