"""Packaging: the wheel holds the library and its metadata, nothing else, and installs cleanly.

The wheel is built once per module (``pip wheel . --no-deps --no-build-isolation``, ~5 s: the
installed setuptools, no download) and installed with ``--no-deps`` into a new virtual
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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True, capture_output=True, timeout=300,
    )
    (whl,) = out.glob("kernelapprox-*.whl")
    return whl


def test_wheel_contents(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"kernelapprox", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for must in ("kernelapprox/__init__.py", "kernelapprox/py.typed", "kernelapprox/hf.py",
                 "kernelapprox/attention/chunk.py", "kernelapprox/theory/moments.py"):
        assert must in names, must
    # the reproduction harness, the tests and the root conftest stay in the repository
    assert not any(n.startswith(("studies/", "tests/")) or n == "conftest.py" for n in names)
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
        "print(md.version('kernelapprox'))"
    )
    out = subprocess.run([str(py), "-c", probe], check=True, capture_output=True, text=True,
                         cwd=tmp_path, timeout=60).stdout.split("\n")
    assert out[0].startswith(str(env)), out  # resolved inside the new environment
    assert out[1] == "None"  # no top-level `studies` package installed
    assert out[2] == "0.1.0"
