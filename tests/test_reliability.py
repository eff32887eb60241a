"""What the library promises under faults: checkpoints round-trip (fitted maps included), finite
gradients wherever the output is finite, empty batches, fits on degenerate but valid data,
non-finite fit data refused at the call, and the hybrid kernel in the log domain."""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings

import numpy as np
import pytest
import torch

import kernelapprox as ka
from kernelapprox.attention.state import LinearAttentionState

ESTIMATORS = list(ka.estimators())
NAMES = [e.name for e in ESTIMATORS]
DATA_DEPENDENT = [e.name for e in ESTIMATORS if e.data_dependent]


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _unit(shape, norm, g, dtype=torch.float32):
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    return (x / x.norm(dim=-1, keepdim=True) * norm).to(dtype)


# --------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_over_the_registry(name):
    """Fit (data-dependent maps) -> state_dict -> weights-only load into a map built the same way
    with another seed -> identical kernel and attention (parallel and causal)."""
    est = ka.get_estimator(name)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 24, 8, generator=g, dtype=torch.float64) * torch.linspace(0.1, 0.5, 8, dtype=torch.float64)
    k = torch.randn(2, 3, 24, 8, generator=g, dtype=torch.float64) * torch.linspace(0.5, 0.1, 8, dtype=torch.float64)
    v = torch.randn(2, 3, 24, 4, generator=g, dtype=torch.float64)
    fm = est.build(8, 16, seed=0, dtype=torch.float64)
    if fm.data_dependent:
        fm.fit(q, k)
    fresh = est.build(8, 16, seed=1, dtype=torch.float64)
    fresh.load_state_dict(_roundtrip(fm.state_dict()))
    assert torch.equal(fresh.kernel(q, k), fm.kernel(q, k))
    for causal in (False, True):
        a = ka.linear_attention(q, k, v, fm, causal=causal, check=False)
        b = ka.linear_attention(q, k, v, fresh, causal=causal, check=False)
        assert torch.equal(a, b)
    if hasattr(fm, "fitted"):
        assert fresh.fitted == fm.fitted


@pytest.mark.parametrize("name", ["oprf", "saderf", "sderf"])
def test_fitted_statistics_are_float64_buffers_that_follow_the_device(name):
    fm = ka.get_estimator(name).build(8, 16, seed=0)
    q = torch.randn(3, 20, 8) * torch.linspace(0.1, 0.5, 8)
    fm.fit(q, q.flip(-1))
    stats = {n: b for n, b in fm.named_buffers() if n.endswith("_") and b.is_floating_point()}
    assert stats and set(stats) <= set(fm.state_dict())
    assert all(b.dtype == torch.float64 for b in stats.values())
    assert fm.fitted and "fitted_" in fm.state_dict()
    half = fm.to(torch.bfloat16)
    assert all(getattr(half, n).dtype == torch.float64 for n in stats)
    assert half.weight.dtype == torch.bfloat16
    meta = ka.get_estimator(name).build(8, 16, seed=0).fit(q, q).to("meta")
    assert all(getattr(meta, n).device.type == "meta" for n in stats)


def test_nystrom_refits_a_smaller_batch_and_loads_into_a_fresh_map():
    fm = ka.NystromFeatures(8, 4, batch_shape=(3,))
    k = torch.randn(2, 3, 16, 8)
    fm.fit(k, k)
    assert fm.batch_shape == (2, 3)
    fm.fit(k[:1], k[:1])  # a smaller last batch
    assert fm.batch_shape == (1, 3)
    fresh = ka.NystromFeatures(8, 4, batch_shape=(3,))
    fresh.load_state_dict(_roundtrip(fm.state_dict()))
    assert fresh.fitted and fresh.batch_shape == (1, 3)
    assert torch.equal(fresh.kernel(k[:1], k[:1]), fm.kernel(k[:1], k[:1]))
    other = ka.NystromFeatures(8, 4, batch_shape=(5,))  # built otherwise: a clear size mismatch
    with pytest.raises(RuntimeError, match="landmarks_"):
        other.load_state_dict(fm.state_dict())


@pytest.mark.parametrize("name", ["positive", "nystrom", "oprf", "sderf", "hedgehog"])
@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_module_round_trip(name, causal):
    fit = ka.get_estimator(name).data_dependent
    torch.manual_seed(0)
    m = ka.nn.LinearAttention(16, heads=2, feature_map=name, num_features=8, fit=fit, causal=causal)
    x = torch.randn(3, 20, 16)
    y = m(x)  # a fitted map is fitted here
    torch.manual_seed(1)
    m2 = ka.nn.LinearAttention(16, heads=2, feature_map=name, num_features=8, fit=fit, causal=causal)
    m2.load_state_dict(_roundtrip(m.state_dict()))
    assert torch.equal(m2(x), y)
    assert m2(x[:1]).shape == (1, 20, 16)  # a smaller last batch after loading


def test_linear_attention_state_loads_weights_only():
    fm = ka.PositiveRF(8, 16, seed=0)
    q, k, v = torch.randn(3, 2, 10, 8).unbind(0)
    out, state = ka.linear_attention(q / 2, k / 2, v, fm, causal=True, return_state=True, check=False)
    back = _roundtrip({"state": state})["state"]
    assert isinstance(back, LinearAttentionState)
    assert torch.equal(back.kv, state.kv) and torch.equal(back.log_scale, state.log_scale)
    nxt = torch.randn(3, 2, 4, 8).unbind(0)
    a = ka.linear_attention(nxt[0] / 2, nxt[1] / 2, nxt[2], fm, causal=True, initial_state=state, check=False)
    b = ka.linear_attention(nxt[0] / 2, nxt[1] / 2, nxt[2], fm, causal=True, initial_state=back, check=False)
    assert torch.equal(a, b)


def test_sklearn_random_features_round_trip():
    from sklearn.base import clone

    from kernelapprox.sklearn import RandomFeatures

    X = np.random.default_rng(0).normal(size=(30, 5))
    rf = RandomFeatures(n_components=16, random_state=0).fit(X)
    back = pickle.loads(pickle.dumps(rf))
    np.testing.assert_array_equal(back.transform(X), rf.transform(X))
    again = clone(rf).fit(X)  # get_params round trip: same random_state, same features
    np.testing.assert_array_equal(again.transform(X), rf.transform(X))


# ------------------------------------------------------------------------------------ gradients
#: Seeds, at r = 32, d = 16, n = 8, at which float32 OPRF/SADERF/SDERF gave non-finite gradients
#: behind a finite output at |q| = |k| = 20 (parallel: 3, 4; causal: 0, 2), per form: a query whose
#: attention denominator underflows (the features of a fitted FAVOR++/FAVOR# map are peaked,
#: A* << 0) got a gradient 1/den that overflowed, and inf * 0 turned it into NaN. The parallel form
#: shifts the features per feature and per query (`kernelapprox.attention._common.doubly_shifted`),
#: the causal form recomputes such rows with per-feature causal scales
#: (`kernelapprox.attention.linear.chunk.per_feature_attention`): every denominator is then >= 1.
#: More seeds: tests/test_causal_grad.py.
GRAD_SEEDS = {False: (3, 4), True: (0, 2)}


@pytest.mark.parametrize(
    ("name", "dtype", "norm", "causal"),
    [
        (n, dt, nm, c)
        for n in NAMES
        for dt in (torch.float32, torch.bfloat16)
        for nm in (1.0, 5.0, 12.0, 20.0)
        for c in (False, True)
    ],
)
def test_gradients_finite_where_the_output_is(name, dtype, norm, causal):
    est = ka.get_estimator(name)
    for seed in GRAD_SEEDS[causal]:
        g = torch.Generator().manual_seed(seed)
        q, k = torch.randn(2, 2, 8, 16, generator=g).mul(norm).unbind(0)
        q = (q / q.norm(dim=-1, keepdim=True) * norm).to(dtype).requires_grad_()
        k = (k / k.norm(dim=-1, keepdim=True) * norm).to(dtype).requires_grad_()
        v = torch.randn(2, 8, 4, generator=g).to(dtype)
        fm = est.build(16, 8 if est.data_dependent and not est.is_random else 32, seed=seed)  # Nystrom: m <= n
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = ka.linear_attention(q, k, v, fm, causal=causal, fit=est.data_dependent, check=False)
        if not bool(out.isfinite().all()):
            continue
        out.float().sum().backward()
        assert q.grad is not None and k.grad is not None
        assert bool(q.grad.isfinite().all()) and bool(k.grad.isfinite().all()), f"seed {seed}"


# ---------------------------------------------------------------------------------- empty batch
FORMS = ("parallel", "causal", "recurrent", "naive", "naive-causal", "naive-recurrent")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", NAMES)
def test_empty_batch_over_registry_and_forms(name, form):
    est = ka.get_estimator(name)
    fm = est.build(8, 16, seed=0)
    n = 20
    q = torch.randn(0, 2, n, 8, requires_grad=True)
    v = torch.randn(0, 2, n, 4)
    fit = est.data_dependent
    # the forms without fit= use a data-dependent map unfitted: it says so (once per map)
    unfitted = getattr(fm, "fitted", True) is False and form not in ("parallel", "causal")
    with pytest.warns(UserWarning, match="used before fit") if unfitted else contextlib.nullcontext():
        if form == "parallel":
            o = ka.linear_attention(q, q, v, fm, fit=fit, check=False)
        elif form == "causal":
            o = ka.linear_attention(q, q, v, fm, causal=True, fit=fit, check=False)
        elif form == "recurrent":
            rnn = ka.RecurrentLinearAttention(fm)
            o = torch.stack([rnn.step(q[..., t, :], q[..., t, :], v[..., t, :]) for t in range(n)], dim=-2)
        elif form == "naive":
            o = ka.naive_linear_attention(q, q, v, fm)
        elif form == "naive-causal":
            o = ka.naive_linear_attention(q, q, v, fm, causal=True)
        else:
            o = ka.naive_recurrent_linear_attention(q, q, v, fm)
    ref = ka.softmax_attention(q, q, v, causal="causal" in form or "recurrent" in form)
    assert o.shape == ref.shape == (0, 2, n, 4)
    o.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_empty_batch_module(name, causal):
    fit = ka.get_estimator(name).data_dependent
    m = ka.nn.LinearAttention(16, heads=2, feature_map=name, num_features=8, fit=fit, causal=causal)
    assert m(torch.randn(0, 20, 16)).shape == (0, 20, 16)


# ------------------------------------------------------------------------- fits on valid data
def _opposite_tokens():
    """Identical-token float32 sequences and their negation (k = -q): mean |q + k|^2 is exactly 0,
    the three rounded terms of it are not (about -1e-8 here, -1e-17 in float64)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 1, 5, generator=g).expand(1, 8, 5) for _ in range(12)]


@pytest.mark.parametrize("name", ["oprf", "saderf", "sderf"])
def test_fit_accepts_exactly_opposite_tokens(name):
    for q in _opposite_tokens():
        fm = ka.get_estimator(name).build(5, 4, seed=0).fit(q, -q)
        assert bool(fm.A_.isfinite().all()) and bool((fm.A_ <= 0).all())
        assert float(fm.A_.abs().max()) < 1e-5  # A*(t ~ 0) ~ 0: FAVOR+
    q = torch.tensor([[0.7]], dtype=torch.float64)
    fm = ka.get_estimator(name).build(1, 4, seed=0).fit(q, -q)
    assert float(fm.A_.abs().max()) == 0.0


def test_optimal_A_fit_never_names_t():
    """The error of a bad fit names the user's argument, never an internal one."""
    q = torch.randn(4, 3)
    for name in DATA_DEPENDENT:
        fm = ka.get_estimator(name).build(3, 2, seed=0)
        with pytest.raises(ValueError, match=r"finite k\b") as info:
            fm.fit(q, torch.full((4, 3), float("inf")))
        assert " t " not in str(info.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("arg", ["q", "k"])
@pytest.mark.parametrize("name", DATA_DEPENDENT)
def test_fit_rejects_non_finite_data_naming_the_argument(name, arg, bad):
    fm = ka.get_estimator(name).build(4, 2, seed=0)
    q, k = torch.randn(2, 6, 4), torch.randn(2, 6, 4)
    (q if arg == "q" else k)[1, 3, 2] = bad
    with pytest.raises(ValueError, match=rf"needs finite {arg}\b"):
        fm.fit(q, k)


# ----------------------------------------------------------------------------------- hybrid
def test_hybrid_kernel_exact_at_plus_minus_q_at_any_norm():
    fm = ka.HybridRF(8, 16, seed=0, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    for norm in (1.0, 5.0, 12.0, 20.0, 26.0, 27.0, 30.0):
        x = _unit((4, 8), norm, g, torch.float64)
        K_minus = torch.diagonal(fm.kernel(x, -x))
        exact = torch.exp(-(x * x).sum(-1))
        assert bool(K_minus.isfinite().all())
        torch.testing.assert_close(K_minus, exact, rtol=1e-9, atol=0)
        K_plus = torch.diagonal(fm.kernel(x, x))
        exact = torch.exp((x * x).sum(-1))
        assert not bool(K_plus.isnan().any())
        torch.testing.assert_close(K_plus, exact, rtol=1e-9, atol=0)  # inf where e^{|x|^2} is


def test_hybrid_kernel_finite_where_the_exact_kernel_is():
    fm = ka.HybridRF(8, 16, seed=0, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    q, k = _unit((40, 8), 20.0, g, torch.float64), _unit((40, 8), 50.0, g, torch.float64)
    K = fm.kernel(q, k)
    assert not bool(K.isnan().any())
    # agrees with the feature product where both are representable
    P = fm(q) @ fm.key_features(k).mT
    ok = P.isfinite() & (P.abs() > 1e-300)
    torch.testing.assert_close(K[ok], P[ok], rtol=1e-6, atol=0)


def test_hybrid_float32_kernel_is_the_float64_estimate_rounded():
    """In float32 the estimate overflows only where its own value exceeds the float32 range
    (the sin/cos part carries e^{(|q|^2 + |k|^2)/2}: 1e43 at |q| = |k| = 10)."""
    fm = ka.HybridRF(8, 16, seed=0)
    g = torch.Generator().manual_seed(3)
    q, k = _unit((40, 8), 10.0, g), _unit((40, 8), 10.0, g)
    K32 = fm.kernel(q, k)
    K64 = fm.kernel(q.double(), k.double())
    assert not bool(K32.isnan().any())
    torch.testing.assert_close(K32, K64.to(torch.float32), rtol=1e-6, atol=0)
