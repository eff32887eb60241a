"""kernelapprox.nn: the attention layers.

What is checked, and how each check would fail:

* the layer computes exactly ``to_out(LA(s^1/2 q, s^1/2 k, v))`` (against the quadratic reference
  ``naive_linear_attention``; a wrong scaling, head split or projection order fails it);
* decoding: two segments (and one token at a time) with the returned state equal one pass;
* the redraw schedule: the projection changes at the start of training-mode calls N+1, 2N+1, ...
  and at no other call, never in eval mode, in place; counters survive ``state_dict``;
* performer-pytorch migration: ``PositiveRF.from_projection(fa.projection_matrix)`` reproduces
  ``FastAttention`` to rounding once its eps floor is removed, and with the floor the difference
  stays inside a bound computed from the floor's share of each denominator;
* training: a one-layer model learns a task that needs attention (predict the previous token);
* validation: bad arguments raise TypeError/ValueError naming the argument.
"""

from __future__ import annotations

import functools
import io
import math

import pytest
import torch
from torch import nn

import kernelapprox as ka
from kernelapprox.nn import LinearAttention, LinearAttentionHeads, default_num_features

F64 = torch.float64


def _x(*shape, seed=0, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=F64)).to(dtype)


# ---------------------------------------------------------------------------------------------
# what the layer computes


@pytest.mark.parametrize("causal", [False, True])
def test_layer_equals_projections_around_linear_attention(causal):
    torch.manual_seed(0)
    layer = LinearAttention(24, heads=3, causal=causal, num_features=20, seed=0, qkv_bias=True).double()
    x = _x(2, 9, 24, dtype=F64)
    out = layer(x)
    s = 8**-0.5
    q, k, v = (layer.split_heads(f(x)) for f in (layer.to_q, layer.to_k, layer.to_v))
    ref = ka.naive_linear_attention(q * s**0.5, k * s**0.5, v, layer.feature_map, causal=causal)
    ref = layer.to_out(ref.transpose(1, 2).reshape(2, 9, 24))
    assert out.shape == (2, 9, 24) and out.dtype == F64
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    # per-head path = the same attention without the projections
    torch.testing.assert_close(layer.forward_heads(q, k, v), layer.merge_heads(ka.naive_linear_attention(
        q * s**0.5, k * s**0.5, v, layer.feature_map, causal=causal)).view(2, 9, 3, 8).transpose(1, 2))


def test_defaults_and_per_head_draws():
    layer = LinearAttention(64, heads=4, seed=0)
    fm = layer.feature_map
    assert isinstance(fm, ka.PositiveRF) and fm.sampler.name == "orthogonal"
    assert layer.dim_head == 16 and fm.num_features == default_num_features(16) == int(16 * math.log(16))
    assert fm.batch_shape == (4,)
    W = fm.weight
    assert W.shape == (4, 44, 16)
    # independent draws per head (not one draw repeated as in performer-pytorch)
    assert all((W[0] - W[h]).abs().max() > 0.1 for h in range(1, 4))
    # the projection is a buffer, not a trainable parameter
    assert all(p is not W for p in layer.parameters())
    assert sum(p.numel() for p in layer.parameters()) == 4 * 64 * 64 + 64
    assert layer.attention.scale == 16**-0.5


def test_scale_sets_the_kernel_temperature():
    # with many features at small norms, the heads approximate softmax attention with logits
    # s q.k: s = 0.05 gives exp(0.05 q.k), not the default exp(q.k / 4)
    attn = LinearAttentionHeads(16, heads=2, num_features=8192, scale=0.05, seed=0)
    q, k, v = _x(3, 1, 2, 30, 16, seed=1).unbind(0)
    out = attn(q, k, v)
    ref = ka.softmax_attention(q * 0.05**0.5, k * 0.05**0.5, v)
    wrong = ka.softmax_attention(q / 2, k / 2, v)
    err, err_wrong = (out - ref).norm() / ref.norm(), (out - wrong).norm() / wrong.norm()
    assert err < 0.1 and err_wrong > 3 * err, (err, err_wrong)


@pytest.mark.parametrize("name", ["positive", "hyperbolic", "trig-sincos", "trig-offset", "elu", "taylor", "hedgehog"])
def test_any_estimator_by_name_trains(name):
    torch.manual_seed(0)
    layer = LinearAttention(16, heads=2, causal=True, feature_map=name, num_features=8, seed=0)
    assert ka.estimator_of(layer.feature_map).name == name
    x = _x(2, 6, 16, seed=2, scale=0.5).requires_grad_()
    out = layer(x)
    out.square().sum().backward()
    assert out.shape == (2, 6, 16) and torch.isfinite(out).all()
    assert torch.isfinite(x.grad).all() and layer.to_q.weight.grad.abs().sum() > 0
    if layer.feature_map.learned:  # Hedgehog: its per-head weights are trained with the layer
        fm_params = list(layer.feature_map.parameters())
        assert fm_params and all(p.grad is not None for p in fm_params)
        assert fm_params[0].shape[0] == 2  # batch_shape=(heads,)


def test_given_map_and_factory():
    shared = ka.PositiveRF(8, 16, sampler="orthogonal", seed=0)
    layer = LinearAttention(32, heads=4, feature_map=shared)
    assert layer.feature_map is shared  # used as is: one map shared by the heads
    layer(_x(1, 5, 32))
    made = []

    def factory(dim_head, heads):
        made.append((dim_head, heads))
        return ka.HyperbolicRF(dim_head, 12, batch_shape=(heads,), seed=3)

    layer = LinearAttention(32, heads=4, feature_map=factory)
    assert made == [(8, 4)] and isinstance(layer.feature_map, ka.HyperbolicRF)
    assert layer(_x(1, 5, 32)).shape == (1, 5, 32)
    # a non-orthogonal sampler and constructor arguments through feature_map_kwargs
    layer = LinearAttention(32, heads=4, feature_map="trig-sincos", num_features=6, sampler="gaussian",
                            feature_map_kwargs={"dtype": F64}, seed=0)
    assert layer.feature_map.sampler.name == "gaussian" and layer.feature_map.weight.dtype == F64


# ---------------------------------------------------------------------------------------------
# decoding with the state


@pytest.mark.parametrize("name", ["positive", "trig-sincos", "taylor"])
def test_two_segments_with_state_equal_one_pass(name):
    torch.manual_seed(0)
    layer = LinearAttention(32, heads=4, causal=True, feature_map=name, num_features=16, seed=0).double()
    layer.eval()
    x = _x(2, 21, 32, seed=4, dtype=F64, scale=0.5)
    full, full_state = layer(x, return_state=True)
    o1, s1 = layer(x[:, :8], return_state=True)
    o2, s2 = layer(x[:, 8:], initial_state=s1, return_state=True)
    torch.testing.assert_close(torch.cat((o1, o2), 1), full, rtol=1e-9, atol=1e-11)
    F = layer.feature_map.feature_dim
    assert isinstance(s2, ka.LinearAttentionState) and s2.kv.shape == (2, 4, F, 9)
    torch.testing.assert_close(s2.S, full_state.S, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(s2.z, full_state.z, rtol=1e-9, atol=1e-11)
    # token by token (decoding)
    state, outs = None, []
    for t in range(x.shape[1]):
        o, state = layer(x[:, t : t + 1], initial_state=state, return_state=True)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-9, atol=1e-11)
    # and the library's RNN continues the per-head state of the layer
    q, k, v = (layer.split_heads(f(x)) for f in (layer.to_q, layer.to_k, layer.to_v))
    root = layer.attention.scale**0.5
    rnn = ka.RecurrentLinearAttention(layer.feature_map, state=s1)
    o_rnn = rnn.step(q[:, :, 8] * root, k[:, :, 8] * root, v[:, :, 8])
    ref = layer.attention(q, k, v)[:, :, 8]
    torch.testing.assert_close(o_rnn, ref, rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------------------------------------
# redraw schedule


def test_redraw_every_n_training_calls_in_place_never_in_eval():
    N = 3
    layer = LinearAttention(16, heads=2, causal=True, num_features=8, redraw_every=N, seed=5)
    W = layer.feature_map.weight
    ptr = W.data_ptr()
    x = _x(1, 4, 16)
    seen = [W.clone()]  # seen[t] = projection used by training call t (1-based); seen[0] = initial
    for _ in range(10):
        layer(x).sum().backward()  # a backward after each call: the in-place redraw is autograd-safe
        seen.append(W.clone())
    changed = [t for t in range(1, 11) if not torch.equal(seen[t], seen[t - 1])]
    assert changed == [4, 7, 10]  # redrawn at the start of calls N+1, 2N+1, 3N+1
    assert torch.equal(seen[1], seen[0])  # call 1 uses the initial draw
    assert layer.feature_map.weight.data_ptr() == ptr  # in place: optimisers/compiled graphs keep it
    assert layer.attention.training_calls == 10 and layer.attention.redraws == 3
    # eval: neither counted nor redrawn; the per-head path counts like forward
    layer.eval()
    for _ in range(7):
        layer(x)
        layer.forward_heads(*_x(3, 1, 2, 4, 8).unbind(0))
    assert torch.equal(W, seen[-1]) and layer.attention.training_calls == 10
    layer.train()
    q, k, v = _x(3, 1, 2, 4, 8).unbind(0)
    layer.forward_heads(q, k, v)
    layer.forward_heads(q, k, v)
    assert torch.equal(W, seen[-1]) and layer.attention.training_calls == 12
    layer.forward_heads(q, k, v)  # call 13 = 4N + 1
    assert not torch.equal(W, seen[-1]) and layer.attention.redraws == 4


def test_redraw_seeds_are_reproducible_and_survive_state_dict():
    def run(layer, calls):
        for _ in range(calls):
            layer(_x(1, 3, 16))
        return layer.feature_map.weight.clone()

    a = LinearAttention(16, heads=2, num_features=8, redraw_every=2, seed=7)
    b = LinearAttention(16, heads=2, num_features=8, redraw_every=2, seed=7)
    c = LinearAttention(16, heads=2, num_features=8, redraw_every=2, seed=8)
    assert torch.equal(run(a, 5), run(b, 5)) and not torch.equal(run(a, 0), run(c, 5))
    # save after 5 calls, reload into a fresh layer: the next calls redraw identically
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    d = LinearAttention(16, heads=2, num_features=8, redraw_every=2, seed=7)
    d.load_state_dict(torch.load(buf))
    assert d.attention.training_calls == 5 and d.attention.redraws == 2
    assert torch.equal(d.feature_map.weight, a.feature_map.weight)
    assert torch.equal(d.to_q.weight, a.to_q.weight)
    assert torch.equal(run(a, 4), run(d, 4))
    # adjacent seeds give disjoint streams: the first redraw of seed 7 is not seed 8's first draw
    e = LinearAttention(16, heads=2, num_features=8, seed=7)
    f = LinearAttention(16, heads=2, num_features=8, seed=8)
    assert not torch.equal(e.redraw().feature_map.weight, f.feature_map.weight)


def test_redraw_needs_a_random_map_that_can_draw():
    with pytest.raises(ValueError, match="redraw_every=5 needs a random feature map; TaylorFeatures"):
        LinearAttention(16, heads=2, feature_map="taylor", redraw_every=5)
    given = ka.PositiveRF.from_projection(torch.randn(8, 8))
    with pytest.raises(ValueError, match="sampler='orthogonal'"):
        LinearAttention(16, heads=2, feature_map=given, redraw_every=5)
    ok = LinearAttention(16, heads=2, feature_map=ka.PositiveRF.from_projection(torch.randn(8, 8), sampler="orthogonal"),
                         redraw_every=5)
    ok.redraw(seed=0)
    assert ok.feature_map.weight.shape == (8, 8)


# ---------------------------------------------------------------------------------------------
# state_dict, devices, dtypes


def test_state_dict_round_trip_and_meta_device():
    torch.manual_seed(0)
    real = LinearAttention(32, heads=4, causal=True, num_features=16, seed=0)
    keys = set(real.state_dict())
    assert "attention.feature_map.projection._weight" in keys and "attention._extra_state" in keys
    meta = LinearAttention(32, heads=4, causal=True, num_features=16, seed=0, device="meta")
    assert meta.feature_map.weight.is_meta and meta.to_q.weight.is_meta
    out = meta(torch.randn(2, 5, 32, device="meta"))
    assert out.is_meta and out.shape == (2, 5, 32)
    meta.to_empty(device="cpu")
    meta.load_state_dict(real.state_dict())
    x = _x(2, 5, 32)
    assert torch.equal(meta(x), real(x))


def test_dtypes():
    layer = LinearAttention(16, heads=2, num_features=8, seed=0)
    x = _x(1, 6, 16)
    ref = layer(x)
    layer16 = LinearAttention(16, heads=2, num_features=8, seed=0).to(torch.bfloat16)
    layer16.load_state_dict(layer.state_dict())
    out16 = layer16(x.bfloat16())
    assert out16.dtype == torch.bfloat16
    assert (out16.float() - ref).abs().max() < 0.05


# ---------------------------------------------------------------------------------------------
# migration from performer-pytorch


def _performer_floor_bound(pp, fa, q, k, v, causal):
    r"""Per-entry bound on |performer - exact FAVOR+| caused by performer's eps floor.

    performer's features are ratio*(exp(.) + eps) (and causal denominators add 1e-6 to the key
    sums): every term the floor adds has a non-negative weight, so performer's output is
    ``(1 - delta) o + delta c`` with ``o`` the floor-free output and ``c`` a convex combination
    of the values (and of 0), ``delta`` = the floor's share of the denominator. Hence
    ``|o_perf - o| <= delta (|o| + max|v|) <= 2 delta max_j |v_j|``.
    """
    P = fa.projection_matrix
    fq = pp.softmax_kernel(q, projection_matrix=P, is_query=True)
    fk = pp.softmax_kernel(k, projection_matrix=P, is_query=False)
    fq0 = pp.softmax_kernel(q, projection_matrix=P, is_query=True, eps=0.0)
    fk0 = pp.softmax_kernel(k, projection_matrix=P, is_query=False, eps=0.0)
    if causal:
        den = (fq * (fk.cumsum(-2) + 1e-6)).sum(-1)
        clean = (fq0 * fk0.cumsum(-2)).sum(-1)
        vmax = v.abs().cummax(-2).values
    else:
        den = (fq * fk.sum(-2, keepdim=True)).sum(-1)
        clean = (fq0 * fk0.sum(-2, keepdim=True)).sum(-1)
        vmax = v.abs().amax(-2, keepdim=True).expand_as(v)
    delta = 1 - clean / den
    return 2 * delta.unsqueeze(-1) * vmax, delta


@pytest.mark.parametrize("causal", [False, True])
def test_performer_fast_attention_migration(causal, monkeypatch):
    pp = pytest.importorskip("performer_pytorch.performer_pytorch")
    torch.manual_seed(0)
    d, r = 16, 64
    fa = pp.FastAttention(d, nb_features=r, causal=causal).double()
    assert fa.projection_matrix.shape == (r, d)  # (nb_features, dim_heads)
    q, k, v = _x(3, 2, 3, 50, d, seed=11, dtype=F64).unbind(0)
    ours = LinearAttentionHeads(d, heads=3, causal=causal,
                                feature_map=ka.PositiveRF.from_projection(fa.projection_matrix))
    out = ours(q, k, v)
    perf = fa(q, k, v)
    err = (perf - out).abs()
    bound, delta = _performer_floor_bound(pp, fa, q, k, v, causal)
    # the floor explains the whole difference ...
    assert (err <= bound + 1e-12).all()
    # ... which is not small here (|q|, |k| ~ 4 at d = 16): the floor moves the output visibly
    assert err.max() > 1e-2 and delta.mean() > 0.05
    # without the floor, performer-pytorch and kernelapprox agree to float64 rounding
    monkeypatch.setattr(pp, "softmax_kernel", functools.partial(pp.softmax_kernel, eps=0.0))
    if causal:
        fa.causal_linear_fn = functools.partial(pp.causal_linear_attention_noncuda, eps=0.0)
    perf0 = fa(q, k, v)
    torch.testing.assert_close(out, perf0, rtol=1e-10, atol=1e-11)


def test_performer_self_attention_layer_migration(monkeypatch):
    pp = pytest.importorskip("performer_pytorch.performer_pytorch")
    torch.manual_seed(0)
    attn = pp.SelfAttention(32, heads=4, dim_head=8, nb_features=24, causal=False).double()
    fm = ka.PositiveRF.from_projection(attn.fast_attention.projection_matrix, sampler="orthogonal")
    layer = LinearAttention(32, heads=4, dim_head=8, feature_map=fm, redraw_every=1000).double()
    for name in ("to_q", "to_k", "to_v", "to_out"):
        getattr(layer, name).load_state_dict(getattr(attn, name).state_dict())
    x = _x(2, 40, 32, seed=12, dtype=F64)
    out = layer(x)
    monkeypatch.setattr(pp, "softmax_kernel", functools.partial(pp.softmax_kernel, eps=0.0))
    torch.testing.assert_close(out, attn(x), rtol=1e-10, atol=1e-11)


def test_redraw_period_matches_performer_projection_updater():
    """performer's ProjectionUpdater(interval=I) redraws at the start of calls I + 1, 2I + 2, ...;
    the layer's redraw_every=I + 1 has the same period, one call later (its first draw serves
    I + 1 calls, performer's I): the migration guide's claim."""
    pp = pytest.importorskip("performer_pytorch.performer_pytorch")
    interval = 2
    net = nn.ModuleList([pp.FastAttention(8, nb_features=8), nn.Linear(1, 1)])  # a parameter: its device
    updater = pp.ProjectionUpdater(net, interval)
    layer = LinearAttentionHeads(8, num_features=8, redraw_every=interval + 1, seed=0)
    q = _x(1, 1, 3, 8)

    def redrew(step, get):
        before = get().clone()
        step()
        return not torch.equal(before, get())

    theirs = [redrew(updater.redraw_projections, lambda: net[0].projection_matrix) for _ in range(10)]
    ours = [redrew(lambda: layer(q, q, q), lambda: layer.feature_map.weight) for _ in range(10)]
    calls = range(1, 11)
    assert theirs == [t % (interval + 1) == 0 for t in calls]  # calls 3, 6, 9
    assert ours == [t > 1 and t % (interval + 1) == 1 for t in calls]  # calls 4, 7, 10


# ---------------------------------------------------------------------------------------------
# it trains


class _Toy(nn.Module):
    """Embedding + positions -> one causal LinearAttention (residual) -> LayerNorm -> logits."""

    def __init__(self, vocab, n, dim, redraw_every):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.5 * torch.randn(n, dim))
        self.attn = LinearAttention(dim, heads=2, causal=True, num_features=32, seed=0,
                                    redraw_every=redraw_every)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        h = self.emb(x) + self.pos[: x.shape[1]]
        h = h + self.attn(h)
        return self.head(self.norm(h))


def test_trains_on_previous_token_task():
    """Predict x_{t-1} at position t (x_0 at t = 0) from i.i.d. tokens: only attention can carry
    x_{t-1} to position t, so a model without it is stuck at a loss >= ln(V) (n-1)/n = 1.95; with
    the layer (and its projection redrawn every 10 steps) the loss falls well below that."""
    V, N, D, steps = 8, 16, 32, 120
    torch.manual_seed(0)
    model = _Toy(V, N, D, redraw_every=10)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, V, (16, N), generator=g)
        y = torch.cat((x[:, :1], x[:, :-1]), dim=1)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert losses[0] > 0.9 * math.log(V)
    assert last < 0.5 < math.log(V) * (N - 1) / N
    assert last < first / 5
    assert model.attn.attention.redraws == (steps - 1) // 10


# ---------------------------------------------------------------------------------------------
# validation


def test_bad_arguments_raise_naming_them():
    with pytest.raises(ValueError, match=r"dim=30 is not a multiple of heads=4"):
        LinearAttention(30, heads=4)
    with pytest.raises(ValueError, match=r"feature_map has dim=8, but the heads have dim_head=16"):
        LinearAttention(32, heads=2, feature_map=ka.PositiveRF(8, 4))
    with pytest.raises(ValueError, match=r"batch_shape=\(3,\); a layer with heads=2"):
        LinearAttention(32, heads=2, feature_map=ka.PositiveRF(16, 4, batch_shape=(3,)))
    with pytest.raises(TypeError, match="num_features only apply"):
        LinearAttention(32, heads=2, feature_map=ka.PositiveRF(16, 4), num_features=8)
    with pytest.raises(TypeError, match="feature_map must be an estimator name.*got int"):
        LinearAttention(32, heads=2, feature_map=42)
    with pytest.raises(TypeError, match="factory must return a kernelapprox FeatureMap, got str"):
        LinearAttention(32, heads=2, feature_map=lambda d, h: "positive")
    with pytest.raises(ValueError, match="unknown estimator 'favor'"):
        LinearAttention(32, heads=2, feature_map="favor")
    with pytest.raises(ValueError, match="redraw_every must be a positive int, got 0"):
        LinearAttention(32, heads=2, redraw_every=0)
    with pytest.raises(TypeError, match="redraw_every must be a positive int, got True"):
        LinearAttention(32, heads=2, redraw_every=True)
    with pytest.raises(ValueError, match=r"scale must be a positive finite float, got -1.0"):
        LinearAttention(32, heads=2, scale=-1.0)
    with pytest.raises(TypeError, match="causal must be a bool, got 1"):
        LinearAttention(32, heads=2, causal=1)
    with pytest.raises(ValueError, match="seed must be a non-negative int or None, got -3"):
        LinearAttention(32, heads=2, seed=-3)
    layer = LinearAttention(32, heads=2, num_features=4, causal=True)
    with pytest.raises(ValueError, match=r"x must have shape \(batch, n, dim=32\), got shape \(5, 32\)"):
        layer(torch.randn(5, 32))
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        layer([[0.0] * 32])
    with pytest.raises(ValueError, match=r"q must have shape \(batch, heads, n, features\).*got shape \(2, 7, 16\)"):
        layer.forward_heads(torch.randn(2, 7, 16), torch.randn(2, 7, 16), torch.randn(2, 7, 16))
    with pytest.raises(ValueError, match=r"k has 3 heads \(shape \(1, 3, 7, 16\)\).*heads=2"):
        layer.forward_heads(torch.randn(1, 2, 7, 16), torch.randn(1, 3, 7, 16), torch.randn(1, 2, 7, 16))
    with pytest.raises(ValueError, match="initial_state has kv of shape"):
        layer(torch.randn(1, 3, 32), initial_state=ka.LinearAttentionState(torch.zeros(1, 2, 5, 3),
                                                                           torch.zeros(1, 2, 1, 1)))
    with pytest.raises(TypeError, match="return_state must be a bool"):
        layer(torch.randn(1, 3, 32), return_state="yes")


def test_import_does_not_load_dynamo():
    """``import kernelapprox`` (nn included) loads no ``torch._dynamo`` (about 1.4 s of imports): the
    layers build their compile-time helper on first use. Checked in a fresh interpreter."""
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, kernelapprox, kernelapprox.nn; print('torch._dynamo' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.stdout.strip() == "False", res.stdout + res.stderr


@pytest.mark.parametrize("batch_first", [True, False])
def test_bad_x_is_named_x(batch_first: bool) -> None:
    """Integer input and an empty sequence are refused naming the caller's ``x`` (not ``q``, not
    a torch dtype error from the projection)."""
    layer = LinearAttention(8, heads=2, seed=0, batch_first=batch_first)
    with pytest.raises(TypeError, match=r"^x must be a floating-point tensor .* got dtype torch.int64"):
        layer(torch.zeros(2, 3, 8, dtype=torch.long))
    empty = torch.randn(2, 0, 8) if batch_first else torch.randn(0, 2, 8)
    with pytest.raises(ValueError, match=r"^x is an empty sequence"):
        layer(empty)
