"""The benchmarks' command line: ``python -m benchmarks`` lists the five, ``python -m benchmarks
NAME ARGS...`` runs one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks
from benchmarks.__main__ import main as cli

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("core", "mc", "sklearn", "train", "decode")


def test_listing_names_the_five(capsys) -> None:
    assert tuple(benchmarks.BENCHMARKS) == NAMES
    for name in NAMES:  # one module per benchmark, each with a main
        assert (ROOT / "benchmarks" / f"{name}.py").is_file()
    assert cli([]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines()[1:]]
    assert listed == list(NAMES), out


def test_listing_from_the_command_line() -> None:
    res = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert [line.split()[0] for line in res.stdout.splitlines()[1:]] == list(NAMES), res.stdout


def test_unknown_name_is_a_usage_error(capsys) -> None:
    assert cli(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nope'" in err and "core, mc, sklearn, train, decode" in err
    with pytest.raises(ValueError, match="unknown benchmark"):
        benchmarks.run("nope", [])


def test_mc_smoke_run_at_a_small_size(capsys) -> None:
    """One case of the Monte Carlo benchmark, quick (2 000 draws of a 64 x 64 kernel, one pair):
    about 2 s. ``main`` returns its results as a dict, which `benchmarks.run` turns into status 0."""
    assert benchmarks.run("mc", ["--quick", "--repeats", "1", "--only", "kernel_error d16"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip().startswith("kernel_error")]
    assert len(rows) == 1, out
    m = re.search(r"kernel_error d16 r64 n64 S2000\s+([0-9.]+)x\s+\(\s*([0-9.]+) ms\)", rows[0])
    assert m is not None, rows[0]
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0


def test_no_forwarding_modules_remain() -> None:
    """The benchmarks and the study engine each have one home: no ``studies/bench_NAME.py`` or
    ``studies/_framework.py`` forwards to them."""
    left = [p.name for p in (ROOT / "studies").glob("bench_*.py")] + [
        p.name for p in (ROOT / "studies").glob("_framework.py")]
    assert not left, left
