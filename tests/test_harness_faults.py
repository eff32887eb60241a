"""The studies harness under faults: it never eats a user's files nor races itself.

Two runs publishing one report take turns (a lock): each leaves a whole report, never a mix and
never a stray ``.incomplete`` marker; a folder of the user's own is refused before any work and a
rerun deletes only the figures its previous ``provenance.json`` lists; a folder or FIFO in place of
a cache entry is one clear line before any work (no hang); staging folders of killed runs are
removed by the next run; Ctrl-C while provenance is written leaves no staging folder; ``--replot``
of a corrupt ``results.csv`` or ``provenance.json`` names the file. A rerun that reproduces the
report byte for byte (provenance aside) rewrites no file of the report root and keeps the
provenance of the run that produced the report; a rerun that changes one number publishes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from pathlib import Path

import pytest
from test_studies_cli import _exit, _toy_cli

from studies._engine import last_run, main, run_study
from studies._engine import provenance as pv
from studies._engine import report as report_mod
from studies._engine.runner import last_run_path


def _stage(root: Path, tag: str, n_files: int = 6) -> Path:
    stage = root / f".stage-{tag}"
    stage.mkdir()
    for i in range(n_files):
        (stage / f"f{i}.txt").write_text(tag)
    (stage / "provenance.json").write_text(json.dumps({"figures": [], "tag": tag}))
    return stage


@pytest.mark.parametrize("keep_reproduced", [False, True])
def test_two_publishes_of_one_report_take_turns(tmp_path: Path, keep_reproduced: bool) -> None:
    folder = tmp_path / "study"
    folder.mkdir()
    for trial in range(25):
        stages = [_stage(tmp_path, f"{trial}-{t}") for t in "ab"]
        errors: list[BaseException] = []

        def go(stage: Path, errors: list[BaseException] = errors) -> None:
            try:
                report_mod.publish(stage, folder, keep_reproduced=keep_reproduced)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=go, args=(s,)) for s in stages]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert not report_mod.is_incomplete(folder)
        tags = {(folder / f"f{i}.txt").read_text() for i in range(6)}
        assert len(tags) == 1  # one run's files, not a mix
        assert json.loads((folder / "provenance.json").read_text())["tag"] in tags


def test_a_folder_of_the_users_own_is_refused_before_any_work(capsys, tmp_path: Path, monkeypatch) -> None:
    import _toy_study as toy

    mine = tmp_path / toy.STUDY.name
    mine.mkdir()
    (mine / "holiday.png").write_bytes(b"\x89PNG mine")
    (mine / "notes.txt").write_text("mine")
    log = tmp_path / "computed.txt"
    monkeypatch.setenv("TOY_LOG", str(log))
    _toy_cli(monkeypatch, toy.STUDY)
    code, err = _exit(["run", toy.STUDY.name, "--out", str(tmp_path), "--no-progress"], capsys)
    assert code == 2 and "no provenance.json" in err and "holiday.png" in err
    assert not log.exists()
    assert (mine / "holiday.png").read_bytes() == b"\x89PNG mine" and (mine / "notes.txt").exists()


def test_a_rerun_deletes_only_the_figures_its_provenance_lists(tmp_path: Path, monkeypatch) -> None:
    import _toy_study as toy

    _toy_cli(monkeypatch, toy.FIGURE_STUDY)
    assert main(["run", toy.FIGURE_STUDY.name, "--out", str(tmp_path), "--no-progress"]) == 0
    folder = tmp_path / toy.FIGURE_STUDY.name
    listed = json.loads((folder / "provenance.json").read_text())["figures"]
    assert listed and all((folder / f).exists() for f in listed)
    (folder / "my-own.png").write_bytes(b"mine")
    assert main(["run", toy.FIGURE_STUDY.name, "--out", str(tmp_path), "--no-progress", "--no-cache"]) == 0
    assert (folder / "my-own.png").read_bytes() == b"mine"
    assert all((folder / f).exists() for f in listed)


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_cache_entry_that_is_not_a_file_is_one_line_before_any_work(capsys, tmp_path: Path, monkeypatch,
                                                                       kind: str) -> None:
    import _toy_study as toy

    from studies._engine import cache as cache_mod
    from studies._engine.model import Context

    _toy_cli(monkeypatch, toy.STUDY)
    assert main(["run", toy.STUDY.name, "--out", str(tmp_path), "--no-progress"]) == 0
    capsys.readouterr()
    cache = tmp_path / toy.STUDY.name / ".cache"
    entry = sorted(cache.glob("*.json"))[0]
    entry.unlink()
    if kind == "folder":
        entry.mkdir()
    else:
        if not hasattr(os, "mkfifo"):
            pytest.skip("no FIFOs here")
        os.mkfifo(entry)
    log = tmp_path / "computed.txt"
    monkeypatch.setenv("TOY_LOG", str(log))
    for extra in ([], ["--no-cache"]):
        code = main(["run", toy.STUDY.name, "--out", str(tmp_path), "--no-progress", *extra])
        err = capsys.readouterr().err
        assert code == 1 and err.count("\n") == 1 and str(entry) in err and "remove it" in err
        assert not log.exists()
    assert cache_mod.CacheEntryError.__mro__[1] is OSError and Context is not None


def test_staging_folders_of_killed_runs_are_removed(tmp_path: Path, monkeypatch) -> None:
    import _toy_study as toy

    _toy_cli(monkeypatch, toy.STUDY)
    dead = tmp_path / f".{toy.STUDY.name}.staging-{2**22 + 12345}"  # above the default pid_max
    dead.mkdir()
    (dead / "results.csv").write_text("half")
    alive = tmp_path / f".{toy.STUDY.name}.staging-{os.getppid()}"  # a live process's
    alive.mkdir()
    assert main(["run", toy.STUDY.name, "--out", str(tmp_path), "--no-progress"]) == 0
    assert not dead.exists() and alive.exists()


def test_ctrl_c_while_provenance_is_written_leaves_no_staging(capsys, tmp_path: Path, monkeypatch) -> None:
    import _toy_study as toy

    from studies._engine import runner

    _toy_cli(monkeypatch, toy.STUDY)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner._prov, "provenance", interrupted)
    code = main(["run", toy.STUDY.name, "--out", str(tmp_path), "--no-progress"])
    assert code == 130 and "interrupted" in capsys.readouterr().err
    assert not list(tmp_path.glob(".*staging*"))
    assert not (tmp_path / toy.STUDY.name / "results.csv").exists()


@pytest.mark.parametrize("bad", ["results.csv", "provenance.json"])
def test_replot_of_a_corrupt_file_names_it(capsys, tmp_path: Path, monkeypatch, bad: str) -> None:
    import _toy_study as toy

    _toy_cli(monkeypatch, toy.STUDY)
    assert main(["run", toy.STUDY.name, "--out", str(tmp_path), "--no-progress"]) == 0
    capsys.readouterr()
    path = tmp_path / toy.STUDY.name / bad
    path.write_bytes(b"\x00\xff\x00{" if bad == "provenance.json" else b"\"a,b\n\"1,2,3\n\xff\xfe")
    code = main(["run", toy.STUDY.name, "--out", str(tmp_path), "--replot", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and str(path) in err


# ---------------------------------------------------------------------------------------------
# A rerun that reproduces the report leaves it untouched; one that changes a number publishes
# ---------------------------------------------------------------------------------------------
def _tree(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under ``root`` outside the caches: (SHA-256, inode, mtime in ns). A file
    rewritten with the same bytes gets another inode (atomic replace) or time."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and ".cache" not in p.relative_to(root).parts:
            st = p.stat()
            out[p.relative_to(root).as_posix()] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_ino,
                                                   st.st_mtime_ns)
    return out


def _without_report(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k != "report"}


def test_a_rerun_that_reproduces_the_report_rewrites_no_file(capsys, tmp_path: Path, monkeypatch) -> None:
    import _toy_study as toy

    study, out = toy.FIGURE_STUDY, tmp_path / "out"
    _toy_cli(monkeypatch, study)
    assert main(["run", study.name, "--out", str(out), "--no-progress"]) == 0
    first = last_run(out, study.name)
    folder = out / study.name
    assert first["report"] == "published" and first["n_cells_from_cache"] == 0
    assert json.loads((folder / "provenance.json").read_text()) == _without_report(first)
    before = _tree(out)
    assert {"README.md", *(f"{study.name}/{f}" for f in ("results.csv", "summary.md", "provenance.json",
                                                         "toy.png", "toy.svg"))} == set(before)
    capsys.readouterr()
    log = tmp_path / "computed.txt"
    monkeypatch.setenv("TOY_LOG", str(log))
    for flags, from_cache in (([], toy.N_CELLS), (["--no-cache"], 0)):  # cached, then every cell again
        assert main(["run", study.name, "--out", str(out), "--no-progress", *flags]) == 0
        err = capsys.readouterr().err
        assert _tree(out) == before  # the report, its figures and the index: same bytes, not rewritten
        rec = last_run(out, study.name)
        assert rec["report"] == "reproduced" and rec["n_cells_from_cache"] == from_cache
        assert rec["command"] == " ".join([f"python -m studies run {study.name}", *flags])
        assert rec["figures"] == first["figures"] and rec["n_cells"] == toy.N_CELLS
        said = [line for line in err.splitlines() if "reproduced" in line]
        assert len(said) == 1 and "byte for byte" in said[0] and str(last_run_path(out, study.name)) in said[0]
    assert sorted(log.read_text().split()) == [str(i) for i in range(toy.N_CELLS)]  # --no-cache computed


def test_a_reproduced_report_names_the_run_that_produced_it(tmp_path: Path, monkeypatch) -> None:
    import _toy_study as toy

    monkeypatch.setattr(pv, "git_commit", lambda: "commit-that-computed")
    run_study(toy.FIGURE_STUDY, out=tmp_path, progress=False, seed=2)
    folder = tmp_path / toy.FIGURE_STUDY.name
    produced = json.loads((folder / "provenance.json").read_text())
    monkeypatch.setattr(pv, "git_commit", lambda: "commit-that-reproduced")  # a later clone, same numbers
    run_study(toy.FIGURE_STUDY, out=tmp_path, progress=False, seed=2, use_cache=False)
    rec = last_run(tmp_path, toy.FIGURE_STUDY)
    assert rec["report"] == "reproduced" and rec["git_commit"] == "commit-that-reproduced"
    assert rec["command"].endswith("--seed 2 --no-cache")
    prov = json.loads((folder / "provenance.json").read_text())
    assert prov == produced and prov["git_commit"] == "commit-that-computed"
    assert prov["command"] == f"python -m studies run {toy.FIGURE_STUDY.name} --seed 2"
    summary = (folder / "summary.md").read_text()
    assert "- git commit: commit-that-computed" in summary and "commit-that-reproduced" not in summary
    assert f"- command: `{prov['command']}`" in summary and "--no-cache" not in summary


def test_a_rerun_that_changes_one_result_publishes_a_new_report(tmp_path: Path, monkeypatch) -> None:
    import dataclasses

    import _toy_study as toy

    run_study(toy.FIGURE_STUDY, out=tmp_path, progress=False)
    folder = tmp_path / toy.FIGURE_STUDY.name
    old_prov = json.loads((folder / "provenance.json").read_text())
    old_csv = (folder / "results.csv").read_text().splitlines()

    def run_cell(cell: dict, ctx) -> list[dict]:
        rows = toy.run_cell(cell, ctx)
        if cell["i"] == 2:  # one number, one ulp up
            rows[0]["mean"] = math.nextafter(rows[0]["mean"], math.inf)
        return rows

    monkeypatch.setattr(toy, "time", type("T", (), {"sleep": staticmethod(lambda s: None)}))
    changed = dataclasses.replace(toy.FIGURE_STUDY, run_cell=run_cell)
    run_study(changed, out=tmp_path, progress=False, use_cache=False)
    new_csv = (folder / "results.csv").read_text().splitlines()
    assert len(new_csv) == len(old_csv) and sum(a != b for a, b in zip(old_csv, new_csv, strict=True)) == 1
    rec = last_run(tmp_path, changed)
    assert rec["report"] == "published"
    prov = json.loads((folder / "provenance.json").read_text())
    assert prov == _without_report(rec) and prov != old_prov
    assert prov["command"].endswith("--no-cache") and "--no-cache" not in old_prov["command"]
    assert "--no-cache" in (folder / "summary.md").read_text()


def test_reproduces_compares_the_summary_body_and_the_figures(tmp_path: Path) -> None:
    def report(where: Path, body: str, provenance_line: str, figures: list[str]) -> Path:
        where.mkdir()
        (where / "summary.md").write_text(f"# s\n\n{body}\n\n## Provenance\n\n- {provenance_line}\n")
        (where / "provenance.json").write_text(json.dumps({"figures": figures, "date_utc": provenance_line}))
        for f in figures:
            (where / f).write_bytes(b"figure " + f.encode())
        (where / "results.csv").write_text("metric,mean\nm,1.0\n")
        return where

    folder = report(tmp_path / "folder", "## Finding\n\n- 1", "date 1", ["a.png"])
    assert report_mod.reproduces(report(tmp_path / "s1", "## Finding\n\n- 1", "date 2", ["a.png"]), folder)
    assert not report_mod.reproduces(report(tmp_path / "s2", "## Finding\n\n- 2", "date 1", ["a.png"]), folder)
    assert not report_mod.reproduces(report(tmp_path / "s3", "## Finding\n\n- 1", "date 1", []), folder)
    s4 = report(tmp_path / "s4", "## Finding\n\n- 1", "date 1", ["a.png"])
    (s4 / "a.png").write_bytes(b"another figure")
    assert not report_mod.reproduces(s4, folder)
    s5 = report(tmp_path / "s5", "## Finding\n\n- 1", "date 1", ["a.png"])
    (s5 / "results.csv").write_text("metric,mean\nm,1.0000000000000002\n")
    assert not report_mod.reproduces(s5, folder)
    (folder / report_mod.INCOMPLETE).write_text("killed\n")  # a half-replaced report is never kept
    assert not report_mod.reproduces(report(tmp_path / "s6", "## Finding\n\n- 1", "date 2", ["a.png"]), folder)
