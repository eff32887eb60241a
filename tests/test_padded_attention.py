"""The student's attention (`kernelapprox.attention.padded`) and the map-spec resolver
(`kernelapprox.maps.spec`) against what the four former copies (nn, hf, recover, the map training)
computed: bit for bit on tensors alone."""

from __future__ import annotations

import pytest
import torch

import kernelapprox as ka
from kernelapprox.attention import hybrid_attention, linear_attention
from kernelapprox.attention.hybrid import exact_set_mask
from kernelapprox.attention.padded import attention_log_weights, check_window_sinks, padded_attention
from kernelapprox.maps.spec import DEFAULT_SAMPLER, default_num_features, layer_seed, resolve_feature_map

F64 = torch.float64


def qkv(b: int = 2, h: int = 4, hk: int = 4, n: int = 9, d: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=F64) * 0.5
    k = torch.randn(b, hk, n, d, generator=g, dtype=F64) * 0.5
    v = torch.randn(b, hk, n, 3, generator=g, dtype=F64)
    return q, k, v


def fm(d: int = 4) -> ka.FeatureMap:
    return ka.PositiveRF(d, 16, seed=0, dtype=F64)


@pytest.mark.parametrize("causal", [False, True])
def test_linear_without_window_is_linear_attention(causal: bool) -> None:
    q, k, v = qkv()
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, :3] = True
    for kpm in (None, pad):
        want = linear_attention(q, k, v, fm(), causal=causal, key_padding_mask=kpm)
        got = padded_attention(q, k, v, fm(), causal=causal, key_padding_mask=kpm)
        assert torch.equal(got, want)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sinks", [0, 2, [0, 5]])
def test_window_is_hybrid_attention_with_grouped_heads_repeated(causal: bool, sinks) -> None:
    q, k, v = qkv(hk=2)
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    want = hybrid_attention(q, kr, vr, fm(), window=3, sinks=sinks, causal=causal)
    got = padded_attention(q, k, v, fm(), window=3, sinks=sinks, causal=causal)
    assert torch.equal(got, want)


def test_states_continue() -> None:
    q, k, v = qkv()
    whole = padded_attention(q, k, v, fm(), window=2, sinks=1, causal=True)
    a, st = padded_attention(q[..., :4, :], k[..., :4, :], v[..., :4, :], fm(), window=2, sinks=1, causal=True,
                             return_state=True)
    b = padded_attention(q[..., 4:, :], k[..., 4:, :], v[..., 4:, :], fm(), window=2, sinks=1, causal=True,
                         initial_state=st)
    torch.testing.assert_close(torch.cat([a, b], -2), whole)


def test_sinks_need_a_window_and_self_attention() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match="sinks=1 needs window="):
        padded_attention(q, k, v, fm(), sinks=1)
    with pytest.raises(ValueError, match="sinks=1 needs window="):
        check_window_sinks(1, None)
    assert check_window_sinks(torch.tensor([5]), 2) == (5,)
    with pytest.raises(ValueError, match="self-attention"):
        padded_attention(q, k[..., :5, :], v[..., :5, :], fm(), window=2)


def _recover_log_weights(q, k, f, causal, window, sinks):
    """The former ``recover._student_log_weights``."""
    n, m = q.shape[-2], k.shape[-2]
    logits = q @ k.mT
    fq, sq = f.log_features(q)
    fk, sk = f.key_log_features(k)
    G = fq @ fk.mT
    lin = torch.log(G.clamp_min(torch.finfo(G.dtype).tiny)) + sq.unsqueeze(-1) + sk.unsqueeze(-2)
    if window is not None:
        lin = torch.where(exact_set_mask(n, window=window, sinks=sinks, causal=causal), logits, lin)
    if causal:
        future = torch.ones(n, m, dtype=torch.bool).triu(1)
        logits = logits.masked_fill(future, float("-inf"))
        lin = lin.masked_fill(future, float("-inf"))
    log_hat = torch.log_softmax(lin, dim=-1)
    if causal:
        log_hat = log_hat.masked_fill(future, 0.0)
    return log_hat, torch.softmax(logits, dim=-1)


def _hedgehog_row_losses(f, q, k, rows, causal, scale, exact):
    """The former ``maps.hedgehog._row_losses``."""
    qs = q if rows is None else q.index_select(-2, rows)
    target = scale * (qs @ k.mT)
    mask = None
    if causal:
        i = torch.arange(q.shape[-2]) if rows is None else rows
        mask = torch.arange(k.shape[-2]).unsqueeze(0) > i.unsqueeze(1)
    if exact is not None:
        e = exact if rows is None else exact.index_select(0, rows)
        mask = e if mask is None else mask | e
    if mask is not None:
        target = target.masked_fill(mask, float("-inf"))
    A = torch.softmax(target, -1)
    fq, _ = f.log_features(qs)
    fk, sk = f.key_log_features(k)
    G = fq @ fk.mT
    logits = torch.log(G.clamp_min(torch.finfo(G.dtype).tiny)) + sk.unsqueeze(-2)
    if mask is not None:
        logits = logits.masked_fill(mask, float("-inf"))
    log_hat = torch.log_softmax(logits, -1)
    if mask is not None:
        log_hat = log_hat.masked_fill(mask, 0.0)
    return -(A * log_hat).sum(-1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 2])
def test_log_weights_match_the_transfer_loss(causal: bool, window) -> None:
    q, k, _ = qkv()
    sinks = 1 if window is not None else 0
    want = _recover_log_weights(q, k, fm(), causal, window, sinks)
    got = attention_log_weights(q, k, fm(), window=window, sinks=sinks, causal=causal)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rows", [None, torch.tensor([1, 4, 8])])
@pytest.mark.parametrize("window", [None, 2])
def test_log_weights_match_the_map_training(causal: bool, rows, window) -> None:
    q, k, _ = qkv()
    S = None if window is None else exact_set_mask(9, window=window, sinks=0, causal=causal)
    want = _hedgehog_row_losses(fm(), q, k, rows, causal, 0.7, S)
    log_hat, A = attention_log_weights(q, k, fm(), causal=causal, exact="exclude", rows=rows, scale=0.7,
                                       exact_set=S)
    torch.testing.assert_close(-(A * log_hat).sum(-1), want, rtol=0, atol=0, equal_nan=True)  # NaN: empty remainder


def test_resolver_defaults_and_forms() -> None:
    a = resolve_feature_map("positive", dim=8, heads=2, seed=3)
    assert a.num_features == default_num_features(8) and tuple(a.batch_shape) == (2,)
    assert DEFAULT_SAMPLER == "orthogonal"
    b = ka.get_estimator("positive").build(8, default_num_features(8), sampler="orthogonal", seed=3, batch_shape=(2,))
    assert torch.equal(a.state_dict()["w"] if "w" in a.state_dict() else next(iter(a.state_dict().values())),
                       next(iter(b.state_dict().values())))
    c = resolve_feature_map("positive", dim=8, heads=2, seed=3, layer=1)
    d = ka.get_estimator("positive").build(8, default_num_features(8), sampler="orthogonal", seed=layer_seed(3, 1),
                                           batch_shape=(2,))
    assert torch.equal(next(iter(c.state_dict().values())), next(iter(d.state_dict().values())))
    inst = fm()
    assert resolve_feature_map(inst, dim=4) is inst
    assert resolve_feature_map({1: inst}, dim=4, layer=1) is inst
    assert resolve_feature_map(lambda layer, h, d: inst, dim=4, factory_args=(0, 2, 4)) is inst
    assert resolve_feature_map("positive", dim=4, options={"sampler": "gaussian"}, seed=0).sampler.name == "gaussian"
    with pytest.raises(KeyError, match="no map for layer 0"):
        resolve_feature_map({1: inst}, dim=4, layer=0)
    with pytest.raises(TypeError, match="factory must return a kernelapprox FeatureMap, got str"):
        resolve_feature_map(lambda d, h: "x", dim=4, heads=1)
    with pytest.raises(TypeError, match="feature_map must be an estimator name"):
        resolve_feature_map(3, dim=4)
