"""``nn.LinearAttention`` and ``nn.MultiheadLinearAttention`` in place of ``torch.nn.MultiheadAttention``.

What is pinned here:

* the adapter has `torch.nn.MultiheadAttention`'s call signature and returns ``(out, None)``; it
  drops into ``torch.nn.TransformerEncoderLayer`` (``layer.self_attn = ...``), and the same small
  model trains (the loss decreases) with either attention, with a key padding mask and with a
  causal ``src_mask``, batch-first and sequence-first;
* key padding: padding a 6-token sequence to 10 leaves the real tokens' outputs unchanged
  (float64, to 1e-10; without the mask they move by O(0.1));
* ``attn_mask``: a causal mask (bool or float, as ``generate_square_subsequent_mask`` makes) is
  causal attention, a mask that is a key-padding pattern is key padding, any other pattern a
  ValueError naming ``attn_mask``; under ``torch.compile(fullgraph=True)`` the same masks compile
  with no graph break (the pattern is read on the device) and give eager's outputs;
* ``context=`` (cross-attention) and ``kdim``/``vdim`` against the projections done by hand;
* ``batch_first=False`` transposes a sequence-first input; dropout is off in eval (deterministic)
  and unbiased per key in training.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

from kernelapprox.nn import LinearAttention, MultiheadLinearAttention

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: threads only cost

F64 = torch.float64
DIM, HEADS = 16, 4


def _layer(**kw):
    kw.setdefault("num_features", 32)
    kw.setdefault("seed", 0)
    kw.setdefault("check", False)
    return LinearAttention(DIM, heads=HEADS, dtype=F64, **kw)


def _x(b=2, n=6, dim=DIM, seed=0):
    return torch.randn(b, n, dim, dtype=F64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_leaves_the_real_tokens_unchanged(causal):
    layer = _layer(causal=causal)
    x = _x()
    ref = layer(x)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[:, 6:] = True
    for junk in (30.0, 1.0):  # padded to 10 with large and with ordinary tokens
        xp = torch.cat([x, junk * _x(n=4, seed=1)], dim=1)
        out = layer(xp, key_padding_mask=mask)
        assert torch.allclose(out[:, :6], ref, atol=1e-10)
    if not causal:
        assert (layer(xp)[:, :6] - ref).abs().max() > 1e-2  # the mask matters


def test_attn_mask_causal_and_padding_patterns():
    layer, causal_layer = _layer(), _layer(causal=True)
    causal_layer.load_state_dict(layer.state_dict())
    x = _x(n=7)
    causal = causal_layer(x)
    bool_mask = torch.ones(7, 7, dtype=torch.bool).triu(1)  # True = not allowed (MultiheadAttention)
    float_mask = nn.Transformer.generate_square_subsequent_mask(7, dtype=F64)
    assert torch.allclose(layer(x, attn_mask=bool_mask), causal, atol=1e-12)
    assert torch.allclose(layer(x, attn_mask=float_mask), causal, atol=1e-12)
    # a per-batch (B, n, m) mask that only hides keys 5, 6 of sequence 1: key padding
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    as_attn = pad[:, None, :].expand(2, 7, 7)
    assert torch.allclose(layer(x, attn_mask=as_attn), layer(x, key_padding_mask=pad), atol=1e-12)
    # (B * heads, n, m), MultiheadAttention's 3-D form
    assert torch.allclose(layer(x, attn_mask=as_attn.repeat_interleave(HEADS, 0)),
                          layer(x, key_padding_mask=pad), atol=1e-12)
    window = torch.ones(7, 7, dtype=torch.bool).triu(1) | torch.ones(7, 7, dtype=torch.bool).tril(-3)
    with pytest.raises(ValueError, match=r"attn_mask.*causal.*padding"):
        layer(x, attn_mask=window)
    with pytest.raises(ValueError, match=r"attn_mask.*0 and -inf"):
        layer(x, attn_mask=torch.randn(7, 7, dtype=F64))
    with pytest.raises(ValueError, match=r"attn_mask.*\(5, 5\)"):
        layer(x, attn_mask=torch.zeros(5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_padding_mask.*\(2, 5\)"):
        layer(x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))


def test_cross_attention_with_context_and_kdim_vdim():
    layer = _layer(kdim=5, vdim=3)
    x, ctx_k, ctx_v = _x(n=6), _x(n=9, dim=5, seed=1), _x(n=9, dim=3, seed=2)
    out = layer._forward(x, ctx_k, ctx_v)
    q, k, v = (layer.split_heads(f(t)) for f, t in ((layer.to_q, x), (layer.to_k, ctx_k), (layer.to_v, ctx_v)))
    ref = layer.to_out(layer.merge_heads(layer.attention(q, k, v)))
    assert out.shape == (2, 6, DIM) and torch.allclose(out, ref, atol=1e-12)
    same = _layer(kdim=5, vdim=5)
    ctx = _x(n=9, dim=5, seed=1)
    assert torch.allclose(same(x, context=ctx), same._forward(x, ctx, ctx), atol=0)
    with pytest.raises(ValueError, match="context"):
        layer(x, context=ctx_k)  # kdim != vdim: pass key and value separately
    with pytest.raises(ValueError, match="causal"):
        _layer(causal=True)(x, context=_x(n=9, seed=1))


def test_batch_first_false_transposes():
    a, b = _layer(), _layer(batch_first=False)
    b.load_state_dict(a.state_dict())
    x = _x(b=3, n=6)
    assert torch.allclose(b(x.transpose(0, 1)).transpose(0, 1), a(x), atol=1e-12)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[0, 4:] = True  # key padding stays (batch, m)
    assert torch.allclose(b(x.transpose(0, 1), key_padding_mask=mask).transpose(0, 1),
                          a(x, key_padding_mask=mask), atol=1e-12)


def test_dropout_off_in_eval_and_unbiased_per_key_in_training():
    layer = _layer(dropout=0.5)
    x = _x()
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    ref = layer(x)
    layer.train()
    torch.manual_seed(0)
    a, b = layer(x), layer(x)
    assert not torch.allclose(a, b)
    # unbiased: the mean over many dropout draws approaches the eval output. The draws' own
    # spread gives the standard error of the mean, per coordinate; the check allows 5 of them
    # (plus rounding), over all 2 * 6 * 16 = 192 coordinates (a 5-sigma excursion anywhere has
    # probability ~1e-4 for Gaussian means).
    draws = torch.stack([layer(x) for _ in range(200)]).detach()
    se = draws.std(0) / 200**0.5
    assert ((draws.mean(0) - ref).abs() <= 5 * se + 1e-12).all()
    ref_wrong = ref + 10 * se  # a biased layer would fail the same check
    assert not ((draws.mean(0) - ref_wrong).abs() <= 5 * se + 1e-12).all()
    with pytest.raises(ValueError, match="dropout"):
        _layer(dropout=1.0)


def test_adapter_signature_and_return():
    mha = MultiheadLinearAttention(DIM, HEADS, batch_first=True, num_features=16, seed=0, check=False)
    x = torch.randn(2, 6, DIM)
    out, w = mha(x, x, x, key_padding_mask=None, need_weights=False, attn_mask=None)
    assert out.shape == (2, 6, DIM) and w is None
    out2, w2 = mha(x, x, x)  # need_weights defaults to True, as in MultiheadAttention: still None
    assert w2 is None and torch.allclose(out, out2)
    seq_first = MultiheadLinearAttention(DIM, HEADS, num_features=16, seed=0, check=False)  # batch_first=False
    seq_first.load_state_dict(mha.state_dict())
    assert torch.allclose(seq_first(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1))[0].transpose(0, 1), out,
                          atol=1e-6)
    assert mha.embed_dim == DIM and mha.num_heads == HEADS and mha.batch_first and mha.out_proj is mha.layer.to_out
    # is_causal, as MultiheadAttention's hint, with the causal mask
    causal = MultiheadLinearAttention(DIM, HEADS, batch_first=True, num_features=16, seed=0, check=False,
                                      causal=True)
    causal.load_state_dict(mha.state_dict())
    m = nn.Transformer.generate_square_subsequent_mask(6)
    assert torch.allclose(mha(x, x, x, attn_mask=m, is_causal=True)[0], causal(x, x, x)[0], atol=1e-6)


def _train(attn_factory, *, batch_first, causal, steps=20, seed=0):
    """A 1-layer encoder on a copy task with padding; returns the losses."""
    torch.manual_seed(seed)
    vocab, d, n, b = 11, DIM, 10, 16
    emb = nn.Embedding(vocab, d)
    enc = nn.TransformerEncoderLayer(d, HEADS, dim_feedforward=32, dropout=0.0, batch_first=batch_first)
    if attn_factory is not None:
        enc.self_attn = attn_factory(batch_first)
    head = nn.Linear(d, vocab)
    params = [*emb.parameters(), *enc.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (b, n), generator=g)
    lengths = torch.randint(5, n + 1, (b,), generator=g)
    pad = torch.arange(n)[None, :] >= lengths[:, None]  # True = padded
    src_mask = torch.ones(n, n, dtype=torch.bool).triu(1) if causal else None  # True = not allowed
    losses = []
    for _ in range(steps):
        x = emb(tokens)
        if not batch_first:
            x = x.transpose(0, 1)
        h = enc(x, src_mask=src_mask, src_key_padding_mask=pad, is_causal=causal)
        if not batch_first:
            h = h.transpose(0, 1)
        logits = head(h)
        loss = nn.functional.cross_entropy(logits[~pad], tokens[~pad])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_transformer_encoder_layer_trains_with_either_attention(batch_first, causal):
    def linear(bf):
        return MultiheadLinearAttention(DIM, HEADS, batch_first=bf, num_features=32, seed=0, check=False)

    mha = _train(None, batch_first=batch_first, causal=causal)
    lin = _train(linear, batch_first=batch_first, causal=causal)
    for losses in (mha, lin):
        assert all(torch.isfinite(torch.tensor(losses)))
        assert losses[-1] < 0.7 * losses[0], losses


def test_heads_module_takes_grouped_kv_heads():
    from kernelapprox.nn import LinearAttentionHeads

    attn = LinearAttentionHeads(8, heads=4, num_features=16, seed=0, check=False)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(2))
    ref = attn(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1))
    assert torch.allclose(attn(q, k, v), ref, atol=1e-6)
    with pytest.raises(ValueError, match="heads"):
        attn(q, k[:, :1].expand(2, 3, 5, 8), v[:, :1].expand(2, 3, 5, 8))


def test_attn_mask_compiles_without_graph_break():
    """A float causal mask (``generate_square_subsequent_mask``) and a float key-padding mask through
    ``torch.compile(fullgraph=True)`` (which raises on any graph break): eager's outputs, one frame."""
    torch._dynamo.reset()
    mha = MultiheadLinearAttention(DIM, HEADS, batch_first=True, num_features=32, seed=0, dtype=F64)
    x = _x(n=7)
    causal = nn.Transformer.generate_square_subsequent_mask(7, dtype=F64)
    pad = torch.zeros(2, 7, 7, dtype=F64)
    pad[1, :, 5:] = float("-inf")
    cnt = CompileCounter()
    compiled = torch.compile(mha, fullgraph=True, backend=cnt)
    for mask in (causal, pad):
        assert torch.allclose(compiled(x, x, x, attn_mask=mask)[0], mha(x, x, x, attn_mask=mask)[0], atol=1e-12)
    assert torch.allclose(compiled(x, x, x, attn_mask=causal, is_causal=True)[0],
                          mha(x, x, x, attn_mask=causal)[0], atol=1e-12)
    assert not torch.allclose(mha(x, x, x, attn_mask=causal)[0], mha(x, x, x, attn_mask=pad)[0])
    assert cnt.frame_count >= 1 and cnt.op_count > 0
