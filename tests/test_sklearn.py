"""kernelapprox.sklearn: the scikit-learn front end (RandomFeatures)."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
from scipy.stats import norm

pytest.importorskip("sklearn")

from sklearn.exceptions import NotFittedError  # noqa: E402
from sklearn.kernel_approximation import RBFSampler  # noqa: E402
from sklearn.metrics.pairwise import rbf_kernel  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402
from sklearn.utils.estimator_checks import parametrize_with_checks  # noqa: E402

from kernelapprox.sklearn import RandomFeatures, supported_estimators  # noqa: E402


def _data(n=40, d=6, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).normal(size=(n, d)).astype(dtype)


# ---------------------------------------------------------------------------------- sklearn API
# estimator=None is trig-sincos (trig-offset in the checks that set n_components=1: an explicit
# "trig-sincos" rejects an odd output width, by design)
@parametrize_with_checks(
    [
        RandomFeatures(kernel="rbf", sampler="orthogonal"),
        RandomFeatures(kernel="rbf", sampler="qmc", estimator="trig-offset"),
        RandomFeatures(kernel="rbf", sampler="qmc"),
        RandomFeatures(kernel="softmax", estimator="positive", sampler="orthogonal", gamma=0.1),
        RandomFeatures(kernel="rbf", sampler="simplex"),
    ]
)
def test_check_estimator(estimator, check):
    with warnings.catch_warnings():
        # the softmax kernel overflows on the checks' loc=100 data, and says so
        warnings.filterwarnings("ignore", "RandomFeatures: some features overflowed", RuntimeWarning)
        check(estimator)


def test_init_stores_parameters_unchanged_without_validation():
    rf = RandomFeatures(kernel="nope", estimator=3, sampler=None, n_components=-1, gamma="x", random_state="y")
    assert rf.get_params() == {
        "kernel": "nope", "estimator": 3, "sampler": None, "n_components": -1, "gamma": "x", "random_state": "y",
    }


@pytest.mark.parametrize(
    ("params", "exc", "name"),
    [
        ({"kernel": "laplacian"}, ValueError, "kernel"),
        ({"estimator": "no-such-map"}, ValueError, "estimator"),
        ({"estimator": 3}, TypeError, "estimator"),
        ({"estimator": "taylor"}, ValueError, "estimator"),  # deterministic
        ({"estimator": "saderf"}, ValueError, "estimator"),  # asymmetric
        ({"estimator": "hedgehog"}, ValueError, "estimator"),  # learned
        ({"sampler": "sobol"}, ValueError, "sampler"),
        ({"n_components": 0}, ValueError, "n_components"),
        ({"n_components": 2.5}, TypeError, "n_components"),
        ({"n_components": 7, "estimator": "trig-sincos"}, ValueError, "n_components"),  # 2r
        ({"gamma": 0.0}, ValueError, "gamma"),
        ({"gamma": -1.0}, ValueError, "gamma"),
        ({"gamma": "auto"}, ValueError, "gamma"),
        ({"random_state": "seed"}, ValueError, "random_state"),
    ],
)
def test_bad_parameters_raise_in_fit_naming_the_parameter(params, exc, name):
    rf = RandomFeatures(**params)  # no validation at construction
    with pytest.raises(exc, match=f"'{name}' parameter"):
        rf.fit(_data())


def test_unsupported_estimators_say_why():
    with pytest.raises(ValueError, match="asymmetric"):
        RandomFeatures(estimator="saderf").fit(_data())
    with pytest.raises(ValueError, match="deterministic"):
        RandomFeatures(estimator="relu").fit(_data())
    assert {"positive", "trig-sincos", "trig-offset", "oprf"} <= set(supported_estimators())
    assert not {"saderf", "taylor", "hedgehog", "elu"} & set(supported_estimators())


def test_input_checks():
    rf = RandomFeatures(random_state=0)
    with pytest.raises(NotFittedError):
        rf.transform(_data())
    rf.fit(_data(d=6))
    with pytest.raises(ValueError, match="features"):
        rf.transform(_data(d=5))
    X = _data()
    X[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        RandomFeatures().fit(X)
    with pytest.raises(ValueError, match="1 feature"):  # a simplex needs d >= 2
        RandomFeatures(sampler="simplex").fit(_data(d=1))


# ---------------------------------------------------------------------------------- outputs
@pytest.mark.parametrize("kernel", ["rbf", "softmax"])
@pytest.mark.parametrize("sampler", ["orthogonal", "structured"])
def test_dtype_preserved_and_float32_close_to_float64(kernel, sampler):
    X = _data() / 3
    rf = RandomFeatures(kernel=kernel, sampler=sampler, n_components=32, random_state=0).fit(X)
    z64 = rf.transform(X)
    z32 = rf.transform(X.astype(np.float32))
    assert z64.dtype == np.float64 and z32.dtype == np.float32
    assert z64.shape == z32.shape == (40, 32)
    np.testing.assert_allclose(z32, z64, rtol=1e-4, atol=1e-5)
    # fitted on float32: the same projection (drawn in float64), output follows the input
    rf32 = RandomFeatures(kernel=kernel, sampler=sampler, n_components=32, random_state=0).fit(X.astype(np.float32))
    assert rf32.transform(X).dtype == np.float64
    assert rf32.transform(X.astype(np.float32)).dtype == np.float32
    np.testing.assert_array_equal(rf32.random_weights_, rf.random_weights_)
    # integers: float64
    assert rf.transform(np.round(X * 3).astype(np.int64)).dtype == np.float64


def test_offset_gaussian_is_rbfsampler_estimator():
    """trig-offset on iid rows is RBFSampler's map: sqrt(2/F) cos(X W + b), W = sqrt(2 gamma) N(0, 1)."""
    X = _data()
    rf = RandomFeatures(estimator="trig-offset", sampler="gaussian", n_components=50, gamma=0.3, random_state=1).fit(X)
    want = np.sqrt(2 / 50) * np.cos(X @ rf.random_weights_ + rf.random_offset_)
    np.testing.assert_allclose(rf.transform(X), want, rtol=1e-10, atol=1e-12)
    assert rf.random_weights_.shape == (6, 50) and rf.random_offset_.shape == (50,)
    # same law as RBFSampler's weights: entries ~ N(0, 2 gamma) (a loose moment check)
    ref = RBFSampler(gamma=0.3, n_components=50, random_state=1).fit(X)
    assert abs(rf.random_weights_.var() / ref.random_weights_.var() - 1) < 0.35


def test_sincos_layout_and_exact_diagonal():
    X = _data()
    rf = RandomFeatures(estimator="trig-sincos", n_components=64, gamma=0.2, random_state=0).fit(X)
    assert rf.num_projections_ == 32 and rf.random_offset_ is None
    Z = rf.transform(X)
    U = X @ rf.random_weights_
    np.testing.assert_allclose(Z, np.hstack([np.sin(U), np.cos(U)]) / np.sqrt(32), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.einsum("ij,ij->i", Z, Z), 1.0, rtol=1e-12)  # sin^2 + cos^2


def test_gamma_scale():
    X = 3.0 * _data()
    rf = RandomFeatures(gamma="scale", random_state=0).fit(X)
    assert rf.gamma_ == pytest.approx(1 / (X.shape[1] * X.var()))
    assert RandomFeatures(gamma="scale").fit(np.ones((5, 3))).gamma_ == 1.0  # Var X = 0


def test_feature_names_and_pandas_output():
    pd = pytest.importorskip("pandas")
    X = pd.DataFrame(_data(n=10, d=3), columns=["a", "b", "c"], index=list("abcdefghij"))
    rf = RandomFeatures(n_components=8, random_state=0).set_output(transform="pandas")
    out = rf.fit_transform(X)
    names = [f"randomfeatures{i}" for i in range(8)]
    assert isinstance(out, pd.DataFrame)
    assert list(out.columns) == names == list(rf.get_feature_names_out())
    assert list(out.index) == list(X.index)
    assert list(rf.feature_names_in_) == ["a", "b", "c"]
    np.testing.assert_allclose(out.to_numpy(), RandomFeatures(n_components=8, random_state=0).fit_transform(X.to_numpy()))
    # in a pipeline: names flow through
    pipe = make_pipeline(StandardScaler(), RandomFeatures(n_components=4, random_state=0)).fit(X)
    assert list(pipe.get_feature_names_out()) == names[:4]


def test_reproducible_with_random_state():
    X = _data()
    for sampler in ("gaussian", "orthogonal", "qmc", "structured", "simplex+"):
        a = RandomFeatures(sampler=sampler, n_components=16, random_state=7).fit_transform(X)
        b = RandomFeatures(sampler=sampler, n_components=16, random_state=7).fit_transform(X)
        c = RandomFeatures(sampler=sampler, n_components=16, random_state=8).fit_transform(X)
        np.testing.assert_array_equal(a, b)
        assert not np.allclose(a, c)
    d = RandomFeatures(random_state=np.random.RandomState(7)).fit_transform(X)
    e = RandomFeatures(random_state=np.random.RandomState(7)).fit_transform(X)
    np.testing.assert_array_equal(d, e)
    np.random.seed(3)  # noqa: NPY002 - random_state=None follows numpy's global RandomState, as in scikit-learn
    f = RandomFeatures().fit_transform(X)
    np.random.seed(3)  # noqa: NPY002
    np.testing.assert_array_equal(f, RandomFeatures().fit_transform(X))
    rf = RandomFeatures(random_state=0).fit(X)
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(rf)).transform(X), rf.transform(X))


# ---------------------------------------------------------------------------------- statistics
# Unbiasedness. For a fixed configuration, the Gram estimates Khat^(s) = Z_s Z_s^T of independent
# seeds s = 1..S are iid with mean K when the estimator is unbiased (every sampler below draws rows
# that are marginally N(0, I_d), so E Khat = K entrywise) and finite variance (the trigonometric
# terms are bounded; positive features have finite variance). By the CLT the mean over S seeds of
# an entry is N(K_ij, sigma_ij^2 / S) up to O(skew / sqrt(S)); sigma_ij is estimated by the sample
# standard deviation over seeds, so z_ij = (mean - K_ij) / (sd_ij / sqrt(S)) is ~ N(0, 1) (t with
# S - 1 = 399 degrees of freedom). We test the m = 15 off-diagonal entries of 6 points (the sin/cos
# diagonal is exactly 1, with zero variance) with a Bonferroni bound at family-wise level
# alpha = 1e-3: |z| < Phi^{-1}(1 - alpha / (2m)) = 3.99 (valid whatever the correlation between
# entries). Positive features are log-normal-like: their terms exp(w.(x~+y~)) have skewness
# ~ (e^t + 2) sqrt(e^t - 1) with t = |x~ + y~|^2, which makes the sample sd, hence z, unreliable at
# S = 400; their cases use scales with t <~ 0.5 (skewness < 3 per term, < 0.8 per 16-term estimate),
# where the normal approximation holds. The seeds are fixed, so the test is deterministic (measured
# max |z|: <= 3.5, the largest for positive/gaussian); its power is checked below (a 10 % error in
# gamma gives |z| ~ 8).
S_SEEDS, N_POINTS = 400, 6
Z_MAX = float(norm.ppf(1 - 1e-3 / (2 * N_POINTS * (N_POINTS - 1) / 2)))


def _mean_gram_z(kernel, estimator, sampler, K_exact, X, gamma, F=16):
    G = np.stack([
        (lambda Z: Z @ Z.T)(
            RandomFeatures(kernel=kernel, estimator=estimator, sampler=sampler, n_components=F, gamma=gamma,
                           random_state=s).fit_transform(X)
        )
        for s in range(S_SEEDS)
    ])
    iu = np.triu_indices(len(X), 1)
    mean, se = G.mean(0)[iu], G.std(0, ddof=1)[iu] / np.sqrt(S_SEEDS)
    return (mean - K_exact[iu]) / se


@pytest.mark.parametrize(
    ("estimator", "sampler", "gamma"),
    [
        ("trig-offset", "gaussian", 0.15),
        ("trig-offset", "orthogonal", 0.15),
        ("trig-sincos", "gaussian", 0.15),
        ("trig-sincos", "orthogonal", 0.15),
        ("trig-sincos", "qmc", 0.15),
        ("trig-sincos", "simplex", 0.15),
        ("positive", "gaussian", 0.02),  # t = 2 gamma |x + y|^2 ~ 0.4
        ("positive", "orthogonal", 0.02),
    ],
)
def test_rbf_gram_unbiased(estimator, sampler, gamma):
    X = _data(n=N_POINTS, d=5, seed=1)
    z = _mean_gram_z("rbf", estimator, sampler, rbf_kernel(X, gamma=gamma), X, gamma)
    assert np.abs(z).max() < Z_MAX, z


@pytest.mark.parametrize(("estimator", "sampler"), [("positive", "gaussian"), ("positive", "orthogonal"), ("trig-sincos", "qmc")])
def test_softmax_gram_unbiased(estimator, sampler):
    X = _data(n=N_POINTS, d=5, seed=2) / 2
    gamma = 0.1  # t = gamma |x + y|^2 ~ 0.25
    z = _mean_gram_z("softmax", estimator, sampler, np.exp(gamma * X @ X.T), X, gamma)
    assert np.abs(z).max() < Z_MAX, z


def test_unbiasedness_test_has_power():
    """The same z-test rejects the kernel at a 10 % wrong gamma (so it would catch a wrong scale)."""
    X = _data(n=N_POINTS, d=5, seed=1)
    z = _mean_gram_z("rbf", "trig-sincos", "orthogonal", rbf_kernel(X, gamma=0.15 * 1.1), X, 0.15)
    assert np.abs(z).max() > 1.5 * Z_MAX


def test_orthogonal_beats_iid_on_digits():
    """At F = 256 the orthogonal sin/cos Gram error is clearly below RBFSampler's (benchmark: 0.139
    vs 0.200, s.e. < 0.004): a mean over 5 seeds each keeps the margin many s.e. wide."""
    from sklearn.datasets import load_digits

    X = StandardScaler().fit_transform(load_digits().data[:300])
    gamma = 1 / X.shape[1]
    K = rbf_kernel(X, gamma=gamma)

    def err(make):
        return np.mean([np.linalg.norm((Z := make(s).fit_transform(X)) @ Z.T - K) / np.linalg.norm(K) for s in range(5)])

    ours = err(lambda s: RandomFeatures(sampler="orthogonal", n_components=256, gamma=gamma, random_state=s))
    ref = err(lambda s: RBFSampler(n_components=256, gamma=gamma, random_state=s))
    assert ours < 0.85 * ref, (ours, ref)


def test_data_dependent_estimator_is_fitted_on_X():
    X = _data(n=30, d=8, seed=3) / 3
    rf = RandomFeatures(kernel="softmax", estimator="oprf", n_components=512, random_state=0).fit(X)
    assert float(rf.feature_map_.A_) < 0  # FAVOR++ chose A < 0 from the data
    Z = rf.transform(X)
    K = np.exp(X @ X.T)
    assert np.linalg.norm(Z @ Z.T - K) / np.linalg.norm(K) < 0.15


def test_softmax_overflow_warns():
    # trig features carry e^{gamma |x|^2 / 2} = e^{1600}; (positive ones underflow instead: their
    # estimate of e^{3200} is hopeless but finite)
    X = np.full((3, 2), 40.0)
    with pytest.warns(RuntimeWarning, match="overflowed"):
        RandomFeatures(kernel="softmax", estimator="trig-sincos", n_components=4, random_state=0).fit_transform(X)


def test_softmax_outside_its_regime_warns_with_advice():
    """The softmax kernel at the default gamma = 1 on standard-normal data (gamma*|x|^2 = 16) has a
    Gram error of 1.0 (the features approximate nothing): fit warns with the closed form's
    prediction and the advice to shrink gamma; at gamma = 0.05 (error 0.13) it is silent."""
    from kernelapprox import KernelApproxWarning

    X = np.random.default_rng(0).normal(size=(200, 16))
    with pytest.warns(KernelApproxWarning, match=r"relative kernel MSE of .*gamma\*\|x\|\^2 = 1\d\.\d") as rec:
        rf = RandomFeatures(kernel="softmax", n_components=256, gamma=1.0, random_state=0).fit(X)
    assert rec[0].filename == __file__  # the user's line, not scikit-learn's wrapper
    Z = rf.transform(X)
    K = np.exp(X @ X.T)
    assert np.linalg.norm(Z @ Z.T - K) / np.linalg.norm(K) > 0.9  # the warning is right
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelApproxWarning)
        rf = RandomFeatures(kernel="softmax", n_components=256, gamma=0.05, random_state=0).fit(X)
    Z = rf.transform(X)
    K = np.exp(0.05 * X @ X.T)
    assert np.linalg.norm(Z @ Z.T - K) / np.linalg.norm(K) < 0.3
