"""One estimator identity: the registry, dispatch through it, user estimators, reproducibility.

Every estimator declares its identity once (``ka.register_estimator`` next to its class); theory,
Monte Carlo, studies and tests find it there. These tests pin that contract: every built-in is
registered with a feature_dim rule that matches what it computes, dispatch never goes by class
name, a user's estimator enters the theory and the studies with one call, and random maps draw
the torch way (``seed=None`` follows ``torch.manual_seed``; ``redraw`` writes in place).
"""

from __future__ import annotations

import ast
import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import F64, randn

import kernelapprox as ka
from kernelapprox.samplers import SAMPLERS

REPO = Path(__file__).resolve().parent.parent
BUILTIN = {
    "positive": (ka.PositiveRF, {}, "r"),
    "hyperbolic": (ka.HyperbolicRF, {}, "2r"),
    "trig-sincos": (ka.TrigRF, {"variant": "sincos"}, "2r"),
    "trig-offset": (ka.TrigRF, {"variant": "offset"}, "r"),
    "elu": (ka.EluFeatures, {}, "d"),
    "relu": (ka.ReluFeatures, {}, "d"),
}


@pytest.fixture
def user_estimator():
    """A user's estimator: FAVOR+ under another class, registered with the positive closed forms."""

    class MyPositiveRF(ka.PositiveRF):
        """FAVOR+ with (say) instrumentation: another class, hence another estimator."""

    est = ka.register_estimator(
        MyPositiveRF, name="my-positive", label="my positive", feature_dim="r",
        theory=ka.get_estimator("positive").theory,
    )
    yield est
    ka.unregister_estimator("my-positive")


# ------------------------------------------------------------------------------------- identity


def test_builtins_are_registered_with_their_rules():
    assert {e.name for e in ka.estimators()} >= set(BUILTIN)
    for name, (cls, params, rule) in BUILTIN.items():
        est = ka.get_estimator(name)
        assert est.cls is cls and dict(est.params) == params and est.feature_dim_rule == rule
        assert est.is_random == cls.is_random and est.positive == cls.positive


@pytest.mark.parametrize("name", [e.name for e in ka.estimators()])
@pytest.mark.parametrize("d,r", [(3, 5), (8, 16)])
def test_feature_dim_rule_matches_the_computed_features(name, d, r):
    est = ka.get_estimator(name)
    fm = est.build(d, r, seed=0, dtype=F64)
    assert ka.estimator_of(fm) is est and fm.estimator is est
    x = randn(4, d, seed=1, scale=0.3)
    unfitted = getattr(fm, "fitted", True) is False  # data-dependent maps warn once before fit
    with pytest.warns(UserWarning, match="used before fit") if unfitted else contextlib.nullcontext():
        assert fm(x).shape[-1] == fm.feature_dim == est.feature_dim(r, d)
    assert fm.log_features(x)[0].shape[-1] == fm.query_features(x).shape[-1] == fm.feature_dim


def test_closed_forms_follow_the_sampler():
    pos, trig = ka.get_estimator("positive"), ka.get_estimator("trig-sincos")
    assert pos.closed_forms("gaussian") == {"moments", "attention_variance"}
    assert pos.closed_forms("orthogonal") == {"moments"}
    assert pos.closed_forms("structured") == pos.closed_forms("qmc") == frozenset()
    assert trig.closed_forms("gaussian") == {"moments", "attention_variance", "bounded_terms", "uniform"}
    assert ka.get_estimator("elu").closed_forms() == {"exact_error"}
    assert [e.name for e in ka.estimators(closed_form="bounded_terms")] == ["trig-sincos", "trig-offset"]
    assert {e.name for e in ka.estimators(random=False)} == {
        "elu", "relu", "taylor", "nystrom", "hedgehog", "hedgehog-lolcats"}


# ------------------------------------------------------------------------------- default sampler


def _sampler_of_registry_build(name: str) -> str:
    return ka.get_estimator(name).build(6, 8, seed=0).sampler.name


def _sampler_of_spec_resolver(name: str) -> str:
    from kernelapprox.maps.spec import resolve_feature_map

    return resolve_feature_map(name, dim=6, heads=2, num_features=8, seed=0).sampler.name


def _sampler_of_nn_layers(name: str) -> str:
    heads = ka.nn.LinearAttentionHeads(6, heads=2, feature_map=name, num_features=8, seed=0)
    layer = ka.nn.LinearAttention(12, heads=2, feature_map=name, num_features=8, seed=0)
    mha = ka.nn.MultiheadLinearAttention(12, 2, feature_map=name, num_features=8, seed=0)
    names = {m.feature_map.sampler.name for m in (heads, layer, mha.layer)}
    assert len(names) == 1, names
    return names.pop()


def _sampler_of_sklearn(name: str) -> str:
    pytest.importorskip("sklearn")
    from kernelapprox.sklearn import RandomFeatures

    tf = RandomFeatures(kernel="softmax", estimator=name, n_components=8, random_state=0)
    tf.fit(randn(20, 6, seed=3, scale=0.3).numpy())
    assert tf.sampler == tf.feature_map_.sampler.name
    return tf.feature_map_.sampler.name


def _sampler_of_diagnose(name: str) -> str:
    q, k = randn(24, 6, seed=4, scale=0.3), randn(24, 6, seed=5, scale=0.3)
    rows = {r["estimator"]: r["sampler"] for r in ka.diagnose(q, k, num_features=8).rows}
    return rows[name]


ENTRY_POINTS = {
    "registry build": _sampler_of_registry_build,
    "spec resolver": _sampler_of_spec_resolver,
    "nn layers": _sampler_of_nn_layers,
    "sklearn": _sampler_of_sklearn,
    "diagnose": _sampler_of_diagnose,
}


def test_default_sampler_is_one_named_constant():
    from kernelapprox import registry
    from kernelapprox.maps import spec

    assert ka.DEFAULT_SAMPLER == registry.DEFAULT_SAMPLER == spec.DEFAULT_SAMPLER == "orthogonal"
    assert ka.get_sampler(ka.DEFAULT_SAMPLER).row_law == "orthogonal-chi"  # chi norms: unbiased
    # the map classes themselves keep their constructor default, iid rows
    assert ka.PositiveRF(6, 8, seed=0).sampler.name == "gaussian"
    # None stands for the default; an explicit sampler is kept
    pos = ka.get_estimator("positive")
    assert pos.build(6, 8, sampler=None, seed=0).sampler.name == ka.DEFAULT_SAMPLER
    assert pos.build(6, 8, sampler="gaussian", seed=0).sampler.row_law == "iid"
    # the filter by closed form refers to the same default rows
    assert [e.name for e in ka.estimators(closed_form="uniform")] == []
    assert [e.name for e in ka.estimators(closed_form="uniform", sampler="gaussian")] == [
        "trig-sincos", "trig-offset"]


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("name", ["positive", "trig-sincos"])
def test_every_entry_point_draws_the_default_sampler(entry, name):
    """Registry build, the spec resolver, the nn layers, scikit-learn's RandomFeatures and diagnose
    all draw ``ka.DEFAULT_SAMPLER`` rows when no sampler is given (estimators whose closed forms
    cover orthogonal rows, for diagnose)."""
    assert ka.get_estimator(name).closed_forms(ka.DEFAULT_SAMPLER) >= {"moments"}
    assert ENTRY_POINTS[entry](name) == ka.DEFAULT_SAMPLER


def test_registry_build_and_the_resolver_draw_the_same_projection():
    """Same seed, same default sampler: the registry's map and the resolver's (hence the layers')
    have the same projection, for every random estimator."""
    from kernelapprox.maps.spec import resolve_feature_map

    for est in ka.estimators(random=True):
        a = est.build(6, 8, seed=3, batch_shape=(2,))
        b = resolve_feature_map(est.name, dim=6, heads=2, num_features=8, seed=3)
        assert a.sampler.name == b.sampler.name == ka.DEFAULT_SAMPLER, est.name
        for (ka_, ta), (kb, tb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert ka_ == kb and torch.equal(ta, tb), (est.name, ka_)


def test_sampler_row_laws():
    laws = {name: cls().row_law for name, cls in SAMPLERS.items()}
    assert laws == {"gaussian": "iid", "orthogonal": "orthogonal-chi", "structured": None, "qmc": None,
                    "simplex": "simplex", "simplex+": None}
    assert ka.OrthogonalSampler(norms="fixed").row_law == "orthogonal-fixed"


def test_registration_errors():
    with pytest.raises(TypeError, match="FeatureMap subclass"):
        ka.register_estimator(int, name="x")
    with pytest.raises(ValueError, match="lower-case"):
        ka.register_estimator(ka.PositiveRF, name="My_RF")
    with pytest.raises(ValueError, match="already registered"):
        ka.register_estimator(ka.PositiveRF, name="positive")
    with pytest.raises(ValueError, match="already registered as 'positive'"):
        ka.register_estimator(ka.PositiveRF, name="favor-plus")
    with pytest.raises(ValueError, match="feature_dim"):
        ka.register_estimator(ka.PositiveRF, name="p2", feature_dim="3r")
    with pytest.raises(TypeError, match="theory"):
        ka.register_estimator(ka.PositiveRF, name="p2", theory=3)
    with pytest.raises(ValueError, match="unknown estimator 'trig'"):
        ka.get_estimator("trig")  # one spelling: no aliases
    with pytest.raises(ValueError, match="no estimator named 'nope'"):
        ka.unregister_estimator("nope")


def test_unregistered_subclass_is_not_its_parent():
    """A subclass may change phi: it is a different estimator until it registers itself, so the
    theory refuses it instead of silently using the parent's formulas. Its feature_dim rule is
    structural and is inherited."""

    class Tweaked(ka.PositiveRF):
        pass

    fm = Tweaked(4, 8, seed=0)
    assert fm.feature_dim == 8
    with pytest.raises(LookupError, match="register"):
        ka.estimator_of(fm)
    x = randn(2, 4, seed=0, scale=0.3)
    with pytest.raises(TypeError, match="register"):
        ka.theory.mse(fm, x, x)
    with pytest.raises(NotImplementedError):
        ka.theory.attention_variance(fm, x, x, x)


def test_no_dispatch_on_class_names():
    """Theory, Monte Carlo and the studies never compare class names or isinstance-check the
    built-in maps: they ask the registry (docstrings and comments excluded)."""
    names = {cls.__name__ for cls, _, _ in BUILTIN.values()}
    files = [*(REPO / "kernelapprox" / "theory").glob("*.py"), REPO / "kernelapprox" / "montecarlo.py",
             *(REPO / "studies").glob("*.py")]
    for path in files:
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                assert node.value not in names, f"{path.name}: string {node.value!r}"
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                refs = {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(node.args[1])}
                assert not refs & names, f"{path.name}:{node.lineno}: isinstance on {refs & names}"
            if isinstance(node, ast.Attribute) and node.attr == "__name__":
                pass  # used in error messages only; comparisons are caught by the string check


# ------------------------------------------------------------------------------- user estimator


def test_user_estimator_enters_theory_and_monte_carlo(user_estimator):
    fm = user_estimator.build(4, 16, sampler="gaussian", seed=0, dtype=F64)
    ref = ka.PositiveRF(4, 16, seed=0, dtype=F64)  # the class's own default: iid rows
    x, y = randn(3, 4, seed=1, scale=0.4), randn(5, 4, seed=2, scale=0.4)
    torch.testing.assert_close(ka.theory.mse(fm, x, y), ka.theory.mse(ref, x, y), rtol=0, atol=0)
    res = ka.montecarlo.kernel_error(fm, x, y, draws=200, quantiles=(0.5,))
    assert res["draws"] == 200 and res["mse"].shape == (3, 5)
    copies = list(ka.montecarlo.batched_draws(fm, 3, chunk_size=2))
    assert all(type(c) is type(fm) for c in copies)


def test_user_estimator_appears_in_the_studies(user_estimator):
    from studies.estimators import get, select

    keys = {s.key for s in select(estimators="my-positive")}
    assert keys == {f"my-positive-{smp}" for smp in SAMPLERS}
    spec = get("my-positive-gaussian")
    assert spec.has_theory and spec.label == "my positive (iid)"
    fm = spec.build(4, 8, batch_shape=(3,), seed=1)
    assert type(fm) is user_estimator.cls and fm.batch_shape == (3,)
    # the error-vs-r study's grid selects every registered estimator
    import studies.error_vs_r as evr

    assert any(c["spec"] == "my-positive-orthogonal" for c in evr.grid(quick=False))
    assert not any(s.name == "my-positive" for s in select(closed_form="bounded_terms"))


def test_user_estimator_without_theory():
    class Plain(ka.PositiveRF):
        pass

    est = ka.register_estimator(Plain, name="plain-positive")
    try:
        assert est.closed_forms("gaussian") == frozenset() and est.theory is None
        x = randn(2, 4, seed=0, scale=0.3)
        with pytest.raises(NotImplementedError, match="no closed-form moments"):
            ka.theory.mse(est.build(4, 8, seed=0), x, x)
    finally:
        ka.unregister_estimator("plain-positive")


# ------------------------------------------------------------------------------ reproducibility


@pytest.mark.parametrize("name", [e.name for e in ka.estimators(random=True)])
def test_seed_none_follows_torch_manual_seed(name):
    est = ka.get_estimator(name)
    torch.manual_seed(123)
    a = est.build(4, 8, sampler="orthogonal")
    torch.manual_seed(123)
    b = est.build(4, 8, sampler="orthogonal")
    c = est.build(4, 8, sampler="orthogonal")  # the global RNG has advanced
    for x, y in zip(a.buffers(), b.buffers(), strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(b.weight, c.weight)


def test_explicit_seed_and_generator_keep_their_meaning():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a = ka.PositiveRF(4, 8, seed=5)
    assert torch.equal(torch.get_rng_state(), state)  # an explicit seed leaves the global RNG alone
    torch.manual_seed(99)
    assert torch.equal(a.weight, ka.PositiveRF(4, 8, seed=5).weight)
    g = torch.Generator().manual_seed(7)
    b, c = ka.PositiveRF(4, 8, generator=g), ka.PositiveRF(4, 8, generator=g)
    assert not torch.equal(b.weight, c.weight)  # the generator advances
    assert torch.equal(b.weight, ka.PositiveRF(4, 8, generator=torch.Generator().manual_seed(7)).weight)


def test_model_with_feature_maps_is_reproducible_under_manual_seed():
    def model():
        return torch.nn.ModuleDict({"lin": torch.nn.Linear(4, 4), "fm": ka.TrigRF(4, 8, variant="offset")})

    torch.manual_seed(0)
    m1 = model()
    torch.manual_seed(0)
    m2 = model()
    for (k1, v1), (k2, v2) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert k1 == k2 and torch.equal(v1, v2), k1


@pytest.mark.parametrize("sampler", ["gaussian", "orthogonal", "structured", "qmc"])
def test_redraw_is_in_place(sampler):
    """Optimisers, hooks and compiled graphs hold references to the buffers: redraw must copy
    into them, not replace them."""
    fm = ka.TrigRF(6, 12, variant="offset", sampler=sampler, seed=0)
    before = {k: (v.data_ptr(), v.clone()) for k, v in fm.named_buffers()}
    refs = dict(fm.named_buffers())
    assert fm.redraw(seed=1) is fm
    after = dict(fm.named_buffers())
    assert after.keys() == before.keys()
    for k, (ptr, old) in before.items():
        assert after[k].data_ptr() == ptr and after[k] is refs[k], k
        assert not torch.equal(after[k], old), k  # new values
    fresh = ka.TrigRF(6, 12, variant="offset", sampler=sampler, seed=1)
    for k, v in fresh.named_buffers():
        assert torch.equal(after[k], v), k  # the same draw as a map built from that seed


def test_get_params_rebuilds_the_same_estimator():
    fm = ka.TrigRF(5, 9, variant="offset", sampler="orthogonal", batch_shape=(2,), seed=0, dtype=F64)
    p = fm.get_params()
    assert p == {"variant": "offset", "dim": 5, "num_features": 9, "sampler": fm.sampler,
                 "batch_shape": (2,), "device": torch.device("cpu"), "dtype": F64}
    clone = type(fm)(**p, seed=3)
    assert ka.estimator_of(clone) is ka.estimator_of(fm) and clone.weight.shape == fm.weight.shape


def test_import_does_not_load_scipy_stats():
    code = "import sys, kernelapprox; print('scipy.stats' in sys.modules, 'pandas' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "False"]
