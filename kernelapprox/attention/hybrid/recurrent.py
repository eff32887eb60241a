r"""Hybrid attention as an RNN: one token per step, $O(w(d + d_v) + F d_v)$ per step whatever the position.

The state (`kernelapprox.attention.hybrid.HybridAttentionState`) is a ring buffer of the last
$w$ keys and values, the $F \times (d_v + 1)$ linear state of the keys that have left the
window (at one scale per feature for positive maps), and the sinks: a key leaving the window is
folded into the linear state (unless it is a sink, which stays exact).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..._validation import (
    broadcast_batch,
    broadcast_shapes,
    check_floating,
    compute_dtype,
    inputs_validated,
    no_autocast,
)
from ...maps.base import FeatureMap
from .._common import check_feature_map, normalise, with_ones
from . import core as _core
from .core import (
    HybridAttentionState,
    check_hybrid_eps,
    check_hybrid_state,
    check_window,
    exp_diff,
    per_feature_scales,
    shared_scale,
    state_batch,
)
from .logfeatures import key_log_features, query_log_features
from .rescue import lost_rows_to_nan, warn_signed_rows
from .sinks import CausalSinks

__all__ = ["RecurrentHybridAttention"]

_NEG_INF = float("-inf")


class RecurrentHybridAttention:
    r"""Token-by-token causal hybrid attention (decoding).

    At position $t$, with the window $W_t = \{t - w < j \le t\}$, sinks $\Sigma$ and the
    linear state $[S_t \mid z_t] = \sum_{j \le t - w,\, j\notin\Sigma}\varphi(k_j)[v_j, 1]^\top$,

    $$
    o_t = \frac{\sum_{j\in W_t\cup\Sigma_{\le t}} e^{q_t^\top k_j} v_j + S_t^\top\varphi(q_t)}
    {\sum_{j\in W_t\cup\Sigma_{\le t}} e^{q_t^\top k_j} + z_t^\top\varphi(q_t)} ,
    $$

    the values of `kernelapprox.attention.hybrid.chunk_hybrid_attention` (same window and sinks).
    A step folds key $t - w$ into the linear state, then reads the
    buffer: $O(w(d + d_v) + F(d + d_v))$ work and a state of fixed size, no KV cache beyond the
    window [Kat20]_.

    Positive maps keep the linear state at one scale per feature, $\tilde S_f = e^{-X_f}\sum_j
    \psi_f(k_j)[v_j, 1]^\top$ with $X_f$ the largest $\log\psi_f(k_j)$ folded so far (a fold
    is the gated update $\tilde S_f \leftarrow e^{X_f - X'_f}\tilde S_f + e^{\log\psi_f(k) -
    X'_f}[v, 1]^\top$ [Yan24]_), and read it with one shift for the window, the sinks and
    $\max_f(\log\varphi_f(q_t) + X_f)$: at that feature the state holds a term 1, so the
    denominator is $\ge 1$ and no row underflows, whatever the norms (one scale for every feature
    lets a fitted map's rows underflow to 0 at large norms). A state with one scale (from a signed
    map or an older checkpoint) is brought to per-feature scales on the first step. Signed maps
    keep one scale and warn (`kernelapprox.KernelApproxWarning`) where the ``eps`` guard changes a
    row.

    Parameters
    ----------
    feature_map : FeatureMap
    window : int
        Window size ``w >= 0``.
    sinks : int or sequence of int, default 0
        Absolute positions of the sinks (a count: the leading positions).
    state : HybridAttentionState, optional
        Initial state, e.g. from ``chunk_hybrid_attention(..., return_state=True)`` on a prompt.
    eps : float, default 1e-6
        Denominator guard for signed maps.

    References
    ----------
    .. [Kat20] A. Katharopoulos, A. Vyas, N. Pappas, F. Fleuret. "Transformers are RNNs", ICML 2020.
    .. [Yan24] S. Yang, B. Wang, Y. Shen, R. Panda, Y. Kim. "Gated linear attention transformers
       with hardware-efficient training", ICML 2024.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> fm = ka.PositiveRF(dim=8, num_features=32, seed=0)
    >>> rnn = RecurrentHybridAttention(fm, window=4, sinks=1)
    >>> q, k, v = torch.randn(3, 2, 8).unbind(0)  # one token, batch of 2
    >>> rnn.step(q, k, v).shape
    torch.Size([2, 8])
    """

    def __init__(
        self,
        feature_map: FeatureMap,
        *,
        window: int,
        sinks: int | Sequence[int] = 0,
        state: HybridAttentionState | None = None,
        eps: float = 1e-6,
    ) -> None:
        check_feature_map(feature_map)
        self.feature_map = feature_map
        self.window = check_window(window)
        self.sinks = CausalSinks(sinks)
        if state is not None:
            check_hybrid_state(state, feature_map, self.window, state.keys.shape[-1], state.values.shape[-1],
                               self.sinks, name="state")
        self.state = state
        self.eps = check_hybrid_eps(eps)

    def reset(self) -> None:
        """Forget the state."""
        self.state = None

    def _empty(self, lead: torch.Size, d: int, dv: int, dtype: torch.dtype, device: torch.device) -> HybridAttentionState:
        Fd, w = self.feature_map.feature_dim, self.window
        z = torch.zeros((), dtype=dtype, device=device)
        scales = Fd if self.feature_map.positive else 1  # one scale per feature for positive maps
        # the ring buffer grows with the tokens seen, up to `window` slots
        return HybridAttentionState(
            z.expand(*lead, Fd, dv + 1).clone(),
            torch.full((*lead, scales, 1), _NEG_INF, dtype=torch.float64, device=device),
            z.expand(*lead, 0, d).clone(), z.expand(*lead, 0, dv).clone(),
            z.expand(*lead, 0, d).clone(), z.expand(*lead, 0, dv).clone(), (), 0, w,
        )

    def _fold(self, kv: torch.Tensor, old: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The linear state ``kv`` at the scale ``old`` (..., 1, 1) with key ``k`` (..., 1, d) and
        value ``v`` (..., 1, dv) added (signed maps: one scale)."""
        with inputs_validated():
            fk, gk = self.feature_map.key_log_features(k, shared=True)  # (..., 1, F), (..., 1)
        gk = gk.double().unsqueeze(-1)  # (..., 1, 1)
        g = torch.maximum(old, gk).detach()
        cdt = fk.dtype
        kv = kv * exp_diff(old, g, cdt) + torch.matmul(fk.mT, with_ones(v)) * exp_diff(gk, g, cdt)
        return kv, g

    def _fold_per_feature(self, kv: torch.Tensor, X: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The linear state ``kv`` (..., F, dv + 1) at per-feature scales ``X`` (..., F) with key
        ``k`` (..., 1, d) and value ``v`` (..., 1, dv) added (positive maps): each feature at the
        larger of its scale and the key's $\log\psi_f(k)$, a gated update with gate
        $e^{X_f - X'_f} \le 1$ [Yan24]_."""
        lk = key_log_features(self.feature_map, k)  # (..., 1, F)
        X_new = torch.maximum(X, lk.detach().double().squeeze(-2))
        ref = torch.where(X_new == _NEG_INF, torch.zeros_like(X_new), X_new)
        cdt = kv.dtype
        add = exp_diff(lk.mT, ref.unsqueeze(-1), cdt) * with_ones(v).to(cdt)  # (..., F, dv + 1)
        return kv * exp_diff(X, ref, cdt).unsqueeze(-1) + add, X_new

    @no_autocast
    def step(self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor) -> torch.Tensor:
        """Consume one token and return its output.

        Parameters
        ----------
        q_t, k_t : Tensor, shape (..., d)
        v_t : Tensor, shape (..., dv)

        Returns
        -------
        Tensor, shape (..., dv), dtype ``promote(q_t, k_t, v_t)`` (computed in at least float32).
        """
        for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
            check_floating(name, x)
            if x.dim() < 1:
                raise ValueError(f"{name} must have shape (..., features), got a scalar")
        fm = self.feature_map
        d, w = fm.dim, self.window
        if q_t.shape[-1] != d or k_t.shape[-1] != d:
            raise ValueError(
                f"q_t and k_t must have last dimension dim={d}, got {tuple(q_t.shape)} and {tuple(k_t.shape)}"
            )
        for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
            broadcast_batch(name, x.shape[:-1], fm.batch_shape)
        dv = v_t.shape[-1]
        out_dtype = torch.promote_types(torch.promote_types(q_t.dtype, k_t.dtype), v_t.dtype)
        cdt = compute_dtype(out_dtype, fm.param_dtype)
        q, k, v = q_t.to(cdt).unsqueeze(-2), k_t.to(cdt).unsqueeze(-2), v_t.to(cdt).unsqueeze(-2)
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], fm.batch_shape)
        st = self.state
        if st is None:
            st = self._empty(lead, d, dv, cdt, q.device)
        else:
            if st.values.shape[-1] != dv:
                raise ValueError(
                    f"v_t has width {dv}, but the state holds values of width {st.values.shape[-1]} (from the previous "
                    "steps): the value width cannot change between steps (reset() to start a new sequence)"
                )
            check_hybrid_state(st, fm, w, d, dv, name="state")
            try:
                state_batch(st, lead, name="state")
            except ValueError:
                raise ValueError(
                    f"q_t, k_t, v_t have batch shape {tuple(lead)}, but the state holds a batch of shape "
                    f"{tuple(st.kv.shape[:-2])} (from the previous steps): the batch cannot change between steps "
                    "(reset() to start a new sequence)"
                ) from None
        t = st.position
        positive = fm.positive
        if positive and st.log_scale.shape[-2] == st.kv.shape[-2]:  # one scale per feature, as kept here
            kv = st.kv.to(cdt)
            with torch.no_grad():  # a feature no key reached: -inf, whatever the stored value
                X = torch.where(st.kv[..., -1] > 0, st.log_scale[..., 0].double(), _NEG_INF)
        elif positive:  # a state with one scale: brought to one per feature
            kv, X = per_feature_scales(st, cdt)
        else:
            kv, g = shared_scale(st)
            kv = kv.to(cdt)
        keys, vals = st.keys.to(cdt), st.values.to(cdt)
        if keys.shape[-2] > min(w, t):  # a buffer of `window` slots before it filled: its used slots
            keys, vals = keys[..., :t, :], vals[..., :t, :]
        sk, sv, spos = st.sink_keys.to(cdt), st.sink_values.to(cdt), st.sink_positions
        # 1. the key leaving the window joins the linear state (the current key if w = 0)
        leaving = None
        if w == 0:
            if t not in self.sinks:
                leaving = (k, v)
        elif t >= w and (t - w) not in self.sinks:
            slot = t % w
            leaving = (keys[..., slot:slot + 1, :], vals[..., slot:slot + 1, :])
        if leaving is not None:
            if positive:
                kv, X = self._fold_per_feature(kv, X, *leaving)
            else:
                kv, g = self._fold(kv, g, *leaving)
        # 2. sinks are kept; the ring buffer takes the new key
        if t in self.sinks:
            sk = torch.cat((sk.expand(*lead, *sk.shape[-2:]), k.expand(*lead, 1, d)), dim=-2)
            sv = torch.cat((sv.expand(*lead, *sv.shape[-2:]), v.expand(*lead, 1, dv)), dim=-2)
            spos = (*spos, t)
        if w and t < w:  # the buffer grows until it holds `window` keys
            keys = torch.cat((keys.expand(*lead, t, d), k.expand(*lead, 1, d)), dim=-2)
            vals = torch.cat((vals.expand(*lead, t, dv), v.expand(*lead, 1, dv)), dim=-2)
        elif w:
            slot = t % w
            keys = keys.expand(*lead, w, d).clone()
            vals = vals.expand(*lead, w, dv).clone()
            keys[..., slot, :] = k.expand(*lead, 1, d)[..., 0, :]
            vals[..., slot, :] = v.expand(*lead, 1, dv)[..., 0, :]
        self.state = HybridAttentionState(kv, X.unsqueeze(-1) if positive else g, keys, vals, sk, sv, spos, t + 1, w)
        # 3. the output: one shift for the exact terms and the linear state
        if positive:  # per feature: a = log phi_f(q) + X_f, the state's part sum_f e^{a_f - m} kv_f
            a = query_log_features(fm, q).double() + X.unsqueeze(-2)  # (..., 1, F), -inf where unreached
            shifts = [a.detach().amax(-1, keepdim=True)]  # (..., 1, 1)
        else:
            with inputs_validated():
                fq, sq = fm.log_features(q)  # (..., 1, F), (..., 1)
            shifts = [(sq.double().unsqueeze(-1) + g).detach()]  # (..., 1, 1)
        parts_k, parts_v, parts_m = [], [], []
        if w:  # every slot of the buffer is filled
            parts_k.append(keys)
            parts_v.append(vals)
            parts_m.append(torch.ones(keys.shape[-2], dtype=torch.bool, device=q.device))
        active = [u for u, p in enumerate(spos) if p <= t - w]
        if active and w:
            parts_k.append(sk[..., active, :])
            parts_v.append(sv[..., active, :])
            parts_m.append(torch.ones(len(active), dtype=torch.bool, device=q.device))
        if parts_k:
            ek = torch.cat(parts_k, dim=-2)
            ev = with_ones(torch.cat(parts_v, dim=-2))
            emask = torch.cat(parts_m)
            logits = torch.matmul(q, ek.mT).masked_fill(~emask, _NEG_INF)  # (..., 1, m)
            shifts.append(logits.detach().amax(-1, keepdim=True).double())
        elif spos and w == 0:  # w = 0: every sink seen so far is exact
            ek, ev = sk, with_ones(sv)
            logits = torch.matmul(q, ek.mT)
            shifts.append(logits.detach().amax(-1, keepdim=True).double())
            parts_k.append(ek)
        m = shifts[0]
        for s_ in shifts[1:]:
            m = torch.maximum(m, s_)
        if positive:
            out = torch.matmul(exp_diff(a, m, cdt), kv)
        else:
            base = sq.double().unsqueeze(-1) + g
            out = torch.matmul(fq, kv) * exp_diff(base, m, cdt)
        if parts_k:
            out = out + torch.matmul(torch.exp(logits - m.to(cdt)), ev)
        den = out[..., dv]
        out = normalise(out[..., :dv], out[..., dv:], fm.positive, self.eps)
        if not fm.positive:  # a positive map's state is per feature: its normaliser never underflows
            if _core._host_checks(q):
                warn_signed_rows(den, self.eps, fm, "decoding step")
            else:  # no host read: NaN, not a wrong row
                out = lost_rows_to_nan(out, den, fm, self.eps, causal=True)
        return out.squeeze(-2).to(out_dtype)
