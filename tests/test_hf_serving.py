"""kernelapprox.hf.serving: the attention a linearised layer runs, on tensors alone (no model).

`AttentionServer` is checked against the library's own forms on random scaled queries and keys:
causal and bidirectional `kernelapprox.linear_attention` (with a key padding mask),
`kernelapprox.hybrid_attention` (window and sinks, per sequence on its valid tokens), and the
recurrent forms (a decoding step continues the stored state, token by token or in blocks, and
equals the full causal pass). Grouped-query keys (one key/value head for two query heads) are
repeated as the model's own attention repeats them.

Tolerances. Float64 inputs; the chunked, recurrent and parallel forms sum the same terms in
another order (differences ~1e-15); checks at 1e-10. Each comparison is paired with one it must
fail (another map, a corrupted state).
"""

from __future__ import annotations

import pytest
import torch

import kernelapprox as ka
from kernelapprox.hf.serving import AttentionServer, Stream, causal_sinks, sequence_sinks

pytestmark = [pytest.mark.usefixtures("one_thread")]

B, H, KV, N, D = 2, 2, 1, 13, 8
ATOL = 1e-10


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = 0.5 * torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k = 0.5 * torch.randn(B, KV, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, KV, N, D, generator=g, dtype=torch.float64)
    return q, k, v


def _fm(seed: int = 0) -> ka.FeatureMap:
    return ka.PositiveRF(D, 32, seed=seed, dtype=torch.float64)


def _rep(x: torch.Tensor) -> torch.Tensor:
    return x.repeat_interleave(H // KV, dim=1)


def _valid() -> torch.Tensor:
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[1, :4] = False  # left padding of row 1
    return valid


def test_causal_equals_linear_attention_and_continues_its_state() -> None:
    q, k, v = _inputs()
    fm = _fm()
    want = ka.linear_attention(q, _rep(k), _rep(v), fm, causal=True)
    assert torch.allclose(AttentionServer().causal(0, k, v, q, 1.0, fm), want, atol=ATOL)
    server = AttentionServer(chunk_size=4)
    parts = [server.causal(0, k[:, :, :7], v[:, :, :7], q[:, :, :7], 1.0, fm)]
    for t in range(7, N):  # one token at a time: the recurrent form on the stored state
        parts.append(server.causal(0, k[:, :, :t + 1], v[:, :, :t + 1], q[:, :, t:t + 1], 1.0, fm))
        assert server.streams[0].consumed == t + 1
    assert torch.allclose(torch.cat(parts, dim=2), want, atol=ATOL)
    other = ka.linear_attention(q, _rep(k), _rep(v), _fm(1), causal=True)
    assert not torch.allclose(other, want, atol=1e-3)


def test_a_continuation_reads_only_the_new_keys() -> None:
    q, k, v = _inputs()
    fm = _fm()
    server = AttentionServer()
    server.causal(0 + 1, k[:, :, :9], v[:, :, :9], q[:, :, :9], 1.0, fm)
    bad = k.clone()
    bad[:, :, 1:8] = 99.0  # cached keys between the first and the last: not read past the first layer
    out = server.causal(1, bad, v, q[:, :, 9:], 1.0, fm)
    want = ka.linear_attention(q, _rep(k), _rep(v), fm, causal=True)[:, :, 9:]
    assert torch.allclose(out, want, atol=ATOL)
    # the first layer compares every cached key: the corrupted cache is rebuilt (and read)
    server.causal(0, k[:, :, :9], v[:, :, :9], q[:, :, :9], 1.0, fm)
    rebuilt = server.causal(0, bad, v, q[:, :, 9:], 1.0, fm)
    assert not torch.allclose(rebuilt, want, atol=1e-3)


def test_scaling_root_scales_the_keys() -> None:
    q, k, v = _inputs()
    fm = _fm()
    r = 0.7
    want = ka.linear_attention(q, _rep(k) * r, _rep(v), fm, causal=True)
    assert torch.allclose(AttentionServer().causal(0, k, v, q, r, fm), want, atol=ATOL)


@pytest.mark.parametrize(("window", "sinks"), [(4, 0), (3, 1), (0, (0, 2))])
def test_causal_hybrid_equals_hybrid_attention_stepwise(window, sinks) -> None:
    q, k, v = _inputs(1)
    fm = _fm()
    want = ka.hybrid_attention(q, _rep(k), _rep(v), fm, window=window, sinks=sinks, causal=True)
    server = AttentionServer(window=window, sinks=sinks, chunk_size=4)
    parts = [server.causal(0, k[:, :, :5], v[:, :, :5], q[:, :, :5], 1.0, fm)]
    for t in range(5, N):
        parts.append(server.causal(0, k[:, :, :t + 1], v[:, :, :t + 1], q[:, :, t:t + 1], 1.0, fm))
    assert torch.allclose(torch.cat(parts, dim=2), want, atol=ATOL)
    plain = ka.linear_attention(q, _rep(k), _rep(v), fm, causal=True)
    assert not torch.allclose(plain, want, atol=1e-3)


def test_causal_padding_per_sequence_and_masked() -> None:
    q, k, v = _inputs(2)
    fm = _fm()
    valid = _valid()
    # the map alone: one call with the key padding mask
    want = ka.linear_attention(q, _rep(k), _rep(v), fm, causal=True, key_padding_mask=~valid)
    out = AttentionServer().causal(0, k, v, q, 1.0, fm, valid=valid)
    assert torch.allclose(out[:, :, 4:], want[:, :, 4:], atol=ATOL)
    # hybrid: each sequence on its own valid tokens (its window and sinks count from its first one)
    server = AttentionServer(window=3, sinks=1)
    out = server.causal(0, k, v, q, 1.0, fm, valid=valid)
    assert server.streams[0].per_sequence and [g.count for g in server.streams[0].groups] == [N, N - 4]
    for i in range(B):
        idx = valid[i].nonzero().squeeze(-1)
        ref = ka.hybrid_attention(q[i][:, idx], _rep(k)[i][:, idx], _rep(v)[i][:, idx], fm, window=3, sinks=1,
                                  causal=True)
        assert torch.allclose(out[i][:, idx], ref, atol=ATOL)
    # a padded query reads the valid keys up to its position with the map alone: row 1's first
    # four queries see no valid key and are zero
    assert torch.equal(out[1][:, :4], torch.zeros_like(out[1][:, :4]))


def test_advance_with_only_the_new_keys_continues_a_held_state() -> None:
    q, k, v = _inputs(3)
    fm = _fm()
    valid = _valid()
    server = AttentionServer(window=2, sinks=1)
    first, stream = server.advance(k[:, :, :8], v[:, :, :8], q[:, :, :8], 1.0, fm, valid=valid[:, :8])
    assert isinstance(stream, Stream) and stream.keys is None and stream.first_key is None
    outs = [first]
    for t in range(8, N):  # the keys of position t alone, as a state-holding cache passes them
        o, stream = server.advance(k[:, :, t:t + 1], v[:, :, t:t + 1], q[:, :, t:t + 1], 1.0, fm,
                                   valid=valid[:, :t + 1], prev=stream, offset=t)
        outs.append(o)
    out = torch.cat(outs, dim=2)
    full = AttentionServer(window=2, sinks=1).causal(0, k, v, q, 1.0, fm, valid=valid)
    assert torch.allclose(out[:, :, 4:], full[:, :, 4:], atol=ATOL) and torch.allclose(out[0], full[0], atol=ATOL)
    with pytest.raises(RuntimeError, match="missing"):  # no state, no cached keys: nothing to continue
        server.advance(k[:, :, 8:9], v[:, :, 8:9], q[:, :, 8:9], 1.0, fm, valid=valid[:, :9], offset=8)
    with pytest.raises(ValueError, match="offset"):
        server.advance(k[:, :, 5:9], v[:, :, 5:9], q[:, :, 8:9], 1.0, fm, valid=valid[:, :9], offset=5)


def test_no_state_is_kept_without_store() -> None:
    q, k, v = _inputs()
    server = AttentionServer()
    server.causal(0, k, v, q, 1.0, _fm(), store=False)
    assert server.streams == {}
    out, stream = server.advance(k, v, q, 1.0, _fm(), store=False)
    assert stream is None and out.shape == (B, H, N, D)


def test_bidirectional_linear_and_hybrid() -> None:
    q, k, v = _inputs(4)
    kr, vr = _rep(k), _rep(v)
    fm = _fm()
    valid = _valid()
    server = AttentionServer()
    assert torch.allclose(server.bidirectional(q, kr, vr, fm), ka.linear_attention(q, kr, vr, fm), atol=ATOL)
    want = ka.linear_attention(q, kr, vr, fm, key_padding_mask=~valid)
    assert torch.allclose(server.bidirectional(q, kr, vr, fm, valid=valid), want, atol=ATOL)
    hyb = AttentionServer(window=2, sinks=[0, -1])
    assert torch.allclose(hyb.bidirectional(q, kr, vr, fm),
                          ka.hybrid_attention(q, kr, vr, fm, window=2, sinks=[0, N - 1]), atol=ATOL)
    out = hyb.bidirectional(q, kr, vr, fm, valid=valid)
    for i in range(B):
        idx = valid[i].nonzero().squeeze(-1)
        ref = ka.hybrid_attention(q[i][:, idx], kr[i][:, idx], vr[i][:, idx], fm, window=2,
                                  sinks=list(sequence_sinks((0, -1), idx.numel())))
        assert torch.allclose(out[i][:, idx], ref, atol=ATOL)
    assert not torch.allclose(out[0], server.bidirectional(q, kr, vr, fm)[0], atol=1e-3)


def test_fitted_maps_are_fitted_per_sequence_on_valid_keys() -> None:
    q, k, v = _inputs(5)
    kr, vr = _rep(k), _rep(v)
    valid = _valid()
    fm = ka.NystromFeatures(D, 4, dtype=torch.float64)
    out = AttentionServer().bidirectional(q, kr, vr, fm, fit=True, valid=valid)
    idx = valid[1].nonzero().squeeze(-1)
    ref_fm = ka.NystromFeatures(D, 4, dtype=torch.float64)
    ref_fm.fit(q[1], kr[1][:, idx])
    ref = ka.linear_attention(q[1], kr[1][:, idx], vr[1][:, idx], ref_fm)
    assert torch.allclose(out[1], ref, atol=ATOL)


def test_sink_helpers_and_bad_settings() -> None:
    assert sequence_sinks(2, 5) == (0, 1) and sequence_sinks((0, -1, 9), 5) == (0, 4)
    assert causal_sinks((0, 3)) == (0, 3)
    with pytest.raises(ValueError, match="non-negative"):
        causal_sinks((0, -1))
    with pytest.raises(ValueError, match="chunk_size"):
        AttentionServer(chunk_size=0)
    with pytest.raises((TypeError, ValueError), match="sinks"):
        AttentionServer(sinks="first")
