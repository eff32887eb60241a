"""Deterministic maps of ``kernelapprox.maps.deterministic``: Based's Taylor map and Nyström features.

No statistics here: both maps are deterministic (given the landmarks), so every check is an
identity or a measured error with a fixed input.

* Taylor: ``phi(q).phi(k) = 1 + q.k + (q.k)^2 / 2`` to float64 rounding, its error against
  ``exp`` (Lagrange remainder ``-e^xi u^3 / 6``), Based's scaling, stabilised features that stay
  finite at any finite input.
* Nyström: exact (kernel and attention) when the landmarks are the keys; error decreasing with the
  number of landmarks on Gaussian data, fitted landmarks beating the data-free fallback; per-head
  and per-batch-element fitting; finiteness at large norms in float32 and bfloat16; the unfitted
  fallback and its warning; validation messages.
"""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch
from conftest import F64, randn, with_norm

import kernelapprox as ka
from kernelapprox.maps.deterministic import NystromFeatures, TaylorFeatures

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def no_fallback_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


# ------------------------------------------------------------------------------------------ Taylor


def test_taylor_identity():
    est = ka.get_estimator("taylor")
    assert est.cls is TaylorFeatures and not est.is_random and not est.positive
    assert est.closed_forms() == {"exact_error"}
    for d in (1, 2, 5, 16):
        fm = est.build(d, 7, seed=0, sampler="orthogonal", batch_shape=(3,))  # random-map args ignored
        assert fm.num_features == d and fm.batch_shape == ()
        assert fm.feature_dim == est.feature_dim(7, d) == 1 + d + d * (d + 1) // 2
        q, k = randn(2, 9, d, seed=d, scale=0.7), randn(11, d, seed=d + 1, scale=0.7)
        u = q @ k.mT
        want = 1 + u + u * u / 2
        torch.testing.assert_close(fm(q) @ fm(k).mT, want, rtol=1e-14, atol=0)
        torch.testing.assert_close(fm.kernel(q, k), want, rtol=1e-14, atol=0)
        assert fm(q).shape == (2, 9, fm.feature_dim)


def test_taylor_error_against_exp():
    """Error 1 + u + u^2/2 - e^u = -e^xi u^3 / 6 (xi between 0 and u): negative for u > 0, positive
    for u < 0, |err| <= e^max(u, 0) |u|^3 / 6; relative error 1.44e-2 at u = 0.5, 0.323 at u = 2
    (e^u - 5 = 2.389), and deterministic_error returns it exactly (float64)."""
    fm = TaylorFeatures(4)
    u = torch.tensor([-3.0, -1.0, -0.5, -0.1, 0.0, 0.1, 0.5, 1.0, 2.0, 3.0], dtype=F64)
    q = torch.zeros(len(u), 4, dtype=F64)
    q[:, 0] = u
    k = torch.zeros(1, 4, dtype=F64)
    k[0, 0] = 1.0
    err = torch.as_tensor(ka.theory.deterministic_error(fm, q, k))[:, 0]
    torch.testing.assert_close(err, 1 + u + u * u / 2 - torch.exp(u), rtol=1e-13, atol=1e-15)
    assert (err[u > 0] < 0).all() and (err[u < 0] > 0).all() and err[u == 0].item() == 0
    bound = torch.exp(u.clamp_min(0)) * u.abs() ** 3 / 6
    assert (err.abs() <= bound * (1 + 1e-12)).all()
    rel = (err / torch.exp(u)).abs()
    assert abs(rel[6].item() - 0.01439) < 1e-5 and abs(rel[8].item() - 0.32332) < 1e-5
    torch.testing.assert_close(torch.as_tensor(ka.theory.mse(fm, q, k))[:, 0], err**2, rtol=1e-12, atol=0)


def test_taylor_is_based_on_prescaled_inputs():
    """Based's map on raw inputs, [1, x / d^(1/4), (x (x) x) / (sqrt(2) sqrt(d))], is this map on
    x d^(-1/4): phi(q d^-1/4).phi(k d^-1/4) = 1 + q.k / sqrt(d) + (q.k)^2 / (2 d)."""
    d = 16
    q, k = randn(5, d, seed=3), randn(6, d, seed=4)
    fm = TaylorFeatures(d)
    u = q @ k.T / math.sqrt(d)
    based_q = torch.cat([torch.ones(5, 1, dtype=F64), q / d**0.25, (q[:, :, None] * q[:, None, :]).flatten(1) / math.sqrt(2 * d)], 1)
    based_k = torch.cat([torch.ones(6, 1, dtype=F64), k / d**0.25, (k[:, :, None] * k[:, None, :]).flatten(1) / math.sqrt(2 * d)], 1)
    torch.testing.assert_close(based_q @ based_k.T, 1 + u + u * u / 2, rtol=1e-13, atol=0)
    torch.testing.assert_close(fm.kernel(q / d**0.25, k / d**0.25), based_q @ based_k.T, rtol=1e-13, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_taylor_features_stabilised(dtype):
    """|f| <= 1 (unit norm: |phi(x)|^2 = 1 + |x|^2 + |x|^4/2 exactly), float64 log scale, finite
    at |x| = 1e20 where x_i x_j overflows float32; float32/bf16 kernels within float32 rounding of
    the float64 kernel on the same (rounded) inputs."""
    fm = TaylorFeatures(6)
    x = randn(2, 7, 6, seed=5)
    for norm in (0.5, 30.0, 1e20):
        xd = with_norm(x, norm).to(dtype)
        for shared in (False, True):
            f, ls = fm.log_features(xd, shared=shared)
            assert f.dtype == torch.float32 and ls.dtype == F64 and torch.isfinite(f).all() and torch.isfinite(ls).all()
            assert f.abs().max() <= 1 + 1e-6
            if not shared:
                torch.testing.assert_close(f.double().norm(dim=-1), torch.ones(2, 7, dtype=F64), rtol=1e-6, atol=0)
        K, K64 = fm.kernel(xd, xd), fm.kernel(xd.double(), xd.double())
        assert K.dtype == dtype and torch.isfinite(K64).all()
        if norm < 1e10:
            torch.testing.assert_close(K.double(), K64, rtol=torch.finfo(dtype).eps, atol=0)
    out = ka.linear_attention(xd, xd, torch.ones(2, 7, 3, dtype=dtype), fm, causal=True)
    assert torch.isfinite(out).all() and out.dtype == dtype


def test_taylor_attention_is_normalised_taylor_kernel():
    q, k, v = randn(3, 2, 12, 4, seed=6, scale=0.6).unbind(0)
    fm = TaylorFeatures(4)
    u = q @ k.mT
    A = 1 + u + u * u / 2
    for causal in (False, True):
        A_ = A.tril() if causal else A
        want = (A_ @ v) / A_.sum(-1, keepdim=True)
        torch.testing.assert_close(ka.linear_attention(q, k, v, fm, causal=causal, chunk_size=5), want, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------- Nyström


def test_nystrom_identity():
    est = ka.get_estimator("nystrom")
    assert est.cls is NystromFeatures and not est.is_random and est.data_dependent and not est.positive
    assert est.feature_dim(12, 5) == 12 and est.closed_forms() == {"exact_error"}


@pytest.mark.parametrize("scale", [0.5, 2.0])
def test_nystrom_exact_with_keys_as_landmarks(scale):
    """L = the keys: K_hat(q, k_j) = e^{q.k_j} and attention equals softmax attention, per head
    (B, H) = (2, 3), d = 8, inputs scale N(0, I) / d^(1/4). The kernel is compared relative to the
    largest entry of its row (measured 5e-15 at scale 0.5, 2.7e-10 at scale 2): the features carry
    an absolute rounding of the size of the row's scale, like trigonometric features (class
    docstring); attention error (measured) 6e-16 and 1.7e-10."""
    d = 8
    q = randn(2, 3, 10, d, seed=7, scale=scale / d**0.25)
    k = randn(2, 3, 24, d, seed=8, scale=scale / d**0.25)
    v = randn(2, 3, 24, 5, seed=9)
    fm = NystromFeatures(d, landmarks=k)
    assert fm.fitted and fm.num_features == 24 and fm.batch_shape == (2, 3) and fm.feature_dim == 24
    K, K_hat = ka.softmax_kernel(q, k), fm.kernel(q, k)
    assert ((K_hat - K).abs() / K.amax(-1, keepdim=True)).max() <= 1e-8
    if scale <= 1:
        torch.testing.assert_close(K_hat, K, rtol=1e-12, atol=0)
    out = ka.linear_attention(q, k, v, fm)
    torch.testing.assert_close(out, ka.softmax_attention(q, k, v), rtol=1e-8, atol=1e-8)
    qc = randn(2, 3, 24, d, seed=10, scale=scale / d**0.25)
    out_c = ka.linear_attention(qc, k, v, fm, causal=True, chunk_size=7)
    torch.testing.assert_close(out_c, ka.softmax_attention(qc, k, v, causal=True), rtol=1e-8, atol=1e-8)
    assert fm.fit(q, q) is fm and torch.equal(fm.landmarks_, k)  # fit() keeps given landmarks


def test_nystrom_error_decreases_with_landmarks():
    """Relative Frobenius error of K_hat on q, k ~ 0.5 N(0, I) / d^(1/4), d = 8, n = 256 keys
    (measured): segment means 2.0e-1, 4.9e-2, 1.2e-2, 4.9e-3 and k-means++ 2.3e-1, 7.6e-2, 1.4e-2,
    3.9e-3 at m = 4, 16, 64, 128; the data-free fallback (N(0, I / sqrt d)) 6.7e-1 ... 3.1e-2,
    2.5-8x worse than the fitted landmarks at every m; m = n segment means (the keys) exact."""
    d, n = 8, 256
    g = torch.Generator().manual_seed(1)
    q = 0.5 * torch.randn(n, d, generator=g, dtype=F64) / d**0.25
    k = 0.5 * torch.randn(n, d, generator=g, dtype=F64) / d**0.25
    K = torch.exp(q @ k.T)

    def err(fm):
        return float((fm.kernel(q, k) - K).norm() / K.norm())

    errs = {}
    for rule in ("segment-means", "kmeans++", "fallback"):
        for m in (4, 16, 64, 128):
            fm = NystromFeatures(d, m, landmarks="segment-means" if rule == "fallback" else rule, seed=0, dtype=F64)
            if rule == "fallback":
                with pytest.warns(UserWarning, match="fit"):
                    errs[rule, m] = err(fm)
            else:
                errs[rule, m] = err(fm.fit(q, k))
    print("\n", {key: f"{e:.2e}" for key, e in errs.items()})
    for rule in ("segment-means", "kmeans++", "fallback"):
        seq = [errs[rule, m] for m in (4, 16, 64, 128)]
        assert all(a > b for a, b in zip(seq, seq[1:], strict=False)), (rule, seq)
    for m in (4, 16, 64, 128):
        assert errs["segment-means", m] < errs["fallback", m] / 2 and errs["kmeans++", m] < errs["fallback", m]
    assert errs["segment-means", 128] < 1e-2
    assert err(NystromFeatures(d, n, dtype=F64).fit(q, k)) < 1e-8  # segments of one key: the keys


def test_nystrom_fit_per_head_and_batch():
    """fit on (B, H, n, d) keys: landmarks (B, H, m, d), each the segment means (or k-means++
    centres, which are keys) of its own sequence, and each head's map equals a map fitted on that
    head alone. A map built per head (batch_shape (H,)) fitted on one shared sequence broadcasts."""
    B, H, n, d, m = 2, 3, 20, 4, 6
    q, k = randn(B, H, n, d, seed=11, scale=0.5), randn(B, H, n, d, seed=12, scale=0.5)
    fm = NystromFeatures(d, m, dtype=F64).fit(q, k)
    assert fm.landmarks_.shape == (B, H, m, d) and fm.batch_shape == (B, H)
    sizes = [len(s) for s in torch.tensor_split(torch.arange(n), m)]
    starts = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    for j in range(m):
        torch.testing.assert_close(fm.landmarks_[..., j, :], k[..., starts[j] : starts[j + 1], :].mean(-2))
    K = fm.kernel(q, k)
    for b in range(B):
        for h in range(H):
            one = NystromFeatures(d, m, dtype=F64).fit(q[b, h], k[b, h])
            torch.testing.assert_close(K[b, h], one.kernel(q[b, h], k[b, h]), rtol=1e-12, atol=0)
    km = NystromFeatures(d, m, landmarks="kmeans++", seed=3, dtype=F64).fit(q, k)
    is_key = (km.landmarks_.unsqueeze(-2) == k.unsqueeze(-3)).all(-1).any(-1)  # (B, H, m)
    assert is_key.all()
    again = NystromFeatures(d, m, landmarks="kmeans++", seed=3, dtype=F64).fit(q, k)
    assert torch.equal(km.landmarks_, again.landmarks_)  # deterministic given the seed
    per_head = NystromFeatures(d, m, batch_shape=(H,), dtype=F64).fit(q[0, 0], k[0, 0])
    assert per_head.landmarks_.shape == (H, m, d) and per_head.batch_shape == (H,)
    with pytest.raises(ValueError, match=r"batch_shape \(3,\)"):
        NystromFeatures(d, m, batch_shape=(H,)).fit(q[:, :2], k[:, :2])
    out = ka.linear_attention(q, k, randn(B, H, n, 2, seed=13), NystromFeatures(d, m, dtype=F64), fit=True)
    assert out.shape == (B, H, n, 2) and torch.isfinite(out).all()


def test_nystrom_query_scale_keeps_denominators_order_one():
    """Keys of varied norms (|k|^2 / 2 from 0.4 to 18, scale 2), keys as landmarks: with the
    log_features normalisation some stabilised denominators phi(q).z e^{-(s_q + M)} are below the
    signed-map guard eps = 1e-6 (measured min 4.7e-7) and the guard would corrupt the output (error
    0.70 before query_features rescaled rows); with query_features they are >= 1.0 (measured), and
    the fast forms equal the naive (unguarded) reference and softmax attention (1.9e-10)."""
    d = 8
    q = randn(2, 3, 24, d, seed=10, scale=2.0 / d**0.25)
    k = randn(2, 3, 24, d, seed=8, scale=2.0 / d**0.25)
    v = randn(2, 3, 24, 5, seed=9)
    fm = NystromFeatures(d, landmarks=k)
    fk, _ = fm.key_log_features(k, shared=True)
    z = fk.sum(-2).unsqueeze(-1)
    assert (fm.log_features(q)[0] @ z).min() < 1e-6  # what the guard would see without the rescaling
    assert (fm.query_features(q) @ z).min() > 0.5
    out = ka.linear_attention(q, k, v, fm)
    torch.testing.assert_close(out, ka.naive_linear_attention(q, k, v, fm), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out, ka.softmax_attention(q, k, v), rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [1.0, 10.0, 30.0])
def test_nystrom_finite_at_large_norms(dtype, norm):
    """Inputs of norm up to 30 (e^{q.k} up to e^900, beyond float64): bounded features with a
    float64 log scale and finite attention in every form, fitted or with the keys as landmarks.
    With the keys as landmarks (float32 map) non-causal attention equals softmax attention to
    float32 rounding (measured 1.6e-5 at norm 10); causal attention only at norm 1: at large norms a
    query's scale is set by its nearest landmark, possibly a *future* key, and the past keys'
    weights fall below float32 resolution relative to it (class docstring)."""
    d, n = 16, 32
    q = with_norm(randn(2, n, d, seed=14), norm)
    k = with_norm(randn(2, n, d, seed=15), norm)
    v = randn(2, n, 4, seed=16)
    qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
    for fm in (NystromFeatures(d, landmarks=kd.float()), NystromFeatures(d, 8).fit(qd, kd)):
        for shared in (False, True):
            f, ls = fm.log_features(kd, shared=shared)
            assert f.dtype == torch.float32 and ls.dtype == F64
            assert torch.isfinite(f).all() and torch.isfinite(ls).all() and f.abs().max() <= 1
        for causal in (False, True):
            out = ka.linear_attention(qd, kd, vd, fm, causal=causal, chunk_size=8)
            assert out.dtype == dtype and torch.isfinite(out).all()
            if fm.num_features == n and (norm == 1.0 or not causal):
                ref = ka.softmax_attention(qd.double(), kd.double(), vd.double(), causal=causal)
                tol = 1e-4 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
                assert (out.double() - ref).abs().max() <= tol * v.abs().max()


def test_nystrom_fallback_warning_and_reproducibility():
    """Unfitted: landmarks from N(0, I / sqrt d) drawn with the seed (reproducible; torch's default
    generator with no seed), a UserWarning at the first use only, none once fitted."""
    d, m = 16, 400
    a, b = NystromFeatures(d, m, seed=4, dtype=F64), NystromFeatures(d, m, seed=4, dtype=F64)
    assert not a.fitted and torch.equal(a.landmarks_, b.landmarks_)
    L = a.landmarks_
    assert abs(float(L.std()) - d**-0.25) < 0.02 and abs(float(L.mean())) < 0.01
    torch.manual_seed(0)
    c = NystromFeatures(d, 3)
    torch.manual_seed(0)
    assert torch.equal(c.landmarks_, NystromFeatures(d, 3).landmarks_)
    x = randn(5, d, seed=17, scale=0.3)
    with pytest.warns(UserWarning, match=r"fit\(q, k\)"):
        a(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a(x)  # once per map
        fitted = NystromFeatures(d, 4, seed=4).fit(x, x)
        fitted(x)
        NystromFeatures(d, landmarks=x)(x)


def test_nystrom_duplicate_landmarks_and_state_dict(no_fallback_warning):
    """Coincident landmarks make G singular: the pseudo-inverse keeps the map exact on the distinct
    keys; the fitted landmarks are a buffer (saved, loaded, moved by .to())."""
    d = 4
    k = randn(6, d, seed=18, scale=0.5)
    L = torch.cat([k, k[:3]])  # 9 landmarks, rank 6
    fm = NystromFeatures(d, landmarks=L)
    q = randn(4, d, seed=19, scale=0.5)
    torch.testing.assert_close(fm.kernel(q, k), ka.softmax_kernel(q, k), rtol=1e-8, atol=0)
    ridge = NystromFeatures(d, landmarks=L, ridge=1e-6)
    torch.testing.assert_close(ridge.kernel(q, k), ka.softmax_kernel(q, k), rtol=1e-4, atol=0)
    src = NystromFeatures(d, 3, dtype=F64).fit(q, k)
    dst = NystromFeatures(d, 3, dtype=F64)
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    assert not dst.fitted
    dst.load_state_dict(torch.load(buf))
    assert dst.fitted  # the flag travels with the landmarks
    torch.testing.assert_close(dst.kernel(q, k), src.kernel(q, k), rtol=0, atol=0)
    src.float()
    assert src.landmarks_.dtype == torch.float32 and src(q.float()).dtype == torch.float32
    assert src.get_params()["landmarks"] == "segment-means"


def test_nystrom_validation_messages():
    with pytest.raises(ValueError, match=r"landmarks must be one of \('segment-means', 'kmeans\+\+'\).*'kmeans'"):
        NystromFeatures(4, 8, landmarks="kmeans")
    with pytest.raises(ValueError, match=r"landmarks must have shape \(\*batch_shape, m, 4\).*\(8, 3\)"):
        NystromFeatures(4, landmarks=torch.randn(8, 3))
    with pytest.raises(TypeError, match=r"landmarks.*int64"):
        NystromFeatures(4, landmarks=torch.ones(8, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"num_features=5 does not match the 8 landmarks"):
        NystromFeatures(4, 5, landmarks=torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"num_features .* is required"):
        NystromFeatures(4)
    with pytest.raises(ValueError, match=r"num_features must be a positive int, got 0"):
        NystromFeatures(4, 0)
    with pytest.raises(ValueError, match=r"ridge must be a finite float >= 0, got -1"):
        NystromFeatures(4, 8, ridge=-1.0)
    with pytest.raises(ValueError, match=r"rcond"):
        NystromFeatures(4, 8, rcond=2.0)
    fm = NystromFeatures(4, 8, seed=0)
    with pytest.raises(ValueError, match=r"need at least num_features=8 keys, got k with 5"):
        fm.fit(torch.randn(5, 4), torch.randn(5, 4))
    with pytest.raises(ValueError, match=r"k has last dimension 3, expected dim=4"):
        fm.fit(torch.randn(9, 4), torch.randn(9, 3))
    with pytest.raises(TypeError, match=r"\bq\b"):
        fm.fit(torch.ones(9, 4, dtype=torch.int64), torch.randn(9, 4))
    with pytest.raises(ValueError, match=r"dim=4"):
        fm.kernel(torch.randn(3, 5), torch.randn(3, 4))
