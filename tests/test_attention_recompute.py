"""Training of the causal chunked form's running-maximum path with recomputation per group.

In training, each group of chunks of the running-maximum path (`kernelapprox.attention.linear.chunk_runmax`:
signed maps such as `ka.TrigRF`, and positive maps with ``_path="runmax"``) runs under
``torch.utils.checkpoint.checkpoint`` (``_recompute=True``, the default): the graph keeps the
group's arguments and the state entering it, and the backward reruns the group. Checked here, in
float64 against the plain references of ``kernelapprox.attention.linear.naive``: forward and backward
(q, k, v and through ``initial_state`` / ``return_state``), chunk sizes that do and do not divide
``n``, several groups, a non-finite value, bitwise equality with plain autograd
(``_recompute=False``), and the bytes saved for the backward.
"""

from __future__ import annotations

import pytest
import torch
from conftest import F64, randn

import kernelapprox as ka
import kernelapprox.attention.linear.chunk_runmax as chunk_runmax
from kernelapprox.attention.linear.parallel import _GEMM_COLUMNS

D = 4
# float64 at 1e-10 against the naive reference: both compute the same sums (the fast form in
# chunks with a carried, rescaled state, the reference as one masked n x n product), so they
# differ by summation order only, ~1e-15 relative, amplified a little by the ratio num / den
# (the signed maps' denominators are kept away from 0 by small q, k); a real error (a missing
# chunk, a state at the wrong scale) is O(1e-2). Recomputation itself reruns the same operations,
# so against plain autograd the comparison is bitwise.
TOL = {"rtol": 1e-10, "atol": 1e-10}
MAPS = ["trig-sincos", "trig-offset", "positive"]

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: threads only cost


def make_map(name: str, r: int = 16) -> ka.FeatureMap:
    if name == "trig-sincos":
        return ka.TrigRF(D, r, seed=2, dtype=F64)  # F = 2r
    if name == "trig-offset":
        return ka.TrigRF(D, 2 * r, variant="offset", seed=2, dtype=F64)  # F = 2r
    if name == "positive":  # on the running-maximum path with _path="runmax" (see `attend`)
        return ka.PositiveRF(D, 2 * r, sampler="orthogonal", seed=0, dtype=F64)  # F = 2r
    raise AssertionError(name)


def attend(q, k, v, fm, recompute: bool = True, **kw):
    """Causal attention on the running-maximum path (signed maps take it anyway)."""
    return ka.chunk_linear_attention(q, k, v, fm, _path="runmax", _recompute=recompute, **kw)


def leaves(n: int, dv: int = 3, seed: int = 0, lead=(2, 2)) -> list[torch.Tensor]:
    """float64 leaves q, k (*lead, n, D) at scale 0.3 (trig denominators far from 0), v (*lead, n, dv)."""
    q = randn(*lead, n, D, seed=seed, scale=0.3)
    k = randn(*lead, n, D, seed=seed + 1, scale=0.3)
    v = randn(*lead, n, dv, seed=seed + 2)
    return [t.requires_grad_(True) for t in (q, k, v)]


def groups_of(n: int, C: int, Fd: int, dv: int, recompute: bool = True) -> int:
    """The number of groups of the running-maximum loop (its formula in `chunk_linear_attention`),
    in training with recomputation split into runs of at most ``_RECOMPUTE_CHUNKS`` chunks."""
    m = _GEMM_COLUMNS  # [v, 1] is zero-padded to a multiple of m columns
    nc, dv1 = -(-n // C), -(-(dv + 1) // m) * m
    group = max(1, (nc * C * (Fd + dv1)) // (Fd * dv1))
    if recompute:
        group = min(group, chunk_runmax._RECOMPUTE_CHUNKS)
    return -(-nc // group)


def count_checkpoints(monkeypatch) -> list[int]:
    """Count the groups run under ``checkpoint`` (one list entry per call)."""
    calls: list[int] = []
    orig = chunk_runmax.checkpoint

    def counted(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    monkeypatch.setattr(chunk_runmax, "checkpoint", counted)
    return calls


def grads_both_ways(monkeypatch, f, inputs):
    """``f(*inputs, recompute)`` -> (output, loss); the output and the gradients of the loss w.r.t.
    ``inputs`` with recomputation and without, checked bitwise equal (NaN where NaN) and the
    number of checkpointed groups returned."""
    calls = count_checkpoints(monkeypatch)
    res = {}
    for rec in (True, False):
        n_before = len(calls)
        out, loss = f(*inputs, rec)
        res[rec] = (out.detach(), torch.autograd.grad(loss, inputs), len(calls) - n_before)
    assert res[False][2] == 0
    for a, b in zip((res[True][0], *res[True][1]), (res[False][0], *res[False][1]), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    return res[True]


@pytest.mark.parametrize(("n", "C", "dv"), [(37, 5, 3), (40, 8, 3), (37, 64, 3), (37, 1, 3), (61, 4, 15)],
                         ids=["C5-partial", "C8-divides", "one-partial-chunk", "C1-5runs", "C4-3groups"])
@pytest.mark.parametrize("name", MAPS)
def test_recompute_equals_naive(monkeypatch, name, n, C, dv):
    """Forward and backward (q, k, v) equal autograd through the naive reference (1e-10) and,
    bitwise, plain autograd through the running-maximum path; one checkpoint per group."""
    fm = make_map(name)
    inputs = leaves(n, dv, seed=3)
    w = randn(2, 2, n, dv, seed=9)

    def f(q, k, v, rec):
        out = attend(q, k, v, fm, rec, chunk_size=C)
        return out, (out * w).sum()

    out, grads, calls = grads_both_ways(monkeypatch, f, inputs)
    groups = groups_of(n, C, fm.feature_dim, dv)
    assert calls == groups
    if dv == 15:
        assert groups == 3  # the several-group case: states carried between checkpointed groups
    ref = ka.naive_linear_attention(*inputs, fm, causal=True)
    torch.testing.assert_close(out, ref, **TOL)
    for a, b, what in zip(grads, torch.autograd.grad((ref * w).sum(), inputs), "qkv", strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=f"d/d{what}")


@pytest.mark.parametrize("name", MAPS)
def test_recompute_through_states(monkeypatch, name):
    """A sequence cut in two: the prefix returns its state, the suffix continues from it and
    returns the final state. Loss on both outputs and on the final state
    ($S \\, e^{\\text{log scale}} = \\sum_j \\varphi(k_j)[v_j, 1]$, the scale carrying no gradient):
    everything equals the naive reference on the whole sequence (output by
    `naive_linear_attention`, state from ``key_features``), gradients through the handed-over
    state included; both segments have several groups and a partial last chunk."""
    n, cut, C, dv = 67, 30, 4, 15
    fm = make_map(name)
    inputs = leaves(n, dv, seed=5)
    w = randn(2, 2, n, dv, seed=10)
    ws = randn(2, 2, fm.feature_dim, dv + 1, seed=11)
    assert groups_of(cut, C, fm.feature_dim, dv) > 1 and groups_of(n - cut, C, fm.feature_dim, dv) > 1

    def f(q, k, v, rec):
        o1, st = attend(q[..., :cut, :], k[..., :cut, :], v[..., :cut, :], fm, rec,
                        chunk_size=C, return_state=True)
        o2, st2 = attend(q[..., cut:, :], k[..., cut:, :], v[..., cut:, :], fm, rec,
                         chunk_size=C, initial_state=st, return_state=True)
        S = st2.kv * torch.exp(st2.log_scale)
        out = torch.cat((o1, o2), dim=-2)
        return torch.cat((out.flatten(-2), S.flatten(-2)), dim=-1), (out * w).sum() + (S * ws).sum()

    got, grads, calls = grads_both_ways(monkeypatch, f, inputs)
    assert calls == groups_of(cut, C, fm.feature_dim, dv) + groups_of(n - cut, C, fm.feature_dim, dv)
    q, k, v = inputs
    ref = ka.naive_linear_attention(q, k, v, fm, causal=True)
    S_ref = fm.key_features(k).mT @ torch.cat((v, torch.ones_like(v[..., :1])), dim=-1)
    torch.testing.assert_close(got, torch.cat((ref.flatten(-2), S_ref.flatten(-2)), dim=-1), **TOL)
    g_ref = torch.autograd.grad((ref * w).sum() + (S_ref * ws).sum(), inputs)
    for a, b, what in zip(grads, g_ref, "qkv", strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=f"d/d{what}")


def test_recompute_gradcheck_initial_state():
    """Finite differences (gradcheck, float64) through the recomputed groups, an initial state
    whose kv is a leaf included: several groups, a partial last chunk, a signed map."""
    fm = ka.TrigRF(D, 4, seed=2, dtype=F64)  # F = 8
    q, k, v = leaves(13, dv=7, seed=7, lead=(1, 2))
    assert groups_of(13, 2, fm.feature_dim, 7) > 1
    _, st = ka.linear_attention(q[..., :3, :].detach(), k[..., :3, :].detach(), v[..., :3, :].detach(),
                                fm, causal=True, return_state=True)
    kv0 = st.kv.clone().requires_grad_(True)

    def f(q, k, v, kv0):
        return attend(q, k, v, fm, chunk_size=2, initial_state=ka.LinearAttentionState(kv0, st.log_scale))

    assert torch.autograd.gradcheck(f, (q, k, v, kv0))


@pytest.mark.parametrize("which", ["q", "v"])
@pytest.mark.parametrize("name", MAPS)
def test_recompute_nonfinite(monkeypatch, name, which):
    """A NaN in one query or value at ``j`` (several groups, ``j`` inside a chunk): the rows before
    ``j`` equal the reference on the sequence cut at ``j``, forward, and so do the gradients of a
    loss on those rows w.r.t. the queries (and, for a NaN value, the values) before ``j``;
    everything, NaN pattern included, equals plain autograd bitwise.

    The other gradients before ``j`` are NaN with or without recomputation (not compared): the
    zero loss weight of a row ``>= j`` meets its NaN in the backward of ``num / den``
    (``-0 * num / den**2`` with a NaN numerator, or ``0 / den`` with a NaN denominator), and
    that reaches the earlier keys (and values) through the carried state's gradient."""
    n, C, dv, j = 61, 4, 15, 33
    fm = make_map(name)
    inputs = leaves(n, dv, seed=13)
    with torch.no_grad():
        inputs["qkv".index(which)][:, :, j, 1] = float("nan")
    w = randn(2, 2, n, dv, seed=12)
    w[..., j:, :] = 0.0  # loss on the rows before j

    def f(q, k, v, rec):
        out = attend(q, k, v, fm, rec, chunk_size=C)
        return out, (out[..., :j, :] * w[..., :j, :]).sum()

    out, grads, calls = grads_both_ways(monkeypatch, f, inputs)
    assert calls == groups_of(n, C, fm.feature_dim, dv) > 1
    assert not torch.isfinite(out[..., j, :]).all()  # the NaN reaches its own row
    cut = [t[..., :j, :].detach().clone().requires_grad_(True) for t in inputs]
    ref = ka.naive_linear_attention(*cut, fm, causal=True)
    torch.testing.assert_close(out[..., :j, :], ref, **TOL)
    g_ref = torch.autograd.grad((ref * w[..., :j, :]).sum(), cut)
    for i in (0,) if which == "q" else (0, 2):  # dq; dv too when the NaN is in a value
        assert torch.isfinite(grads[i][..., :j, :]).all(), "qkv"[i]
        torch.testing.assert_close(grads[i][..., :j, :], g_ref[i], **TOL, msg=f"d/d{'qkv'[i]}")


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages of the tensors autograd saves while ``fn`` runs (a view
    counts its whole storage, once). Under non-reentrant checkpointing the group's own
    intermediates go to the checkpoint's hooks, not these, but its arguments are saved through
    them (so the entering states and the chunked inputs are counted)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_recompute_saves_no_chunk_states():
    """Bytes saved for the backward, with and without recomputation.

    Bound with recomputation, per head, in float64 elements: the inputs (n(2d + d_v)), the
    features and the map's intermediates for q and k, ``[v, 1]``, the per-token weights and
    scales (a few n each) and the intra-chunk weights E (nC) -- together under
    4 n (d + F + d_v+1 + C) -- plus the state entering each group, groups x F x (d_v+1). Measured:
    2.5 n (d + F + d_v+1 + C) + the states. Plain autograd also keeps every chunk's entering
    state (n_c x F x (d_v+1) = n F (d_v+1) / C: 16 n (F + d_v+1) here, with F = d_v+1 = 64, C = 2)
    and the intra-chunk scores: measured 17.8 n (d + F + d_v+1 + C), above the bound."""
    n, r, dv, C = 256, 32, 63, 2
    fm = ka.TrigRF(D, r, seed=2, dtype=F64)
    Fd, dv1, heads = fm.feature_dim, dv + 1, 2
    q, k, v = leaves(n, dv, seed=17, lead=(1, heads))
    groups = groups_of(n, C, Fd, dv)
    assert groups == 16
    bound = 8 * heads * (4 * n * (D + Fd + dv1 + C) + groups * Fd * dv1)
    sizes = {}
    for rec in (True, False):
        sizes[rec] = saved_bytes(lambda rec=rec: attend(q, k, v, fm, rec, chunk_size=C))
    assert sizes[True] <= bound < sizes[False], (sizes, bound)
