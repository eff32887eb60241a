"""Learned feature maps (Hedgehog, two variants) and their distillation from softmax attention.

What is pinned here: the two registered kernels and their formulas (identity init written out
with torch.softmax), positivity and normalisation of the features, that the variants are different
kernels, gradients to W and b, the distillation loss against a hand-written cross-entropy,
``fit_feature_map`` on a peaked synthetic problem (loss and attention-output error before/after),
determinism, per-head independence, state hygiene and validation. The generic contracts (dtype
rule, fast forms vs naive, gradcheck, validation messages) come from the registry-driven test
files, which include ``hedgehog`` and ``hedgehog-lolcats`` automatically.
"""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path

import pytest
import torch
from conftest import F64, randn

import kernelapprox as ka
from kernelapprox.maps.hedgehog import HedgehogFeatures
from kernelapprox.training import distillation_loss, fit_feature_map

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: threads only cost
REPO = Path(__file__).resolve().parent.parent
VARIANTS = ["fla", "lolcats"]
NAMES = {"fla": "hedgehog", "lolcats": "hedgehog-lolcats"}


def hand_phi(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, variant: str) -> torch.Tensor:
    """The two reference maps written out: fla softmax([2z, -2z]), lolcats [softmax z, softmax -z]."""
    z = x @ W.mT + (0 if b is None else b.unsqueeze(-2))
    if variant == "fla":
        return torch.softmax(torch.cat((2 * z, -2 * z), -1), -1)
    return torch.cat((torch.softmax(z, -1), torch.softmax(-z, -1)), -1)


def clustered(H: int, n: int, d: int, seed: int, *, centers_seed: int = 100, rho: float = 3.0, noise: float = 0.5):
    """Peaked attention with structure: keys around 4 cluster centres (per head, fixed by
    ``centers_seed``), norm ``rho``; each query is its key plus noise, so a query attends to its
    own key and, less, to its cluster. ``seed`` draws the tokens (a new seed: held-out tokens)."""
    gc = torch.Generator().manual_seed(centers_seed)
    centres = torch.randn(H, 4, d, generator=gc, dtype=F64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(4, (H, n), generator=g)
    k = torch.gather(centres, 1, idx[..., None].expand(H, n, d)) + 0.3 * torch.randn(H, n, d, generator=g, dtype=F64)
    k = k / k.norm(dim=-1, keepdim=True) * rho
    q = k + noise * torch.randn(H, n, d, generator=g, dtype=F64)
    v = torch.randn(H, n, 4, generator=g, dtype=F64)
    return q, k, v


def entropy(q, k, causal=False):
    s = q @ k.mT
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    A = torch.softmax(s, -1)
    return float(-(A * A.clamp_min(1e-300).log()).sum(-1).mean())


# ------------------------------------------------------------------------------------ the maps


@pytest.mark.parametrize("variant", VARIANTS)
def test_registered_as_two_estimators(variant):
    est = ka.get_estimator(NAMES[variant])
    assert est.cls is HedgehogFeatures and dict(est.params) == {"variant": variant}
    assert est.feature_dim_rule == "2r" and est.learned and not est.is_random and est.positive
    assert not est.data_dependent
    fm = est.build(6)  # num_features=None -> f = d
    assert fm.num_features == 6 and fm.feature_dim == 12 == est.feature_dim(6, 6)
    assert ka.estimator_of(fm) is est and fm.variant == variant
    fm = est.build(6, 10, seed=0)
    assert fm.weight.shape == (10, 6) and fm.feature_dim == 20 == est.feature_dim(10, 6)
    assert fm(torch.randn(3, 6)).shape == (3, 20)
    assert HedgehogFeatures.symmetric and HedgehogFeatures.learned


@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes_positivity_and_row_sums(variant):
    fm = HedgehogFeatures(5, 7, variant=variant, batch_shape=(3,), init="kaiming", seed=0, dtype=F64)
    x = randn(2, 3, 11, 5, seed=1, scale=2.0)
    phi = fm(x)
    assert phi.shape == (2, 3, 11, 14) and phi.dtype == F64
    assert (phi > 0).all() and (phi <= 1).all()
    if variant == "fla":  # one normalisation over the 2f entries
        torch.testing.assert_close(phi.sum(-1), torch.ones(2, 3, 11, dtype=F64), rtol=0, atol=1e-14)
    else:  # two: each half sums to 1
        for half in phi.split(7, dim=-1):
            torch.testing.assert_close(half.sum(-1), torch.ones(2, 3, 11, dtype=F64), rtol=0, atol=1e-14)
    f, ls = fm.log_features(x)
    assert torch.equal(f, phi) and ls.shape == (2, 3, 11) and not ls.any()
    f, ls = fm.log_features(x, shared=True)
    assert ls.shape == (2, 3, 1) and not ls.any()
    assert torch.equal(fm.query_features(x), phi)
    # per-head maps: head h uses W[h], b[h]
    for h in range(3):
        ref = hand_phi(x[:, h], fm.weight[h], None if fm.bias is None else fm.bias[h], variant)
        torch.testing.assert_close(phi[:, h], ref, rtol=1e-14, atol=0)
    # 16-bit inputs are computed in float32 and returned in their dtype
    fm32 = HedgehogFeatures(5, 7, variant=variant, init="kaiming", seed=0)
    xb = randn(4, 5, seed=2).to(torch.bfloat16)
    out = fm32(xb)
    assert out.dtype == torch.bfloat16
    ref = hand_phi(xb.double(), fm32.weight.double(), None if fm32.bias is None else fm32.bias.double(), variant)
    assert (out.double() - ref).abs().max() <= torch.finfo(torch.bfloat16).eps * ref.abs().max()


@pytest.mark.parametrize("variant", VARIANTS)
def test_identity_init_is_the_documented_map(variant):
    """W = I, b = 0: fla phi(x) = softmax([2x, -2x]); lolcats phi(x) = [softmax(x), softmax(-x)];
    with f != d, W = I_{f x d} (ones on the diagonal)."""
    x = randn(9, 4, seed=3, scale=1.5)
    fm = HedgehogFeatures(4, variant=variant, dtype=F64)
    assert torch.equal(fm.weight, torch.eye(4, dtype=F64))
    assert (fm.bias is not None) == (variant == "fla")  # the references' defaults
    if fm.bias is not None:
        assert not fm.bias.any()
    if variant == "fla":
        expected = torch.softmax(torch.cat((2 * x, -2 * x), -1), -1)
    else:
        expected = torch.cat((torch.softmax(x, -1), torch.softmax(-x, -1)), -1)
    torch.testing.assert_close(fm(x), expected, rtol=1e-15, atol=0)
    for f in (2, 6):
        fm = HedgehogFeatures(4, f, variant=variant, dtype=F64)
        assert torch.equal(fm.weight, torch.eye(f, 4, dtype=F64))
        torch.testing.assert_close(fm(x), hand_phi(x, torch.eye(f, 4, dtype=F64), None, variant), rtol=1e-15, atol=0)
    # reset_parameters brings a changed map back to its init
    fm = HedgehogFeatures(4, variant=variant, bias=True, dtype=F64)
    with torch.no_grad():
        fm.weight.add_(1.0)
        fm.bias.add_(1.0)
    fm.reset_parameters()
    assert torch.equal(fm.weight, torch.eye(4, dtype=F64)) and not fm.bias.any()


def test_the_two_variants_are_different_kernels():
    r"""Both kernels against their closed forms, then a numerical example of attention weights that
    differ. fla with W and lolcats with 2W share the exponentials e^{+-2 z_j}; they differ in the
    normalisers: fla divides by Z(x) Z(y) with Z = sum_l 2 cosh(2 z_l) (per query: cancels in
    attention; per key: does not), lolcats divides the + half by Z+(x) Z+(y) and the - half by
    Z-(x) Z-(y), so even the query normaliser weights the halves differently."""
    W = torch.tensor([[1.0, 0.5], [-0.3, 1.0]], dtype=F64)
    fla = HedgehogFeatures(2, variant="fla", dtype=F64)
    lol = HedgehogFeatures(2, variant="lolcats", dtype=F64)
    with torch.no_grad():
        fla.weight.copy_(W)
        lol.weight.copy_(2 * W)
    q = torch.tensor([[0.8, -0.2]], dtype=F64)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-0.7, 0.7], [0.5, 0.5]], dtype=F64)
    zq, zk = q @ W.T, k @ W.T  # (1, 2), (4, 2)
    s = zq[:, None, :] + zk[None, :, :]  # z_j(q) + z_j(k)
    Z = lambda z: (2 * torch.cosh(2 * z)).sum(-1)  # noqa: E731
    K_fla = (torch.exp(2 * s) + torch.exp(-2 * s)).sum(-1) / (Z(zq)[:, None] * Z(zk)[None, :])
    Zp = lambda z: torch.exp(2 * z).sum(-1)  # noqa: E731
    Zm = lambda z: torch.exp(-2 * z).sum(-1)  # noqa: E731
    K_lol = torch.exp(2 * s).sum(-1) / (Zp(zq)[:, None] * Zp(zk)[None, :]) + torch.exp(-2 * s).sum(-1) / (
        Zm(zq)[:, None] * Zm(zk)[None, :]
    )
    torch.testing.assert_close(fla.kernel(q, k), K_fla, rtol=1e-14, atol=0)
    torch.testing.assert_close(lol.kernel(q, k), K_lol, rtol=1e-14, atol=0)
    A_fla = K_fla / K_fla.sum(-1, keepdim=True)
    A_lol = K_lol / K_lol.sum(-1, keepdim=True)
    # the attention weights of one query over the four keys (printed with -s):
    # fla [0.4219, 0.1649, 0.0745, 0.3387], lolcats [0.4317, 0.1582, 0.0779, 0.3322]
    print("\nfla    ", [round(a, 4) for a in A_fla[0].tolist()])
    print("lolcats", [round(a, 4) for a in A_lol[0].tolist()])
    assert (A_fla - A_lol).abs().max() > 5e-3
    # no rescaling of W makes the lolcats weights those of fla here (closest: c = 2, 0.0098 apart)
    for c in (0.25, 0.5, 1.0, 2.0, 4.0):
        with torch.no_grad():
            lol.weight.copy_(c * W)
        Kc = lol.kernel(q, k)
        assert (Kc / Kc.sum(-1, keepdim=True) - A_fla).abs().max() > 5e-3, c
    # the same weights come out of linear attention (per-token key normalisers included)
    v = torch.eye(4, dtype=F64)
    with torch.no_grad():
        lol.weight.copy_(2 * W)
    torch.testing.assert_close(ka.linear_attention(q, k, v, fla), A_fla, rtol=1e-12, atol=0)
    torch.testing.assert_close(ka.linear_attention(q, k, v, lol), A_lol, rtol=1e-12, atol=0)
    # the sharpest case, f = 1: lolcats' two softmaxes over one entry are 1 for every input (phi = [1, 1],
    # uniform attention whatever W), while fla's phi = [e^{2z}, e^{-2z}] / (2 cosh 2z) gives weights
    # proportional to cosh(2(z_q + z_k)) / cosh(2 z_k)
    q1, k1 = torch.tensor([[0.5]], dtype=F64), torch.tensor([[-1.0], [0.0], [1.0]], dtype=F64)
    v1 = torch.eye(3, dtype=F64)
    for w in (0.5, 1.0, 3.0):
        f1, l1 = (HedgehogFeatures(1, variant=var, dtype=F64) for var in VARIANTS)
        with torch.no_grad():
            f1.weight.fill_(w)
            l1.weight.fill_(w)
        torch.testing.assert_close(ka.linear_attention(q1, k1, v1, l1), torch.full((1, 3), 1 / 3, dtype=F64))
        expected = torch.cosh(2 * w * (q1 + k1.T)) / torch.cosh(2 * w * k1.T)
        expected = expected / expected.sum(-1, keepdim=True)  # w = 1: [0.089, 0.333, 0.578]
        torch.testing.assert_close(ka.linear_attention(q1, k1, v1, f1), expected, rtol=1e-12, atol=0)
        assert expected.max() - expected.min() > 0.1


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_reach_weight_and_bias(variant):
    fm = HedgehogFeatures(3, 4, variant=variant, bias=True, init="kaiming", seed=1, dtype=F64, batch_shape=(2,))
    assert {n for n, _ in fm.named_parameters()} == {"weight", "bias"} and list(fm.buffers()) == []
    q, k, v = randn(2, 6, 3, seed=4), randn(2, 6, 3, seed=5), randn(2, 6, 2, seed=6)
    for causal in (False, True):
        fm.zero_grad(set_to_none=True)
        out = ka.linear_attention(q, k, v, fm, causal=causal, chunk_size=4)
        (out * randn(*out.shape, seed=7)).sum().backward()
        for p in (fm.weight, fm.bias):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().min() > 0
    # exact gradients with respect to the parameters (finite differences)
    x = randn(2, 5, 3, seed=8)

    def phi(W, b):
        return torch.func.functional_call(fm, {"weight": W, "bias": b}, (x,))

    W, b = fm.weight.detach().clone().requires_grad_(), fm.bias.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(phi, (W, b))
    # lolcats' default: no bias parameter
    assert HedgehogFeatures(3, variant="lolcats").bias is None
    assert [n for n, _ in HedgehogFeatures(3, variant="lolcats").named_parameters()] == ["weight"]


def test_module_behaviour_state_dict_get_params_and_init():
    fm = HedgehogFeatures(4, 6, init="kaiming", seed=0, batch_shape=(2,), dtype=F64)
    p = fm.get_params()
    assert p == {"dim": 4, "num_features": 6, "variant": "fla", "bias": True, "init": "kaiming",
                 "batch_shape": (2,), "device": torch.device("cpu"), "dtype": F64}
    clone = HedgehogFeatures(**p, seed=0)
    assert ka.estimator_of(clone) is ka.estimator_of(fm) and torch.equal(clone.weight, fm.weight)
    # kaiming: nn.Linear's U(-1/sqrt d, 1/sqrt d); seeds behave as for the random maps
    assert fm.weight.abs().max() <= 0.5 and not torch.equal(fm.weight[0], fm.weight[1])
    assert not torch.equal(HedgehogFeatures(4, 6, init="kaiming", seed=1, batch_shape=(2,), dtype=F64).weight, fm.weight)
    torch.manual_seed(5)
    a = HedgehogFeatures(4, init="kaiming")
    torch.manual_seed(5)
    assert torch.equal(a.weight, HedgehogFeatures(4, init="kaiming").weight)
    # state_dict round trip carries trained parameters
    q, k, _ = clustered(2, 16, 4, seed=0)
    fit_feature_map(fm, q, k, steps=5, lr=0.05, progress=False)
    other = HedgehogFeatures(**p, seed=3)
    buf = io.BytesIO()
    torch.save(fm.state_dict(), buf)
    buf.seek(0)
    other.load_state_dict(torch.load(buf))
    assert torch.equal(other(q), fm(q))
    # dtype moves, deepcopy and redraw (a no-op: the map is not random)
    assert fm.to(torch.float32).weight.dtype == torch.float32 and fm(q).dtype == F64
    assert copy.deepcopy(fm).double().weight.dtype == F64
    w = fm.weight.detach().clone()
    assert fm.redraw(seed=1) is fm and torch.equal(fm.weight, w)
    assert "variant='fla'" in repr(fm) and "batch_shape=(2,)" in repr(fm)


# ---------------------------------------------------------------------------------- distillation


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_distillation_loss_equals_hand_cross_entropy(causal):
    """-sum_j A_ij log Ahat_ij averaged over rows, A = softmax(scale q k^T), Ahat the row-normalised
    phi(q) phi(k)^T, written with plain tensors; also for a random positive map (any positive map
    can be measured), and its minimum is the entropy of A (at Ahat = A)."""
    q, k, _ = clustered(2, 12, 4, seed=1)
    fm = HedgehogFeatures(4, 5, variant="lolcats", init="kaiming", seed=2, batch_shape=(2,), dtype=F64)
    for m, scale in ((fm, 1.0), (fm, 0.5), (ka.PositiveRF(4, 16, seed=0, dtype=F64), 1.0)):
        s = scale * q @ k.mT
        K_hat = m(q) @ m(k).mT
        if causal:
            keep = torch.ones(12, 12, dtype=torch.bool).tril()
            s = s.masked_fill(~keep, float("-inf"))
            K_hat = K_hat * keep
        A = torch.softmax(s, -1)
        A_hat = K_hat / K_hat.sum(-1, keepdim=True)
        ce = -(A * torch.where(A > 0, A_hat.log(), torch.zeros_like(A_hat))).sum(-1).mean()
        torch.testing.assert_close(distillation_loss(m, q, k, causal=causal, scale=scale), ce, rtol=1e-12, atol=0)
    assert float(distillation_loss(fm, q, k, causal=causal).detach()) > entropy(q, k, causal)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fit_reduces_loss_and_attention_error(variant):
    """Peaked clustered attention (2 heads, n = 64, d = 16, |k| = 3, q = k + 0.5 noise, 4 clusters:
    the 16 largest weights of a row carry 95 % of it, entropy 2.73 nats vs log 64 = 4.16): 300 full-batch Adam steps (lr 0.05) from the
    identity init. The excess loss over the entropy of A (= the mean KL(A || Ahat)) must drop by
    at least 85 %, the mean abs error of ka.linear_attention against ka.softmax_attention must at
    least halve on the fitted tokens, and drop by a quarter on held-out tokens of the same
    distribution. Measured (fla / lolcats): loss 3.463 -> 2.775 / 3.857 -> 2.788, i.e. KL
    0.735 -> 0.046 / 1.129 -> 0.060; output error 0.153 -> 0.064 / 0.191 -> 0.068; held-out
    0.166 -> 0.101 / 0.195 -> 0.093 (printed with -s)."""
    H, n, d = 2, 64, 16
    q, k, v = clustered(H, n, d, seed=0)
    q2, k2, v2 = clustered(H, n, d, seed=1)  # held-out tokens, same clusters
    q0, k0 = q.clone(), k.clone()
    fm = HedgehogFeatures(d, variant=variant, batch_shape=(H,), dtype=F64)
    ent = entropy(q, k)

    def measure():
        with torch.no_grad():
            loss = float(distillation_loss(fm, q, k))
            err = float((ka.linear_attention(q, k, v, fm) - ka.softmax_attention(q, k, v)).abs().mean())
            held = float((ka.linear_attention(q2, k2, v2, fm) - ka.softmax_attention(q2, k2, v2)).abs().mean())
        return loss, err, held

    loss0, err0, held0 = measure()
    hist = fit_feature_map(fm, q, k, steps=300, lr=0.05, seed=0, progress=False)
    loss1, err1, held1 = measure()
    print(f"\n{variant}: entropy {ent:.3f}; loss {loss0:.3f} -> {loss1:.3f} (KL {loss0 - ent:.3f} -> "
          f"{loss1 - ent:.3f}); output error {err0:.3f} -> {err1:.3f}; held-out {held0:.3f} -> {held1:.3f}")
    assert len(hist) == 300 and all(math.isfinite(h) for h in hist)
    assert hist[0] == pytest.approx(loss0, rel=1e-12)  # the history starts at the initial loss
    assert loss1 < hist[0] and hist[-1] < hist[0]
    assert loss1 - ent <= 0.15 * (loss0 - ent)
    assert err1 <= 0.5 * err0
    assert held1 < 0.75 * held0
    assert torch.equal(q, q0) and torch.equal(k, k0)  # calibration data untouched


def test_fit_causal_with_row_batches():
    """Causal distillation with 16 of 48 query rows per step (each row keeps all its keys j <= i)
    lowers the causal loss; the row subsets are drawn from the seed."""
    q, k, _ = clustered(2, 48, 8, seed=2)
    fm = HedgehogFeatures(8, batch_shape=(2,), dtype=F64)
    before = float(distillation_loss(fm, q, k, causal=True).detach())
    hist = fit_feature_map(fm, q, k, steps=120, lr=0.05, batch_size=16, causal=True, seed=1, progress=False)
    after = float(distillation_loss(fm, q, k, causal=True).detach())
    ent = entropy(q, k, causal=True)
    assert after - ent < 0.5 * (before - ent)
    assert len(hist) == 120 and len(set(hist)) > 100  # different rows at every step


def test_fit_is_deterministic_given_seed():
    q, k, _ = clustered(2, 32, 6, seed=3)

    def run(seed, **kw):
        fm = HedgehogFeatures(6, variant="lolcats", batch_shape=(2,), bias=True, dtype=F64)
        hist = fit_feature_map(fm, q, k, steps=25, lr=0.05, batch_size=8, seed=seed, progress=False, **kw)
        return fm, hist

    a, ha = run(7)
    b, hb = run(7)
    assert ha == hb  # bit-identical history
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    c, hc = run(8)
    assert hc != ha and not torch.equal(c.weight, a.weight)
    # seed=None draws the rows from torch's global generator
    torch.manual_seed(11)
    d1, h1 = run(None)
    torch.manual_seed(11)
    d2, h2 = run(None)
    assert h1 == h2 and torch.equal(d1.weight, d2.weight)
    # the same for SGD, and a float32 map on float32 data
    s1, hs1 = run(7, optimizer="sgd")
    s2, hs2 = run(7, optimizer="sgd")
    assert hs1 == hs2 and torch.equal(s1.weight, s2.weight) and hs1 != ha
    f1, f2 = HedgehogFeatures(6, batch_shape=(2,)), HedgehogFeatures(6, batch_shape=(2,))
    h1 = fit_feature_map(f1, q.float(), k.float(), steps=10, batch_size=8, seed=0, progress=False)
    h2 = fit_feature_map(f2, q.float(), k.float(), steps=10, batch_size=8, seed=0, progress=False)
    assert h1 == h2 and torch.equal(f1.weight, f2.weight) and f1.weight.dtype == torch.float32


def test_heads_fit_independently():
    """A map with batch_shape (H,) fitted on (B, H, n, d) data equals H single maps each fitted on
    its head's data with the same settings (the objective sums the heads' mean losses, so each head
    gets exactly its own gradient); only the summation order of batched kernels differs."""
    H = 3
    q, k, _ = clustered(H, 24, 5, seed=4)
    q = torch.stack((q, q.flip(-2)))  # B = 2 sequences per head
    k = torch.stack((k, k.flip(-2) + 0.1))
    fm = HedgehogFeatures(5, 7, batch_shape=(H,), init="kaiming", seed=0, dtype=F64)
    init = fm.weight.detach().clone()
    fit_feature_map(fm, q, k, steps=40, lr=0.05, batch_size=12, causal=True, seed=2, progress=False)
    for h in range(H):
        single = HedgehogFeatures(5, 7, dtype=F64)
        with torch.no_grad():
            single.weight.copy_(init[h])
        fit_feature_map(single, q[:, h], k[:, h], steps=40, lr=0.05, batch_size=12, causal=True, seed=2,
                        progress=False)
        torch.testing.assert_close(fm.weight[h], single.weight, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(fm.bias[h], single.bias, rtol=1e-10, atol=1e-12)


def test_fit_leaves_no_state_behind():
    """Mode, requires_grad flags and .grad are restored; works inside torch.no_grad; frozen
    parameters stay as they are."""
    q, k, _ = clustered(1, 16, 4, seed=5)
    fm = HedgehogFeatures(4, dtype=F64)
    fm.eval()
    marker = torch.full_like(fm.weight, 3.0)
    fm.weight.grad = marker
    with torch.no_grad():
        hist = fit_feature_map(fm, q, k, steps=5, lr=0.05, progress=False)
    assert len(hist) == 5 and not fm.training and fm.weight.grad is marker and fm.bias.grad is None
    assert fm.weight.requires_grad and fm.bias.requires_grad
    fm.train()
    fit_feature_map(fm, q, k, steps=2, progress=False)
    assert fm.training
    fm.bias.requires_grad_(False)
    b = fm.bias.detach().clone()
    w = fm.weight.detach().clone()
    fit_feature_map(fm, q, k, steps=3, lr=0.05, progress=False)
    assert torch.equal(fm.bias, b) and not torch.equal(fm.weight, w) and not fm.bias.requires_grad


def test_progress_bar_runs(capsys):
    q, k, _ = clustered(1, 8, 4, seed=6)
    hist = fit_feature_map(HedgehogFeatures(4, dtype=F64), q, k, steps=3, progress=True)
    assert len(hist) == 3
    assert "fit_feature_map" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fit_on_gpu_matches_cpu():
    """Parameters on the GPU, data on the GPU: the same fit as on the CPU (row subsets are drawn on
    the CPU generator and moved), float64 up to reduction order."""
    q, k, v = clustered(2, 32, 8, seed=8)
    cpu = HedgehogFeatures(8, batch_shape=(2,), dtype=F64)
    gpu = HedgehogFeatures(8, batch_shape=(2,), dtype=F64, device="cuda")
    hc = fit_feature_map(cpu, q, k, steps=20, lr=0.05, batch_size=16, causal=True, seed=0, progress=False)
    hg = fit_feature_map(gpu, q.cuda(), k.cuda(), steps=20, lr=0.05, batch_size=16, causal=True, seed=0,
                         progress=False)
    assert gpu.weight.device.type == "cuda" and gpu.get_params()["device"].type == "cuda"
    torch.testing.assert_close(gpu.weight.cpu(), cpu.weight, rtol=1e-9, atol=1e-10)
    assert hg == pytest.approx(hc, rel=1e-9)
    with torch.no_grad():
        out = ka.linear_attention(q.cuda(), k.cuda(), v.cuda(), gpu, causal=True)
        ref = ka.linear_attention(q, k, v, cpu, causal=True)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-9, atol=1e-10)


# ------------------------------------------------------------------------------------ validation


def test_constructor_validation():
    with pytest.raises(ValueError, match=r"variant.*'favor'"):
        HedgehogFeatures(4, variant="favor")
    with pytest.raises(ValueError, match=r"init.*'zeros'"):
        HedgehogFeatures(4, init="zeros")
    with pytest.raises(TypeError, match=r"bias.*'yes'"):
        HedgehogFeatures(4, bias="yes")
    with pytest.raises(ValueError, match=r"num_features.*0"):
        HedgehogFeatures(4, 0)
    with pytest.raises(TypeError, match=r"num_features"):
        HedgehogFeatures(4, 2.5)
    with pytest.raises(ValueError, match=r"\bdim\b"):
        HedgehogFeatures(0)
    with pytest.raises(TypeError, match=r"dtype"):
        HedgehogFeatures(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"batch_shape"):
        HedgehogFeatures(4, batch_shape=(0,))
    with pytest.raises(TypeError, match=r"seed"):
        HedgehogFeatures(4, init="kaiming", seed="zero")
    with pytest.raises(ValueError, match=r"batch_shape") as info:
        HedgehogFeatures(4, batch_shape=(3,))(torch.randn(2, 5, 4))
    assert "(3,)" in str(info.value) and "(2,)" in str(info.value)


def test_fit_validation():
    q, k, _ = clustered(1, 8, 4, seed=7)
    fm = HedgehogFeatures(4, dtype=F64)
    for not_learned in (ka.PositiveRF(4, 8, seed=0), ka.EluFeatures(4)):
        with pytest.raises(TypeError, match=r"learned") as info:
            fit_feature_map(not_learned, q, k, progress=False)
        assert type(not_learned).__name__ in str(info.value)
    with pytest.raises(TypeError, match=r"\bfm\b.*Linear"):
        fit_feature_map(torch.nn.Linear(4, 4), q, k, progress=False)
    for bad, exc in ((0, ValueError), (-3, ValueError), (2.5, TypeError), ("10", TypeError)):
        with pytest.raises(exc, match=r"steps") as info:
            fit_feature_map(fm, q, k, steps=bad, progress=False)
        assert str(bad) in str(info.value)
    for bad, exc in ((0.0, ValueError), (-1e-3, ValueError), (float("nan"), ValueError),
                     (float("inf"), ValueError), ("fast", TypeError)):
        with pytest.raises(exc, match=r"\blr\b") as info:
            fit_feature_map(fm, q, k, lr=bad, progress=False)
        assert str(bad) in str(info.value)
    with pytest.raises(ValueError, match=r"batch_size.*0"):
        fit_feature_map(fm, q, k, batch_size=0, progress=False)
    with pytest.raises(ValueError, match=r"optimizer.*'lbfgs'"):
        fit_feature_map(fm, q, k, optimizer="lbfgs", progress=False)
    with pytest.raises(TypeError, match=r"causal"):
        fit_feature_map(fm, q, k, causal=1, progress=False)
    with pytest.raises(ValueError, match=r"\bscale\b"):
        fit_feature_map(fm, q, k, scale=float("inf"), progress=False)
    with pytest.raises(ValueError, match=r"causal.*queries as keys"):
        fit_feature_map(fm, q, k[..., :5, :], causal=True, progress=False)
    with pytest.raises(ValueError, match=r"\bq\b.*dim=4") as info:
        fit_feature_map(fm, torch.randn(8, 5, dtype=F64), k, progress=False)
    assert "5" in str(info.value)
    with pytest.raises(TypeError, match=r"\bk\b"):
        fit_feature_map(fm, q, k.long(), progress=False)
    with pytest.raises(ValueError, match=r"broadcast"):
        fit_feature_map(HedgehogFeatures(4, batch_shape=(3,)), torch.randn(2, 8, 4), torch.randn(2, 8, 4),
                        progress=False)
    bad_q = q.clone()
    bad_q[0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"\bq\b.*non-finite"):
        fit_feature_map(fm, bad_q, k, progress=False)
    frozen = HedgehogFeatures(4).requires_grad_(False)
    with pytest.raises(ValueError, match=r"requires_grad"):
        fit_feature_map(frozen, q.float(), k.float(), progress=False)
    with pytest.raises(TypeError, match=r"positive"):
        distillation_loss(ka.TrigRF(4, 8, seed=0), q, k)
    # a failed call changed nothing
    assert torch.equal(fm.weight, torch.eye(4, dtype=F64)) and fm.weight.grad is None


@pytest.mark.parametrize("variant", ["fla", "lolcats"])
def test_inference_fast_path_equals_the_autograd_path(variant):
    """Without autograd the maps take an in-place path (unnormalised fla features for queries, the
    normaliser in the keys' log scale); it must give the same features, kernel and attention as the
    differentiable path, to rounding."""
    g = torch.Generator().manual_seed(7)
    fm = ka.HedgehogFeatures(8, 6, variant=variant, init="kaiming", generator=g, batch_shape=(2,), dtype=torch.float64)
    with torch.no_grad():
        fm.bias.normal_(generator=g) if fm.bias is not None else None
    x = torch.randn(3, 2, 20, 8, generator=g, dtype=torch.float64)
    v = torch.randn(3, 2, 20, 4, generator=g, dtype=torch.float64)
    slow = fm(x)  # parameters require grad: the autograd path
    slow_k = fm.kernel(x, x)
    slow_att = ka.linear_attention(x, x, v, fm, causal=True)
    with torch.no_grad():
        fast = fm(x)
        fast_k = fm.kernel(x, x)
        fast_att = ka.linear_attention(x, x, v, fm, causal=True)
        fq = fm.query_features(x)
        f, ls = fm.log_features(x)
        fs, M = fm.log_features(x, shared=True)
    assert torch.allclose(fast, slow, rtol=1e-12, atol=1e-15)
    assert torch.allclose(fast_k, slow_k, rtol=1e-12, atol=1e-15)
    assert torch.allclose(fast_att, slow_att, rtol=1e-10, atol=1e-13)
    assert torch.allclose(f * ls.exp().unsqueeze(-1), slow, rtol=1e-12, atol=1e-15)
    assert torch.allclose(fs * M.exp().unsqueeze(-1), slow, rtol=1e-12, atol=1e-15)
    assert (fq > 0).all() and (f <= 1).all() and (fs <= 1).all()
    # queries: equal to phi up to a positive factor per row
    ratio = fq / slow
    assert torch.allclose(ratio, ratio[..., :1].expand_as(ratio), rtol=1e-12)
