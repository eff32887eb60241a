"""The recurrent state of linear attention, kept in a stabilised (scaled) form."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._validation import check_tensor_fields

__all__ = ["LinearAttentionState"]


@dataclass
class LinearAttentionState:
    r"""State $(S, z)$ of causal linear attention after ``t`` tokens.

    $$
    S_t = \sum_{j\le t} \varphi(k_j) v_j^\top \in \mathbb R^{F\times d_v},\qquad
    z_t = \sum_{j\le t} \varphi(k_j) \in \mathbb R^{F}.
    $$

    Stored stabilised as ``kv = [S | z] * exp(-log_scale)`` so that exponential feature scales never
    overflow; `S` and `z` return the true values (which may overflow for huge norms,
    the stored form does not).

    Attributes
    ----------
    kv : Tensor, shape (..., F, dv + 1)
        ``[S | z]`` divided by ``exp(log_scale)``.
    log_scale : Tensor, shape (..., 1, 1) or (..., F, 1)
        Shared log scale (float64 for the random maps), or one per feature: the state of the
        per-feature gated forms (positive maps with log2 features: `RecurrentLinearAttention`
        and the state returned by the causal and parallel forms), where each feature keeps its
        own running maximum so that none underflows beside a larger one.

    Examples
    --------
    A long sequence in two segments, the state carried between them:

    >>> import torch, kernelapprox as ka
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (0.5 * torch.randn(3, 2, 10, 8, generator=g)).unbind(0)
    >>> fm = ka.PositiveRF(8, 16, seed=0)
    >>> out, st = ka.linear_attention(q, k, v, fm, causal=True, return_state=True)
    >>> st.kv.shape, st.S.shape, st.z.shape, (st.feature_dim, st.value_dim)
    (torch.Size([2, 16, 9]), torch.Size([2, 16, 8]), torch.Size([2, 16]), (16, 8))
    >>> torch.allclose(st.z, fm.key_features(k).sum(-2), atol=1e-5)
    True
    >>> o1, s1 = ka.linear_attention(q[:, :6], k[:, :6], v[:, :6], fm, causal=True, return_state=True)
    >>> o2 = ka.linear_attention(q[:, 6:], k[:, 6:], v[:, 6:], fm, causal=True, initial_state=s1)
    >>> torch.allclose(torch.cat([o1, o2], dim=1), out, atol=1e-6)
    True
    """

    kv: torch.Tensor
    log_scale: torch.Tensor

    def __post_init__(self) -> None:
        check_tensor_fields(self, "kv", "log_scale")

    @property
    def S(self) -> torch.Tensor:
        """$S$, shape (..., F, dv)."""
        return self.kv[..., :-1] * torch.exp(self.log_scale).to(self.kv.dtype)

    @property
    def z(self) -> torch.Tensor:
        """$z$, shape (..., F)."""
        return (self.kv[..., -1:] * torch.exp(self.log_scale).to(self.kv.dtype)).squeeze(-1)

    @property
    def feature_dim(self) -> int:
        """``F``, the feature dimension of the map that built the state."""
        return int(self.kv.shape[-2])

    @property
    def value_dim(self) -> int:
        """``dv``, the value dimension."""
        return int(self.kv.shape[-1]) - 1

    def detach(self) -> LinearAttentionState:
        """The same state, detached from autograd (e.g. between segments of truncated BPTT)."""
        return LinearAttentionState(self.kv.detach(), self.log_scale.detach())

    def to(self, *args, **kwargs) -> LinearAttentionState:
        """Move/cast ``kv`` like `torch.Tensor.to`; ``log_scale`` keeps its dtype (float64
        for random maps: rounding a log scale of ~50 to 16 bits would be a visible error) and
        only follows a device move."""
        kv = self.kv.to(*args, **kwargs)
        return LinearAttentionState(kv, self.log_scale.to(device=kv.device))


# A checkpoint holding a state loads with ``torch.load(..., weights_only=True)``: the class is
# allow-listed for the restricted unpickler (it holds two tensors and nothing else).
torch.serialization.add_safe_globals([LinearAttentionState])
