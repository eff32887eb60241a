"""Linear attention (parallel, causal chunked, recurrent) and the exact softmax references.

Every fast form is compared in float64 with the independent references of
``kernelapprox.attention.linear.naive`` (the plain quadratic formula A = phi(q) phi(k)^T, masked with tril
when causal, out = A v / A 1, and the plain recurrence), forward and backward, at 1e-10, so a
causal path that ignores q or k (the xformers bug) cannot pass.
"""

from __future__ import annotations

import pytest
import torch
from conftest import F64, randn, softmax_attn_ref, warns_unfitted, with_norm

import kernelapprox as ka

TOL = {"rtol": 1e-10, "atol": 1e-10}
B, H, N, D, DV = 2, 3, 37, 4, 3


def make_map(name: str, d: int = D):
    if name == "positive":
        return ka.PositiveRF(d, 16, sampler="orthogonal", seed=0, dtype=F64)
    if name == "hyperbolic":
        return ka.HyperbolicRF(d, 8, seed=1, dtype=F64)
    if name == "trig":  # signed features: inputs kept small so denominators stay far from 0
        return ka.TrigRF(d, 64, seed=2, dtype=F64)
    if name == "elu":
        return ka.EluFeatures(d)
    raise AssertionError(name)


MAP_NAMES = ["positive", "hyperbolic", "trig", "elu"]


def qkv(n=N, m=None, seed=0, scale=0.5, lead=(B, H)):
    m = n if m is None else m
    q = randn(*lead, n, D, seed=seed, scale=scale)
    k = randn(*lead, m, D, seed=seed + 1, scale=scale)
    v = randn(*lead, m, DV, seed=seed + 2)
    return q, k, v


def scale_for(name):
    return 0.3 if name == "trig" else 0.5


# --------------------------------------------------------------------------- every fast form vs naive


def _grad_inputs(name: str, n: int = 23):
    """float64 leaves (q, k, v) for gradient checks; ReLU inputs shifted so no feature row is all 0."""
    q, k, v = qkv(n=n, scale=scale_for(name), seed=11)
    if name == "relu":
        q, k = q.abs() + 0.1, k.abs() + 0.1
    return [t.clone().requires_grad_(True) for t in (q, k, v)]


def _recurrent(q, k, v, fm):
    rnn = ka.RecurrentLinearAttention(fm)
    return torch.stack([rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(q.shape[-2])], -2)


def _two_segments(q, k, v, fm, split=9):
    o1, st = ka.linear_attention(q[..., :split, :], k[..., :split, :], v[..., :split, :], fm, causal=True,
                                 chunk_size=4, return_state=True)
    o2 = ka.linear_attention(q[..., split:, :], k[..., split:, :], v[..., split:, :], fm, causal=True,
                             chunk_size=5, initial_state=st)
    return torch.cat([o1, o2], -2)


FAST_FORMS = {
    # name: (fast form, causal reference?)
    "parallel": (lambda q, k, v, fm: ka.linear_attention(q, k, v, fm), False),
    "parallel_fn": (lambda q, k, v, fm: ka.parallel_linear_attention(q, k, v, fm), False),
    "chunk1": (lambda q, k, v, fm: ka.linear_attention(q, k, v, fm, causal=True, chunk_size=1), True),
    "chunk5": (lambda q, k, v, fm: ka.chunk_linear_attention(q, k, v, fm, chunk_size=5), True),
    "chunk64": (lambda q, k, v, fm: ka.linear_attention(q, k, v, fm, causal=True, chunk_size=64), True),
    "recurrent": (_recurrent, True),
    "state_handover": (_two_segments, True),
}
ESTIMATOR_NAMES = [e.name for e in ka.estimators()]


def _registered_map(name: str):
    est = ka.get_estimator(name)
    r = 64 if not est.positive else 16  # signed maps: more features keep denominators away from 0
    return est.build(D, r, seed=3, dtype=F64)


@pytest.mark.parametrize("form", list(FAST_FORMS))
@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_fast_form_equals_naive_forward_and_backward(name, form):
    """One parametrised check of every fast form of every registered estimator against the naive
    reference, forward (1e-10) and backward (gradients w.r.t. q, k and v, 1e-8)."""
    fm = _registered_map(name)
    fast, causal = FAST_FORMS[form]
    q, k, v = _grad_inputs(name)
    with warns_unfitted(fm):  # data-dependent maps are checked unfitted (data-free parameters)
        out = fast(q, k, v, fm)
    ref = ka.naive_linear_attention(q, k, v, fm, causal=causal)
    assert out.shape == ref.shape and out.dtype == F64
    torch.testing.assert_close(out, ref, **TOL)
    w = randn(*out.shape, seed=5)  # a random cotangent, so no gradient can cancel by symmetry
    g_fast = torch.autograd.grad((out * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b, what in zip(g_fast, g_ref, "qkv", strict=True):
        assert b.abs().max() > 0, what
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"d/d{what}")


@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_naive_references_agree(name):
    """The two references (quadratic and plain recurrence) agree with each other."""
    fm = _registered_map(name)
    q, k, v = (t.detach() for t in _grad_inputs(name))
    with warns_unfitted(fm):
        rec = ka.naive_recurrent_linear_attention(q, k, v, fm)
    torch.testing.assert_close(rec, ka.naive_linear_attention(q, k, v, fm, causal=True), **TOL)


def test_naive_shares_no_code_with_the_fast_paths():
    """fla's pattern: the reference is independent of what it checks (no import from the fast
    modules, no stabilised feature methods, no shared normalisation)."""
    import ast
    import inspect

    import kernelapprox.attention.linear.naive as naive

    tree = ast.parse(inspect.getsource(naive))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"_common", "chunk", "parallel", "recurrent", "state"}, imported
    called = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    called |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    for name in ("log_features", "query_features", "normalise", "RecurrentLinearAttention", "kernel"):
        assert name not in called, name


def test_each_input_is_validated_once(monkeypatch):
    """q, k, v are checked once per call (by the entry point), not again inside the feature map."""
    import kernelapprox._validation as V
    import kernelapprox.exact as E
    import kernelapprox.maps.base as Fm

    calls = []
    orig = V.check_floating

    def counting(name, x):
        calls.append(name)
        return orig(name, x)

    for mod in (V, E, Fm):
        monkeypatch.setattr(mod, "check_floating", counting)
    fm = make_map("positive")
    q, k, v = qkv()
    for causal in (False, True):
        calls.clear()
        ka.linear_attention(q, k, v, fm, causal=causal)
        assert sorted(calls) == ["k", "q", "v"], calls
    calls.clear()
    fm.kernel(q, k)
    assert sorted(calls) == ["k", "q"], calls
    calls.clear()
    fm(q)
    assert calls == ["x"], calls


# --------------------------------------------------------------------------- parallel and causal vs hand


@pytest.mark.parametrize("name", MAP_NAMES)
def test_noncausal_equals_hand_formula(name):
    fm = make_map(name)
    q, k, v = qkv(n=11, m=23, scale=scale_for(name))
    out = ka.linear_attention(q, k, v, fm)
    assert out.shape == (B, H, 11, DV) and out.dtype == F64
    torch.testing.assert_close(out, ka.naive_linear_attention(q, k, v, fm, causal=False), **TOL)


def test_noncausal_elu_written_out():
    """Katharopoulos et al.: phi = elu + 1, written with torch.nn.functional, no library features."""
    q, k, v = qkv(n=9, m=13, scale=1.5)
    pq, pk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    expected = (pq @ (pk.mT @ v)) / (pq @ pk.sum(-2, keepdim=True).mT)
    torch.testing.assert_close(ka.linear_attention(q, k, v, ka.EluFeatures(D)), expected, **TOL)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 37, 64, 100])
@pytest.mark.parametrize("name", MAP_NAMES)
def test_causal_equals_masked_quadratic(name, chunk_size):
    fm = make_map(name)
    q, k, v = qkv(scale=scale_for(name))
    out = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=chunk_size)
    assert out.shape == (B, H, N, DV) and out.dtype == F64
    torch.testing.assert_close(out, ka.naive_linear_attention(q, k, v, fm, causal=True), **TOL)


def test_causal_depends_on_q_and_k():
    """The reference changes when q (or k) changes, and the library follows it exactly.
    A causal path that ignores q and k (xformers: running mean of v) is rejected."""
    fm = make_map("positive")
    q, k, v = qkv()
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    base = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=16)
    for q2, k2 in ((q[..., perm, :], k), (q, k[..., perm, :]), (2 * q, k), (q, -k)):
        ref2 = ka.naive_linear_attention(q2, k2, v, fm, causal=True)
        assert (ref2 - base).abs().max() > 1e-3  # the test input really changes the answer
        torch.testing.assert_close(
            ka.linear_attention(q2, k2, v, fm, causal=True, chunk_size=16), ref2, **TOL
        )
    # a q/k-independent output (the xformers bug) is far from the reference
    running_mean = v.cumsum(-2) / torch.arange(1, N + 1, dtype=F64)[:, None]
    assert (running_mean - base).abs().max() > 1e-2


def test_noncausal_last_row_equals_causal_last_row():
    fm = make_map("positive")
    q, k, v = qkv()
    c = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=5)
    nc = ka.linear_attention(q, k, v, fm, causal=False)
    torch.testing.assert_close(c[..., -1, :], nc[..., -1, :], **TOL)
    assert (c[..., 0, :] - nc[..., 0, :]).abs().max() > 1e-3


@pytest.mark.parametrize("name", MAP_NAMES)
def test_recurrent_equals_causal(name):
    fm = make_map(name)
    q, k, v = qkv(scale=scale_for(name))
    rnn = ka.RecurrentLinearAttention(fm)
    steps = torch.stack([rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(N)], dim=-2)
    assert steps.shape == (B, H, N, DV)
    torch.testing.assert_close(steps, ka.naive_linear_attention(q, k, v, fm, causal=True), **TOL)
    torch.testing.assert_close(steps, ka.linear_attention(q, k, v, fm, causal=True, chunk_size=7), **TOL)


# --------------------------------------------------------------------------- state hand-over


@pytest.mark.parametrize("prefix", [1, 13, 32, 36])
@pytest.mark.parametrize("name", ["positive", "trig", "elu"])
def test_state_handover_chunked(name, prefix):
    fm = make_map(name)
    q, k, v = qkv(scale=scale_for(name))
    whole = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=8)
    o1, st = ka.linear_attention(
        q[..., :prefix, :],
        k[..., :prefix, :],
        v[..., :prefix, :],
        fm,
        causal=True,
        chunk_size=16,
        return_state=True,
    )
    o2 = ka.linear_attention(
        q[..., prefix:, :],
        k[..., prefix:, :],
        v[..., prefix:, :],
        fm,
        causal=True,
        chunk_size=5,
        initial_state=st,
    )
    torch.testing.assert_close(torch.cat([o1, o2], -2), whole, **TOL)


@pytest.mark.parametrize("name", ["positive", "hyperbolic", "elu"])
def test_state_handover_to_recurrent(name):
    """A prompt processed in parallel hands over to token-by-token decoding."""
    fm = make_map(name)
    q, k, v = qkv(scale=scale_for(name))
    p = 20
    o1, st = ka.linear_attention(
        q[..., :p, :], k[..., :p, :], v[..., :p, :], fm, causal=True, return_state=True
    )
    rnn = ka.RecurrentLinearAttention(fm, state=st)
    o2 = torch.stack([rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(p, N)], dim=-2)
    torch.testing.assert_close(torch.cat([o1, o2], -2), ka.naive_linear_attention(q, k, v, fm, causal=True), **TOL)


def test_state_handover_when_key_scale_grows():
    """Keys of the continuation have much larger norm than the prompt's: the stabilised state must be
    rescaled, not overwritten (float64 keeps the hand reference finite at these norms)."""
    fm = make_map("positive")
    q, k, v = qkv(scale=0.3)
    k = k.clone()
    k[..., 20:, :] = with_norm(k[..., 20:, :], 4.0)
    q[..., 20:, :] = with_norm(q[..., 20:, :], 3.0)
    ref = ka.naive_linear_attention(q, k, v, fm, causal=True)
    o1, st = ka.linear_attention(
        q[..., :20, :], k[..., :20, :], v[..., :20, :], fm, causal=True, return_state=True
    )
    o2 = ka.linear_attention(
        q[..., 20:, :], k[..., 20:, :], v[..., 20:, :], fm, causal=True, initial_state=st
    )
    torch.testing.assert_close(torch.cat([o1, o2], -2), ref, **TOL)
    rnn = ka.RecurrentLinearAttention(fm, state=st)
    o3 = torch.stack([rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(20, N)], dim=-2)
    torch.testing.assert_close(o3, ref[..., 20:, :], **TOL)


def test_returned_state_values():
    """state.S = sum_j phi(k_j) v_j^T, state.z = sum_j phi(k_j) (true, unstabilised values)."""
    fm = make_map("hyperbolic")
    q, k, v = qkv()
    _, st = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=6, return_state=True)
    pk = fm(k)
    torch.testing.assert_close(st.S, pk.mT @ v, **TOL)
    torch.testing.assert_close(st.z, pk.sum(-2), **TOL)


def test_noncausal_with_initial_state():
    """Non-causal queries over (prompt keys from a state) + (new keys) = attention over all keys."""
    fm = make_map("positive")
    q, k, v = qkv()
    _, st = ka.linear_attention(
        q[..., :15, :], k[..., :15, :], v[..., :15, :], fm, causal=True, return_state=True
    )
    out = ka.linear_attention(q[..., 15:, :], k[..., 15:, :], v[..., 15:, :], fm, initial_state=st)
    torch.testing.assert_close(out, ka.naive_linear_attention(q[..., 15:, :], k, v, fm, causal=False), **TOL)


@pytest.mark.parametrize("name", MAP_NAMES)
def test_noncausal_returned_state_and_padding(name):
    """The non-causal state is [S | z] of width dv + 1 (the GEMMs' zero padding to a multiple of
    8 columns is internal), with the true values; a state handed over reproduces attention over
    all keys; dv = 7 (dv + 1 a multiple of 8, no padding) and dv = 3 (padded to 8) both."""
    fm = make_map(name)
    for dv in (3, 7):
        q, k, _ = qkv(scale=scale_for(name))
        v = randn(B, H, N, dv, seed=5)
        out, st = ka.linear_attention(q, k, v, fm, return_state=True)
        assert st.kv.shape == (B, H, fm.feature_dim, dv + 1) and st.kv.is_contiguous()
        pk = fm.key_features(k)
        torch.testing.assert_close(st.S, pk.mT @ v, **TOL)
        torch.testing.assert_close(st.z, pk.sum(-2), **TOL)
        torch.testing.assert_close(out, ka.naive_linear_attention(q, k, v, fm, causal=False), **TOL)
        out2 = ka.linear_attention(q[..., 20:, :], k[..., 20:, :], v[..., 20:, :], fm,
                                   initial_state=ka.linear_attention(q[..., :20, :], k[..., :20, :],
                                                                     v[..., :20, :], fm, return_state=True)[1])
        torch.testing.assert_close(out2, ka.naive_linear_attention(q[..., 20:, :], k, v, fm, causal=False), **TOL)


def test_noncausal_recycled_buffers():
    """Without autograd the non-causal form writes phi(Q) into the memory of phi(K) and the
    product into that of [wV, w] (`FeatureMap.query_features_into`): the values equal those of
    the autograd path (which recycles nothing) and of the naive reference, the output owns no
    memory of a recycled buffer, and the inputs are untouched."""
    fm = make_map("positive")
    q, k, v = qkv()
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    buf = torch.full((B, H, N, fm.feature_dim + 3), float("nan"), dtype=F64)
    fq = fm.query_features_into(q, buf)
    assert fq.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    torch.testing.assert_close(fq, fm.query_features(q), rtol=0, atol=0)
    with torch.no_grad():
        out = ka.linear_attention(q, k, v, fm)
    with torch.enable_grad():
        ref = ka.linear_attention(q.requires_grad_(), k, v, fm).detach()
    q.requires_grad_(False)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(out, ka.naive_linear_attention(q, k, v, fm, causal=False), **TOL)
    assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
    assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0)
    # a buffer of the wrong dtype or too small is not used
    for bad in (buf.float(), buf[..., :2].contiguous()):
        f2 = fm.query_features_into(q, bad)
        assert f2.untyped_storage().data_ptr() != bad.untyped_storage().data_ptr()

    # a subclass that computes its features otherwise does not inherit the recycling
    class Halved(ka.PositiveRF):
        def query_features(self, x):
            return 0.5 * super().query_features(x) + 0.5 * super().query_features(x).flip(-1)

    sub = Halved.from_projection(fm.weight)
    assert not sub.key_features_recyclable()
    torch.testing.assert_close(sub.query_features_into(q, buf), sub.query_features(q), rtol=0, atol=0)
    with torch.no_grad():
        got = ka.linear_attention(q, k, v, sub)
    with torch.enable_grad():  # the autograd path recycles nothing
        want = ka.linear_attention(q.clone().requires_grad_(), k, v, sub).detach()
    torch.testing.assert_close(got, want, **TOL)


# --------------------------------------------------------------------------- batch shapes of the map


def test_per_head_projection_in_attention():
    fm = ka.PositiveRF(D, 16, seed=3, batch_shape=(H,), dtype=F64)
    q, k, v = qkv()
    for causal in (False, True):
        out = ka.linear_attention(q, k, v, fm, causal=causal, chunk_size=8)
        for h in range(H):
            single = ka.PositiveRF.from_projection(fm.weight[h])
            ref = ka.naive_linear_attention(q[:, h], k[:, h], v[:, h], single, causal=causal)
            torch.testing.assert_close(out[:, h], ref, **TOL)


def test_monte_carlo_batch_in_attention():
    S = 4
    fm = ka.PositiveRF(D, 16, seed=3, batch_shape=(S, 1, 1), dtype=F64)
    q, k, v = qkv()
    out = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=8)
    assert out.shape == (S, B, H, N, DV)
    for s in range(S):
        single = ka.PositiveRF.from_projection(fm.weight[s, 0, 0])
        torch.testing.assert_close(out[s], ka.naive_linear_attention(q, k, v, single, causal=True), **TOL)


# --------------------------------------------------------------------------- exact references


def test_softmax_kernel_exact():
    q, k = randn(2, 7, 5, seed=0, scale=2.0), randn(2, 9, 5, seed=1, scale=2.0)
    K = ka.softmax_kernel(q, k)
    assert K.shape == (2, 7, 9) and K.dtype == F64
    torch.testing.assert_close(K, torch.exp(q @ k.mT), rtol=1e-14, atol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("norm", [1.0, 10.0], ids=["norm1", "norm10"])
def test_softmax_attention_matches_torch(causal, norm):
    n = 29
    q = with_norm(randn(B, H, n, D, seed=0), norm)
    k = with_norm(randn(B, H, n if causal else 17, D, seed=1), norm)
    v = randn(B, H, k.shape[-2], DV, seed=2)
    ref = softmax_attn_ref(q, k, v, causal)
    assert torch.isfinite(ref).all()
    for chunk_size in (4, 1024):  # memory-bounded path: queries in chunks
        out = ka.softmax_attention(q, k, v, causal=causal, chunk_size=chunk_size)
        assert out.shape == ref.shape and out.dtype == F64
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_softmax_attention_float32_large_logits_finite():
    q = with_norm(randn(2, 64, 16, seed=0), 10.0).float()
    k = with_norm(randn(2, 64, 16, seed=1), 10.0).float()
    v = randn(2, 64, 8, seed=2).float()
    for causal in (False, True):
        out = ka.softmax_attention(q, k, v, causal=causal)
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        ref = softmax_attn_ref(q.double(), k.double(), v.double(), causal)
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("groups", [1, 3], ids=["one-group", "three-groups"])
@pytest.mark.parametrize("budget", [1, 10**9], ids=["block-per-sequence", "one-block"])
def test_causal_inference_blocks(monkeypatch, groups, budget):
    """The shared-scale forward without autograd takes the sequences in blocks sized to
    ``chunk_shared._BLOCK_BYTES`` and writes its output into the memory of the weighted values:
    with a block per sequence or one block, one group of chunks or several (another code path),
    and an initial state, output and final state equal the naive reference (1e-10, float64), the
    state shape carries no zero padding, and the inputs are untouched."""
    from kernelapprox.attention.linear import chunk_shared

    monkeypatch.setattr(chunk_shared, "_BLOCK_BYTES", budget)
    if groups > 1:
        monkeypatch.setattr(chunk_shared, "_GROUP_TOKENS", 1)  # the smallest groups the rule allows
    fm = make_map("positive")
    q, k, v = qkv(n=41)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    calls = _paths(monkeypatch)
    with torch.no_grad():
        _, st0 = ka.linear_attention(q[..., :9, :], k[..., :9, :], v[..., :9, :], fm, causal=True,
                                     chunk_size=4, return_state=True)
        out, st = ka.linear_attention(q[..., 9:, :], k[..., 9:, :], v[..., 9:, :], fm, causal=True,
                                      chunk_size=4, initial_state=st0, return_state=True)
    assert calls["forward"] == 2 and calls["function"] == 0
    ref = ka.naive_linear_attention(q, k, v, fm, causal=True)[..., 9:, :]
    torch.testing.assert_close(out, ref, **TOL)
    assert st.kv.shape == (B, H, fm.feature_dim, DV + 1)
    pk = fm(k)
    torch.testing.assert_close(st.S, pk.mT @ v, **TOL)
    torch.testing.assert_close(st.z, pk.sum(-2), **TOL)
    assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize("causal", [False, True], ids=["parallel", "causal"])
def test_values_broadcast_over_heads(causal):
    """Values shared by the heads (shape (1, n, dv), or a stride-0 expanded tensor) against
    per-head queries and keys, without autograd: the in-place weighting and buffer reuse of the
    fast paths must not write through a broadcast (a RuntimeError before the fix) nor into the
    caller's tensor."""
    fm = make_map("positive")
    q = randn(3, 37, D, seed=0, scale=0.5)
    k = randn(3, 37, D, seed=1, scale=0.5)
    for v in (randn(1, 37, DV, seed=2), randn(37, DV, seed=3).expand(3, 37, DV)):
        v0 = v.clone()
        with torch.no_grad():
            out = ka.linear_attention(q, k, v, fm, causal=causal, chunk_size=8)
        ref = ka.naive_linear_attention(q, k, v.expand(3, 37, DV).contiguous(), fm, causal=causal)
        torch.testing.assert_close(out, ref, **TOL)
        assert torch.equal(v, v0)


# --------------------------------------------------------------------------- chunked causal backward


def _paths(monkeypatch) -> dict[str, int]:
    """Count the calls of the shared-scale path's custom autograd Function (training) and of its
    plain forward (inference), so a test knows which path it checked."""
    from kernelapprox.attention.linear import chunk_shared

    calls = {"function": 0, "forward": 0}
    apply, forward = chunk_shared.ChunkedCausal.apply, chunk_shared.chunked_forward

    def counted_apply(*a):
        calls["function"] += 1
        return apply(*a)

    def counted_forward(*a, **kw):
        calls["forward"] += 1
        return forward(*a, **kw)

    monkeypatch.setattr(chunk_shared.ChunkedCausal, "apply", counted_apply)
    monkeypatch.setattr(chunk_shared, "chunked_forward", counted_forward)
    return calls


@pytest.mark.parametrize("reverse", [False, True], ids=["prefix", "suffix"])
def test_scan_equals_cumsum(reverse):
    """The two-sweep in-place scan of the chunk states equals torch.cumsum (flipped for suffix
    sums) for every length, powers of two and not."""
    from kernelapprox.attention.linear.chunk_shared import _scan_

    for g in range(1, 41):
        x = randn(2, g, 3, 2, seed=g)
        ref = x.flip(1).cumsum(1).flip(1) if reverse else x.cumsum(1)
        torch.testing.assert_close(_scan_(x.clone(), reverse=reverse), ref, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-scale", "running-max"])
@pytest.mark.parametrize(("n", "chunk_size", "r"), [(23, 1, 16), (37, 5, 16), (37, 64, 16), (150, 4, 64)])
def test_causal_backward_equals_naive(monkeypatch, shared, n, chunk_size, r):
    """Both causal paths (the shared-scale one with its recomputing backward, and the
    running-maximum one with autograd through every chunk) equal autograd through the naive
    quadratic reference, forward (1e-10) and backward (1e-8), normaliser included (the output is
    the ratio). Groups are made small, so the shared-scale state is carried and rescaled between
    groups (except with a single chunk). The path counter proves which path ran."""
    import kernelapprox.attention.linear.chunk_shared as chunk_shared

    monkeypatch.setattr(chunk_shared, "_GROUP_TOKENS", 8)  # groups of 2-3 chunks: states carried between groups
    calls = _paths(monkeypatch)
    fm = ka.PositiveRF(D, r, sampler="orthogonal", seed=0, dtype=F64)
    q, k, v = (t.clone().requires_grad_(True) for t in qkv(n=n, seed=21))
    out = ka.chunk_linear_attention(q, k, v, fm, chunk_size=chunk_size, _path="shared" if shared else "runmax",
                                    _recompute=False)
    ref = ka.naive_linear_attention(q, k, v, fm, causal=True)
    torch.testing.assert_close(out, ref, **TOL)
    w = randn(*out.shape, seed=6)
    g_fast = torch.autograd.grad((out * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b, what in zip(g_fast, g_ref, "qkv", strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"d/d{what}")
    assert calls["function"] == (1 if shared else 0), calls


def test_causal_backward_with_key_padding(monkeypatch):
    """Right-padded batches (sequences of lengths 37 and 21 in one tensor, garbage after each
    end): causal rows never see later keys, so with the loss on the real rows only, the real
    tokens' gradients equal those of the naive reference on each unpadded sequence and the
    padding tokens' gradients are exactly 0."""
    calls = _paths(monkeypatch)
    fm = ka.PositiveRF(D, 16, sampler="orthogonal", seed=0, dtype=F64)
    q, k, v = qkv(n=N, seed=31, lead=(2, H))
    lengths = (37, 21)
    keep = torch.arange(N) < torch.tensor(lengths)[:, None]  # (2, N): the key padding mask
    pad = ~keep[:, None, :, None]
    q, k = q.masked_fill(pad, 0.7), k.masked_fill(pad, -0.9)  # arbitrary padding values
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    w = randn(2, H, N, DV, seed=7).masked_fill(pad, 0.0)  # loss on real rows only
    out = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=8)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    assert calls["function"] == 1
    for b, n_b in enumerate(lengths):
        qb, kb, vb = (t[b:b + 1, :, :n_b].detach().clone().requires_grad_(True) for t in (q, k, v))
        ref = ka.naive_linear_attention(qb, kb, vb, fm, causal=True)
        torch.testing.assert_close(out[b:b + 1, :, :n_b], ref, **TOL)
        g_ref = torch.autograd.grad((ref * w[b:b + 1, :, :n_b]).sum(), (qb, kb, vb))
        for g, gr, what in zip(grads, g_ref, "qkv", strict=True):
            torch.testing.assert_close(g[b:b + 1, :, :n_b], gr, rtol=1e-8, atol=1e-10, msg=f"d/d{what}")
            assert (g[b, :, n_b:] == 0).all(), what


def test_causal_gradcheck():
    """Finite differences (torch.autograd.gradcheck, float64) of the causal path through the
    custom Function: several chunks, a partial last chunk, the normaliser, and an initial state
    whose kv also receives gradients."""
    fm = ka.PositiveRF(D, 8, sampler="orthogonal", seed=0, dtype=F64)
    q, k, v = (t.clone().requires_grad_(True) for t in qkv(n=11, seed=41, lead=(1, 2)))
    _, st = ka.linear_attention(q[..., :3, :].detach(), k[..., :3, :].detach(), v[..., :3, :].detach(),
                                fm, causal=True, return_state=True)
    kv0 = st.kv.clone().requires_grad_(True)

    def f(q, k, v, kv0):
        state = ka.LinearAttentionState(kv0, st.log_scale)
        return ka.linear_attention(q, k, v, fm, causal=True, chunk_size=3, initial_state=state)

    assert torch.autograd.gradcheck(f, (q, k, v, kv0))


def test_chunked_function_gradcheck():
    """gradcheck of the custom Function alone, both outputs (chunk outputs and final state) and
    all four inputs, with three groups of chunks and the rescaling factors between them."""
    from kernelapprox.attention.linear.chunk_shared import ChunkedCausal

    L, nc, C, Fd, dv1 = 2, 5, 3, 4, 3
    fq, fk = (randn(L, nc, C, Fd, seed=s).abs().requires_grad_(True) for s in (1, 2))
    vw = randn(L, nc, C, dv1, seed=3).requires_grad_(True)
    S0 = randn(L, Fd, dv1, seed=4).requires_grad_(True)
    decay = (None, torch.tensor([0.5, 0.9], dtype=F64).view(L, 1, 1), torch.tensor([0.7, 1.0], dtype=F64).view(L, 1, 1))
    bounds = ((0, 2), (2, 4), (4, 5))
    mask = torch.ones(C, C, dtype=torch.bool).tril()
    assert torch.autograd.gradcheck(lambda *x: ChunkedCausal.apply(*x, decay, bounds, mask), (fq, fk, vw, S0))


def _saved_numels(fn) -> list[int]:
    """Element counts of the tensors autograd saves while ``fn`` runs, one per storage (a tensor
    saved twice, or a view of one already saved, counts once: what the memory holds)."""
    sizes: dict[tuple[int, int], int] = {}

    def pack(t):
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        sizes[key] = max(sizes.get(key, 0), st.nbytes() // t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return list(sizes.values())


@pytest.mark.parametrize(("shared", "recompute"), [(True, True), (False, True), (False, False)],
                         ids=["shared-scale", "running-max-recomputed", "running-max-autograd"])
def test_causal_training_saves_no_chunk_states(shared, recompute):
    """Training memory: with the shared-scale path, and with the running-maximum path in
    recomputed runs, nothing that autograd saves is larger than the features or [v, 1]
    (n x max(F, d_v + 1) per head), and the total is a few such tensors, so no (n_c, F, d_v + 1)
    stack of chunk states is kept for the backward. Shapes make the state stack 4x the larger of
    the two (F = 16, d_v + 1 = 32, C = 4). The running-maximum path with plain autograd
    (``_recompute=False``) keeps them: checked to exceed the bounds, so the test can
    tell the cases apart."""
    n, Fd, dv, C = 256, 16, 31, 4
    fm = ka.PositiveRF(D, Fd, seed=0, dtype=F64)
    q, k = (randn(1, 2, n, D, seed=s, scale=0.5).requires_grad_(True) for s in (1, 2))
    v = randn(1, 2, n, dv, seed=3).requires_grad_(True)
    path = "shared" if shared else "runmax"
    sizes = _saved_numels(lambda: ka.chunk_linear_attention(q, k, v, fm, chunk_size=C, _path=path,
                                                            _recompute=recompute))
    row = 2 * n * max(Fd, dv + 1)  # the larger of the features and [v, 1] (2 heads)
    within = max(sizes) <= row and sum(sizes) <= 8 * row
    assert within == recompute, (max(sizes) / row, sum(sizes) / row)


def test_causal_mixed_paths_equal_naive(monkeypatch):
    """Where a key's scale jumps above its group's reference by more than the allowed spread
    (made 0.2 nats here, so it happens at some token of each sequence), the rows before that
    token come from the shared-scale path and the rest from the running-maximum path: together
    they equal the naive reference, forward and backward."""
    import kernelapprox.attention.linear.chunk_shared as chunk_shared

    monkeypatch.setattr(chunk_shared, "_SPREAD", 0.2)
    calls = _paths(monkeypatch)
    masks = []
    orig = chunk_shared.clean_mask
    monkeypatch.setattr(chunk_shared, "clean_mask", lambda *a: masks.append(orig(*a)) or masks[-1])
    fm = ka.PositiveRF(D, 16, sampler="orthogonal", seed=0, dtype=F64)
    q, k, v = (t.clone().requires_grad_(True) for t in qkv(seed=51))
    out = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=4)
    keep = masks[0]
    assert keep is not None and 0 < int(keep.sum()) < keep.numel(), keep  # both paths have rows
    assert calls["function"] == 1
    ref = ka.naive_linear_attention(q, k, v, fm, causal=True)
    torch.testing.assert_close(out, ref, **TOL)
    w = randn(*out.shape, seed=8)
    for a, b, what in zip(torch.autograd.grad((out * w).sum(), (q, k, v)),
                          torch.autograd.grad((ref * w).sum(), (q, k, v)), "qkv", strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"d/d{what}")


@pytest.mark.parametrize("path", ["shared", "runmax"])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_short_causal_call_allocates_for_its_own_size(path, grad):
    """A short causal call (n = 16 < chunk_size = 64, B x H = 8, r = 64, d_v = 16) allocates no
    tensor larger than 4 n (F + d_v + 1) elements per batch-head (features, [v, 1] and the chunk
    states of its own tokens; forward and, in training, backward). Every tensor an operator returns
    is counted (``TorchDispatchMode``). Groups and spans sized for 16 384 tokens instead of the
    sequence allocate (L, 60 032) references: 12x over."""
    from torch.utils._python_dispatch import TorchDispatchMode

    n, dv, r, L = 16, 16, 64, 8
    fm = ka.PositiveRF(D, r, sampler="orthogonal", seed=0, dtype=F64)
    q, k = (randn(2, 4, n, D, seed=s, scale=0.5) for s in (1, 2))
    v = randn(2, 4, n, dv, seed=3)
    bound = 4 * n * (fm.feature_dim + dv + 1)
    sizes: list[tuple[int, str]] = []

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    sizes.append((t.numel(), str(func)))
            return out

    inputs = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    with Largest():
        out = ka.chunk_linear_attention(*inputs, fm, _path=path)
        if grad:
            out.sum().backward()
    assert len(sizes) > 10
    worst = max(sizes)
    assert worst[0] <= bound * L, (worst, bound * L)
    torch.testing.assert_close(out.detach(), ka.naive_linear_attention(q, k, v, fm, causal=True), **TOL)
