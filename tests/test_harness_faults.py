"""The studies harness under faults: it never eats a user's files nor races itself.

Two runs publishing one report take turns (a lock): each leaves a whole report, never a mix and
never a stray ``.incomplete`` marker; a folder of the user's own is refused before any work and a
rerun deletes only the figures its previous ``provenance.json`` lists; a folder or FIFO in place of
a cache entry is one clear line before any work (no hang); staging folders of killed runs are
removed by the next run; Ctrl-C while provenance is written leaves no staging folder; ``--replot``
of a corrupt ``results.csv`` or ``provenance.json`` names the file.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from test_studies_cli import _exit, _toy_cli

from studies._engine import main
from studies._engine import report as report_mod


def _stage(root: Path, tag: str, n_files: int = 6) -> Path:
    stage = root / f".stage-{tag}"
    stage.mkdir()
    for i in range(n_files):
        (stage / f"f{i}.txt").write_text(tag)
    (stage / "provenance.json").write_text(json.dumps({"figures": [], "tag": tag}))
    return stage


def test_two_publishes_of_one_report_take_turns(tmp_path: Path) -> None:
    folder = tmp_path / "study"
    folder.mkdir()
    for trial in range(25):
        stages = [_stage(tmp_path, f"{trial}-{t}") for t in "ab"]
        errors: list[BaseException] = []

        def go(stage: Path, errors: list[BaseException] = errors) -> None:
            try:
                report_mod.publish(stage, folder)
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
