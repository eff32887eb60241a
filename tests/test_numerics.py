"""Numerics: log-domain kernels in float32, finite attention in 32/16-bit, bf16 ELU, gradients.

float32 results are compared with a float64 evaluation of the *same* estimator on the *same*
projection (``from_projection(fm.weight.double())``) and the same (float32-representable) inputs,
so only the arithmetic differs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import F64, randn, warns_unfitted, with_norm

import kernelapprox as ka

F32 = torch.finfo(torch.float32)
D, R = 16, 64
REL_TOL = 1e-5  # contract: relative error <= 1e-5 in float32 against float64


def inputs_with_norm(norm: float, n: int = 64):
    """q, k of the given norm: random directions, plus rows with k = q (largest kernel, may overflow
    float32) and k = -q (smallest, may underflow), as float32 tensors."""
    q = with_norm(randn(n, D, seed=1), norm)
    k = with_norm(randn(n, D, seed=2), norm)
    k[:2] = q[:2]
    k[2:4] = -q[2:4]
    return q.float(), k.float()


def representable(K64: torch.Tensor) -> torch.Tensor:
    return (K64.abs() >= F32.tiny) & (K64.abs() <= F32.max)


def check_against_float64(K32: torch.Tensor, K64: torch.Tensor, scale: torch.Tensor) -> None:
    assert K32.dtype == torch.float32
    assert not torch.isnan(K32).any(), "silent NaN"
    K32 = K32.double()
    rep = representable(K64)
    assert rep.float().mean() > 0.5  # the check is not vacuous
    err = (K32 - K64).abs() / scale
    assert err[rep].max() <= REL_TOL, f"max relative error {err[rep].max():.3g} > {REL_TOL}"
    over = K64.abs() > F32.max
    assert torch.isinf(K32[over]).all()  # overflow is reported as inf, not as garbage
    under = K64.abs() < F32.tiny
    assert (K32[under].abs() <= F32.tiny).all()


@pytest.mark.parametrize("norm", [1.0, 5.0, 10.0])
@pytest.mark.parametrize("cls", [ka.PositiveRF, ka.HyperbolicRF], ids=["positive", "hyperbolic"])
def test_positive_kernel_float32_vs_float64(cls, norm):
    """Positive estimates are sums of positive terms: plain relative error wherever representable."""
    fm = cls(D, R, sampler="orthogonal", seed=0)
    fm64 = cls.from_projection(fm.weight.double())
    q, k = inputs_with_norm(norm)
    K64 = fm64.kernel(q.double(), k.double())
    check_against_float64(fm.kernel(q, k), K64, K64.abs())


@pytest.mark.parametrize("norm", [1.0, 5.0, 9.0, 9.5])
@pytest.mark.parametrize("variant", ["sincos", "offset"])
def test_trig_kernel_float32_vs_float64(variant, norm):
    """Trig estimates e^{(|q|^2+|k|^2)/2} (1/r) sum cos(.) are sums of cancelling terms of size
    T = e^{(|q|^2+|k|^2)/2}: the error is measured against max(|K|, T).  At |q| = |k| = 9.5 the
    factor T (e^90) overflows float32 while many estimates do not: those must come out finite."""
    fm = ka.TrigRF(D, R, variant=variant, seed=0)
    fm64 = ka.TrigRF.from_projection(
        fm.weight.double(),
        variant=variant,
        **({"offsets": fm.offsets.double()} if variant == "offset" else {}),
    )
    q, k = inputs_with_norm(norm)
    q64, k64 = q.double(), k.double()
    K64 = fm64.kernel(q64, k64)
    T = torch.exp(0.5 * (q64 * q64).sum(-1)[:, None] + 0.5 * (k64 * k64).sum(-1)[None, :])
    check_against_float64(fm.kernel(q, k), K64, torch.maximum(K64.abs(), T))


@pytest.mark.parametrize("norm", [1.0, 5.0, 10.0])
def test_softmax_kernel_float32_vs_float64(norm):
    q, k = inputs_with_norm(norm)
    K64 = torch.exp(q.double() @ k.double().T)
    check_against_float64(ka.softmax_kernel(q, k), K64, K64.abs())


def test_trig_kernel_beyond_naive_overflow():
    """|q| = |k| = 9.5 in float32: phi(q) phi(k)^T overflows (inf or nan), the log-domain kernel does not."""
    fm = ka.TrigRF(D, R, seed=0)
    q, k = inputs_with_norm(9.5)
    naive = fm(q) @ fm(k).T
    K = fm.kernel(q, k)
    fin = torch.isfinite(K)
    assert (~torch.isfinite(naive[fin])).any()  # the naive product really fails there
    assert fin.float().mean() > 0.5


# --------------------------------------------------------------------------- attention in low precision

def _build(name: str, sampler: str = "orthogonal"):
    """Every registered estimator at D, with the same feature dimension R where it has projections."""
    est = ka.get_estimator(name)
    r = R if est.feature_dim(R, D) == R else R // 2  # 2r-wide maps get half the projections
    return est.build(D, r, sampler=sampler, seed=0)


ALL_MAPS = {e.name: (lambda name=e.name: _build(name)) for e in ka.estimators()}


def attn_inputs(norm, n=64, dtype=torch.float32):
    q = with_norm(randn(2, n, D, seed=3), norm).to(dtype)
    k = with_norm(randn(2, n, D, seed=4), norm).to(dtype)
    v = randn(2, n, 8, seed=5).to(dtype)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("norm", [1.0, 10.0])
@pytest.mark.parametrize("name", list(ALL_MAPS))
def test_linear_attention_float32_finite(name, norm, causal):
    fm = ALL_MAPS[name]()
    q, k, v = attn_inputs(norm)
    with warns_unfitted(fm):  # data-dependent maps: unfitted (data-free parameters) here
        out = ka.linear_attention(q, k, v, fm, causal=causal, chunk_size=16)
        assert out.dtype == torch.float32 and out.shape == v.shape
        assert torch.isfinite(out).all()
        if fm.is_random and fm.positive:
            # a convex combination of v with weights accurate to ~1e-5 relative: same as float64
            fm64 = type(fm).from_projection(fm.weight.double())
            ref = ka.linear_attention(q.double(), k.double(), v.double(), fm64, causal=causal)
            assert (out.double() - ref).abs().max() <= 1e-4 * v.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(ALL_MAPS))
def test_linear_attention_16bit(name, causal, dtype):
    """16-bit inputs: output in the input dtype, finite, and (for positive maps) equal to the float64
    evaluation on the same rounded inputs up to 16-bit output rounding."""
    fm = ALL_MAPS[name]()
    norms = [1.0] if not ka.get_estimator(name).positive else [1.0, 10.0]  # signed denominators: small norms only
    with warns_unfitted(fm):  # data-dependent maps: unfitted (data-free parameters) here
        for norm in norms:
            q, k, v = attn_inputs(norm, dtype=dtype)
            out = ka.linear_attention(q, k, v, fm, causal=causal, chunk_size=16)
            assert out.dtype == dtype and torch.isfinite(out).all()
            if fm.positive and name != "relu":
                fm64 = type(fm).from_projection(fm.weight.double()) if fm.is_random else fm
                ref = ka.linear_attention(q.double(), k.double(), v.double(), fm64, causal=causal)
                # Internals are float32 (error ~1e-6 relative), so the only sizeable error is the final
                # cast: half an ulp of |out| <= max|v|, i.e. eps(dtype)/2 * max|v|; allow one full eps.
                tol = torch.finfo(dtype).eps * v.abs().max().double()
                assert (out.double() - ref).abs().max() <= tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_feature_maps_16bit_dtype(dtype):
    x = randn(3, 10, D, seed=0, scale=0.25).to(dtype)
    for name, make in ALL_MAPS.items():
        fm = make()
        with warns_unfitted(fm):
            out = fm(x)
        assert out.dtype == dtype, name
        assert torch.isfinite(out).all(), name


@pytest.mark.parametrize(
    "dtype,xs",
    [
        (torch.bfloat16, [-6.0, -8.0, -10.0, -20.0, -40.0]),
        (torch.float16, [-6.0, -8.0, -10.0]),  # exp(-10) is still representable in fp16
    ],
    ids=["bf16", "fp16"],
)
def test_elu_low_precision_does_not_round_to_zero(dtype, xs):
    """FLA#1261: bf16 elu(x)+1 rounds to 0 for x <= -8; the map must give exp(x) to 16-bit precision."""
    x = torch.tensor([xs], dtype=dtype)
    out = ka.EluFeatures(len(xs))(x)
    assert out.dtype == dtype
    exact = torch.exp(x.double())
    assert (out > 0).all()
    assert ((out.double() - exact).abs() / exact).max() <= 1e-2


def test_elu_attention_bf16_very_negative_inputs():
    """With all inputs <= -8, naive bf16 elu+1 gives 0/0; the output and its gradient must match float64."""
    g = torch.Generator().manual_seed(0)
    q = (-10.0 + torch.rand(2, 32, 4, generator=g)).to(torch.bfloat16).requires_grad_()
    k = (-10.0 + torch.rand(2, 32, 4, generator=g)).to(torch.bfloat16)
    v = torch.randn(2, 32, 3, generator=g).to(torch.bfloat16)
    fm = ka.EluFeatures(4)
    out = ka.linear_attention(q, k, v, fm, causal=True)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    q64 = q.detach().double().requires_grad_()
    ref = ka.naive_linear_attention(q64, k.double(), v.double(), ka.EluFeatures(4), causal=True)
    assert (out.double() - ref).abs().max() <= 2e-2 * v.abs().max().double()
    w = torch.randn(2, 32, 3, generator=g)
    (out.float() * w).sum().backward()
    (ref * w.double()).sum().backward()
    assert torch.isfinite(q.grad).all()
    assert (q.grad.double() - q64.grad).abs().max() <= 5e-2 * q64.grad.abs().max()


# --------------------------------------------------------------------------- gradients


def small_map(name):
    if name == "structured":
        return ka.PositiveRF(3, 4, sampler="structured", seed=0, dtype=F64)
    return ka.get_estimator(name).build(3, 4, sampler="orthogonal", seed=0, dtype=F64)


GRAD_MAPS = [e.name for e in ka.estimators()] + ["structured"]


def leaf(*shape, seed, scale=0.5):
    return randn(*shape, seed=seed, scale=scale).requires_grad_()


@pytest.mark.parametrize("name", GRAD_MAPS)
def test_gradcheck_features_and_kernel(name):
    fm = small_map(name)
    x = leaf(2, 4, 3, seed=0)
    with warns_unfitted(fm):
        assert torch.autograd.gradcheck(fm, (x,))
    q, k = leaf(4, 3, seed=1), leaf(5, 3, seed=2)
    assert torch.autograd.gradcheck(fm.kernel, (q, k))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", GRAD_MAPS)
def test_gradcheck_linear_attention(name, causal):
    fm = small_map(name)
    scale = 0.5 if small_map(name).positive else 0.3  # signed maps: denominators away from 0
    q, k, v = leaf(1, 4, 3, seed=3, scale=scale), leaf(1, 4, 3, seed=4, scale=scale), leaf(1, 4, 2, seed=5)
    if name == "relu":  # keep ReLU away from its kink and from all-zero rows
        q, k = (q.detach().abs() + 0.1).requires_grad_(), (k.detach().abs() + 0.1).requires_grad_()

    def f(q, k, v):
        return ka.linear_attention(q, k, v, fm, causal=causal, chunk_size=2)

    # fast_mode: checks v^T J u for random u, v against finite differences (a wrong gradient fails
    # with probability 1); the full Jacobian check of every entry is done for the feature maps above.
    with warns_unfitted(fm):
        assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)
    assert torch.autograd.gradcheck(f, (q, k, v.detach()))  # full Jacobian w.r.t. q and k


def test_gradcheck_recurrent_step():
    fm = small_map("positive")
    q, k, v = leaf(4, 3, seed=6), leaf(4, 3, seed=7), leaf(4, 2, seed=8)

    def f(q, k, v):
        rnn = ka.RecurrentLinearAttention(fm)
        return torch.stack([rnn.step(q[t], k[t], v[t]) for t in range(4)])

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradcheck_softmax_references(causal):
    q, k, v = leaf(1, 4, 3, seed=9), leaf(1, 4, 3, seed=10), leaf(1, 4, 2, seed=11)
    assert torch.autograd.gradcheck(lambda q, k, v: ka.softmax_attention(q, k, v, causal=causal), (q, k, v))
    assert torch.autograd.gradcheck(ka.softmax_kernel, (q, k))
