"""Masks, ``scale=``, grouped-query heads and the layout check of ``ka.linear_attention``.

What is pinned here:

* a padded key contributes nothing, in every form (parallel, chunked causal on both algorithms,
  recurrent): padding a 6-token sequence to 10 with keys of huge norm (which would otherwise
  set the key-scale maximum and underflow the real keys) or non-finite garbage leaves the real
  tokens' outputs unchanged, against the same call on the unpadded sequence and against the
  quadratic reference on the valid keys; a row with no valid key gives 0 without NaN, forward
  and backward; gradients of the masked call equal those of the compacted call (float64);
* `ka.softmax_attention` takes the same mask (the exact reference);
* ``scale=s`` equals inputs scaled by ``sqrt(s)`` (the kernel ``exp(s q.k)``);
* grouped-query heads (``H_kv`` dividing ``H_q``) equal the explicit repetition of the KV heads;
* ``layout="bthd"`` equals the transposed call, and a (B, T, H, K) tensor read in the default
  layout against a per-head map raises instead of computing silently;
* bad masks raise ValueError/TypeError naming the argument and the shapes.

Tolerances: float64 throughout except where stated; the fast forms agree with the quadratic
reference to ~1e-13 on these sizes, the checks use 1e-10 (float64) and 1e-5 (float32), while an
ignored mask moves the compared outputs by O(0.1-1) (asserted in the first test).
"""

from __future__ import annotations

import pytest
import torch

import kernelapprox as ka
from kernelapprox.attention import chunk_linear_attention, naive_linear_attention

F64 = torch.float64
B, H, D, N, NPAD = 2, 3, 8, 6, 10


def _inputs(seed=0, n=N, dtype=F64, b=B, h=H, d=D):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=dtype) * 0.5 for _ in range(3))
    return q, k, v


def _maps():
    return {
        "positive": ka.PositiveRF(D, 32, seed=0, batch_shape=(H,), dtype=F64),
        "trig": ka.TrigRF(D, 32, seed=0, dtype=F64),
        "elu": ka.EluFeatures(D),
    }


def _pad(q, k, v, where, scale=60.0, garbage=False):
    """Insert padded tokens at positions ``where`` (sorted) into sequences of length N -> NPAD.

    Padded keys have a huge norm (``scale``): their log-scale would dominate the key maximum.
    ``garbage``: padded queries, keys and values are NaN/Inf."""
    valid = torch.ones(NPAD, dtype=torch.bool)
    valid[list(where)] = False
    shape = (*q.shape[:-2], NPAD, q.shape[-1])
    g = torch.Generator().manual_seed(1)
    qp, kp, vp = (torch.randn(shape, generator=g, dtype=q.dtype) for _ in range(3))
    kp = kp * scale
    if garbage:
        kp[..., ~valid, 0] = float("nan")
        vp[..., ~valid, 1] = float("inf")
    qp[..., valid, :], kp[..., valid, :], vp[..., valid, :] = q, k, v
    mask = (~valid).expand(q.shape[0], NPAD)  # (B, m), True = padded (nn.MultiheadAttention)
    return qp, kp, vp, mask, valid


FORMS = ["parallel", "causal-shared", "causal-runmax", "recurrent"]


def _run(form, q, k, v, fm, mask):
    if form == "parallel":
        return ka.linear_attention(q, k, v, fm, key_padding_mask=mask)
    if form.startswith("causal"):
        return chunk_linear_attention(q, k, v, fm, chunk_size=4, key_padding_mask=mask,
                                      _path=form.split("-")[1])
    rnn = ka.RecurrentLinearAttention(fm)
    outs = []
    for t in range(q.shape[-2]):
        m_t = None if mask is None else mask[:, t].view(-1, 1).expand(q.shape[0], q.shape[1])
        outs.append(rnn.step(q[..., t, :], k[..., t, :], v[..., t, :], key_padding_mask=m_t))
    return torch.stack(outs, dim=-2)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["positive", "trig", "elu"])
@pytest.mark.parametrize("where", [(6, 7, 8, 9), (0, 1, 2, 3), (0, 3, 7, 9)], ids=["right", "left", "mixed"])
def test_padding_leaves_the_real_tokens_unchanged(form, name, where):
    fm = _maps()[name]
    q, k, v = _inputs()
    ref = _run(form, q, k, v, fm, None)  # the unpadded sequence (causal: the order is kept)
    for scale in (60.0, 1.0):  # padded keys of huge and of ordinary norm
        qp, kp, vp, mask, valid = _pad(q, k, v, where, scale=scale)
        out = _run(form, qp, kp, vp, fm, mask)
        assert torch.allclose(out[..., valid, :], ref, atol=1e-10, rtol=1e-10), (out[..., valid, :] - ref).abs().max()
    # the same padded call without the mask is far off: the test can fail
    if form == "parallel" or where != (6, 7, 8, 9):  # (causal rows never see trailing padding)
        unmasked = _run(form, qp, kp, vp, fm, None)[..., valid, :]
        assert (unmasked - ref).abs().max() > 1e-2


@pytest.mark.parametrize("form", FORMS)
def test_padding_with_non_finite_garbage_is_ignored(form):
    fm = _maps()["positive"]
    q, k, v = _inputs()
    ref = _run(form, q, k, v, fm, None)
    qp, kp, vp, mask, valid = _pad(q, k, v, (0, 4, 8, 9), garbage=True)
    out = _run(form, qp, kp, vp, fm, mask)
    assert torch.allclose(out[..., valid, :], ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_padding_float32_to_1e_6(causal):
    fm = ka.PositiveRF(D, 64, seed=0)
    q, k, v = _inputs(dtype=torch.float32)
    ref = ka.linear_attention(q, k, v, fm, causal=causal)
    qp, kp, vp, mask, valid = _pad(q, k, v, (6, 7, 8, 9))
    out = ka.linear_attention(qp, kp, vp, fm, causal=causal, key_padding_mask=mask)
    rel = ((out[..., valid, :] - ref).norm() / ref.norm()).item()
    assert rel < 1e-6, rel


@pytest.mark.parametrize("causal", [False, True])
def test_masked_equals_the_quadratic_reference_forward_and_backward(causal):
    """Float64 forward and backward against ``naive_linear_attention`` on the valid keys."""
    fm = ka.PositiveRF(D, 32, seed=3, dtype=F64)
    q, k, v = _inputs(seed=2)
    where = (6, 7, 8, 9) if causal else (0, 3, 7, 9)
    qp, kp, vp, mask, valid = _pad(q, k, v, where, scale=3.0)
    qp, kp, vp = (t.clone().requires_grad_(True) for t in (qp, kp, vp))
    out = ka.linear_attention(qp, kp, vp, fm, causal=causal, key_padding_mask=mask, chunk_size=4)
    w = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(5))
    (out[..., valid, :] * w[..., valid, :]).sum().backward()
    q2, k2, v2 = (t.detach()[..., valid, :].clone().requires_grad_(True) for t in (qp, kp, vp))
    ref = naive_linear_attention(q2, k2, v2, fm, causal=causal)
    (ref * w[..., valid, :]).sum().backward()
    assert torch.allclose(out[..., valid, :], ref, atol=1e-10)
    for a, b in ((qp, q2), (kp, k2), (vp, v2)):
        assert torch.allclose(a.grad[..., valid, :], b.grad, atol=1e-10)
    assert kp.grad[..., ~valid, :].abs().max() == 0 and vp.grad[..., ~valid, :].abs().max() == 0


@pytest.mark.parametrize("form", ["parallel", "causal-shared", "causal-runmax", "recurrent"])
def test_a_row_without_valid_keys_gives_zero_without_nan(form):
    fm = ka.PositiveRF(D, 16, seed=0)
    q, k, v = (t.clone().requires_grad_(True) for t in _inputs(n=NPAD))
    mask = torch.zeros(B, NPAD, dtype=torch.bool)
    mask[0] = True  # sequence 0 fully padded
    mask[1, :3] = True  # sequence 1: the first three keys padded
    out = _run(form, q, k, v, fm, mask)
    assert out[0].abs().max() == 0
    if form != "parallel":
        assert out[1, :, :3].abs().max() == 0
    assert out.isfinite().all()
    out.sum().backward()
    assert all(t.grad.isfinite().all() for t in (q, k, v))


def test_softmax_reference_takes_the_same_mask():
    q, k, v = _inputs()
    qp, kp, vp, mask, valid = _pad(q, k, v, (0, 3, 7, 9))
    out = ka.softmax_attention(qp, kp, vp, key_padding_mask=mask)
    assert torch.allclose(out[..., valid, :], ka.softmax_attention(q, k, v), atol=1e-12)
    qp, kp, vp, mask, valid = _pad(q, k, v, (6, 7, 8, 9))
    out = ka.softmax_attention(qp, kp, vp, causal=True, key_padding_mask=mask)
    assert torch.allclose(out[..., valid, :], ka.softmax_attention(q, k, v, causal=True), atol=1e-12)
    full = torch.ones(B, NPAD, dtype=torch.bool)
    assert ka.softmax_attention(qp, kp, vp, key_padding_mask=full).abs().max() == 0


def test_an_exact_map_matches_softmax_with_the_mask():
    """Nyström with the (valid) keys as landmarks is exact: the masked linear attention is the
    masked softmax attention."""
    q, k, v = _inputs(b=1, h=1)
    qp, kp, vp, mask, valid = _pad(q, k, v, (0, 3, 7, 9))
    fm = ka.NystromFeatures(D, landmarks=k[0, 0])
    out = ka.linear_attention(qp, kp, vp, fm, key_padding_mask=mask)
    ref = ka.softmax_attention(qp, kp, vp, key_padding_mask=mask)
    assert torch.allclose(out, ref, atol=1e-9)


def test_float_additive_mask_and_a_two_dim_mask_for_heads():
    fm = ka.PositiveRF(D, 16, seed=0)
    q, k, v = _inputs()
    qp, kp, vp, mask, valid = _pad(q, k, v, (6, 7, 8, 9))
    add = torch.zeros(B, NPAD, dtype=F64).masked_fill(mask, float("-inf"))
    a = ka.linear_attention(qp, kp, vp, fm, key_padding_mask=mask)
    b = ka.linear_attention(qp, kp, vp, fm, key_padding_mask=add)
    c = ka.linear_attention(qp, kp, vp, fm, key_padding_mask=mask[:, None, :])  # (B, 1, m)
    assert torch.equal(a, b) and torch.equal(a, c)


def test_bad_masks_raise_naming_the_argument():
    fm = ka.PositiveRF(D, 16, seed=0)
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"key_padding_mask.*\(2, 5\).*6"):
        ka.linear_attention(q, k, v, fm, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_padding_mask.*\(4, 6\)"):
        ka.linear_attention(q, k, v, fm, key_padding_mask=torch.zeros(4, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_padding_mask.*0 and -inf"):
        ka.linear_attention(q, k, v, fm, key_padding_mask=torch.rand(2, 6))
    with pytest.raises(TypeError, match=r"key_padding_mask.*int64"):
        ka.linear_attention(q, k, v, fm, key_padding_mask=torch.ones(2, 6, dtype=torch.long))
    with pytest.raises(TypeError, match="key_padding_mask"):
        ka.linear_attention(q, k, v, fm, key_padding_mask=[[True] * 6] * 2)
    with pytest.raises(ValueError, match=r"key_padding_mask.*\(2, 6\).*step"):
        ka.RecurrentLinearAttention(fm).step(q[..., 0, :], k[..., 0, :], v[..., 0, :],
                                             key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [0.125, 2.0])
def test_scale_multiplies_q_dot_k(causal, scale):
    fm = ka.PositiveRF(D, 32, seed=0, dtype=F64)
    q, k, v = _inputs()
    out = ka.linear_attention(q, k, v, fm, causal=causal, scale=scale)
    r = scale**0.5
    assert torch.allclose(out, ka.linear_attention(q * r, k * r, v, fm, causal=causal), atol=1e-12)
    assert not torch.allclose(out, ka.linear_attention(q, k, v, fm, causal=causal), atol=1e-3)
    # an exact map: scale= is softmax(scale q k^T) v, SDPA's scale
    ex = ka.NystromFeatures(D, landmarks=k[0, 0] * r)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q[:1, :1], k[:1, :1], v[:1, :1], scale=scale)
    assert torch.allclose(ka.linear_attention(q[:1, :1], k[:1, :1], v[:1, :1], ex, scale=scale), sdpa, atol=1e-9)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), True, "1"])
def test_bad_scale(scale):
    q, k, v = _inputs()
    with pytest.raises((ValueError, TypeError), match="scale"):
        ka.linear_attention(q, k, v, ka.EluFeatures(D), scale=scale)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_grouped_query_heads_equal_explicit_repetition(causal, per_head):
    hq, hkv = 6, 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, hq, N, D, generator=g, dtype=F64) / 2
    k, v = (torch.randn(B, hkv, N, D, generator=g, dtype=F64) / 2 for _ in range(2))
    fm = ka.PositiveRF(D, 16, seed=0, dtype=F64, batch_shape=(hq,) if per_head else ())
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[1, -2:] = True
    out = ka.linear_attention(q, k, v, fm, causal=causal, key_padding_mask=mask)
    kr, vr = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    ref = ka.linear_attention(q, kr, vr, fm, causal=causal, key_padding_mask=mask)
    assert out.shape == (B, hq, N, D)
    assert torch.allclose(out, ref, atol=1e-12)
    with pytest.raises(ValueError, match="heads"):
        ka.linear_attention(q, k[:, :1].expand(B, 4, N, D), v[:, :1].expand(B, 4, N, D), fm, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_layout_bthd_equals_the_transposed_call(causal):
    fm = ka.PositiveRF(D, 16, seed=0, batch_shape=(H,), dtype=F64)
    q, k, v = _inputs()
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[0, -1] = True
    ref = ka.linear_attention(q, k, v, fm, causal=causal, key_padding_mask=mask)
    t = [x.transpose(1, 2) for x in (q, k, v)]  # (B, T, H, K), flash-linear-attention's layout
    out = ka.linear_attention(*t, fm, causal=causal, key_padding_mask=mask, layout="bthd")
    assert out.shape == (B, N, H, D)
    assert torch.allclose(out.transpose(1, 2), ref, atol=1e-12)
    with pytest.raises(ValueError, match="layout"):
        ka.linear_attention(*t, fm, causal=causal)
    with pytest.raises(ValueError, match="layout"):
        ka.linear_attention(q, k, v, fm, layout="bhdt")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("where", [(6, 7, 8, 9), (0, 1, 2, 3)], ids=["right", "left"])
def test_the_state_after_a_padded_sequence_is_the_unpadded_one(causal, where):
    """The returned state (S, z) ignores padded keys, and continuing from it is unchanged."""
    fm = ka.PositiveRF(D, 16, seed=0, batch_shape=(H,), dtype=F64)
    q, k, v = _inputs()
    _, ref = ka.linear_attention(q, k, v, fm, causal=causal, return_state=True, chunk_size=4)
    qp, kp, vp, mask, _ = _pad(q, k, v, where)
    _, st = ka.linear_attention(qp, kp, vp, fm, causal=causal, return_state=True, chunk_size=4,
                                key_padding_mask=mask)
    assert torch.allclose(st.S, ref.S, rtol=1e-10, atol=0) and torch.allclose(st.z, ref.z, rtol=1e-10, atol=0)
    q2, k2, v2 = _inputs(seed=9, n=3)
    a = ka.linear_attention(q2, k2, v2, fm, causal=True, initial_state=st)
    b = ka.linear_attention(q2, k2, v2, fm, causal=True, initial_state=ref)
    assert torch.allclose(a, b, atol=1e-12)
