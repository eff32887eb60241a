r"""Serving: the attention a linearised model runs, and the decoding state it keeps, on tensors alone.

`AttentionServer` computes, for the scaled queries and keys of one layer (no model involved),

$$
o_i = \frac{\sum_{j \in S_i} e^{\tilde q_i^\top \tilde k_j} v_j
+ \varphi(\tilde q_i)^\top \sum_{j \in J_i \setminus S_i} \varphi(\tilde k_j) v_j^\top}
{\sum_{j \in S_i} e^{\tilde q_i^\top \tilde k_j}
+ \varphi(\tilde q_i)^\top \sum_{j \in J_i \setminus S_i} \varphi(\tilde k_j)},
$$

with $J_i$ the keys query $i$ may read (causal or bidirectional, padded keys excluded) and $S_i$
the exact set of hybrid attention (window and sinks; empty without them): the forms of
`kernelapprox.linear_attention` and `kernelapprox.hybrid_attention`, called through the one
attention over padded batches, `kernelapprox.attention.padded.padded_attention`. Causal layers keep a state per
layer (`Stream`): the linear-attention state and, with a window, the ring buffer of the window's
keys and values, one per group of sequences (`Group`: the whole batch, or each sequence where
sequences are fitted or windowed on their own valid tokens), so that decoding advances by the new
tokens only. `kernelapprox.hf.linearize` plugs it into a model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..maps.base import FeatureMap
from .switch import repeat_kv

__all__ = ["AttentionServer", "Group", "Stream", "causal_sinks", "fit_map", "sequence_sinks"]


def fit_map(fm: FeatureMap, q: torch.Tensor, k: torch.Tensor) -> FeatureMap:
    """The map to use on queries ``q`` and keys ``k`` (..., m_valid, d), fitted on them.

    Nyström with landmarks chosen by a rule ("segment-means", "kmeans++") needs at least as many
    keys as landmarks; a short sentence has fewer (9 valid keys for 32 landmarks). Each sequence
    then gets ``min(num_features, valid keys)`` landmarks, placed on its own keys (landmarks have
    the shape of the keys of the last fit): with fewer keys than ``num_features``, a
    Nyström map on the keys themselves (same ridge and cutoff), exact softmax attention on that
    sequence, since every key is a landmark. The layer's own map is left as it was. Every other
    map is fitted in place, ``fm.fit(q, k)``.
    """
    from ..maps.deterministic import NystromFeatures

    if isinstance(fm, NystromFeatures) and not isinstance(fm.landmarks, torch.Tensor):
        if k.shape[-2] < fm.num_features:
            return NystromFeatures(fm.dim, landmarks=k.detach(), ridge=fm.ridge, rcond=fm.rcond,
                                   dtype=fm.landmarks_.dtype, device=fm.landmarks_.device)
        # landmarks placed by a rule take the shape of these keys: the batch shape of a previous
        # fit (the whole batch, another sequence) is not a constraint on this one
        fm.batch_shape = ()
    fm.fit(q, k)
    return fm



def sequence_sinks(sinks: int | tuple[int, ...], length: int) -> tuple[int, ...]:
    """Sinks of one bidirectional sequence of ``length`` valid tokens: a count is clipped to the
    length, negative positions count from its end, positions outside it are dropped."""
    if isinstance(sinks, int):
        return tuple(range(min(sinks, length)))
    return tuple(sorted({p + length if p < 0 else p for p in sinks if -length <= p < length}))


def causal_sinks(sinks: int | tuple[int, ...]) -> int | tuple[int, ...]:
    """Sinks of a causal model: a count, or non-negative positions (else a clear error)."""
    if isinstance(sinks, tuple) and any(p < 0 for p in sinks):
        raise ValueError(
            f"sinks of a causal model must be non-negative positions (a decoder does not know where its "
            f"sequence ends), got {list(sinks)}"
        )
    return sinks



@dataclass
class Group:
    """Decoding state of one group of sequences in one layer."""

    fm: FeatureMap
    state: Any  # LinearAttentionState | HybridAttentionState | None
    count: int  # valid keys consumed


@dataclass
class Stream:
    """Decoding state of one layer: what the last call consumed, to recognise its continuation."""

    batch: int
    consumed: int
    per_sequence: bool
    groups: list[Group]
    # what recognises a continuation of the keys of a model's own cache (None in a state held by
    # a `LinearizedCache`, which is continued by construction)
    first_key: torch.Tensor | None = None
    last_key: torch.Tensor | None = None
    valid: torch.Tensor | None = None  # (batch, consumed) or None where every key was valid
    keys: torch.Tensor | None = None  # the first layer: every consumed key

    def follows(self, key: torch.Tensor, valid: torch.Tensor | None, p: int, per_sequence: bool) -> bool:
        """Whether a call with keys ``key`` (batch, kv_heads, m, d), of which the first ``p`` are cached,
        continues the consumed sequence: same batch, same count, same first and last cached key
        (bit for bit; the first layer: every cached key, since its keys depend on their token and
        position only, not on the context), same padding of the prefix."""
        if key.shape[0] != self.batch or p != self.consumed or p == 0 or per_sequence != self.per_sequence:
            return False
        if self.first_key is None or self.last_key is None:
            return False
        if self.first_key.shape != key[:, :, :1].shape or self.first_key.device != key.device:
            return False
        if not (torch.equal(key[:, :, :1], self.first_key) and torch.equal(key[:, :, p - 1:p], self.last_key)):
            return False
        if self.keys is not None and not torch.equal(key[:, :, :p], self.keys):
            return False
        prefix = None if valid is None else valid[:, :p]
        if self.valid is None:
            return prefix is None or bool(prefix.all())
        return prefix is not None and torch.equal(prefix, self.valid)





class AttentionServer:
    r"""Linear or hybrid attention of a model's layers, with the causal layers' decoding states.

    Parameters
    ----------
    window : int or None, default None
        Hybrid attention's exact window (``None``: the feature map alone).
    sinks : int or tuple of int, default 0
        Hybrid attention's sink tokens (a count of leading tokens, or positions).
    chunk_size : int, default 64
        Chunk length of the causal forms.

    Attributes
    ----------
    streams : dict of int to Stream
        The state of each causal layer after its last call (kept only where ``store``).
    pending : dict of int to StateLayer
        Layers whose next call continues a state held by a `kernelapprox.hf.cache.LinearizedCache`.

    Notes
    -----
    Queries and keys are the scaled ones, $\tilde q = \sqrt s\, q$ and $\tilde k = \sqrt s\, k$;
    ``causal`` takes unscaled keys and values with their key/value heads (grouped-query
    attention: repeated to the query heads where read) and the root ``r = sqrt(s)``.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> from kernelapprox.hf.serving import AttentionServer
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (0.5 * torch.randn(3, 1, 2, 10, 8, generator=g)).unbind(0)
    >>> fm = ka.PositiveRF(8, 16, seed=0)
    >>> server = AttentionServer()
    >>> first = server.causal(0, k[:, :, :7], v[:, :, :7], q[:, :, :7], 1.0, fm)
    >>> last = server.causal(0, k, v, q[:, :, 7:], 1.0, fm)  # continues the stored state
    >>> full = ka.linear_attention(q, k, v, fm, causal=True)
    >>> torch.allclose(torch.cat([first, last], dim=2), full, atol=1e-5)
    True
    """

    def __init__(self, *, window: int | None = None, sinks: Any = 0, chunk_size: int = 64) -> None:
        from .._validation import check_positive_int
        from ..attention.hybrid import check_window
        from ..attention.hybrid.sinks import check_sinks

        self.window = None if window is None else check_window(window)
        self.sinks: int | tuple[int, ...] = check_sinks(sinks)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        self.hybrid = self.window is not None or self.sinks != 0
        self.w = 0 if self.window is None else self.window
        self.streams: dict[int, Stream] = {}
        # layers whose next call continues a state held by a cache (`kernelapprox.hf.cache.StateLayer`),
        # set by the cache as it hands the call's new keys over
        self.pending: dict[int, Any] = {}

    # ------------------------------------------------------------------ the forms
    def linear(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fm: FeatureMap, causal: bool,
               pad: torch.Tensor | None = None) -> torch.Tensor:
        """`kernelapprox.linear_attention` of ``q`` on ``k``, ``v`` (``pad``: True at padded keys)."""
        from ..attention.padded import padded_attention

        out = padded_attention(q, k, v, fm, causal=causal, chunk_size=self.chunk_size, key_padding_mask=pad)
        return cast(torch.Tensor, out)  # no state was requested

    def _hybrid_full(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fm: FeatureMap, sk: Any) -> torch.Tensor:
        from ..attention.padded import padded_attention

        return cast(torch.Tensor, padded_attention(q, k, v, fm, window=self.w, sinks=sk, chunk_size=self.chunk_size))

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor | None, fm: FeatureMap,
             state: Any) -> tuple[torch.Tensor, Any]:
        """Causal attention of n queries on the n new keys after ``state``: output and new state
        (one token after a state: the recurrent form, whose step runs where
        `kernelapprox.backends.decode_plan` says, fla's fused kernel on CUDA with fla; the chunked
        form otherwise)."""
        from ..attention.hybrid.recurrent import RecurrentHybridAttention
        from ..attention.linear.recurrent import RecurrentLinearAttention
        from ..attention.padded import padded_attention

        if q.shape[-2] == 1 and state is not None:
            rnn: Any
            if self.hybrid:
                rnn = RecurrentHybridAttention(fm, window=self.w, sinks=causal_sinks(self.sinks), state=state)
                o = rnn.step(q[..., 0, :], k[..., 0, :], v[..., 0, :])
            else:
                rnn = RecurrentLinearAttention(fm, state=state)
                o = rnn.step(q[..., 0, :], k[..., 0, :], v[..., 0, :], key_padding_mask=pad)
            return o.unsqueeze(-2), rnn.state
        return cast(tuple[torch.Tensor, Any], padded_attention(
            q, k, v, fm, window=self.w if self.hybrid else None, sinks=causal_sinks(self.sinks) if self.hybrid else 0,
            causal=True, chunk_size=self.chunk_size, initial_state=state, return_state=True,
            key_padding_mask=None if self.hybrid else pad))

    def prefix_state(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor | None,
                     fm: FeatureMap) -> Any:
        """The state after the keys ``k`` (it does not depend on the queries)."""
        from ..attention.padded import padded_attention

        if self.hybrid:
            return self.step(k, k, v, None, fm, None)[1]
        return cast(tuple[torch.Tensor, Any], padded_attention(
            q[..., :1, :], k, v, fm, return_state=True, key_padding_mask=pad))[1]

    # ------------------------------------------------------------------ causal layers
    def causal(self, layer: int, key: torch.Tensor, value: torch.Tensor, queries: torch.Tensor, root: float,
               fm: FeatureMap, *, fit: bool = False, valid: torch.Tensor | None = None,
               store: bool = True) -> torch.Tensor:
        """Causal (hybrid) attention of the n queries ``queries`` (scaled, (b, h, n, d)) on the m keys
        ``key`` (b, kv_heads, m, d; unscaled, ``root`` = sqrt of the model's scaling): the n new keys
        continue the layer's stored state where the call continues it (`Stream.follows`), the state
        is rebuilt from the m - n cached keys otherwise. ``valid`` (b, m): the keys that are not
        padding (None: all). ``store``: keep the state for the next call. Returns (b, h, n, d_v)."""
        m = key.shape[2]
        p = m - queries.shape[2]
        per_sequence = valid is not None and (fit or self.hybrid)
        prev = self.streams.pop(layer, None)
        cont = prev is not None and prev.follows(key, valid, p, per_sequence)
        out, stream = self.advance(key, value, queries, root, fm, fit=fit, valid=valid,
                                   prev=prev if cont else None, store=store)
        if stream is not None:
            # the first layer keeps a copy of the call's keys (a cache may change its tensors in place)
            stream.first_key = key[:, :, :1].detach().clone()
            stream.last_key = key[:, :, -1:].detach().clone()
            stream.valid = None if valid is None else valid.clone()
            stream.keys = key.detach().clone() if layer == 0 else None
            self.streams[layer] = stream
        return out

    def advance(self, key: torch.Tensor, value: torch.Tensor, queries: torch.Tensor, root: float, fm: FeatureMap,
                *, fit: bool = False, valid: torch.Tensor | None = None, prev: Stream | None = None,
                offset: int = 0, store: bool = True) -> tuple[torch.Tensor, Stream | None]:
        """Causal attention of the n queries on the keys of positions ``offset`` .. m - 1 (``key``,
        ``value``: (b, kv_heads, m - offset, ·)), continuing ``prev`` (the state after m - n keys)
        where given; ``offset = m - n`` (only the new keys) needs ``prev``. Returns the output
        (b, h, n, d_v) and, with ``store``, the state after the m keys (its continuation fields unset)."""
        b, h, n, _ = queries.shape
        m = offset + key.shape[2] if valid is None else valid.shape[1]
        if offset + key.shape[2] != m:
            raise ValueError(f"valid has {m} positions but key covers {offset} + {key.shape[2]}")
        p = m - n  # cached keys
        if offset not in (0, p):
            raise ValueError(f"offset must be 0 or the {p} cached keys, got {offset}")
        per_sequence = valid is not None and (fit or self.hybrid)
        r = root
        if prev is not None and (prev.batch != b or prev.consumed != p or prev.per_sequence != per_sequence):
            prev = None
        if offset and p and prev is None:
            raise RuntimeError(
                f"the state after the {p} cached tokens is missing (batch {b}, per-sequence {per_sequence}): "
                "it cannot be rebuilt from the new keys alone"
            )
        full: dict[str, torch.Tensor] = {}

        def keys_values(sel: Any = slice(None), rows: Any = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
            """Scaled keys and values repeated to the query heads, of batch ``rows`` and positions ``sel``
            (absolute; the whole cache is repeated once per call, and only where it is read)."""
            if offset and isinstance(sel, slice):
                sel = slice(None if sel.start is None else sel.start - offset,
                            None if sel.stop is None else sel.stop - offset)
            elif offset:
                sel = sel - offset
            if isinstance(sel, slice) and sel == slice(None) or "k" in full:
                if "k" not in full:
                    full["k"], full["v"] = repeat_kv(key, h) * r, repeat_kv(value, h)
                return full["k"][rows][:, :, sel], full["v"][rows][:, :, sel]
            return repeat_kv(key[rows][:, :, sel], h) * r, repeat_kv(value[rows][:, :, sel], h)

        dv = value.shape[-1]
        out = queries.new_zeros(b, h, n, dv, dtype=torch.promote_types(queries.dtype, value.dtype))
        groups: list[Group] = []
        for g in range(b if per_sequence else 1):
            rows: Any = slice(g, g + 1) if per_sequence else slice(None)
            new: Any
            if per_sequence:
                assert valid is not None
                kidx = valid[g].nonzero().squeeze(-1)
                new = kidx[kidx >= p]
                qrows = new - p  # valid queries: the sequence's valid new keys
                qg, pad, cached = queries[g:g + 1, :, qrows], None, kidx.numel() - new.numel()
            else:
                kidx = qrows = torch.arange(0)  # unused: the whole batch is one group
                new, qg, cached = slice(p, m), queries, p
                pad = None if valid is None else ~valid
            nq = qg.shape[2]
            old = prev.groups[g] if prev is not None else None
            if old is not None and old.count != cached:
                old = None
            if old is not None:  # continue: only the new keys are read
                fm_g, state = old.fm, old.state
                kn, vn = keys_values(new, rows)
            elif offset and cached:
                raise RuntimeError(f"the state of sequence {g} after its {cached} cached tokens is missing")
            else:  # rebuild from the cache
                kg, vg = keys_values(kidx if per_sequence else slice(None), rows)
                fm_g = fit_map(fm, qg, kg) if fit and kg.shape[2] else fm
                state = None
                if cached:
                    state = self.prefix_state(qg if nq else kg, kg[..., :cached, :], vg[..., :cached, :],
                                              None if pad is None else pad[..., :cached], fm_g)
                kn, vn = kg[..., cached:, :], vg[..., cached:, :]
            if nq:
                o, state = self.step(qg, kn, vn, None if pad is None else pad[..., p:], fm_g, state)
                if per_sequence:
                    out[g][:, qrows] = o[0].to(out.dtype)
                else:
                    out = o.to(out.dtype)
            if per_sequence and nq < n:
                # padded queries see the valid keys up to their position (feature map alone)
                assert valid is not None
                if offset:
                    raise NotImplementedError(
                        "a padded new token after cached tokens: the state holds no keys for it to read"
                    )
                kg, vg = keys_values(kidx, rows)
                rest = (~valid[g, p:]).nonzero().squeeze(-1) + p
                seen = torch.searchsorted(kidx, rest, right=True)
                for c in seen.unique().tolist():
                    if c:
                        sel = rest[seen == c] - p
                        out[g][:, sel] = self.linear(queries[g][:, sel], kg[0, :, :c], vg[0, :, :c], fm_g,
                                                     False).to(out.dtype)
            if store:
                keep_fm = copy.deepcopy(fm_g) if fit and per_sequence and fm_g is fm else fm_g
                groups.append(Group(keep_fm, None if state is None else state.detach(), cached + nq))
        if not store:
            return out, None
        return out, Stream(b, m, per_sequence, groups)

    # ------------------------------------------------------------------ bidirectional layers
    def bidirectional(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, fm: FeatureMap,
                      *, fit: bool = False, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Bidirectional (hybrid) attention of the scaled ``queries`` (b, h, n, d) on the scaled
        ``keys`` and ``values`` (b, h, m, ·), repeated to the query heads; ``valid`` (b, m) the
        non-padded keys. A data-dependent map (``fit``) is fitted per sequence on its valid keys; with
        a window or sinks the positions are each sequence's own valid tokens (negative sinks count
        from its last one). Returns (b, h, n, d_v)."""
        if self.hybrid:
            return self._bidirectional_hybrid(queries, keys, values, fm, fit, valid)
        if valid is None:
            return self.linear(queries, keys, values, fit_map(fm, queries, keys) if fit else fm, False)
        if not fit:  # one call with the key padding mask: every query sees the valid keys
            return self.linear(queries, keys, values, fm, False, pad=~valid)
        b, _, n, _ = queries.shape
        out = queries.new_zeros(b, queries.shape[1], n, values.shape[-1],
                                dtype=torch.promote_types(queries.dtype, values.dtype))
        for i in range(b):
            idx = valid[i].nonzero().squeeze(-1)
            if idx.numel():
                ki, vi = keys[i][:, idx], values[i][:, idx]
                out[i] = self.linear(queries[i], ki, vi, fit_map(fm, queries[i], ki), False).to(out.dtype)
        return out

    def _bidirectional_hybrid(self, qs: torch.Tensor, ks: torch.Tensor, v_: torch.Tensor, fm: FeatureMap,
                              fit: bool, valid: torch.Tensor | None) -> torch.Tensor:
        b, _, n, _ = qs.shape
        if valid is None:
            fm_ = fit_map(fm, qs, ks) if fit else fm
            return self._hybrid_full(qs, ks, v_, fm_, sequence_sinks(self.sinks, n))
        out = qs.new_zeros(b, qs.shape[1], n, v_.shape[-1], dtype=torch.promote_types(qs.dtype, v_.dtype))
        for i in range(b):
            idx = valid[i].nonzero().squeeze(-1)
            if idx.numel() == 0:
                continue
            qi, ki, vi = qs[i][:, idx], ks[i][:, idx], v_[i][:, idx]
            fm_i = fit_map(fm, qi, ki) if fit else fm
            if idx.numel() < n:  # padded queries: every valid key, feature map alone
                out[i] = self.linear(qs[i], ki, vi, fm_i, False).to(out.dtype)
            out[i][:, idx] = self._hybrid_full(qi, ki, vi, fm_i, sequence_sinks(self.sinks, idx.numel())).to(out.dtype)
        return out
