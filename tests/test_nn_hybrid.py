"""Hybrid attention in the layers of kernelapprox.nn (``window=``, ``sinks=``).

What the layer computes is compared in float64 with the materialised reference
``kernelapprox.attention.hybrid.naive`` around the layer's own projections (1e-10), the limit
``window >= n`` with softmax attention (``torch.nn.MultiheadAttention`` with the same weights),
``window=None`` with the linear-attention layer, and padding with the unpadded sequences.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernelapprox.attention.hybrid import HybridAttentionState
from kernelapprox.attention.hybrid.naive import naive_hybrid_attention
from kernelapprox.nn import LinearAttention, LinearAttentionHeads, MultiheadLinearAttention

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _x(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=g, dtype=F64)


def _heads(layer, x):
    return [layer.split_heads(f(x)) for f in (layer.to_q, layer.to_k, layer.to_v)]


def _reference(layer, x, window, sinks, causal, key_padding_mask=None):
    """The layer's projections around the naive hybrid reference, at the layer's scale."""
    q, k, v = _heads(layer, x)
    root = layer.attention.scale**0.5
    o = naive_hybrid_attention(q * root, k * root, v, layer.feature_map, window=window, sinks=sinks,
                               causal=causal, key_padding_mask=key_padding_mask)
    return layer.to_out(layer.merge_heads(o))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window, sinks", [(0, 2), (3, 0), (3, [0, 5]), (4, 1)])
def test_layer_equals_projections_around_naive_hybrid(causal, window, sinks):
    torch.manual_seed(0)
    layer = LinearAttention(24, heads=3, causal=causal, num_features=20, seed=0, qkv_bias=True,
                            window=window, sinks=sinks, chunk_size=4).double()
    x = _x(2, 11, 24)
    out = layer(x)
    torch.testing.assert_close(out, _reference(layer, x, window, sinks, causal), **TOL)
    # per-head path: the same attention without the projections
    q, k, v = _heads(layer, x)
    root = layer.attention.scale**0.5
    ref = naive_hybrid_attention(q * root, k * root, v, layer.feature_map, window=window, sinks=sinks, causal=causal)
    torch.testing.assert_close(layer.forward_heads(q, k, v), ref, **TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_negative_sinks_and_padding_equal_naive(causal):
    """Padded keys are in neither the window, nor the sinks, nor the remainder (reference:
    their columns of the materialised matrix set to zero)."""
    layer = LinearAttention(16, heads=2, causal=causal, num_features=12, seed=1, window=3,
                            sinks=[0, 6] if causal else [0, -1], chunk_size=4).double()
    x = _x(2, 10, 16, seed=1)
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[0, 6:] = True  # sequence 0: 6 tokens (the sink at 6, or the last position, is padding)
    pad[1, 2] = True  # a hole inside a window
    out = layer(x, key_padding_mask=pad)
    sinks = [0, 6] if causal else [0, 9]
    ref = _reference(layer, x, 3, sinks, causal, key_padding_mask=pad.unsqueeze(1))
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_right_padding_gives_the_unpadded_outputs(causal):
    layer = LinearAttention(16, heads=2, causal=causal, num_features=12, seed=2, window=2, sinks=1,
                            chunk_size=4).double()
    x = _x(2, 9, 16, seed=2)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[0, 5:] = True
    out = layer(x, key_padding_mask=pad)
    torch.testing.assert_close(out[0, :5], layer(x[:1, :5])[0], **TOL)
    torch.testing.assert_close(out[1], layer(x[1:])[0], **TOL)
    assert out.isfinite().all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_full_window_is_multihead_softmax_attention(causal, padded):
    """window >= n: MultiheadLinearAttention is torch.nn.MultiheadAttention with the same weights."""
    torch.manual_seed(0)
    E, H, n = 16, 4, 7
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=F64)
    hyb = MultiheadLinearAttention(E, H, batch_first=True, num_features=8, seed=0, window=n, causal=causal,
                                   dtype=F64)
    Wq, Wk, Wv = mha.in_proj_weight.chunk(3)
    bq, bk, bv = mha.in_proj_bias.chunk(3)
    with torch.no_grad():
        for lin, W, b in ((hyb.layer.to_q, Wq, bq), (hyb.layer.to_k, Wk, bk), (hyb.layer.to_v, Wv, bv)):
            lin.weight.copy_(W)
            lin.bias.copy_(b)
        hyb.out_proj.weight.copy_(mha.out_proj.weight)
        hyb.out_proj.bias.copy_(mha.out_proj.bias)
    x = _x(2, n, E, seed=3)
    pad = None
    if padded:
        pad = torch.zeros(2, n, dtype=torch.bool)
        pad[1, 4:] = True
    mask = torch.ones(n, n, dtype=torch.bool).triu(1) if causal else None  # True = not allowed
    ref, _ = mha(x, x, x, key_padding_mask=pad, attn_mask=mask, need_weights=False)
    out, w = hyb(x, x, x, key_padding_mask=pad)
    assert w is None
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    if causal:  # a causal attn_mask on a non-causal layer makes the call causal (the same result)
        free = MultiheadLinearAttention(E, H, batch_first=True, num_features=8, seed=0, window=n, dtype=F64)
        free.load_state_dict(hyb.state_dict())
        torch.testing.assert_close(free(x, x, x, key_padding_mask=pad, attn_mask=mask)[0], ref, rtol=1e-10,
                                   atol=1e-12)


def test_window_none_is_the_linear_attention_layer():
    torch.manual_seed(0)
    a = LinearAttention(32, heads=4, num_features=16, seed=0)
    b = LinearAttention(32, heads=4, num_features=16, seed=0, window=None, sinks=0)
    b.load_state_dict(a.state_dict())
    x = _x(2, 10, 32).float()
    assert torch.equal(a(x), b(x))
    assert "window" not in repr(b)


def test_heads_module_and_grouped_query_heads():
    attn = LinearAttentionHeads(8, heads=4, num_features=16, seed=0, window=2, sinks=1, dtype=F64)
    q = _x(2, 4, 9, 8, seed=4)
    k, v = _x(2, 2, 9, 8, seed=5), _x(2, 2, 9, 8, seed=6)  # two key/value heads for four query heads
    out = attn(q, k, v)
    root = attn.scale**0.5
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    ref = naive_hybrid_attention(q * root, kr * root, vr, attn.feature_map, window=2, sinks=1)
    torch.testing.assert_close(out, ref, **TOL)


def test_causal_decoding_with_the_hybrid_state():
    layer = LinearAttention(16, heads=2, causal=True, num_features=12, seed=0, window=3, sinks=1).double()
    x = _x(2, 12, 16, seed=7)
    full = layer(x)
    out, st = layer(x[:, :5], return_state=True)
    assert isinstance(st, HybridAttentionState) and st.position == 5
    steps = []
    for t in range(5, 12):
        o, st = layer(x[:, t:t + 1], initial_state=st, return_state=True)
        steps.append(o)
    torch.testing.assert_close(torch.cat([out, *steps], 1), full, **TOL)


def test_state_dict_round_trip_and_repr():
    torch.manual_seed(0)
    a = LinearAttention(32, heads=4, num_features=16, seed=0, window=4, sinks=[0, -1])
    b = LinearAttention(32, heads=4, num_features=16, seed=1, window=4, sinks=[0, -1])
    x = _x(2, 10, 32).float()
    assert not torch.equal(a(x), b(x))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(x), b(x))
    assert set(a.state_dict()) == set(LinearAttention(32, heads=4, num_features=16, seed=0).state_dict())
    assert "window=4, sinks=(-1, 0)" in repr(a)
    assert a.window == 4 and a.sinks == (-1, 0)
    m = MultiheadLinearAttention(32, 4, num_features=16, seed=0, window=8, sinks=1)
    assert "window=8, sinks=1" in m.extra_repr()


def test_gradients_reach_every_parameter():
    layer = LinearAttention(16, heads=2, num_features=12, seed=0, window=3, sinks=1, qkv_bias=True)
    x = _x(2, 10, 16).float().requires_grad_()
    layer(x).square().sum().backward()
    for name, p in [("x", x), *layer.named_parameters()]:
        assert p.grad is not None and p.grad.isfinite().all() and p.grad.abs().max() > 0, name


def test_encoder_layer_drop_in():
    enc = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True)
    enc.self_attn = MultiheadLinearAttention(32, 4, batch_first=True, num_features=16, seed=0, window=4, sinks=1)
    x = _x(2, 10, 32).float()
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[1, 6:] = True
    out = enc(x, src_key_padding_mask=pad)
    assert out.shape == (2, 10, 32) and out[:, :6].isfinite().all()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="window"):
        LinearAttention(16, heads=2, window=-1)
    with pytest.raises(TypeError, match="window"):
        LinearAttention(16, heads=2, window=2.5)
    with pytest.raises(ValueError, match="sinks=1 needs window="):
        LinearAttention(16, heads=2, sinks=1)
    with pytest.raises(TypeError, match="sinks"):
        LinearAttention(16, heads=2, window=2, sinks="0")
    with pytest.raises(ValueError, match="sinks as a count"):
        LinearAttention(16, heads=2, window=2, sinks=-1)
    layer = LinearAttention(16, heads=2, num_features=8, window=2)
    x = _x(2, 6, 16).float()
    with pytest.raises(ValueError, match="context= \\(cross-attention\\) with window=2"):
        layer(x, context=_x(2, 9, 16).float())
    mha = MultiheadLinearAttention(16, 2, batch_first=True, num_features=8, window=2)
    with pytest.raises(ValueError, match="needs self-attention"):
        mha(x, x.clone(), x)
    causal = LinearAttention(16, heads=2, causal=True, num_features=8, window=2, sinks=[-1])
    with pytest.raises(ValueError, match="sinks position"):  # causal sinks are absolute positions
        causal(x)
    noncausal = LinearAttention(16, heads=2, num_features=8, window=2)
    with pytest.raises(ValueError, match="causal=True"):
        noncausal(x, return_state=True)
    ka_layer = LinearAttention(16, heads=2, causal=True, num_features=8, window=2)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match="return_state=True with a key_padding_mask"):
        ka_layer(x, key_padding_mask=pad, return_state=True)


@pytest.mark.parametrize("causal", [False, True])
def test_block_window_layer_equals_naive(causal):
    layer = LinearAttention(16, heads=2, causal=causal, num_features=12, seed=3, window=3, sinks=1,
                            window_mode="block").double()
    x = _x(2, 11, 16, seed=8)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[0, 8:] = True
    q, k, v = _heads(layer, x)
    root = layer.attention.scale**0.5
    o = naive_hybrid_attention(q * root, k * root, v, layer.feature_map, window=3, sinks=1, causal=causal,
                               key_padding_mask=pad.unsqueeze(1), window_mode="block")
    torch.testing.assert_close(layer(x, key_padding_mask=pad), layer.to_out(layer.merge_heads(o)), **TOL)
    assert "window_mode='block'" in repr(layer)
    with pytest.raises(ValueError, match="window_mode"):
        LinearAttention(16, heads=2, window=3, window_mode="blocks")
    if causal:
        with pytest.raises(ValueError, match="no state"):
            layer(x, return_state=True)
