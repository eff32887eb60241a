"""Static check of the mutation list in ``tests/mutations.py`` (no pytest run inside).

Every mutant's target string must occur exactly once in the current sources, so that a refactor
cannot silently turn a mutant into a no-op (or an ambiguous edit); ``python -m tests.mutations``
runs the check itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from mutations import MUTANTS, Mutant, MutationError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_target_occurs_exactly_once(mutant: Mutant):
    text = (ROOT / mutant.path).read_text(encoding="utf-8")
    assert text.count(mutant.old) == 1, (
        f"{mutant.name}: {mutant.old!r} occurs {text.count(mutant.old)} times in {mutant.path}; "
        "update the mutant in tests/mutations.py"
    )


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_is_a_real_change_that_parses(mutant: Mutant, tmp_path: Path):
    assert mutant.new != mutant.old
    src = ROOT / mutant.path
    (tmp_path / mutant.path).parent.mkdir(parents=True)
    (tmp_path / mutant.path).write_text(src.read_text(encoding="utf-8"), encoding="utf-8")
    mutant.apply(tmp_path)
    mutated = (tmp_path / mutant.path).read_text(encoding="utf-8")
    assert mutated != src.read_text(encoding="utf-8")
    ast.parse(mutated)  # a syntax error would be "caught" by any test, proving nothing


def test_names_unique_and_apply_refuses_ambiguous_targets(tmp_path: Path):
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    (tmp_path / "f.py").write_text("x = 1\nx = 1\n", encoding="utf-8")
    with pytest.raises(MutationError, match="2 times"):
        Mutant("twice", "f.py", "x = 1", "x = 2", "").apply(tmp_path)
    with pytest.raises(MutationError, match="0 times"):
        Mutant("absent", "f.py", "y = 1", "y = 2", "").apply(tmp_path)
