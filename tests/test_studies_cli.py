"""The studies command line: usage errors exit 2 with one clear line, before any work or folder;
--version; the cell cache is keyed on the code; the recorded command carries every flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from studies._engine import Context, get_study, last_run, main, run_study
from studies._engine import cache as cache_mod
from studies._engine import provenance as pv


def _exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return int(info.value.code or 0), capsys.readouterr().err


def test_unknown_study_is_a_usage_error_listing_the_names(capsys, tmp_path: Path) -> None:
    code, err = _exit(["run", "no-such-study", "--out", str(tmp_path)], capsys)
    assert code == 2
    assert "unknown study 'no-such-study'" in err and "dlogd" in err and "real-attention" in err
    assert not any(tmp_path.iterdir())


def test_replot_without_results_creates_nothing(capsys, tmp_path: Path) -> None:
    code, err = _exit(["run", "dlogd", "--replot", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "run the study first" in err
    assert not (tmp_path / "r").exists()
    # the library function says the same, also before creating the folder
    with pytest.raises(FileNotFoundError, match="run the study first"):
        run_study(get_study("dlogd"), out=tmp_path / "r2", replot=True, progress=False)
    assert not (tmp_path / "r2").exists()


def test_cuda_without_a_gpu_is_one_line_before_any_work(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = _exit(["run", "dlogd", "--device", "cuda", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "no CUDA device is available" in err
    assert not (tmp_path / "r").exists()
    code, err = _exit(["run", "dlogd", "--device", "tpu9", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "is not a torch device" in err


def test_missing_studies_extra_names_the_install_command(capsys, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "seaborn" else real(name, *a))
    for argv in (["list"], ["run", "dlogd"]):
        code, err = _exit(argv, capsys)
        assert code == 2
        assert "seaborn" in err and '-e ".[studies]"' in err


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as info:  # argparse prints the version on stdout and exits 0
        main(["--version"])
    assert info.value.code == 0
    assert "kernelapprox 0.1.0" in capsys.readouterr().out


def test_cell_cache_is_keyed_on_the_code(monkeypatch) -> None:
    study = get_study("dlogd")
    ctx = Context(study="dlogd")
    cell = {"d": 4}
    key = cache_mod.cell_key(study, cell, ctx)
    assert key == cache_mod.cell_key(study, cell, ctx)
    monkeypatch.setattr(pv, "code_hash", lambda: "0" * 16)  # any change of the code
    assert cache_mod.cell_key(study, cell, ctx) != key


def test_code_hash_covers_library_and_studies(tmp_path: Path, monkeypatch) -> None:
    """Editing a study file changes the hash (a copy of the studies folder, edited)."""
    import shutil

    pv.code_hash.cache_clear()
    before = pv.code_hash()
    copy = tmp_path / "repo"
    shutil.copytree(pv.REPO_ROOT / "studies", copy / "studies")
    monkeypatch.setattr(pv, "REPO_ROOT", copy)
    pv.code_hash.cache_clear()
    assert pv.code_hash() == before  # same files, same hash
    (copy / "studies" / "dlogd.py").write_text((copy / "studies" / "dlogd.py").read_text() + "\n# edit\n")
    pv.code_hash.cache_clear()
    assert pv.code_hash() != before
    monkeypatch.undo()
    pv.code_hash.cache_clear()


def test_recorded_command_has_every_flag(tmp_path: Path) -> None:
    ctx = Context(device=torch.device("cpu"), seed=3, quick=True, out=tmp_path / "rep" / "dlogd",
                  dtype=torch.float32, study="dlogd")
    cmd = pv.command_line(ctx, use_cache=False)
    # a temporary folder outside the working folder is no --out a user can rerun into: left out
    assert cmd == "python -m studies run dlogd --quick --seed 3 --dtype float32 --no-cache"
    rel = Context(out=Path("my-reports") / "dlogd", study="dlogd")
    assert pv.command_line(rel) == "python -m studies run dlogd --out my-reports"
    inside = Context(out=Path.cwd() / "my-reports" / "dlogd", study="dlogd")
    assert pv.command_line(inside) == "python -m studies run dlogd --out my-reports"
    default = Context(out=Path("reports") / "dlogd", study="dlogd")
    assert pv.command_line(default) == "python -m studies run dlogd"
    # where the cells ran is part of the recorded command (results are the same either way)
    jobs = Context(out=Path("reports") / "dlogd", study="dlogd", jobs=4)
    assert pv.command_line(jobs) == "python -m studies run dlogd --jobs 4"
    dask = Context(out=Path("reports") / "dlogd", study="dlogd", scheduler="tcp://10.0.0.1:8786")
    assert pv.command_line(dask) == "python -m studies run dlogd --scheduler tcp://10.0.0.1:8786"


def test_scheduler_without_dask_names_the_cluster_extra(capsys, tmp_path: Path, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "distributed" else real(name, *a))
    code, err = _exit(["run", "dlogd", "--scheduler", "tcp://127.0.0.1:8786", "--out", str(tmp_path / "r")],
                      capsys)
    assert code == 2
    assert err.count("\n") == 1 and 'pip install "kernelapprox[studies,cluster]"' in err
    assert not (tmp_path / "r").exists()


def test_jobs_and_scheduler_usage_errors(capsys, tmp_path: Path) -> None:
    code, err = _exit(["run", "dlogd", "--jobs", "0", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "--jobs must be at least 1, got 0" in err
    code, err = _exit(["run", "dlogd", "--jobs", "2", "--scheduler", "tcp://h:1", "--out", str(tmp_path / "r")],
                      capsys)
    assert code == 2 and "give one of them" in err
    assert not (tmp_path / "r").exists()
    study = get_study("dlogd")
    with pytest.raises(ValueError, match="jobs must be >= 1, got 0"):
        run_study(study, out=tmp_path / "r", jobs=0)
    with pytest.raises(TypeError, match="jobs must be an int, got 2.0"):
        run_study(study, out=tmp_path / "r", jobs=2.0)  # type: ignore[arg-type]
    assert not (tmp_path / "r").exists()


def test_study_dtypes_are_checked() -> None:
    base = get_study("dlogd")
    import dataclasses

    assert dataclasses.replace(base, dtypes={"search": "float32"}).dtypes == {"search": "float32"}
    with pytest.raises(ValueError, match="names no torch dtype for {'search': 'float31'}"):
        dataclasses.replace(base, dtypes={"search": "float31"})
    with pytest.raises(TypeError, match="dtypes must be a dict"):
        dataclasses.replace(base, dtypes=["float32"])  # type: ignore[arg-type]
    hash(dataclasses.replace(base, dtypes={"search": "float32"}))  # still hashable


# ---------------------------------------------------------------------------------------------
# Errors a user meets: typos, run's own usage, Ctrl-C, a read-only folder
# ---------------------------------------------------------------------------------------------
def test_a_typo_gets_close_names_and_runs_own_usage(capsys, tmp_path: Path) -> None:
    code, err = _exit(["run", "dlogdd", "--out", str(tmp_path)], capsys)
    assert code == 2 and "did you mean 'dlogd'" in err
    assert err.startswith("usage: python -m studies run ")  # run's usage, not the top-level one
    code, err = _exit(["run", "erorr-vs-r", "--out", str(tmp_path)], capsys)
    assert "did you mean 'error-vs-r'" in err
    code, err = _exit(["run", "dlogd", "--jobs", "0", "--out", str(tmp_path)], capsys)
    assert code == 2 and err.startswith("usage: python -m studies run ")
    assert not any(tmp_path.iterdir())


def _toy_cli(monkeypatch, study) -> None:
    """Let ``main`` find ``study`` by name (the toy study is no module of ``studies/``)."""
    import sys

    mod = sys.modules[main.__module__]
    monkeypatch.setattr(mod, "load_studies", lambda strict=False: {study.name: study})
    monkeypatch.setattr(mod, "get_study", lambda name: study)


def test_ctrl_c_is_one_line_and_exit_130(capsys, tmp_path: Path, monkeypatch) -> None:
    import dataclasses

    import _toy_study as toy

    def run_cell(cell: dict, ctx: Context) -> list[dict]:
        if cell["i"] == 2:
            raise KeyboardInterrupt  # Ctrl-C while the third cell computes
        return toy.run_cell(cell, ctx)

    study = dataclasses.replace(toy.STUDY, run_cell=run_cell)
    _toy_cli(monkeypatch, study)
    code = main(["run", study.name, "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 130
    assert err == f"python -m studies: [{study.name}] interrupted; 2 of 5 cells cached; rerun to resume\n"
    assert len(list((tmp_path / study.name / ".cache").glob("*.json"))) == 2
    assert not (tmp_path / study.name / "results.csv").exists()


def test_a_read_only_report_folder_is_one_line_before_any_work(capsys, tmp_path: Path, monkeypatch) -> None:
    import _toy_study as toy
    from test_studies_executor import readonly as _ro  # noqa: F401  (the fixture's helper below)

    ro = tmp_path / "ro"
    ro.mkdir()
    log = tmp_path / "computed.txt"
    monkeypatch.setenv("TOY_LOG", str(log))
    _toy_cli(monkeypatch, toy.STUDY)
    if not _make_readonly(ro):
        pytest.skip("cannot make a folder read-only here")
    try:
        code, err = _exit(["run", toy.STUDY.name, "--out", str(ro), "--no-progress"], capsys)
    finally:
        _make_readonly(ro, undo=True)
    assert code == 2 and err.count("\n") == 1 and "cannot write in the report folder" in err
    assert not log.exists()


def _make_readonly(folder: Path, undo: bool = False) -> bool:
    import os
    import subprocess

    if os.geteuid() == 0:
        return subprocess.run(["chattr", "-i" if undo else "+i", str(folder)], capture_output=True,
                              check=False).returncode == 0
    folder.chmod(0o755 if undo else 0o555)
    return True


# ---------------------------------------------------------------------------------------------
# A user's estimator through a study
# ---------------------------------------------------------------------------------------------
USER_MODULE = '''"""A user's estimator."""
import kernelapprox as ka


class MyRF(ka.PositiveRF):
    """Positive random features under another name."""


ka.register_estimator(MyRF, name="my-rf", label="my RF")
'''


@pytest.fixture
def user_module(tmp_path: Path):
    import kernelapprox as ka

    path = tmp_path / "my_estimators.py"
    path.write_text(USER_MODULE)
    yield path
    if "my-rf" in {e.name for e in ka.estimators()}:
        ka.unregister_estimator("my-rf")


def test_the_cache_key_hashes_a_users_estimator(user_module: Path) -> None:
    from studies._engine.model import import_user_modules

    import_user_modules([str(user_module)])
    study = get_study("error-vs-r")
    ctx = Context(study=study.name)
    cell = {"spec": "my-rf-gaussian", "d": 16}
    key = cache_mod.cell_key(study, cell, ctx)
    assert cache_mod.cell_key(study, cell, ctx) == key
    user_module.write_text(USER_MODULE.replace('"""Positive', '"""Edited: positive'))
    assert cache_mod.cell_key(study, cell, ctx) != key  # an edit of the user's code: recompute
    # a library estimator's key depends on the library's code only
    lib = {"spec": "positive-gaussian", "d": 16}
    assert cache_mod.cell_key(study, lib, ctx) == cache_mod.cell_key(study, lib, ctx)


def test_run_a_study_on_a_users_estimator(capsys, tmp_path: Path, user_module: Path, monkeypatch) -> None:

    import pandas as pd

    from studies import error_vs_r

    # a small grid (the study's own full grid, restricted to the user's estimator, at d = 8)
    monkeypatch.setattr(error_vs_r, "DIMS", [8])
    monkeypatch.setattr(error_vs_r, "R_GRID", [8, 16, 32])
    monkeypatch.setattr(error_vs_r, "REGIMES", ["attention", "sphere-1"])
    out = tmp_path / "mine"
    argv = ["run", "error-vs-r", "--import", str(user_module), "--estimators", "my-rf-gaussian", "--out",
            str(out), "--no-progress"]
    assert main(argv) == 0
    df = pd.read_csv(out / "error-vs-r" / "results.csv")
    assert set(df["estimator"]) == {"my-rf"} and set(df["d"]) == {8}
    prov = last_run(out, "error-vs-r")
    assert "--estimators my-rf-gaussian" in prov["command"] and "--import" in prov["command"]
    assert prov["estimators"] == ["my-rf-gaussian"]
    assert prov["n_cells"] == 1
    n = prov["n_cells"]
    assert main(argv) == 0  # resumed from the cache
    assert last_run(out, "error-vs-r")["n_cells_from_cache"] == n
    user_module.write_text(USER_MODULE + "\n# edited\n")
    assert main(argv) == 0  # the user's code changed: every cell computed again
    assert last_run(out, "error-vs-r")["n_cells_from_cache"] == 0


def test_estimators_needs_an_estimator_axis(capsys, tmp_path: Path) -> None:
    code, err = _exit(["run", "qr-sign-bias", "--estimators", "positive", "--out", str(tmp_path)], capsys)
    assert code == 2 and "has no estimator axis" in err
    code, err = _exit(["run", "error-vs-r", "--quick", "--estimators", "no-such", "--out", str(tmp_path)],
                      capsys)
    assert code == 2 and "no cell of study 'error-vs-r' uses" in err
    assert not any(tmp_path.iterdir())


def test_dirty_means_the_code_differs_from_the_commit(tmp_path: Path, monkeypatch) -> None:
    import subprocess

    repo = tmp_path / "clone"
    for sub in ("kernelapprox", "studies", "reports"):
        (repo / sub).mkdir(parents=True)
        (repo / sub / "x.py").write_text("x = 1\n")
    (repo / "pyproject.toml").write_text("[project]\n")

    def git(*a: str) -> None:
        subprocess.run(["git", "-c", "user.email=a@b", "-c", "user.name=a", *a], cwd=repo, check=True,
                       capture_output=True)

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "c")
    monkeypatch.setattr(pv, "REPO_ROOT", repo.resolve())
    clean = pv.git_commit()
    assert len(clean) == 40
    (repo / "reports" / "x.py").write_text("x = 2\n")  # a regenerated report: not the code
    assert pv.git_commit() == clean
    (repo / "studies" / "x.py").write_text("x = 2\n")
    assert pv.git_commit() == clean + "+dirty"
