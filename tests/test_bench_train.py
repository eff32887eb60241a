"""The training benchmark (``benchmarks.train``) on a shrunken problem: two AdamW steps of the
FAVOR+ model (one block of width 16, sequences of 16), eager and compiled (``aot_eager``: Dynamo and AOTAutograd, no code generation),
give finite losses and the same loss curve; the table has one row per run."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo as dynamo

from benchmarks import train as bt


@pytest.fixture
def small(monkeypatch):
    for name, value in {"BATCH": 2, "SEQ": 16, "DIM": 16, "HEADS": 2, "LAYERS": 1}.items():
        monkeypatch.setattr(bt, name, value)
    dynamo.reset()
    yield torch.randint(0, bt.VOCAB, (4096,), generator=torch.Generator().manual_seed(0))
    dynamo.reset()


# Tolerance: the compiled graph reorders float32 sums (at most max(SEQ, 4 DIM, VOCAB) = 256 terms,
# each reduction off by at most 256 u = 1.5e-5 relative, gamma_m = m u) over about ten chained
# stages, so 1.5e-4 relative on the loss (about 4: 6e-4) at the first step and after one AdamW
# step from the same weights; a wrong chunk, state or gradient moves the loss by O(1e-2).
LOSS_TOL = 6e-4


def test_compiled_matches_eager(small):
    eager = bt.train("positive", "eager", small, 2, progress=False)
    compiled = bt.train("positive", "compiled", small, 2, backend="aot_eager", progress=False)
    assert len(eager.losses) == len(compiled.losses) == 2
    assert all(math.isfinite(x) for x in eager.losses + compiled.losses)
    assert eager.losses[0] != eager.losses[1]  # the optimiser stepped
    assert bt.max_diff(compiled, eager) <= LOSS_TOL, (eager.losses, compiled.losses)
    rows = bt.table([eager, compiled]).splitlines()
    assert len(rows) == 4 and rows[3].startswith("| positive | compiled |")


def test_bad_mode(small):
    with pytest.raises(ValueError, match="mode must be one of"):
        bt.train("positive", "fp8", small, 1, progress=False)
