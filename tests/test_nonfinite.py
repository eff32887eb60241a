"""Causal containment of non-finite values: output ``i`` depends on positions ``<= i`` only, also
when an input holds NaN or +-Inf, and padding after the sequence has no effect.

The reference is the recurrent form (``RecurrentLinearAttention.step``, token by token), where
containment holds by construction: a token is consumed only at its own step. The naive references
are plain formulas (a quadratic product masked afterwards, NaN * 0 = NaN) and are not meant for
non-finite inputs.

Semantics checked against the recurrent form, per batch element with one non-finite entry at
position ``j`` (one coordinate of one token):

* rows ``i < j`` are finite, equal (bitwise) to the output without the non-finite entry, and
  allclose to the recurrent rows;
* rows ``i >= j`` have the same finiteness pattern (``torch.isfinite``) as the recurrent rows,
  and their finite entries agree. Where the recurrent form gives +-Inf the chunked form may give
  NaN (both non-finite; e.g. an Inf value enters the intra-chunk product as NaN): only
  finiteness is compared, not NaN versus Inf.

Some cells stay finite on purpose: ``elu(-inf) + 1 = 0`` is a valid feature, so a -Inf in a
query or key coordinate of :class:`EluFeatures` gives a finite (different) output, in both forms.

The old bug these tests protect against: with ``chunk_size=64`` a NaN in key 3 gave NaN rows
0-15, rows *before* the NaN among them, because the intra-chunk score matrix
:math:`\\varphi(Q_c)\\varphi(K_c)^\\top` (and the value product) was formed before the causal
mask applied, and the mask multiplied by 0: NaN * 0 = NaN.
"""

from __future__ import annotations

import functools

import pytest
import torch

import kernelapprox as ka

F64 = torch.float64
D, N, DV = 4, 37, 3
CHUNKS = [1, 5, 16, 64]
# first token; key 3 (the old bug); last token of the first chunk of 5; last of a chunk of 5; last
# of the first chunk of 16; first of the second chunk of 16; middle; last token of the sequence.
POSITIONS = [0, 3, 4, 9, 15, 16, 18, N - 1]
COORD = 1  # the coordinate of q/k (or the column of v) that receives the value
VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
MAP_NAMES = ["positive", "hyperbolic", "trig", "elu"]
TOL = {"rtol": 1e-9, "atol": 1e-10}  # float64: chunked and recurrent differ by summation order only


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: threads only cost


def make_map(name: str, dtype=F64):
    if name == "positive":
        return ka.PositiveRF(D, 16, sampler="orthogonal", seed=0, dtype=dtype)
    if name == "hyperbolic":
        return ka.HyperbolicRF(D, 8, seed=1, dtype=dtype)
    if name == "trig":
        return ka.TrigRF(D, 32, seed=2, dtype=dtype)
    if name == "elu":
        return ka.EluFeatures(D)
    raise AssertionError(name)


def clean_inputs(name: str, batch: int, n: int = N, dtype=F64, seed: int = 0):
    """q, k (batch, n, D), v (batch, n, DV); small q, k for trig (denominators away from 0)."""
    g = torch.Generator().manual_seed(seed)
    s = 0.3 if name == "trig" else 0.5
    q = s * torch.randn(batch, n, D, generator=g, dtype=F64)
    k = s * torch.randn(batch, n, D, generator=g, dtype=F64)
    v = torch.randn(batch, n, DV, generator=g, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def poisoned(name: str, which: str, value: float, positions, **kw):
    """Clean inputs, and a copy where batch element ``p`` holds ``value`` at token ``positions[p]``
    (coordinate ``COORD`` of q or k, column ``COORD`` of v)."""
    clean = clean_inputs(name, len(positions), **kw)
    bad = [t.clone() for t in clean]
    t = bad["qkv".index(which)]
    for p, j in enumerate(positions):
        t[p, j, COORD] = value
    return clean, bad


def recurrent(fm, q, k, v, state=None) -> torch.Tensor:
    rnn = ka.RecurrentLinearAttention(fm, state=state)
    return torch.stack([rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(q.shape[-2])], dim=-2)


@functools.cache
def clean_outputs(name: str) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Recurrent and chunked outputs (every chunk size) of the clean inputs of ``poisoned``
    (computed once per map; the chunked ones checked against the recurrent one)."""
    fm = make_map(name)
    q, k, v = clean_inputs(name, len(POSITIONS))
    rec = recurrent(fm, q, k, v)
    assert torch.isfinite(rec).all()
    chunked = {C: ka.linear_attention(q, k, v, fm, causal=True, chunk_size=C) for C in CHUNKS}
    for C, out in chunked.items():
        torch.testing.assert_close(out, rec, **TOL, msg=f"clean inputs, chunk {C}")
    return rec, chunked


def check_contained(out, rec, j, clean_out=None, tol=TOL, what=""):
    """Containment of a non-finite entry at ``j`` for one sequence ``out``, ``rec`` (n, dv)."""
    before, rec_before = out[:j], rec[:j]
    assert torch.isfinite(before).all(), f"{what}: a row before j={j} is non-finite"
    torch.testing.assert_close(before, rec_before, **tol, msg=f"{what}: rows before j={j}")
    if clean_out is not None:
        assert torch.equal(before, clean_out[:j]), f"{what}: rows before j={j} changed"
    fin, rec_fin = torch.isfinite(out[j:]), torch.isfinite(rec[j:])
    assert torch.equal(fin, rec_fin), (
        f"{what}: finiteness of rows >= j={j} differs from the recurrent form at "
        f"{(fin != rec_fin).nonzero().add(torch.tensor([j, 0])).tolist()[:6]}"
    )
    torch.testing.assert_close(out[j:][fin], rec[j:][fin], **tol, msg=f"{what}: finite rows >= j={j}")


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("name", MAP_NAMES)
def test_causal_chunked_contains_nonfinite(name, which, value):
    """NaN/+Inf/-Inf in one coordinate of q, k or v at each of POSITIONS, every chunk size: the
    chunked form is contained exactly like the recurrent form (module docstring). Protects against
    the old bug (a NaN in key 3 with chunk_size=64 gave NaN rows 0-15, because the intra-chunk
    scores were formed before the mask and NaN * 0 = NaN), and the same leak through the values or
    through an Inf key scale, at chunk starts, chunk ends and in the zero-padded last chunk."""
    fm = make_map(name)
    _, (q, k, v) = poisoned(name, which, VALUES[value], POSITIONS)
    rec = recurrent(fm, q, k, v)
    rec0, clean_chunked = clean_outputs(name)
    for p, j in enumerate(POSITIONS):
        if value == "nan":  # the injection is not vacuous: it reaches the output at j
            assert not torch.isfinite(rec[p, j]).all(), (p, j)
        if which == "k" and value == "nan":  # a NaN key poisons every later row
            assert not torch.isfinite(rec[p, j:]).any(dim=-1).any()
    for C in CHUNKS:
        out = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=C)
        for p, j in enumerate(POSITIONS):
            check_contained(out[p], rec[p], j, clean_chunked[C][p], what=f"{name} {value} in {which}, chunk {C}")


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("name", ["positive", "trig"])
def test_causal_chunked_contains_nan_float32(name, which):
    """The same containment in float32 (map and inputs): the masking does not depend on the
    compute dtype. Rows before ``j`` match the recurrent form to float32 rounding (3e-5)."""
    fm = make_map(name, dtype=torch.float32)
    (q0, k0, v0), (q, k, v) = poisoned(name, which, float("nan"), POSITIONS, dtype=torch.float32)
    rec = recurrent(fm, q, k, v)
    for C in CHUNKS:
        clean = ka.linear_attention(q0, k0, v0, fm, causal=True, chunk_size=C)
        out = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=C)
        assert out.dtype == torch.float32
        for p, j in enumerate(POSITIONS):
            check_contained(out[p], rec[p], j, clean[p], tol={"rtol": 3e-5, "atol": 3e-5}, what=f"chunk {C}")


@pytest.mark.parametrize("pad", ["nan", "+inf", "-inf", "1e4"])
@pytest.mark.parametrize("name", MAP_NAMES)
def test_padding_after_sequence_has_no_effect(name, pad):
    """Seven garbage tokens (NaN, +-Inf or huge 1e4 in every coordinate of q, k and v) appended after
    position n leave outputs 0..n-1 unchanged, for every chunk size (n = 37 is no multiple of 5, 16
    or 64, so the garbage shares a chunk with real tokens). Protects against padding that leaks
    backwards through the intra-chunk product (NaN * 0) or through a shared key scale (a huge
    future key would underflow the past)."""
    fm = make_map(name)
    q, k, v = clean_inputs(name, 2)
    garbage = float(pad)
    qp, kp, vp = (torch.cat((t, torch.full((2, 7, t.shape[-1]), garbage, dtype=F64)), dim=-2) for t in (q, k, v))
    for C in CHUNKS:
        ref = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=C)
        out = ka.linear_attention(qp, kp, vp, fm, causal=True, chunk_size=C)
        assert torch.isfinite(out[..., :N, :]).all()
        # not bitwise: the chunk count changes how chunks are grouped into GEMMs
        torch.testing.assert_close(out[..., :N, :], ref, rtol=1e-12, atol=1e-12, msg=f"chunk {C}")


SPLIT = 20  # prefix 0..19, suffix 20..36
STATE_POSITIONS = [3, SPLIT - 1, SPLIT, 30]  # in the prefix, its last token, first of suffix, later


@pytest.mark.parametrize("value", ["nan", "+inf"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("name", MAP_NAMES)
def test_state_continuation_keeps_containment(name, which, value):
    """A sequence cut in two, the prefix run with ``return_state=True`` and the suffix continued
    with ``initial_state`` (chunked) or as the recurrent ``state``, is contained like the uncut
    recurrent run: a non-finite entry in the suffix does not reach the earlier suffix rows, one in
    the prefix reaches the suffix exactly where it does in the uncut run (a query's entry not at
    all: the state holds keys and values only). Protects against a returned state that carries the
    zero-padded chunk, or a non-finite scale, into the continuation."""
    fm = make_map(name)
    (q0, k0, v0), (q, k, v) = poisoned(name, which, VALUES[value], STATE_POSITIONS)
    rec = recurrent(fm, q, k, v)
    clean = recurrent(fm, q0, k0, v0)
    pre, suf = slice(0, SPLIT), slice(SPLIT, N)
    for C in (5, 16):
        out1, st = ka.linear_attention(q[:, pre], k[:, pre], v[:, pre], fm, causal=True, chunk_size=C,
                                       return_state=True)
        out2 = ka.linear_attention(q[:, suf], k[:, suf], v[:, suf], fm, causal=True, chunk_size=C,
                                   initial_state=st)
        out_rec2 = recurrent(fm, q[:, suf], k[:, suf], v[:, suf], state=st)
        for cont, label in ((out2, "chunked"), (out_rec2, "recurrent")):
            out = torch.cat((out1, cont), dim=-2)
            for p, j in enumerate(STATE_POSITIONS):
                check_contained(out[p], rec[p], j, what=f"{label} continuation, chunk {C}")
                if which == "q":  # a query's non-finite entry stays in its own row
                    keep = torch.arange(N) != j
                    torch.testing.assert_close(out[p, keep], clean[p, keep], **TOL)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("name", MAP_NAMES)
def test_noncausal_nan_is_not_silently_finite(name, which):
    """Non-causal attention lets every row see every key and value, so a NaN there must show in
    every row: a NaN in a key makes every output entry non-finite, one in column c of a value makes
    column c non-finite in every row (the other columns unchanged), and one in a query only its own
    row (the other rows unchanged). Protects against a non-causal form that masks or zeroes a NaN
    into a finite, wrong answer."""
    fm = make_map(name)
    (q0, k0, v0), (q, k, v) = poisoned(name, which, float("nan"), POSITIONS)
    clean = ka.linear_attention(q0, k0, v0, fm)
    out = ka.linear_attention(q, k, v, fm)
    assert torch.isfinite(clean).all()
    for p, j in enumerate(POSITIONS):
        bad = torch.zeros(N, DV, dtype=torch.bool)
        if which == "k":
            bad[:] = True
        elif which == "v":
            bad[:, COORD] = True
        else:
            bad[j] = True
        assert not torch.isfinite(out[p][bad]).any(), f"NaN in {which}[{j}] left finite entries"
        torch.testing.assert_close(out[p][~bad], clean[p][~bad], **TOL)


def test_positions_cover_chunk_boundaries():
    """POSITIONS hold, for every chunk size, the first token, a chunk's last token and the
    sequence's last token (the cases where the intra-chunk mask matters most)."""
    for C in CHUNKS:
        assert 0 in POSITIONS and N - 1 in POSITIONS
        ends = [j for j in POSITIONS if (j + 1) % C == 0 or j == N - 1]
        assert ends, C
    assert any(j % 16 == 0 and j > 0 for j in POSITIONS)
    assert len(set(POSITIONS)) == len(POSITIONS)


@pytest.mark.parametrize("name", ["positive", "hyperbolic", "elu"])
def test_huge_finite_key_stays_finite(name):
    """A finite key of huge norm (1e30 in one coordinate, float64) is not an error: for the
    positive maps its feature :math:`e^{w^\\top k - \\|k\\|^2/2}` is 0 next to every other key (elu
    gives it a huge finite weight). Every form stays finite, the recurrent and chunked forms agree,
    rows before it are unchanged, and the non-causal output equals that without the key (positive
    maps). Protects against the stabilised shared-scale features of a single key (the recurrent
    step, and the keys of the parallel form) being computed as ``exp(u - (M - c))`` with
    ``M = max(m + c)``: for ``|c| = |k|^2/2`` far above ``|m| = |max w^T k|`` the subtraction
    ``M - c`` cancels ``m`` away and the bounded features overflow to Inf (then NaN outputs), where
    the per-row form of the chunked path stayed finite."""
    fm = make_map(name)
    (q0, k0, v0), (q, k, v) = poisoned(name, "k", 1e30, POSITIONS)
    rec = recurrent(fm, q, k, v)
    assert torch.isfinite(rec).all()
    for C in CHUNKS:
        out = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=C)
        clean = ka.linear_attention(q0, k0, v0, fm, causal=True, chunk_size=C)
        for p, j in enumerate(POSITIONS):
            check_contained(out[p], rec[p], j, clean[p], what=f"chunk {C}")
    f, ls = fm.log_features(k[:, :1], shared=True)  # one key (p = 0 holds the huge one)
    assert torch.isfinite(f).all()
    if fm.is_random:  # bounded: |f| <= 1, with 1 attained by the row that sets the scale
        assert f.abs().amax(-1).max() == 1
    par = ka.linear_attention(q, k, v, fm)
    assert torch.isfinite(par).all()
    if name != "elu":
        for p, j in enumerate(POSITIONS):
            keep = torch.arange(N) != j
            torch.testing.assert_close(par[p], ka.linear_attention(q[p], k[p, keep], v[p, keep], fm), **TOL)
