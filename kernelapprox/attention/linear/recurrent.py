"""Linear attention as an RNN: one token per step, O(F d_v) per step whatever the position."""

from __future__ import annotations

import torch

from ..._validation import broadcast_batch, check_floating, compute_dtype, inputs_validated, no_autocast
from ...maps.base import FeatureMap
from .._common import (
    apply_padding,
    check_eps,
    check_feature_map,
    check_state,
    feature_state,
    has_log2_features,
    host_reads,
    log2_state,
    normalise,
    padding_mask,
    signed_lost,
    split,
    state_abs_mass,
    with_ones,
)
from ..state import LinearAttentionState


class RecurrentLinearAttention:
    r"""Token-by-token causal linear attention (decoding).

    $$
    S_t = S_{t-1} + \varphi(k_t) v_t^\top,\quad z_t = z_{t-1} + \varphi(k_t),\quad
    o_t = \frac{S_t^\top \varphi(q_t)}{z_t^\top \varphi(q_t)}.
    $$

    The state has a fixed size $F \times (d_v + 1)$, so a step costs $O(F d_v)$
    independently of ``t`` (no KV cache). The state is kept stabilised
    (`LinearAttentionState`): a key whose feature scale exceeds the state's rescales it.

    Parameters
    ----------
    feature_map : FeatureMap
        The same map used for queries and keys.
    state : LinearAttentionState, optional
        Initial state, e.g. from ``linear_attention(..., causal=True, return_state=True)`` on a prompt.
    eps : float, default 1e-6
        Denominator guard for signed feature maps (see `kernelapprox.linear_attention`). For a
        signed map the step also carries $\sum_j|\psi(k_j)|$ (per feature, beside the state) and
        reports a lost row (`kernelapprox.attention._common.signed_lost`): a warning on the CPU,
        NaN on accelerators. A state handed in (``state=``) enters that bound with the absolute
        value of its summed features (the norms of its keys are not stored).

    Examples
    --------
    >>> import kernelapprox as ka
    >>> fm = ka.PositiveRF(dim=8, num_features=32, seed=0)
    >>> rnn = ka.RecurrentLinearAttention(fm)
    >>> q, k, v = torch.randn(3, 2, 8).unbind(0)  # one token, batch of 2
    >>> rnn.step(q, k, v).shape
    torch.Size([2, 8])
    """

    def __init__(
        self,
        feature_map: FeatureMap,
        *,
        state: LinearAttentionState | None = None,
        eps: float = 1e-6,
    ) -> None:
        check_feature_map(feature_map)
        if state is not None and not isinstance(state, LinearAttentionState):
            raise TypeError(f"state must be a LinearAttentionState, got {type(state).__name__}")
        self.feature_map = feature_map
        self.state = state
        self.eps = check_eps(eps)
        self.steps = 0
        # signed maps: sum_j |psi(k_j)| at the state's scale (the keys' part of the magnitude bound
        # of `signed_lost`), with the state object it belongs to
        self._zabs: tuple[LinearAttentionState, torch.Tensor] | None = None

    def reset(self) -> None:
        """Forget the state."""
        self.state = None
        self.steps = 0
        self._zabs = None

    @no_autocast
    def step(
        self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, *,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        r"""Consume one token and return its output.

        Parameters
        ----------
        q_t, k_t : Tensor, shape (..., d)
        v_t : Tensor, shape (..., dv)
        key_padding_mask : Tensor, optional
            Bool, shape broadcasting with ``k_t.shape[:-1]``, ``True`` where this token is
            padding: its key and value leave the state unchanged (log-scale $-\infty$, weight 0;
            the state's scale ignores it), and its query still reads the state (0 while nothing
            valid has been seen). A float 0/-inf mask is read as in `kernelapprox.linear_attention`.

        Returns
        -------
        Tensor, shape (..., dv), dtype ``promote(q_t, k_t, v_t)`` (computed in
        ``promote(q_t, k_t, v_t, feature map)``, at least float32).
        """
        for name, t in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
            check_floating(name, t)
            if t.dim() < 1:
                raise ValueError(f"{name} must have shape (..., features), got a scalar")
        fm = self.feature_map
        d = fm.dim
        if q_t.shape[-1] != d or k_t.shape[-1] != d:
            raise ValueError(
                f"q_t and k_t must have last dimension dim={d}, got {tuple(q_t.shape)} and {tuple(k_t.shape)}"
            )
        for name, t in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
            broadcast_batch(name, t.shape[:-1], fm.batch_shape)
        pad = None
        if key_padding_mask is not None:
            kpm = key_padding_mask
            if isinstance(kpm, torch.Tensor):  # one token: one entry per row of the batch
                if kpm.dim() > k_t.dim() - 1 or kpm.dim() == 0:
                    raise ValueError(
                        f"key_padding_mask has shape {tuple(kpm.shape)}; step expects one entry per token: "
                        f"a shape broadcasting with k_t.shape[:-1] = {tuple(k_t.shape[:-1])}"
                    )
                kpm = kpm.unsqueeze(-1)
            try:
                pad = padding_mask(kpm, torch.Size((*k_t.shape[:-1], 1, d)))
            except ValueError:
                raise ValueError(
                    f"key_padding_mask has shape {tuple(key_padding_mask.shape)}; step expects one entry per "
                    f"token: a shape broadcasting with k_t.shape[:-1] = {tuple(k_t.shape[:-1])}"
                ) from None
        if self.state is not None:
            check_state(self.state, fm.feature_dim, v_t.shape[-1], "state",
                        tuple(torch.broadcast_shapes(q_t.shape[:-1], k_t.shape[:-1], v_t.shape[:-1])))
        out_dtype = torch.promote_types(torch.promote_types(q_t.dtype, k_t.dtype), v_t.dtype)
        cdt = compute_dtype(out_dtype, fm.param_dtype)
        q, k, v = q_t.to(cdt).unsqueeze(-2), k_t.to(cdt).unsqueeze(-2), v_t.to(cdt).unsqueeze(-2)
        k, v = apply_padding(pad, k, v)
        if fm.positive and has_log2_features(fm):
            with inputs_validated():
                lk = fm.key_log2_features(k)
                lq = fm.query_log2_features(q)
            if lk is not None and lq is not None:
                return self._gated_step(lq, lk, v, pad).squeeze(-2).to(out_dtype)
        with inputs_validated():
            fk, gk = fm.key_log_features(k, shared=True)  # (..., 1, F), (..., 1)
            fq = fm.query_features(q)
        gk = gk.unsqueeze(-1)  # (..., 1, 1)
        v1 = with_ones(v)
        if pad is not None:  # a padded token: weight 0 and no part in the state's scale
            gk = gk.masked_fill(pad.unsqueeze(-1), float("-inf"))
            v1 = v1.masked_fill(pad.unsqueeze(-1), 0.0)
        upd = torch.matmul(fk.mT, v1)  # (..., F, dv + 1)
        if self.state is None:
            g = gk.detach()
            g = torch.where(g == float("-inf"), torch.zeros_like(g), g)  # nothing valid yet: any scale
            kv = upd * torch.exp(gk - g).to(cdt) if pad is not None else upd
        else:
            old = self.state
            old_ls = old.log_scale.to(gk.dtype)
            g = torch.maximum(old_ls, gk).detach()
            kv = old.kv.to(cdt) * torch.exp(old_ls - g).to(cdt) + upd * torch.exp(gk - g).to(cdt)
        zabs = None
        if not fm.positive:
            # sum_j |psi(k_j)| carried beside the state, per feature (a state given from
            # elsewhere enters with its |z|, `state_abs_mass`)
            with torch.no_grad():
                zabs = torch.matmul(fk.detach().abs().mT, torch.exp(gk.detach() - g.detach()).to(cdt))
                if self.state is not None:
                    old_z = (self._zabs[1] if self._zabs is not None and self._zabs[0] is self.state
                             else state_abs_mass(self.state, v_t.shape[-1]))
                    zabs = zabs + old_z.to(cdt) * torch.exp(self.state.log_scale.detach() - g.detach()).to(cdt)
        self.state = LinearAttentionState(kv, g.expand(*kv.shape[:-2], 1, 1))
        self.steps += 1
        raw = torch.matmul(fq, kv)
        lost = None
        if zabs is not None:
            self._zabs = (self.state, zabs)
            with torch.no_grad():
                lost = signed_lost(raw[..., -1:], torch.matmul(fq.detach().abs(), zabs),
                                   (zabs > 0).any(dim=-2, keepdim=True))
        out = normalise(*split(raw), fm.positive, self.eps, lost, host=lost is None or host_reads(kv.device))
        return out.squeeze(-2).to(out_dtype)

    def _gated_step(
        self, lq: torch.Tensor, lk: torch.Tensor, v: torch.Tensor, pad: torch.Tensor | None
    ) -> torch.Tensor:
        r"""One step of the per-feature gated recurrence (positive maps with log2 features).

        With $X_f$ the running maximum of feature $f$'s key log2-features (the state's
        per-feature scale) and $a_f$ this key's: $X'_f = \max(X_f, a_f)$, the state decays by
        $2^{X_f - X'_f} \le 1$ and the key enters as $2^{a_f - X'_f}$; the query reads it with
        $2^{b_f + X'_f - M}$, $M = \max_f(b_f + X'_f)$. Every factor is in $[0, 1]$ and one
        term of the denominator is 1: no row underflows, however peaked the features (see
        `kernelapprox.attention.linear.naive_gated.naive_gated_linear_attention`). The state is
        stored with a per-feature ``log_scale`` (..., F, 1).
        """
        ninf = float("-inf")
        dv = v.shape[-1]
        if pad is not None:
            lk = lk.masked_fill(pad.unsqueeze(-1), ninf)
        v1 = with_ones(v)
        if pad is not None:
            v1 = v1.masked_fill(pad.unsqueeze(-1), 0.0)
        a = lk.squeeze(-2)  # (..., F)
        if self.state is None:
            X = torch.full_like(a, ninf)
            kv_old = None
        else:
            kv_old, X = log2_state(self.state, dv, v1.dtype)
        with torch.no_grad():
            Xn = torch.maximum(X, a)
            ref = torch.where(Xn == ninf, torch.zeros_like(Xn), Xn)
        kv = torch.matmul(torch.exp2(lk - ref.unsqueeze(-2)).mT, v1)  # (..., F, dv + 1)
        if kv_old is not None:
            with torch.no_grad():
                gate = torch.where(X == ninf, torch.zeros_like(X), torch.exp2(X - ref))
            kv = kv + gate.unsqueeze(-1) * kv_old
        b = lq + Xn.unsqueeze(-2)
        with torch.no_grad():
            s = b.amax(dim=-1, keepdim=True)
            s = torch.where(s == ninf, torch.zeros_like(s), s)
        self.state = feature_state(kv, Xn)
        self.steps += 1
        out = torch.matmul(torch.exp2(b - s), kv)
        return normalise(*split(out), True, self.eps)
