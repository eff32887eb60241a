"""Cells computed by an executor: in this process, by ``--jobs N`` spawned
processes, or on a Dask cluster (``--scheduler``); the same ``results.csv`` byte for byte, a
killed run resumes where it stopped, a failing cell is named, the executor is recorded.

The study is ``tests/_toy_study.py`` (5 cells, float64 rows of 257 Gaussian draws each): a
module of its own, so that worker processes import it by module path as they import the real
studies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _toy_study as toy
import pytest

from studies._engine import CellError, Study, run_study
from studies._engine import executors as ex
from studies._engine import provenance as pv

REPO = Path(__file__).resolve().parent.parent
CSV = Path(toy.STUDY.name) / "results.csv"


@pytest.fixture(scope="module")
def sequential(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """results.csv of the default executor (in this process): the reference bytes."""
    out = tmp_path_factory.mktemp("seq")
    run_study(toy.STUDY, out=out, progress=False)
    prov = json.loads((out / toy.STUDY.name / "provenance.json").read_text())
    assert prov["executor"] == "sequential" and prov["n_cells_from_cache"] == 0
    return (out / CSV).read_bytes()


def _run(out: Path, **kw) -> Path:
    # hash the files now, as the workers spawned by this run will: a run that started with other
    # files than its workers import refuses to cache their cells (an edit during the run)
    pv.code_hash.cache_clear()
    return run_study(toy.STUDY, out=out, progress=False, **kw)


def _prov(out: Path) -> dict:
    return json.loads((out / toy.STUDY.name / "provenance.json").read_text())


def test_study_ref_finds_the_module_a_worker_imports() -> None:
    module, attr, file = ex.study_ref(toy.STUDY)
    assert (module, attr) == ("_toy_study", "STUDY") and Path(file) == Path(toy.__file__)
    assert ex._load_study(module, attr, file) is toy.STUDY
    # a module that is not on the worker's path is loaded from its file
    loaded = ex._load_study("_toy_study_elsewhere", attr, file)
    assert loaded.name == toy.STUDY.name
    sys.modules.pop("_toy_study_elsewhere")
    # a study built in a function is no module's attribute: a worker could not find it
    local = Study(name="local", description="", grid=toy.grid, run_cell=lambda c, x: [],
                     plot=toy.plot, summarize=toy.summarize)
    with pytest.raises(ValueError, match="not a module-level attribute"):
        ex.study_ref(local)


def test_processes_give_the_same_bytes_and_record_the_executor(sequential: bytes, tmp_path: Path) -> None:
    _run(tmp_path, jobs=2)
    assert (tmp_path / CSV).read_bytes() == sequential
    prov = _prov(tmp_path)
    assert prov["executor"] == "processes(2)"
    # a temporary --out is no folder a user can rerun into: the command leaves it out
    assert prov["command"] == f"python -m studies run {toy.STUDY.name} --jobs 2"
    # each of the 2 workers gets max(1, cores // 2) torch threads
    assert prov["torch_threads"] == max(1, ex._cores() // 2)
    assert prov["dtypes"] == {"search": "float32", "evaluation": "float64"}
    summary = (tmp_path / toy.STUDY.name / "summary.md").read_text()
    assert "- executor: processes(2)" in summary
    assert "dtype search float32, evaluation float64 (--dtype float64)" in summary
    # the cache the workers' cells filled serves the default executor: nothing recomputed
    run_study(toy.STUDY, out=tmp_path, progress=False)
    assert _prov(tmp_path)["n_cells_from_cache"] == toy.N_CELLS
    assert (tmp_path / CSV).read_bytes() == sequential


def test_a_failing_cell_in_a_worker_is_named(tmp_path: Path) -> None:
    with pytest.raises(CellError, match=r"cell \{'i': 2, .*failed in a worker process.*toy failure") as info:
        _run(tmp_path, jobs=2, seed=toy.FAIL_SEED)
    assert info.value.cell["i"] == 2 and info.value.study == toy.STUDY.name
    # in this process too, the same error names the cell; the cells before it stay cached
    with pytest.raises(CellError, match=r"cell \{'i': 2, .*toy failure") as info:
        run_study(toy.STUDY, out=tmp_path / "seq", progress=False, seed=toy.FAIL_SEED)
    assert isinstance(info.value.__cause__, ArithmeticError)
    assert len(list((tmp_path / "seq" / toy.STUDY.name / ".cache").glob("*.json"))) == 2


def test_a_killed_run_resumes_where_it_stopped(sequential: bytes, tmp_path: Path, monkeypatch) -> None:
    """A run killed in cell 3 (os._exit in a subprocess) keeps cells 0-2; the rerun computes 3 and 4
    only and writes the reference bytes. Both runs compute in their own process, with the code
    hash pinned: an edit of the files between the two runs (another session) must not change the
    cache keys of this test."""
    log = tmp_path / "computed.txt"
    code = (f"import sys; sys.path[:0] = [{str(REPO / 'tests')!r}, {str(REPO)!r}]\n"
            "import _toy_study as t\nimport studies._engine.provenance as pv\nimport studies._engine as e\n"
            "pv.code_hash = lambda: 'pinned'\n"
            f"e.run_study(t.STUDY, out={str(tmp_path)!r}, progress=False)\n")
    env = {**os.environ, "TOY_EXIT_AT": "3", "TOY_LOG": str(log)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert log.read_text().split() == ["0", "1", "2"]
    cache = tmp_path / toy.STUDY.name / ".cache"
    assert len(list(cache.glob("*.json"))) == 3 and not list(cache.glob("*.tmp"))
    assert not (tmp_path / CSV).exists()

    log.unlink()
    monkeypatch.setattr(pv, "code_hash", lambda: "pinned")
    monkeypatch.setenv("TOY_LOG", str(log))
    run_study(toy.STUDY, out=tmp_path, progress=False)
    assert log.read_text().split() == ["3", "4"]
    assert _prov(tmp_path)["n_cells_from_cache"] == 3
    assert (tmp_path / CSV).read_bytes() == sequential


def test_dask_local_cluster_gives_the_same_bytes(sequential: bytes, tmp_path: Path) -> None:
    distributed = pytest.importorskip("dask.distributed")
    import logging

    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  silence_logs=logging.ERROR) as cluster:
        address = cluster.scheduler_address
        _run(tmp_path, scheduler=address)
        with pytest.raises(CellError, match=r"cell \{'i': 2, .*failed on a Dask worker.*toy failure"):
            _run(tmp_path / "fail", scheduler=address, seed=toy.FAIL_SEED)
    assert (tmp_path / CSV).read_bytes() == sequential
    prov = _prov(tmp_path)
    assert prov["executor"] == f"dask({address}, n_workers=2)"
    assert prov["command"].endswith(f"--scheduler {address}")
