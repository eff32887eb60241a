r"""``ka.diagnose``: regime statistics, predictions that match Monte Carlo, and the two regimes of
the issue (random features work at sigma = 0.25, none does at sigma = 1, d = 64).

Prediction against Monte Carlo. For the sampled pairs, ``S`` independent maps give per-pair
relative MSEs ``m_p = mean_s ((K_hat_s - K) / K)^2``; their median over pairs is compared with the
predicted median. At sigma = 0.25 (``|q + k|^2 ~ 1``) the relative errors are light-tailed, so
each ``m_p`` has a relative standard error of about ``sqrt(2 / S) = 3.2 %`` at ``S = 2000`` (for a
normal error; log-normal terms at ``t ~ 1`` add a few percent): the median over pairs moves by
less than that, and a 10 % tolerance is three standard errors. A wrong closed form (or a wrong
``r``, a factor 2) misses it by far.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import kernelapprox as ka

pytestmark = pytest.mark.usefixtures("one_thread")


def data(sigma: float, n: int = 128, d: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, n, d, generator=g, dtype=torch.float64) * sigma / d**0.25).unbind(0)
    return q, k


def test_regime_statistics_are_the_brute_force_ones():
    q, k = data(0.5, n=64, d=16)
    dx = ka.diagnose(q, k, num_features=64, max_rows=64, max_pairs=64 * 64)
    t_all = ((q[:, None] + k[None]) ** 2).sum(-1)
    assert math.isclose(dx.regime["t_bar"], float(t_all.mean()), rel_tol=1e-12)
    p = torch.softmax(q @ k.T, dim=-1)
    ent = -(p * p.log()).sum(-1)
    assert math.isclose(dx.regime["entropy_mean"], float(ent.mean()), rel_tol=1e-10)
    assert math.isclose(dx.regime["log_m"], math.log(64))
    assert math.isclose(dx.regime["q_norm_median"], float(q.norm(dim=-1).median()), rel_tol=1e-12)


def test_the_two_regimes_of_the_issue():
    """Warns (infeasible, advice to use a learned or data-dependent map) at sigma = 1, d = 64;
    feasible at sigma = 0.25."""
    q, k = data(1.0)
    bad = ka.diagnose(q, k, num_features=256)
    assert not bad.feasible
    assert bad.recommendation.startswith("no random-feature estimator reaches the target")
    assert "learned or data-dependent" in bad.recommendation
    pos = next(r for r in bad.rows if r["estimator"] == "positive")
    assert pos["rel_mse_median"] > 100 and not pos["delta_method_valid"]
    good = ka.diagnose(0.25 * q, 0.25 * k, num_features=256)
    assert good.feasible
    pos = next(r for r in good.rows if r["estimator"] == "positive")
    assert pos["rel_mse_median"] < 0.01 and pos["delta_method_valid"]
    assert "reaches a median relative kernel MSE" in good.recommendation


@pytest.mark.statistical
@pytest.mark.parametrize("name", ["positive", "trig-sincos", "oprf"])
def test_predicted_median_matches_monte_carlo(name):
    q, k = data(0.25, n=32, d=16, seed=3)
    r, S = 64, 2000
    dx = ka.diagnose(q, k, num_features=r, max_pairs=32 * 32)
    row = next(x for x in dx.rows if x["estimator"] == name)
    fm = ka.get_estimator(name).build(16, r, sampler=row["sampler"], batch_shape=(S,), seed=11, dtype=torch.float64)
    fm.fit(q, k)
    K = ka.softmax_kernel(q, k)
    per_pair = (((fm.kernel(q, k) - K) / K) ** 2).mean(0)
    ratio = float(per_pair.median()) / row["rel_mse_median"]
    assert 0.9 < ratio < 1.1, ratio
    # r_needed follows the 1/r law of the median
    assert math.isclose(row["r_needed"], r * row["rel_mse_median"] / dx.target, rel_tol=1e-12)


def test_one_feature_map_and_data_dependent_fit():
    q, k = data(0.5, n=64, d=16)
    fm = ka.OptimalPositiveRF(16, 32, sampler="orthogonal", seed=0, dtype=torch.float64)
    dx = ka.diagnose(q, k, fm)
    assert [r["estimator"] for r in dx.rows] == ["oprf"]
    assert float(fm.A_) < 0  # fitted on (q, k)
    assert dx.rows[0]["num_features"] == 32


def test_output_forms_and_validation():
    q, k = data(0.5, n=32, d=8)
    dx = ka.diagnose(q, k, num_features=16)
    text = repr(dx)
    assert "Diagnosis(" in text and dx.recommendation in text
    assert "<table>" in dx._repr_html_()
    # the mean column is labelled as the subsample estimate it is (32 queries x 32 keys here)
    assert (dx.regime["pairs_q"], dx.regime["pairs_k"]) == (32, 32)
    assert "rel. MSE (mean, 32x32-pair sample)" in text and "rel. MSE (median, 32x32 pairs)" in text
    assert "rel. MSE (mean)" not in text
    df = dx.to_frame()
    assert {"estimator", "rel_mse_median", "r_needed", "normaliser_rel_var"} <= set(df.columns)
    assert not any(r["estimator"].startswith("hedgehog") for r in dx.rows)  # no closed form
    with pytest.raises(ValueError, match="target"):
        ka.diagnose(q, k, target=0.0)
    bad = q.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        ka.diagnose(bad, k)
    with pytest.raises(ValueError):
        ka.diagnose(q, k[:, :4])
    with pytest.raises(TypeError):
        ka.diagnose(q.numpy(), k)  # type: ignore[arg-type]


def _kernel_warnings(fn) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fn()
    return [w for w in rec if issubclass(w.category, ka.KernelApproxWarning)]


def _attention_warnings(q, k, fm, **kw) -> list[warnings.WarningMessage]:
    v = torch.randn(*q.shape[:-1], 4, dtype=q.dtype, generator=torch.Generator().manual_seed(1))
    return _kernel_warnings(lambda: ka.linear_attention(q, k, v, fm, **kw))


@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_checks_only_when_asked(causal):
    """The primitive computes attention only: silent by default even where FAVOR+ cannot work
    (sigma = 1, d = 64, r = 256); with ``check=True`` it warns, pointing at the caller; sigma =
    0.25: silent; deterministic maps: never checked."""
    q, k = data(1.0, n=128)
    fm = ka.PositiveRF(64, 256, sampler="orthogonal", seed=0)
    assert _attention_warnings(q, k, fm, causal=causal) == []
    got = _attention_warnings(q, k, fm, causal=causal, check=True)
    assert len(got) == 1 and "ka.diagnose" in str(got[0].message)
    assert got[0].filename == __file__
    assert _attention_warnings(0.25 * q, 0.25 * k, fm, causal=causal, check=True) == []
    assert _attention_warnings(q, k, ka.EluFeatures(64), causal=causal, check=True) == []
    # a fitted FAVOR++ map is predicted with its own A: still hopeless at this scale
    opt = ka.OptimalPositiveRF(64, 256, seed=0)
    assert len(_attention_warnings(q, k, opt, fit=True, causal=causal, check=True)) == 1
    with pytest.raises(TypeError, match="check must be a bool"):
        ka.linear_attention(q, k, q, fm, check=1)  # type: ignore[arg-type]


def test_attention_imports_no_statistics():
    """No module of ``kernelapprox/attention`` imports ``diagnose`` or ``theory`` at module level:
    ``check=True`` calls `kernelapprox.diagnose.warn_if_hopeless` by name, imported inside
    ``_common.run_input_checks`` (the one import of statistics there, on the first checked call),
    and nothing registers itself into attention."""
    import ast
    from pathlib import Path

    import kernelapprox.attention._common as common

    folder = Path(ka.__file__).parent / "attention"
    files = sorted(folder.rglob("*.py"))
    assert len(files) >= 8
    allowed = {("_common.py", "run_input_checks")}
    for path in files:
        tree = ast.parse(path.read_text())
        inside = {id(n): f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for n in ast.walk(f)}
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if "diagnose" in parts or "theory" in parts:
                    assert (path.name, inside.get(id(node))) in allowed, (path.name, name)
    assert not hasattr(common, "install_input_check") and not hasattr(common, "_INPUT_CHECKS")


def test_layer_checks_once_per_map_by_default():
    """``nn.LinearAttentionHeads`` checks on by default, once per map: the first call at sigma = 1
    warns (pointing at the caller's line), later calls and a second layer sharing the map do not;
    a new map is checked again; ``check=False`` never warns; small inputs never do."""
    from kernelapprox.nn import LinearAttention, LinearAttentionHeads

    q, k = (t.float().reshape(1, 1, 128, 64) for t in data(1.0, n=128))
    v = torch.randn(1, 1, 128, 8)
    attn = LinearAttentionHeads(64, num_features=256, scale=1.0, seed=0)
    got = _kernel_warnings(lambda: attn(q, k, v))
    assert len(got) == 1 and got[0].filename == __file__
    assert _kernel_warnings(lambda: attn(q, k, v)) == []
    shared = LinearAttentionHeads(64, feature_map=attn.feature_map, scale=1.0)
    assert _kernel_warnings(lambda: shared(q, k, v)) == []
    assert len(_kernel_warnings(lambda: LinearAttentionHeads(64, num_features=256, scale=1.0, seed=1)(q, k, v))) == 1
    off = LinearAttentionHeads(64, num_features=256, scale=1.0, seed=2, check=False)
    assert _kernel_warnings(lambda: off(q, k, v)) == []
    assert _kernel_warnings(lambda: LinearAttentionHeads(64, num_features=256, scale=1.0, seed=3)(
        0.25 * q, 0.25 * k, v)) == []
    # the full layer: inputs whose projections have norms of order d^(1/4) x 4 warn once
    layer = LinearAttention(64, heads=1, num_features=256, seed=0)
    with torch.no_grad():
        for lin in (layer.to_q, layer.to_k):
            lin.weight.mul_(40.0)
    x = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(3))
    assert len(_kernel_warnings(lambda: layer(x))) == 1
    assert _kernel_warnings(lambda: layer(x)) == []


def test_linearize_checks_each_layer_once():
    """``hf.linearize`` checks each linearised layer's map on its first call (query and key
    projections scaled so that the logits are large: FAVOR+ at r = 16 is hopeless there), and not
    on later calls; ``check=False`` is silent."""
    transformers = pytest.importorskip("transformers")
    from kernelapprox.hf import linearize

    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=37, vocab_size=99, attn_implementation="sdpa")
    model = transformers.BertModel(cfg).eval()
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.mul_(30.0)
            layer.attention.self.key.weight.mul_(30.0)
    ids = torch.randint(1, 99, (2, 12), generator=torch.Generator().manual_seed(1))
    with linearize(model, "positive", num_features=16):
        assert len(_kernel_warnings(lambda: model(input_ids=ids))) == 2  # one per layer
        assert _kernel_warnings(lambda: model(input_ids=ids)) == []
    with linearize(model, "positive", num_features=16, check=False):
        assert _kernel_warnings(lambda: model(input_ids=ids)) == []


def test_quick_prediction_is_the_closed_form_at_the_mean_pair():
    """quick_relative_mse = ka.theory.relative_mse at (x, y) with |x|^2, |y|^2, x.y the batch means;
    below the pair-averaged closed form (Jensen: the relative MSE is convex in t)."""
    from kernelapprox.diagnose import quick_relative_mse

    q, k = data(0.5, n=64, d=16)
    fm = ka.PositiveRF(16, 64, seed=0, dtype=torch.float64)
    quick = quick_relative_mse(fm, q, k)
    tbar = float(((q[:, None] + k[None]) ** 2).sum(-1).mean())
    assert math.isclose(quick, math.expm1(tbar) / 64, rel_tol=1e-9)  # positive iid: (e^t - 1) / r
    assert quick <= float(torch.as_tensor(ka.theory.relative_mse(fm, q, k)).mean())
    assert math.isnan(quick_relative_mse(ka.EluFeatures(16), q, k))
    assert math.isnan(quick_relative_mse(ka.PositiveRF(16, 64, sampler="structured", seed=0), q, k))


@pytest.mark.statistical
def test_predicted_attention_error_matches_monte_carlo_where_the_delta_method_holds():
    """With v, each row predicts sqrt(sum Var o_hat) / ||o|| by the delta method (iid rows). At
    sigma = 0.25 (normaliser relative variance << 0.05) it matches the Monte Carlo RMS output error
    of iid maps: S = 400 draws give the mean squared error to sqrt(2/S) = 7 % (normal errors), so the
    RMS to 3.5 %; the tolerance of 15 % is four standard errors."""
    q, k = data(0.25, n=128, d=64, seed=5)
    v = torch.randn(128, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    dx = ka.diagnose(q, k, v=v, num_features=128, max_rows=128)
    ref = ka.softmax_attention(q, k, v)
    for name in ("positive", "trig-sincos"):
        row = next(x for x in dx.rows if x["estimator"] == name)
        assert row["delta_method_valid"]
        fm = ka.get_estimator(name).build(64, 128, sampler="gaussian", batch_shape=(400,), seed=9, dtype=torch.float64)
        out = ka.linear_attention(q, k, v, fm, check=False)
        meas = float(((out - ref) ** 2).sum((-1, -2)).mean().sqrt() / ref.norm())
        assert abs(meas / row["attn_rel_err_pred"] - 1) < 0.15, (name, meas, row["attn_rel_err_pred"])


def test_default_samplers_are_the_documented_ones():
    """``Estimator.build`` and what builds a map for a model by name draw the one default,
    orthogonal rows; a map class keeps its iid constructor default; `diagnose` names the sampler it
    assumed in each row (tests/test_registry.py checks every entry point)."""
    from kernelapprox.maps.spec import DEFAULT_SAMPLER, resolve_feature_map

    assert ka.get_estimator("positive").build(8, 16, seed=0).sampler.name == DEFAULT_SAMPLER
    assert ka.PositiveRF(8, 16, seed=0).sampler.name == "gaussian"
    assert DEFAULT_SAMPLER == "orthogonal"
    assert resolve_feature_map("positive", dim=8, num_features=16, seed=0).sampler.name == "orthogonal"
    q, k = data(0.5, n=32, d=8)
    dx = ka.diagnose(q, k, num_features=16)
    by_name = {r["estimator"]: r["sampler"] for r in dx.rows}
    assert by_name["positive"] == "orthogonal" and "sampler" in repr(dx)
