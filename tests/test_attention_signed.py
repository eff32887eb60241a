"""Signed feature maps (``positive = False``: trigonometric, Taylor, Nyström, hybrid): no form of
linear attention returns a silently wrong row.

The rows the survey of ``tests/test_attention_gated.py`` found wrong, one test each: the
trigonometric row at $\\|x\\| = 128$ (its key scales accumulated in float32, now in float64) and
the Nyström rows whose features meet none of their keys' in float32 (underflow: den = B = 0).
A row with $|\\text{den}_i| \\le \\varepsilon B_i$, $B_i = |\\varphi(q_i)|^\\top\\sum_j|\\psi(k_j)|$,
is lost (`kernelapprox.attention._common.signed_lost`): on the CPU the call warns with a
`kernelapprox.KernelApproxWarning` naming their number and returns them as computed; on the
accelerator path (forced here with ``KERNELAPPROX_BACKEND=accelerator``) they are NaN, without a
host read. Rows without keys are not lost (they give 0), and ordinary calls do not warn."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from _sync import host_syncs

import kernelapprox as ka
from kernelapprox import backends
from kernelapprox.attention._common import lost_tolerance, signed_lost
from kernelapprox.attention.linear.naive_gated import exact_linear_attention

N, D = 16, 4


def _inputs(norm, seed):
    """The survey's inputs: q, k of norm ``norm`` (2, 16, 4), v (2, 16, 3)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 2, N, D, generator=g).unbind(0)
    v = torch.randn(2, N, 3, generator=g)
    return norm * q / q.norm(dim=-1, keepdim=True), norm * k / k.norm(dim=-1, keepdim=True), v


def _map(name, q=None, k=None):
    fm = ka.get_estimator(name).build(dim=D, num_features=16, seed=0)
    if fm.data_dependent:
        fm.fit(q, k)
    return fm


def _form(form, fm, q, k, v, eps=0.0):
    n = q.shape[-2]
    with torch.no_grad():
        if form == "causal":
            return ka.linear_attention(q, k, v, fm, causal=True, chunk_size=4, eps=eps)
        if form == "parallel":
            return ka.linear_attention(q, k, v, fm, eps=eps)
        if form == "recurrent":
            rnn = ka.RecurrentLinearAttention(fm, eps=eps)
            return torch.stack([rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(n)], dim=-2)
        h = 7 if n > 7 else n // 2
        o1, st = ka.linear_attention(q[..., :h, :], k[..., :h, :], v[..., :h, :], fm, causal=True,
                                     return_state=True, eps=eps)
        o2 = ka.linear_attention(q[..., h:, :], k[..., h:, :], v[..., h:, :], fm, causal=True,
                                 initial_state=st, eps=eps)
        return torch.cat([o1, o2], dim=-2)


def _run(fn, *args, **kwargs):
    """``fn(...)`` and the counts named by its KernelApproxWarnings."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    counts = [int(re.match(r"(\d+) row", str(w.message)).group(1))  # type: ignore[union-attr]
              for w in rec if issubclass(w.category, ka.KernelApproxWarning)]
    return out, counts


CAUSAL_FORMS = ["causal", "recurrent", "segmented"]


def test_lost_rule():
    """|den| <= eps * B in a row with keys; a row without keys is not lost; NaN is not lost."""
    eps32 = torch.finfo(torch.float32).eps
    assert lost_tolerance(torch.float32) == eps32 and lost_tolerance(torch.float64) == torch.finfo(torch.float64).eps
    den = torch.tensor([[eps32], [1.5 * eps32], [0.0], [0.0], [float("nan")]])
    bound = torch.tensor([[1.0], [1.0], [0.0], [0.0], [1.0]])
    has_key = torch.tensor([[True], [True], [True], [False], [True]])
    assert signed_lost(den, bound, has_key).squeeze(-1).tolist() == [True, False, True, False, False]
    # the tolerance of the terms' dtype where it is given (16-bit kernel operands)
    assert signed_lost(den[:2], bound[:2], dtype=torch.bfloat16).all()


def test_trig_log_scale_accumulated_in_float64():
    """The log scale |x|^2/2 + log c of TrigRF at |x| = 128 equals the float64 map's on the same
    float32 inputs to 1e-9 (a float32 accumulation was off by up to 5e-4 there)."""
    q, k, _ = _inputs(128.0, 2)
    fm = _map("trig-sincos")
    _, ls = fm.key_log_features(k)
    _, ls64 = copy.deepcopy(fm).double().key_log_features(k.double())
    assert ls.dtype == torch.float64
    assert (ls - ls64).abs().max() < 1e-9


def test_trig_log_scale_replaces_the_fused_kernels(monkeypatch):
    """On CUDA the fused kernel returns the sines and a float32 log scale; TrigRF keeps the sines
    and takes the float64 log scale (and applies a shared scale itself). Emulated on the CPU: a
    stand-in kernel returns the torch path's f and a float32-accumulated log scale."""
    q, k, _ = _inputs(128.0, 2)
    fm = _map("trig-sincos")
    f_ref, ls_ref = fm.log_features(k)
    fs_ref, gs_ref = fm.log_features(k, shared=True)
    calls = []

    def fake_kernel(m, x, shared=False, key=False):
        calls.append(shared)
        f, ls = m._scaled(x)
        return f, (0.5 * torch.einsum("...d,...d->...", x, x) + (ls - 0.5 * (x.double() ** 2).sum(-1))).float()

    monkeypatch.setattr(backends, "use_fused_maps", lambda x: True)
    monkeypatch.setattr(backends, "fused_log_features", fake_kernel)
    f, ls = fm.log_features(k)
    fs, gs = fm.log_features(k, shared=True)
    assert calls == [False, False]
    assert torch.equal(f, f_ref) and torch.equal(ls, ls_ref) and torch.equal(fs, fs_ref) and torch.equal(gs, gs_ref)


@pytest.mark.parametrize("form", CAUSAL_FORMS)
def test_trig_sincos_row_at_norm_128(form):
    """The survey's trig-sincos row (sequence 0, row 10; sum|A| / |sum A| = 195) at |q| = |k| = 128,
    float32: was off by 6 (5 %) without warning in the causal, recurrent and segmented forms; now
    within 2e-3 relative of the exact answer (measured 6.5e-5 to 7e-4: the float32 angles
    |Wx| ~ 400 carry a rounding of 1.5e-5, times the row's cancellation), and no warning."""
    q, k, v = _inputs(128.0, 2)
    fm = _map("trig-sincos")
    ref = exact_linear_attention(q, k, v, fm, causal=True)
    out, counts = _run(_form, form, fm, q, k, v)
    assert counts == []
    rel = (out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel[0, 10] < 2e-3, float(rel[0, 10])
    assert rel.max() < 2e-3, float(rel.max())


@pytest.mark.parametrize("form", CAUSAL_FORMS)
@pytest.mark.parametrize(("norm", "seed", "lost"), [(16.0, 1, 1), (128.0, 2, 14)])
def test_nystrom_rows_lost_to_underflow_warn(form, norm, seed, lost):
    """The survey's Nyström rows (NaN without warning at |q| = |k| = 16 and 128): the query's
    features and its keys' meet nowhere in float32 (B_i = 0: the exact weights are 1e-53 and
    below of the features' scale). On the CPU the call warns and names the lost rows' number
    (per step for the recurrent form); the forced accelerator path returns exactly those rows NaN,
    the others equal to the CPU's, without any warning. At |x| = 16 the CPU's Cauchy-Schwarz screen
    takes 15 candidate rows of the causal call, and their exact bound keeps one: the features are
    peaked but exact (den / B ~ 1e-4, not 1e-17), and those rows are right."""
    q, k, v = _inputs(norm, seed)
    fm = _map("nystrom", q, k)
    out, counts = _run(_form, form, fm, q, k, v)
    assert sum(counts) == lost, counts
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(backends.ENV_VAR, "accelerator")
        acc, acc_counts = _run(_form, form, fm, q, k, v)
    assert acc_counts == []
    nan = acc.isnan().any(-1)
    assert int(nan.sum()) == lost and bool(acc[nan].isnan().all())
    # the accelerator's row-scale scan is another algorithm: on the other rows it is as close to
    # the float64 answer as the CPU's (both 0.082 off at |x| = 16, from the map's float32
    # features; the two differ by 4.5e-4)
    ref = exact_linear_attention(q, k, v, fm, causal=True) if form == "causal" else None
    if ref is not None:
        err_acc = (acc.double() - ref)[~nan].abs().max()
        err_cpu = (out.double() - ref)[~nan].abs().max()
        assert err_acc <= err_cpu + 1e-3, (float(err_acc), float(err_cpu))
    else:
        assert torch.equal(acc[~nan], out[~nan])
    # the non-causal form reaches every key: nothing is lost
    assert _run(_form, "parallel", fm, q, k, v)[1] == []


@pytest.mark.parametrize("form", ["causal", "recurrent", "segmented", "parallel"])
def test_taylor_rows_lost_to_cancellation(form):
    """Taylor features at |x| = 1000 with keys orthogonal to the query: K(q, k) = 1, while each
    term of the features' products is ~|x|^4 / 4: den / B ~ 1e-12, and float32 returns garbage
    (a row off by 0.5 from (v_0 + v_1) / 2). Every row but the one-key rows is lost; the CPU
    warns with their number, the accelerator path returns them NaN; a float64 call computes
    them (no warning, the exact answer to 1e-4)."""
    g = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=torch.float64))
    q = (1e3 * basis[:, 0]).expand(3, 4).contiguous()
    k = 1e3 * basis[:, 1:].mT
    v = torch.randn(3, 2, generator=g, dtype=torch.float64)
    fm = ka.TaylorFeatures(4)
    out, counts = _run(_form, form, fm, q.float(), k.float(), v.float())
    assert sum(counts) == 3
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(backends.ENV_VAR, "accelerator")
        acc, acc_counts = _run(_form, form, fm, q.float(), k.float(), v.float())
    assert acc_counts == [] and bool(acc.isnan().all())
    fm64 = copy.deepcopy(fm).double()
    out64, counts64 = _run(_form, form, fm64, q, k, v)
    ref = exact_linear_attention(q, k, v, fm64, causal=form != "parallel")
    assert counts64 == [] and (out64 - ref).abs().max() < 1e-4  # eps_64 B / |den| ~ 2e-4; measured 1e-5


def test_lost_rows_with_the_eps_guard():
    """With the default eps = 1e-6 a lost row is still reported: the CPU warns and returns the row
    as computed (finite here), the accelerator path returns NaN."""
    q, k, v = _inputs(16.0, 1)
    fm = _map("nystrom", q, k)
    out, counts = _run(_form, "causal", fm, q, k, v, eps=1e-6)
    assert counts == [1] and bool(out.isfinite().all())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(backends.ENV_VAR, "accelerator")
        acc, _ = _run(_form, "causal", fm, q, k, v, eps=1e-6)
    assert int(acc.isnan().any(-1).sum()) == 1 and bool(acc[0, 0].isnan().all())


def test_accelerator_path_reads_no_value():
    """The lost-row check on the forced accelerator path: no host read in the causal and
    non-causal forms and a decoding step (the CPU reads values, for its screen and its warning)."""
    q, k, v = _inputs(16.0, 1)
    fm = _map("nystrom", q, k)
    assert host_syncs(ka.linear_attention, q, k, v, fm, causal=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(backends.ENV_VAR, "accelerator")
        for causal in (True, False):
            assert not host_syncs(ka.linear_attention, q, k, v, fm, causal=causal)
        rnn = ka.RecurrentLinearAttention(fm)
        rnn.step(q[:, 0], k[:, 0], v[:, 0])
        assert not host_syncs(rnn.step, q[:, 1], k[:, 1], v[:, 1])


@pytest.mark.parametrize("name", ["trig-sincos", "trig-offset", "taylor", "nystrom", "hybrid"])
def test_rows_without_keys_are_not_lost(name):
    """Fully padded sequences and causal rows before the first valid key give 0 (not NaN, no
    warning), on the CPU and on the accelerator path."""
    q, k, v = _inputs(2.0, 3)
    fm = _map(name, q, k)
    pad = torch.zeros(2, N, dtype=torch.bool)
    pad[0] = True  # sequence 0: no key at all
    pad[1, :5] = True  # sequence 1: its first 5 rows see no key
    for env in ("auto", "accelerator"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(backends.ENV_VAR, env)
            for causal in (True, False):
                out, counts = _run(ka.linear_attention, q, k, v, fm, causal=causal, key_padding_mask=pad, eps=0.0)
                assert counts == [] and bool(out.isfinite().all()), (env, causal)
                assert (out[0] == 0).all()
                if causal:
                    assert (out[1, :5] == 0).all()


@pytest.mark.parametrize("name", ["trig-sincos", "trig-offset", "hybrid"])
def test_ordinary_calls_do_not_warn(name):
    """Random maps at a usual scale (q, k ~ N(0, I / 4), d = 16, 512 tokens): no row is lost
    (the smallest den / B is 2e-5 here), no warning, no NaN on the accelerator path; the rows match
    float64 to 1e-3 (relative, the worst row; measured 1e-4)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(3, 2, 512, 16, generator=g).unbind(0)
    q, k = q / 2, k / 2
    fm = ka.get_estimator(name).build(dim=16, num_features=32, seed=0)
    ref = ka.linear_attention(q.double(), k.double(), v.double(), copy.deepcopy(fm).double(), causal=True,
                              eps=0.0)
    out, counts = _run(ka.linear_attention, q, k, v, fm, causal=True, eps=0.0)
    assert counts == []
    rel = (out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max() < 1e-3, float(rel.max())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(backends.ENV_VAR, "accelerator")
        assert not bool(ka.linear_attention(q, k, v, fm, causal=True, eps=0.0).isnan().any())


def test_cpu_screen_finds_the_exact_bound_rows():
    """The CPU's causal check (a Cauchy-Schwarz screen, then the exact bound of the candidate
    rows) and the accelerator path's (the exact bound of every row) report the same rows, on a
    mix of lost rows (Taylor at |x| = 1000, orthogonal pairs), ordinary ones, padding and an
    initial state."""
    g = torch.Generator().manual_seed(1)
    basis, _ = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=torch.float64))
    n = 24
    q = torch.randn(2, n, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, n, 4, generator=g, dtype=torch.float64)
    q[0, :12] = 1e3 * basis[:, 0]  # sequence 0: its first 12 rows see only orthogonal keys (lost)
    k[0, :12] = 1e3 * basis[:, 1 + torch.arange(12) % 3].mT
    q, k = q.float(), k.float()
    v = torch.randn(2, n, 3, generator=g)
    pad = torch.zeros(2, n, dtype=torch.bool)
    pad[1, :3] = True
    fm = ka.TaylorFeatures(4)
    _, st = ka.linear_attention(q[:, :4], k[:, :4], v[:, :4], fm, causal=True, return_state=True)
    kw = dict(causal=True, chunk_size=8, key_padding_mask=pad, initial_state=st, eps=0.0)
    out, counts = _run(ka.linear_attention, q, k, v, fm, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(backends.ENV_VAR, "accelerator")
        acc = ka.linear_attention(q, k, v, fm, **kw)
    nan = acc.isnan().any(-1)
    assert nan[0, :12].all() and not nan[0, 12:].any() and not nan[1].any()
    assert counts == [12]
    assert torch.allclose(acc[~nan], out[~nan], atol=1e-6)


def test_decoding_continues_the_bound():
    """A decoder continuing a causal prefill carries sum_j |psi(k_j)| step by step: its lost rows
    (NaN on the accelerator path) are those of the causal call on the whole sequence."""
    q, k, v = _inputs(128.0, 2)
    fm = _map("nystrom", q, k)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(backends.ENV_VAR, "accelerator")
        full = ka.linear_attention(q, k, v, fm, causal=True, eps=0.0)
        o1, st = ka.linear_attention(q[:, :7], k[:, :7], v[:, :7], fm, causal=True, return_state=True, eps=0.0)
        rnn = ka.RecurrentLinearAttention(fm, state=st, eps=0.0)
        dec = torch.stack([rnn.step(q[:, t], k[:, t], v[:, t]) for t in range(7, N)], dim=1)
    got = torch.cat([o1, dec], dim=1)
    assert torch.equal(got.isnan(), full.isnan()) and int(full.isnan().any(-1).sum()) == 14
    assert torch.allclose(got[~got.isnan()], full[~full.isnan()], atol=1e-5)
