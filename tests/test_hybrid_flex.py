"""The flex path of hybrid attention (`kernelapprox.attention.hybrid.flex`): flex_attention on
the exact sets plus a delayed per-feature log-domain scan, merged under one normaliser.

On the CPU eager flex_attention has a forward (no backward), so the path is checked here in
float64 against the quadratic reference, at large norms against a float64 log-domain
reference, for a fixed number of operations whatever n, and for the dispatch that chooses it.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernelapprox as ka
from kernelapprox import backends
from kernelapprox.attention.hybrid import exact_set_mask, hybrid_attention, naive_hybrid_attention
from kernelapprox.attention.hybrid.flex import flex_hybrid_attention
from kernelapprox.attention.hybrid.logfeatures import log_features_pair

F64 = torch.float64
POSITIVE = [e.name for e in ka.estimators() if e.positive]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _qkv(b=2, n=37, d=6, dv=5, seed=0, scale=0.5, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q, k = (scale * torch.randn(2, b, n, d, generator=g, dtype=dtype)).unbind(0)
    v = torch.randn(b, n, dv, generator=g, dtype=dtype)
    return q, k, v


@pytest.fixture
def forced_flex(monkeypatch):
    monkeypatch.setattr(backends, "hybrid_path", lambda device, dtype, requires_grad: "flex")


@pytest.mark.parametrize("n", [23, 64, 101])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["token", "block"])
def test_flex_merge_equals_the_dense_hybrid_in_float64(n, causal, mode, forced_flex):
    fm = ka.PositiveRF(6, 16, seed=0, dtype=F64)
    q, k, v = _qkv(n=n)
    sink_sets = [0, 3, [4, 9]] + ([] if causal else [[-1, 2]])
    worst = 0.0
    for w in (1, 5, 16, n - 1):
        for sinks in sink_sets:
            ref = naive_hybrid_attention(q, k, v, fm, window=w, sinks=sinks, causal=causal, window_mode=mode)
            out = hybrid_attention(q, k, v, fm, window=w, sinks=sinks, causal=causal, window_mode=mode)
            worst = max(worst, float((out - ref).abs().max()))
    assert worst < 1e-10


@pytest.mark.parametrize("causal", [True, False])
def test_flex_merge_with_padding_and_broadcast(causal):
    fm = ka.PositiveRF(6, 16, seed=1, dtype=F64)
    g = torch.Generator().manual_seed(3)
    q = 0.5 * torch.randn(2, 3, 29, 6, generator=g, dtype=F64)
    k = 0.5 * torch.randn(2, 1, 29, 6, generator=g, dtype=F64)
    v = torch.randn(2, 3, 29, 4, generator=g, dtype=F64)
    pad = torch.zeros(2, 29, dtype=torch.bool)
    pad[1, 21:] = True
    for mode in ("token", "block"):
        out = flex_hybrid_attention(q, k, v, fm, window=4, sinks=1, causal=causal, window_mode=mode,
                                    key_padding_mask=pad[:, None])
        ref = naive_hybrid_attention(q, k, v, fm, window=4, sinks=1, causal=causal, window_mode=mode,
                                     key_padding_mask=pad[:, None])
        real = ~pad[:, None, :, None].expand_as(out)
        assert float((out - ref)[real].abs().max()) < 1e-10


def test_flex_reads_the_state_up_to_the_last_key_outside_the_exact_set():
    # the remainder alone (a map with phi = 1 on every key): query i averages the keys j <= p(i)
    # with p(i) the last key not in its exact set, read off exact_set_mask
    n, w = 19, 4
    S = exact_set_mask(n, window=w, causal=True)
    rem = torch.ones(n, n, dtype=torch.bool).tril() & ~S
    for i in range(n):
        cols = rem[i].nonzero().flatten().tolist()
        assert cols == list(range(0, i - w + 1))


def _log_reference(q, k, v, fm, window, sinks, mode, causal):
    fm64 = copy.deepcopy(fm).double()
    q, k, v = q.double(), k.double(), v.double()
    n = q.shape[-2]
    S = exact_set_mask(n, window=window, sinks=sinks, window_mode=mode, causal=causal)
    lq, lk = log_features_pair(fm64, q, k)
    rem = torch.logsumexp(lq.unsqueeze(-2) + lk.unsqueeze(-3), -1)
    scores = torch.where(S, q @ k.mT, rem)
    if causal:
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("name", POSITIVE)
def test_flex_path_has_no_wrong_rows_at_large_norms(name, forced_flex):
    g = torch.Generator().manual_seed(0)
    fm = ka.get_estimator(name).build(4, 16, seed=0)
    dirs = torch.randn(2, 2, 40, 4, generator=g)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    v = torch.randn(2, 40, 3, generator=g)
    bad = {}
    for norm in (2, 4, 8, 32, 128):
        q, k = (norm * dirs).unbind(0)
        if name == "relu":
            q, k = q.abs(), k.abs()
        if fm.data_dependent:
            fm.fit(q, k)
        for causal in (True, False):
            for mode in ("token", "block"):
                ref = _log_reference(q, k, v, fm, 3, 1, mode, causal)
                out = hybrid_attention(q, k, v, fm, window=3, sinks=1, window_mode=mode, causal=causal)
                err = (out.double() - ref).abs().amax(-1)
                n_bad = int((~(err <= 0.5)).sum())
                if n_bad:
                    bad[(norm, mode, causal)] = n_bad
    assert bad == {}


class _OpCount(TorchDispatchMode):
    """Counts the operators dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["token", "block"])
def test_flex_path_op_count_does_not_grow_with_n(causal, mode, forced_flex, monkeypatch):
    # the window term (one flex_attention call and its block mask) runs outside the mode and
    # counts as one operator: dispatch modes cannot enter flex_attention's higher-order operator
    from torch.utils._python_dispatch import _disable_current_modes

    import kernelapprox.attention.hybrid.flex as flex_mod

    real = flex_mod._window_term

    def window_term(*a, **kw):
        probe.count += 1
        with _disable_current_modes():
            return real(*a, **kw)

    monkeypatch.setattr(flex_mod, "_window_term", window_term)
    fm = ka.PositiveRF(8, 16, seed=0)
    counts = []
    for n in (256, 2048):
        q, k, v = _qkv(b=1, n=n, d=8, dv=8, dtype=torch.float32)
        q, k, v = q[None], k[None], v[None]  # (1, 1, n, d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _OpCount() as probe:
                hybrid_attention(q, k, v, fm, window=16, sinks=1, causal=causal, window_mode=mode)
        counts.append(probe.count)
    assert counts[0] == counts[1], counts


def test_hybrid_path_choice(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    assert backends.hybrid_path("cpu", torch.float32, False) == "torch"
    assert backends.hybrid_path("meta", torch.float32, True) == "torch"
    monkeypatch.setattr(backends, "is_accelerator", lambda device: True)
    assert backends.hybrid_path("cuda", torch.bfloat16, True) == "flex"
    assert backends.hybrid_path("cuda", torch.float32, False) == "flex"
    monkeypatch.setattr(backends, "has_flex_attention", lambda: False)
    assert backends.hybrid_path("cuda", torch.float32, False) == "torch"
    monkeypatch.setattr(backends, "has_flex_attention", lambda: True)
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    assert backends.hybrid_path("cuda", torch.float32, True) == "torch"
    monkeypatch.setattr(backends, "is_accelerator", lambda device: False)
    monkeypatch.setenv(backends.ENV_VAR, "accelerator")  # the CPU forward only (no flex backward there)
    assert backends.hybrid_path("cpu", torch.float32, False) == "flex"
    assert backends.hybrid_path("cpu", torch.float32, True) == "torch"


def test_dispatch_takes_flex_only_where_it_applies(monkeypatch):
    import kernelapprox.attention.hybrid.flex as flex_mod

    calls = []
    real = flex_mod.flex_hybrid_attention

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(flex_mod, "flex_hybrid_attention", spy)
    q, k, v = _qkv(n=20)
    pos = ka.PositiveRF(6, 16, seed=0, dtype=F64)
    hybrid_attention(q, k, v, pos, window=3, causal=True)
    assert calls == []  # the CPU takes the torch forms
    monkeypatch.setattr(backends, "hybrid_path", lambda device, dtype, requires_grad: "flex")
    hybrid_attention(q, k, v, pos, window=3, causal=True)
    assert len(calls) == 1
    trig = ka.get_estimator("trig").build(6, 16, seed=0, dtype=F64) if "trig" in [
        e.name for e in ka.estimators()] else None
    if trig is not None:  # signed maps keep the torch forms
        hybrid_attention(q, k, v, trig, window=3, causal=True)
    hybrid_attention(q, k, v, pos, window=0, causal=True)  # no window: linear attention
    hybrid_attention(q, k, v, pos, window=3, causal=True, return_state=True)  # a state: the chunked form
    assert len(calls) == 1


def test_flex_refuses_what_it_cannot_compute():
    q, k, v = _qkv(n=12)
    with pytest.raises(ValueError, match="window"):
        flex_hybrid_attention(q, k, v, ka.PositiveRF(6, 16, seed=0, dtype=F64), window=0)
    signed = [e for e in ka.estimators() if not e.positive]
    if signed:
        fm = signed[0].build(6, 16, seed=0, dtype=F64)
        with pytest.raises(ValueError, match="positive"):
            flex_hybrid_attention(q, k, v, fm, window=2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["token", "block"])
def test_torch_window_term_forward_and_backward_equal_the_dense_hybrid(causal, mode):
    # window_term="torch": the same merge with the window in plain torch, differentiable on the CPU
    fm = ka.PositiveRF(6, 16, seed=0, dtype=F64)
    q, k, v = _qkv(n=45)
    pad = torch.zeros(2, 45, dtype=torch.bool)
    pad[1, 40:] = True
    for w, sinks in ((1, 0), (4, 2), (7, [3, 20, 33])):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = flex_hybrid_attention(*leaves, fm, window=w, sinks=sinks, causal=causal, window_mode=mode,
                                    key_padding_mask=pad, window_term="torch")
        ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = naive_hybrid_attention(*ref_leaves, fm, window=w, sinks=sinks, causal=causal, window_mode=mode,
                                     key_padding_mask=pad)
        real = ~pad[:, :, None].expand_as(out)
        assert float((out - ref)[real].abs().max()) < 1e-10
        g = torch.randn_like(out) * real
        grads = torch.autograd.grad((out * g).sum(), leaves)
        ref_grads = torch.autograd.grad((ref * g).sum(), ref_leaves)
        for a, b in zip(grads, ref_grads, strict=True):
            assert float((a - b).abs().max()) < 1e-9


@pytest.mark.parametrize("name", ["positive", "saderf", "sderf", "oprf"])
def test_torch_window_term_has_no_wrong_causal_rows_at_large_norms(name):
    if name not in POSITIVE:
        pytest.skip(f"{name} is not a registered positive map")
    g = torch.Generator().manual_seed(0)
    fm = ka.get_estimator(name).build(4, 16, seed=0)
    dirs = torch.randn(2, 2, 40, 4, generator=g)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    v = torch.randn(2, 40, 3, generator=g)
    bad = {}
    for norm in (2, 8, 32, 128):
        q, k = (norm * dirs).unbind(0)
        if fm.data_dependent:
            fm.fit(q, k)
        for mode in ("token", "block"):
            for dt in (torch.float32, torch.bfloat16):
                # float64 on the inputs the call receives (bf16 rounding moves logits of ~|q||k| by ~1%)
                ref = _log_reference(q.to(dt), k.to(dt), v.to(dt), fm, 3, 1, mode, True)
                out = flex_hybrid_attention(q.to(dt), k.to(dt), v.to(dt), fm, window=3, sinks=1, causal=True,
                                            window_mode=mode, window_term="torch")
                err = (out.double() - ref).abs().amax(-1)
                n_bad = int((~(err <= 0.5)).sum())
                if n_bad:
                    bad[(norm, mode, str(dt))] = n_bad
    assert bad == {}
