"""The studies command line: usage errors exit 2 with one clear line, before any work or folder;
--version; the cell cache is keyed on the code; the recorded command carries every flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from studies._engine import Context, get_study, main, run_study
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
