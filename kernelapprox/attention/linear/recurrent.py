"""Linear attention as an RNN: one token per step, O(F d_v) per step whatever the position."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ... import backends
from ..._validation import (
    broadcast_batch,
    broadcast_shapes,
    check_bool,
    check_floating,
    compute_dtype,
    inputs_validated,
    no_autocast,
)
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
from .fla import fla_decode_step, fla_mode

if TYPE_CHECKING:
    from .graphed import CapturedStep


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
    inplace : bool, default False
        Write each step's state into the tensors of the state this decoder made at the step
        before (``copy_``), instead of new tensors: the state's storage then stays put from the
        second step on, as a captured CUDA graph needs (`capture`). A state passed in (``state``,
        or assigned to ``.state``) is never written; a state that records autograd is replaced,
        not overwritten.

    Notes
    -----
    Where the step runs is `kernelapprox.backends.decode_plan`'s choice: the torch step on the
    CPU and wherever fla is absent, flash-linear-attention's fused recurrent kernels on CUDA
    (`kernelapprox.attention.linear.fla.fla_decode_step`). On accelerators neither reads a
    device value on the host (on the CPU a signed map's step reads one, for its warning), and ``torch.compile(rnn.step, fullgraph=True)`` traces the torch step. `capture`
    replays a step from a CUDA graph (``docs/gpu.md``).

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
        inplace: bool = False,
    ) -> None:
        check_feature_map(feature_map)
        if state is not None and not isinstance(state, LinearAttentionState):
            raise TypeError(f"state must be a LinearAttentionState, got {type(state).__name__}")
        self.feature_map = feature_map
        self.state = state
        self.eps = check_eps(eps)
        self.inplace = check_bool("inplace", inplace)
        self.steps = 0
        self._owned: LinearAttentionState | None = None  # the state whose tensors ``inplace`` may write
        # signed maps: sum_j |psi(k_j)| at the state's scale (the keys' part of the magnitude bound
        # of `signed_lost`), with the state object it belongs to
        self._zabs: tuple[LinearAttentionState, torch.Tensor] | None = None

    def reset(self) -> None:
        """Forget the state."""
        self.state = self._owned = None
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
                        tuple(broadcast_shapes(q_t.shape[:-1], k_t.shape[:-1], v_t.shape[:-1])))
        out_dtype = torch.promote_types(torch.promote_types(q_t.dtype, k_t.dtype), v_t.dtype)
        cdt = compute_dtype(out_dtype, fm.param_dtype)
        q, k, v = q_t.to(cdt).unsqueeze(-2), k_t.to(cdt).unsqueeze(-2), v_t.to(cdt).unsqueeze(-2)
        k, v = apply_padding(pad, k, v)
        mode = fla_mode(fm)
        if backends.decode_plan(q_t.device, cdt, mode=mode).path == "fla":
            with inputs_validated():
                out, state = fla_decode_step(q, k, v, fm, state=self.state, key_padding_mask=pad, eps=self.eps)
            self._commit(state.kv, state.log_scale)
            return out.squeeze(-2).to(out_dtype)
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
        self._commit(kv, g.expand(*kv.shape[:-2], 1, 1))
        raw = torch.matmul(fq, kv)
        lost = None
        if zabs is not None and self.state is not None:  # `_commit` has set the state
            self._zabs = (self.state, zabs)
            with torch.no_grad():
                lost = signed_lost(raw[..., -1:], torch.matmul(fq.detach().abs(), zabs),
                                   (zabs > 0).any(dim=-2, keepdim=True))
        out = normalise(*split(raw), fm.positive, self.eps, lost, host=lost is None or host_reads(kv.device))
        return out.squeeze(-2).to(out_dtype)

    def capture(
        self, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, *, warmup: int = 2, compile: bool = False,
    ) -> CapturedStep:
        r"""Record one step in a CUDA graph and return it as a callable: ``capture(q, k, v)(q_t,
        k_t, v_t)`` is ``step(q_t, k_t, v_t)`` replayed (`kernelapprox.attention.linear.graphed`).

        Sets ``inplace``; the state is left as it was. ``q_t, k_t, v_t`` (CUDA) give the shapes
        to replay; ``warmup`` steps run first; ``compile`` captures ``torch.compile(self.step)``.
        See `kernelapprox.attention.linear.graphed.capture_step`.

        Returns
        -------
        CapturedStep

        Examples
        --------
        Runs on a CUDA device (``docs/gpu.md``); on a CPU tensor it says so:

        >>> import kernelapprox as ka
        >>> rnn = ka.RecurrentLinearAttention(ka.PositiveRF(8, 16, seed=0))
        >>> q, k, v = torch.randn(3, 2, 8).unbind(0)
        >>> _ = rnn.step(q, k, v)
        >>> rnn.capture(q, k, v)
        Traceback (most recent call last):
        ...
        ValueError: q_t must be a CUDA tensor to capture a CUDA graph, got cpu
        """
        from .graphed import capture_step

        return capture_step(self, q_t, k_t, v_t, warmup=warmup, compile=compile)

    def _commit(self, kv: torch.Tensor, log_scale: torch.Tensor) -> None:
        """Keep the step's state: under ``inplace`` written into the tensors of the state this
        decoder made at its previous step (never a state it was given) where shapes and dtypes
        match and nothing records autograd, else as new tensors; count the step."""
        old = self.state
        self.steps += 1
        if self.inplace and not kv.requires_grad:
            if (old is not None and old is self._owned and old.kv.shape == kv.shape and old.kv.dtype == kv.dtype
                    and old.log_scale.shape == log_scale.shape and old.log_scale.dtype == log_scale.dtype
                    and not old.kv.requires_grad):
                old.kv.copy_(kv)
                old.log_scale.copy_(log_scale)
                return
            # the first step: tensors of the step's own layout, with storage of their own
            self.state = self._owned = LinearAttentionState(kv.contiguous(), log_scale.contiguous())
            return
        self.state = LinearAttentionState(kv, log_scale)

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
        st = feature_state(kv, Xn)
        self._commit(st.kv, st.log_scale)
        out = torch.matmul(torch.exp2(b - s), kv)
        return normalise(*split(out), True, self.eps)
