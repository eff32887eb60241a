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

from studies._engine import CellError, Study, last_run, run_study
from studies._engine import executors as ex
from studies._engine import provenance as pv

REPO = Path(__file__).resolve().parent.parent
CSV = Path(toy.STUDY.name) / "results.csv"


@pytest.fixture(scope="module")
def sequential(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """results.csv of the default executor (in this process): the reference bytes."""
    out = tmp_path_factory.mktemp("seq")
    run_study(toy.STUDY, out=out, progress=False)
    prov = last_run(out, toy.STUDY)
    assert prov["executor"] == "sequential" and prov["n_cells_from_cache"] == 0
    return (out / CSV).read_bytes()


def _run(out: Path, **kw) -> Path:
    # hash the files now, as the workers spawned by this run will: a run that started with other
    # files than its workers import refuses to cache their cells (an edit during the run)
    pv.code_hash.cache_clear()
    return run_study(toy.STUDY, out=out, progress=False, **kw)


def _prov(out: Path) -> dict:
    """The provenance of the last run into ``out`` (whether it replaced the report or reproduced it)."""
    return last_run(out, toy.STUDY)


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
    assert last_run(tmp_path, toy.STUDY)["n_cells_from_cache"] == toy.N_CELLS
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
    hash pinned: an edit of the files between the two runs (by another process) must not change the
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


# ---------------------------------------------------------------------------------------------
# Faults: a report is never half-written, a cache record is checked, nothing foreign overwritten
# ---------------------------------------------------------------------------------------------
def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("stage", ["plot", "summarize"])
def test_an_exception_in_plot_or_summarize_leaves_the_previous_report(tmp_path: Path, stage: str) -> None:
    import dataclasses

    run_study(toy.FIGURE_STUDY, out=tmp_path, progress=False)
    folder = tmp_path / toy.FIGURE_STUDY.name
    before = _files(folder)
    assert {"results.csv", "summary.md", "provenance.json", "toy.png", "toy.svg"} <= set(before)

    def boom(*args: object) -> None:
        raise ZeroDivisionError(f"{stage} failed")

    broken = dataclasses.replace(toy.FIGURE_STUDY, **{stage: boom})
    with pytest.raises(ZeroDivisionError, match=f"{stage} failed"):
        run_study(broken, out=tmp_path, progress=False, seed=5)  # other numbers: another results.csv
    assert _files(folder) == before  # the previous run's report, every file as it was
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left
    # the cells of the failed run are cached: the next run only plots
    run_study(toy.FIGURE_STUDY, out=tmp_path, progress=False, seed=5)
    assert last_run(tmp_path, toy.FIGURE_STUDY)["n_cells_from_cache"] == toy.N_CELLS
    assert (folder / "results.csv").read_bytes() != before["results.csv"]


def test_an_incomplete_report_is_refused_by_replot_and_marked_in_the_index(tmp_path: Path) -> None:
    run_study(toy.STUDY, out=tmp_path, progress=False)
    folder = tmp_path / toy.STUDY.name
    (folder / ".incomplete").write_text("killed while replacing the files\n")  # as a kill leaves it
    with pytest.raises(RuntimeError, match="incomplete"):
        run_study(toy.STUDY, out=tmp_path, progress=False, replot=True)
    from studies._engine import write_index

    write_index(tmp_path)
    assert "incomplete" in (tmp_path / "README.md").read_text().lower()
    run_study(toy.STUDY, out=tmp_path, progress=False)  # a full run repairs it
    assert not (folder / ".incomplete").exists()


def _cache_files(out: Path) -> list[Path]:
    """The cell records of the cache (``last-run.json`` is the last run's provenance, no cell's)."""
    return sorted(p for p in (out / toy.STUDY.name / ".cache").glob("*.json") if p.name != "last-run.json")


@pytest.mark.parametrize("damage", ["truncated", "empty", "braces", "binary", "edited", "foreign"])
def test_a_damaged_cache_record_is_named_and_recomputed(sequential: bytes, tmp_path: Path, damage: str,
                                                        monkeypatch) -> None:
    run_study(toy.STUDY, out=tmp_path, progress=False)
    victim, other = _cache_files(tmp_path)[:2]
    text = victim.read_text()
    rec, original = json.loads(text), json.loads(text)["rows"]
    if damage == "truncated":
        victim.write_text(text[: len(text) // 2])
    elif damage == "empty":
        victim.write_text("")
    elif damage == "braces":
        victim.write_text("{}")
    elif damage == "binary":
        victim.write_bytes(bytes(range(256)))
    elif damage == "edited":  # other numbers, same cell and code
        rec["rows"][0]["mean"] += 1.0
        victim.write_text(json.dumps(rec))
    else:  # another cell's record under this cell's name
        victim.write_text(other.read_text())
    log = tmp_path / "computed.txt"
    monkeypatch.setenv("TOY_LOG", str(log))
    with pytest.warns(UserWarning, match=f"cache file .*{victim.name}"):
        run_study(toy.STUDY, out=tmp_path, progress=False)
    assert len(log.read_text().split()) == 1  # that cell, and only that one, computed again
    assert (tmp_path / CSV).read_bytes() == sequential
    assert json.loads(victim.read_text())["rows"] == original  # the record is repaired


def test_out_never_overwrites_a_readme_the_harness_did_not_write(tmp_path: Path) -> None:
    mine = "# My project\n\nhand-written\n"
    (tmp_path / "README.md").write_text(mine)
    with pytest.warns(UserWarning, match="not written by python -m studies"):
        run_study(toy.STUDY, out=tmp_path, progress=False)
    assert (tmp_path / "README.md").read_text() == mine
    assert (tmp_path / toy.STUDY.name / "summary.md").exists()
    # an index the harness wrote is rewritten; an absent one is written
    fresh = tmp_path / "fresh"
    run_study(toy.STUDY, out=fresh, progress=False)
    first = (fresh / "README.md").read_text()
    assert toy.STUDY.name in first
    run_study(toy.FIGURE_STUDY, out=fresh, progress=False)
    assert toy.FIGURE_STUDY.name in (fresh / "README.md").read_text()


@pytest.fixture
def readonly(tmp_path: Path):
    """A folder no file can be created in: chmod for a user, chattr +i for root (root ignores
    the mode bits)."""
    ro = tmp_path / "ro"
    (ro / toy.STUDY.name).mkdir(parents=True)
    if os.geteuid() == 0:
        flags = [subprocess.run(["chattr", "+i", str(p)], capture_output=True, check=False).returncode
                 for p in (ro / toy.STUDY.name, ro)]
        if any(flags):
            pytest.skip("cannot make a folder read-only here (root, no chattr)")
        yield ro
        for p in (ro, ro / toy.STUDY.name):
            subprocess.run(["chattr", "-i", str(p)], check=False)
    else:
        for p in (ro / toy.STUDY.name, ro):
            p.chmod(0o555)
        yield ro
        for p in (ro, ro / toy.STUDY.name):
            p.chmod(0o755)


def test_a_read_only_report_folder_fails_before_any_cell(readonly: Path, tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "computed.txt"
    monkeypatch.setenv("TOY_LOG", str(log))
    with pytest.raises(PermissionError, match=r"cannot write in the report folder .*ro"):
        run_study(toy.STUDY, out=readonly, progress=False)
    assert not log.exists()  # no cell computed


def test_provenance_records_a_command_a_user_can_rerun(tmp_path: Path, monkeypatch) -> None:
    run_study(toy.STUDY, out=tmp_path, progress=False, seed=3)
    assert _prov(tmp_path)["command"] == f"python -m studies run {toy.STUDY.name} --seed 3"
    assert str(tmp_path) not in (tmp_path / toy.STUDY.name / "summary.md").read_text()
    monkeypatch.chdir(tmp_path)  # an output folder inside the working folder: relative
    run_study(toy.STUDY, out=tmp_path / "mine", progress=False)
    assert _prov(tmp_path / "mine")["command"] == f"python -m studies run {toy.STUDY.name} --out mine"


def test_figures_are_byte_stable(tmp_path: Path) -> None:
    run_study(toy.FIGURE_STUDY, out=tmp_path / "a", progress=False)
    run_study(toy.FIGURE_STUDY, out=tmp_path / "b", progress=False, replot=False)
    a, b = (tmp_path / x / toy.FIGURE_STUDY.name for x in "ab")
    for name in ("toy.png", "toy.svg"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    svg = (a / "toy.svg").read_text()
    assert "<dc:date>" not in svg
    # and a replot redraws the same bytes
    run_study(toy.FIGURE_STUDY, out=tmp_path / "a", progress=False, replot=True)
    assert (a / "toy.svg").read_text() == svg


def test_ctrl_c_in_a_cell_keeps_the_cells_before_it(tmp_path: Path, monkeypatch) -> None:
    import dataclasses

    from studies._engine import StudyInterrupted

    def run_cell(cell: dict, ctx) -> list[dict]:
        if cell["i"] == 3:
            raise KeyboardInterrupt
        return toy.run_cell(cell, ctx)

    monkeypatch.setattr(toy, "time", type("T", (), {"sleep": staticmethod(lambda s: None)}))
    study = dataclasses.replace(toy.STUDY, run_cell=run_cell)
    with pytest.raises(StudyInterrupted, match="interrupted; 3 of 5 cells cached; rerun to resume"):
        run_study(study, out=tmp_path, progress=False)
    assert len(_cache_files(tmp_path)) == 3
