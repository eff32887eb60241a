"""Projection samplers: orthogonality, N(0, I) marginals, per-row unbiasedness, determinism.

Statistical checks draw from ``conftest.seed`` (base ``KERNELAPPROX_TEST_SEED``, default 0: the
default run is deterministic) and carry the ``statistical`` marker; each one is also shown to
*fail* on a deliberately wrong construction (the Performer QR without sign correction), so none is
vacuous. z-statistic: see conftest.py (|z| < Z_MAX = 4.5).

KS p-value threshold ``P_MIN = 6.8e-6`` = P(|N(0,1)| > 4.5), the false-alarm level of every z-check
of the suite. (It was 1e-3: with 72 KS tests in ``test_rows_have_standard_normal_marginal`` that is
a family-wise false-alarm rate of ~7 % per run, about one spurious failure per 20-seed sweep.) To
keep the power, the iid and orthogonal marginals use S = 12 000 draws (was 5000). Measured power
(200 repetitions) at S = 12 000, P_MIN = 6.8e-6: a 0.1-sd shift of ``w.u`` is flagged with
probability 1.0, a 5 % scale change of ``|w|^2`` with 0.975 (the old S = 5000, p < 1e-3: 1.0 and
0.71). QMC rows now use the same S = 12 000 (their scramble is vectorised; they used S = 2000,
with power 0.22 against a 0.1-sd shift, while scipy scrambled one draw at a time); the QMC
estimators' unbiasedness is resolved to 1 % in ``test_unbiased.py``. The uncorrected QR gives p < 1e-10 (asserted below).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import F64, Z_MAX, seed, zscores
from scipy import stats

import kernelapprox as ka
from kernelapprox.samplers import OrthogonalSampler, QMCSampler, StructuredSampler, make_generator

P_MIN = 2 * stats.norm.sf(Z_MAX)  # 6.8e-6 (module docstring)


def weights(sampler, d, r, S, seed=0, dtype=F64):
    return ka.PositiveRF(d, r, sampler=sampler, seed=seed, batch_shape=(S,), dtype=dtype).weight


def performer_uncorrected_orf(d, r, S, seed):
    """The widely copied construction: rows of Q^T from a plain QR (no sign(diag R) fix), chi norms."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-r // d)
    Q, _ = torch.linalg.qr(torch.randn(S, nb, d, d, generator=g, dtype=F64))
    W = Q.mT.reshape(S, nb * d, d)[:, :r]
    norms = torch.randn(S, r, d, generator=g, dtype=F64).norm(dim=-1)
    return W * norms[..., None]


def sign_corrected_orf(d, r, S, seed):
    """Mezzadri's fix written out independently of the library: Q diag(sign(diag R))."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-r // d)
    Q, R = torch.linalg.qr(torch.randn(S, nb, d, d, generator=g, dtype=F64))
    Q = Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)
    W = Q.mT.reshape(S, nb * d, d)[:, :r]
    norms = torch.randn(S, r, d, generator=g, dtype=F64).norm(dim=-1)
    return W * norms[..., None]


# --------------------------------------------------------------------------- per-row unbiasedness

X_PERF = torch.tensor([1.0, 0.5, -0.3, 0.2], dtype=F64)  # the x of the Performer bug report
S_ROW = 20_000


def per_row_z(W: torch.Tensor) -> torch.Tensor:
    """z-score of the per-row mean of exp(w_i.x - |x|^2/2) (true value 1), computed through the
    library's PositiveRF on the given projection W (S, r, d)."""
    r = W.shape[-2]
    fm = ka.PositiveRF.from_projection(W)
    draws = fm(X_PERF[None]).squeeze(-2) * math.sqrt(r)  # (S, r): exp(w_i.x - |x|^2/2)
    torch.testing.assert_close(draws, torch.exp(W @ X_PERF - 0.5 * X_PERF.dot(X_PERF)), rtol=1e-12, atol=0)
    z, se = zscores(draws, 1.0)
    # power: se < 2 % of the row mean, so a per-row bias of 4.5 * 2 % = 9 % shifts z by Z_MAX. The
    # Performer bug moves the row means by 12-68 % (z >= 10 * Z_MAX, asserted below); a subtler
    # per-row bias would also bias the kernel estimate, which test_unbiased.py resolves to 1 %.
    assert (se < 0.02).all()
    return z


@pytest.mark.statistical
@pytest.mark.parametrize("r", [4, 6, 8], ids=["one_block", "partial_block", "two_blocks"])
@pytest.mark.parametrize("sampler", ["orthogonal", OrthogonalSampler(norms="chi")], ids=["name", "object"])
def test_orthogonal_unbiased_per_row(sampler, r):
    """Regression test for the Performer ORF bias (per-row means 0.32, 0.63, 1.21, 1.12 without the
    QR sign correction at d=4): here every row's mean is within Z_MAX standard errors of 1."""
    W = weights(sampler, 4, r, S_ROW, seed=seed(600 + r))
    z = per_row_z(W)
    assert z.shape == (r,)
    assert (z.abs() < Z_MAX).all(), z


@pytest.mark.statistical
def test_per_row_statistic_detects_uncorrected_qr():
    """The same statistic flags torch.linalg.qr without the sign fix (so the test above can fail),
    and passes the fix written out independently."""
    z_bad = per_row_z(performer_uncorrected_orf(4, 4, S_ROW, seed=seed(611)))
    assert z_bad.abs().max() > 10 * Z_MAX, z_bad
    z_good = per_row_z(sign_corrected_orf(4, 4, S_ROW, seed=seed(611)))
    assert (z_good.abs() < Z_MAX).all(), z_good


# --------------------------------------------------------------------------- block-orthogonal structure


@pytest.mark.parametrize("norms", ["chi", "fixed"])
@pytest.mark.parametrize("d,r", [(4, 4), (4, 10), (5, 3), (8, 24)])
def test_orthogonal_blocks(d, r, norms):
    W = weights(OrthogonalSampler(norms=norms), d, r, 50, seed=d * r)
    assert W.shape == (50, r, d)
    sq = (W * W).sum(-1)  # (S, r) squared row norms
    for b in range(-(-r // d)):
        blk = W[:, b * d : (b + 1) * d]
        G = blk @ blk.mT
        torch.testing.assert_close(G, torch.diag_embed(sq[:, b * d : (b + 1) * d]), rtol=0, atol=1e-10)
    if norms == "fixed":
        torch.testing.assert_close(sq, torch.full_like(sq, float(d)), rtol=1e-12, atol=0)
    else:
        assert sq.std() > 0.5  # chi norms really vary (not a disguised fixed norm)
    if r > d:  # blocks are independent draws, not copies
        assert (W[:, :d] - W[:, d : 2 * d]).abs().max() > 0.1


def _marginal_pvalues(W: torch.Tensor, u: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per row i (iid across the S draws): KS of w_i.u vs N(0,1) and of |w_i|^2 vs chi2(d)."""
    d = W.shape[-1]
    p_proj, p_norm = [], []
    for i in range(W.shape[-2]):
        p_proj.append(stats.kstest((W[:, i] @ u).numpy(), "norm").pvalue)
        p_norm.append(stats.kstest((W[:, i] ** 2).sum(-1).numpy(), "chi2", args=(d,)).pvalue)
    return p_proj, p_norm


UNITS = {
    "e1": torch.tensor([1.0, 0, 0, 0], dtype=F64),
    "generic": torch.tensor([0.6, -0.2, 0.7, 0.3], dtype=F64) / math.sqrt(0.98),
}


@pytest.mark.statistical
@pytest.mark.parametrize("u", list(UNITS))
@pytest.mark.parametrize(
    "sampler", ["gaussian", "orthogonal", QMCSampler("sobol")], ids=["gaussian", "orthogonal", "qmc"]
)
def test_rows_have_standard_normal_marginal(sampler, u):
    S = 12_000  # the QMC scramble is vectorised: all draws at once
    W = weights(sampler, 4, 6, S, seed=seed(620))
    p_proj, p_norm = _marginal_pvalues(W, UNITS[u])
    assert min(p_proj) > P_MIN, p_proj
    assert min(p_norm) > P_MIN, p_norm


@pytest.mark.statistical
def test_marginal_test_detects_uncorrected_qr():
    p_proj, _ = _marginal_pvalues(performer_uncorrected_orf(4, 6, 5000, seed=seed(621)), UNITS["e1"])
    assert min(p_proj) < 1e-10


# --------------------------------------------------------------------------- SORF


@pytest.mark.parametrize("d,r", [(8, 8), (8, 20), (16, 40)])
def test_structured_rows_orthogonal(d, r):
    """d a power of two: rows within a block of p = d rows are orthogonal with norm sqrt(p)."""
    W = weights("structured", d, r, 3, seed=1)
    assert W.shape == (3, r, d)
    for b in range(-(-r // d)):
        blk = W[:, b * d : (b + 1) * d]
        eye = torch.eye(blk.shape[-2], dtype=F64).expand(3, -1, -1)
        torch.testing.assert_close(blk @ blk.mT, d * eye, rtol=0, atol=1e-10)
    if r > d:
        assert (W[:, :d] - W[:, d : 2 * d]).abs().max() > 0.1  # independent blocks


def test_structured_padded_dim_columns_orthogonal():
    """d = 5 is zero-padded to p = 8: W is the first d columns of an orthogonal (scaled by sqrt(p))
    p x p block, so W_b^T W_b = p I_d for every full block of p rows."""
    d, p, r = 5, 8, 16
    W = weights("structured", d, r, 3, seed=2)
    for b in range(r // p):
        blk = W[:, b * p : (b + 1) * p]
        torch.testing.assert_close(
            blk.mT @ blk, p * torch.eye(d, dtype=F64).expand(3, -1, -1), rtol=0, atol=1e-10
        )


def test_structured_is_hadamard_product():
    """Each p x p block is sqrt(p) H D1 H D2 H D3: all of its entries have the form
    sqrt(p) * (integer / p^(3/2)), i.e. p * W is an integer matrix (H entries are +-1/sqrt(p))."""
    d = 8
    W = weights("structured", d, d, 2, seed=4)
    M = W * d
    torch.testing.assert_close(M, M.round(), rtol=0, atol=1e-9)
    assert StructuredSampler().name == "structured"


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize(
    "sampler",
    ["gaussian", "orthogonal", OrthogonalSampler("fixed"), "structured", "qmc", QMCSampler("halton")],
    ids=["gaussian", "orthogonal", "orth_fixed", "structured", "qmc_sobol", "qmc_halton"],
)
def test_same_seed_same_projection(sampler):
    w1 = weights(sampler, 5, 9, 3, seed=42)
    w2 = weights(sampler, 5, 9, 3, seed=42)
    w3 = weights(sampler, 5, 9, 3, seed=43)
    assert torch.equal(w1, w2)
    assert (w1 - w3).abs().max() > 0.1
    # drawn in float64 on CPU then cast: float32 is the rounding of the float64 projection
    w32 = weights(sampler, 5, 9, 3, seed=42, dtype=torch.float32)
    assert w32.dtype == torch.float32
    torch.testing.assert_close(w32, w1.float(), rtol=1e-6, atol=1e-6)
    # the three batch elements are distinct draws
    assert (w1[0] - w1[1]).abs().max() > 0.1


def test_generator_argument_equivalent_to_seed():
    g = torch.Generator().manual_seed(5)
    a = ka.PositiveRF(4, 8, sampler="orthogonal", generator=g).weight
    b = ka.PositiveRF(4, 8, sampler="orthogonal", seed=5).weight
    assert torch.equal(a, b)


def test_sampler_names_and_attributes():
    assert ka.get_sampler("gaussian").name == "gaussian"
    assert ka.get_sampler("orthogonal").name == "orthogonal"
    assert ka.get_sampler("orthogonal").norms == "chi"
    assert OrthogonalSampler(norms="fixed").norms == "fixed"
    assert ka.get_sampler("structured").name == "structured"
    assert ka.get_sampler("qmc").name == "qmc"
    fm = ka.PositiveRF(4, 8, sampler="orthogonal", seed=0)
    assert fm.sampler.name == "orthogonal"


# --------------------------------------------------------------------------- fast Hadamard paths


@pytest.mark.parametrize("p", [1, 2, 8, 64, 128, 256, 2048])
def test_fwht_gemm_equals_butterfly(p):
    """The GEMM path (one dense H_p up to FWHT_GEMM_MAX, Kronecker-factored above) against the
    butterflies, and both against x @ H_p from scipy's independent construction."""
    from scipy.linalg import hadamard

    from kernelapprox.samplers import fwht, hadamard_matrix

    x = torch.randn(3, 5, p, generator=torch.Generator().manual_seed(p), dtype=F64)
    ref = x @ torch.from_numpy(hadamard(p).astype("float64"))
    for method in ("butterfly", "gemm", "auto"):
        # |x H| entries are sums of p terms of size ~1: float64 rounding ~ p * 1e-16
        torch.testing.assert_close(fwht(x, method), ref, rtol=0, atol=1e-13 * p)
    torch.testing.assert_close(hadamard_matrix(p), torch.from_numpy(hadamard(p).astype("float64")), rtol=0, atol=0)


def test_fwht_rejects_bad_input():
    from kernelapprox.samplers import fwht, hadamard_matrix

    with pytest.raises(ValueError, match="power-of-two"):
        fwht(torch.ones(3, 6))
    with pytest.raises(ValueError, match="method"):
        fwht(torch.ones(4), method="fast")
    with pytest.raises(TypeError, match="x must be"):
        fwht([1.0, 2.0])
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)


@pytest.mark.parametrize("d,r", [(5, 11), (8, 20), (64, 256)])
def test_structured_dense_path_equals_transform(d, r, monkeypatch):
    """Below dense_max_dim the SORF projection is one GEMM with its cached W; above, three FWHTs.
    Both (and the butterfly reference) agree, forward and backward."""
    from kernelapprox.samplers import HadamardProjection

    P = StructuredSampler().sample(r, d, batch_shape=(2,), generator=make_generator(7))
    x = torch.randn(2, 9, d, generator=torch.Generator().manual_seed(1), dtype=F64, requires_grad=True)
    g = torch.randn(2, 9, r, generator=torch.Generator().manual_seed(2), dtype=F64)
    assert P.gemm_weight(F64) is not None  # the dense path is the one taken at these sizes
    dense = P(x)
    (gd,) = torch.autograd.grad((dense * g).sum(), x)
    ref = P._apply_transform(x, "butterfly")
    (gr,) = torch.autograd.grad((ref * g).sum(), x)
    torch.testing.assert_close(dense, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gd, gr, rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(HadamardProjection, "dense_max_dim", 0)
    assert P.gemm_weight(F64) is None
    fast = P(x)
    (gf,) = torch.autograd.grad((fast * g).sum(), x)
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gf, gr, rtol=1e-12, atol=1e-12)


def test_structured_dense_cache_follows_redraw_and_dtype():
    """The cached W is rebuilt after an in-place redraw and per dtype (never stale)."""
    fm = ka.PositiveRF(8, 16, sampler="structured", seed=0, dtype=F64)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3), dtype=F64)
    before = fm(x)
    fm.redraw(seed=1)
    after = fm(x)
    assert (after - before).abs().max() > 1e-3
    W = fm.weight
    torch.testing.assert_close(fm.projection(x), x @ W.mT, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fm.projection(x.float()), (x @ W.mT).float(), rtol=1e-5, atol=1e-5)
    assert fm.projection(x.float()).dtype == torch.float32


# --------------------------------------------------------------------------- vectorised QMC scramble


@pytest.mark.statistical
@pytest.mark.parametrize("method", ["sobol", "halton"])
def test_qmc_scrambled_points_uniform(method):
    """Each randomised point is uniform on [0, 1)^d: for fixed (point i, coordinate j), the S
    independent draws t[:, i, j] pass a KS test against U(0, 1) (threshold P_MIN, module
    docstring; 16 x 3 tests). The unrandomised sequence (every draw equal) gives p = 0, and an
    unshifted linear scramble keeps point 0 at the origin (p = 0), so the test can fail."""
    S, n, d = 4000, 16, 3
    T = QMCSampler(method).points(n, d, S, make_generator(seed(640)))
    assert T.shape == (S, n, d) and T.dtype == F64
    assert (T >= 0).all() and (T < 1).all()
    p = [stats.kstest(T[:, i, j].numpy(), "uniform").pvalue for i in range(n) for j in range(d)]
    assert min(p) > P_MIN, min(p)
    # the same test on points that are not uniform (the first point of an unshifted scramble, 0)
    assert stats.kstest(torch.zeros(S).numpy() + 1e-9 * torch.rand(S).numpy(), "uniform").pvalue < 1e-10


@pytest.mark.statistical
@pytest.mark.parametrize("method", ["sobol", "halton"])
def test_qmc_scrambled_points_low_discrepancy(method):
    """Scrambled point sets keep their low discrepancy: the mean centred L2 discrepancy
    (scipy.stats.qmc.discrepancy) of 60 scrambled sets of n = 64 points in d = 4 is below that of
    60 iid uniform sets, by more than Z_MAX standard errors of the difference
    se = sqrt(se_qmc^2 + se_iid^2), se_* = sample std / sqrt(60). (Measured: 0.0010 (Sobol'),
    0.0018 (Halton) vs 0.017 iid, z ~ 20.) iid points in place of the scramble give z ~ 0, so the
    check fails on a scramble that destroys the structure."""
    from scipy.stats import qmc

    S, n, d = 60, 64, 4
    T = QMCSampler(method).points(n, d, S, make_generator(seed(641))).numpy()
    g = torch.Generator().manual_seed(seed(642))
    U = torch.rand(S, n, d, generator=g, dtype=F64).numpy()
    dq = torch.tensor([qmc.discrepancy(T[s]) for s in range(S)], dtype=F64)
    di = torch.tensor([qmc.discrepancy(U[s]) for s in range(S)], dtype=F64)
    se = math.sqrt(dq.var() / S + di.var() / S)
    z = (di.mean() - dq.mean()) / se
    assert z > Z_MAX, (float(dq.mean()), float(di.mean()), float(z))
    assert float(dq.mean()) < 0.25 * float(di.mean())


@pytest.mark.parametrize("m", [3, 6])
def test_qmc_sobol_scramble_keeps_net_property(m):
    """Exact: the first 2^m points of a scrambled Sobol' sequence, in each of its first two
    coordinates jointly, put exactly one point in every dyadic box of volume 2^-m (a (0, m, 2)-net,
    preserved by the linear scramble and the digital shift). A non-linear jitter or a wrong bit
    order breaks it."""
    T = QMCSampler("sobol").points(2**m, 3, 5, make_generator(seed(643)))
    for s in range(5):
        for m1 in range(m + 1):
            m2 = m - m1
            cell = (T[s, :, 0] * 2**m1).floor() * 2**m2 + (T[s, :, 1] * 2**m2).floor()
            assert torch.equal(cell.sort().values, torch.arange(2**m, dtype=F64))


def test_qmc_scramble_is_vectorised_and_independent():
    """All draws come from one call (no per-draw engine); different draws differ, and the same
    generator state gives the same points."""
    a = QMCSampler("sobol").points(8, 2, 3, make_generator(0))
    b = QMCSampler("sobol").points(8, 2, 3, make_generator(0))
    assert torch.equal(a, b)
    assert (a[0] - a[1]).abs().max() > 0.01
    with pytest.raises(ValueError, match="count"):
        QMCSampler().points(8, 2, 0, make_generator(0))
