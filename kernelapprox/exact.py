r"""Exact references: the softmax kernel $\exp(q^\top k)$ and softmax attention.

These are the ground truth for every error measurement in the library. Both compute in at least
float32 (float64 inputs stay float64) and return the input dtype. Softmax attention is chunked
over queries and log-sum-exp stabilised, so memory is $O(\text{chunk}\cdot m)$ per head
instead of $O(nm)$.
"""

from __future__ import annotations

import torch

from ._validation import (
    broadcast_shapes,
    check_bool,
    check_floating,
    check_last_dim,
    compute_dtype,
    no_autocast,
)

__all__ = ["softmax_kernel", "softmax_attention", "check_qkv"]


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None, *, causal: bool = False) -> None:
    """Validate attention inputs: q (..., n, d), k (..., m, d), v (..., m, dv), broadcastable leading dims."""
    check_bool("causal", causal)
    check_floating("q", q)
    check_floating("k", k)
    if v is not None:
        check_floating("v", v)
    for name, t in (("q", q), ("k", k)) + ((("v", v),) if v is not None else ()):
        check_last_dim(name, t, t.shape[-1] if t.dim() else 0)
        if t.device != q.device:
            raise ValueError(f"q, k and v must be on one device, got q on {q.device} and {name} on {t.device}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same last dimension d, got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if v is not None and v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"k and v must have the same sequence length (dim -2), got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"causal attention needs as many queries as keys, got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    shapes = [q.shape[:-2], k.shape[:-2]] + ([v.shape[:-2]] if v is not None else [])
    try:
        broadcast_shapes(*shapes)
    except RuntimeError:
        raise ValueError(
            "leading (batch) dimensions of q, k" + (", v" if v is not None else "")
            + f" do not broadcast: {[tuple(s) for s in shapes]}"
        ) from None


def padding_mask(
    mask: object, k_shape: torch.Size, lead: torch.Size | None = None, name: str = "key_padding_mask"
) -> torch.Tensor | None:
    r"""A key padding mask as a bool tensor ``True`` = padded, with ``len(k_shape) - 1`` dimensions.

    Accepted (the conventions of `torch.nn.MultiheadAttention`): ``None``; a bool tensor,
    ``True`` where the key is padding (ignored); or a float tensor added to the scores, holding
    ``0`` (kept) and ``-inf`` (padded) only. Shape ``(B, m)`` with ``B = k.shape[0]`` (the
    leading dimensions between the batch and the keys, e.g. the heads, are broadcast), or any
    shape broadcasting with ``k.shape[:-1]``. An integer tensor (a Hugging Face
    ``attention_mask``, ``1`` = token) is refused: its polarity is the opposite, pass
    ``attention_mask == 0``.

    A float mask with other values would be a per-key bias $b_j$; linear attention could fold
    $e^{b_j}$ into the keys' weights, but the additive attention masks met in practice are 0/-inf,
    and anything else is more likely a wrong mask: refused.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a bool torch.Tensor (True = padded) or None, got {type(mask).__name__}")
    if mask.dtype.is_floating_point:
        if not torch.compiler.is_compiling():
            ok = (mask == 0) | (mask == float("-inf"))
            if not bool(ok.all()):
                raise ValueError(
                    f"{name} is a float mask of shape {tuple(mask.shape)} with values other than 0 and -inf: "
                    "an additive key padding mask holds 0 (kept) and -inf (padded) only; pass a bool mask "
                    "(True = padded)"
                )
        mask = mask == float("-inf")
    elif mask.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a bool tensor (True = padded key, as in torch.nn.MultiheadAttention) or a float "
            f"0/-inf mask, got dtype {mask.dtype}; for a Hugging Face attention_mask (1 = token) pass "
            "attention_mask == 0"
        )
    given = tuple(mask.shape)
    nk = len(k_shape) - 1  # dimensions of k.shape[:-1]
    m = k_shape[-2]
    want = f"(batch, m) or a shape broadcasting with k.shape[:-1] = {tuple(k_shape[:-1])}, m = {m} keys"
    if mask.dim() == 0 or mask.shape[-1] != m or mask.dim() > max(nk, 2):
        raise ValueError(f"{name} has shape {tuple(mask.shape)}; expected {want}")
    if mask.dim() == 2 and nk > 2:  # (B, m): broadcast over the heads (and any dims before the keys)
        mask = mask.reshape(mask.shape[0], *([1] * (nk - 2)), m)
    try:
        broadcast_shapes(mask.shape, tuple(k_shape[:-1]), *(() if lead is None else (tuple(lead),)))
    except RuntimeError:
        extra = "" if lead is None else f", and the batch shape {tuple(lead)} of q, k, v"
        raise ValueError(f"{name} has shape {given}; expected {want}{extra}") from None
    return mask


@no_autocast
def softmax_kernel(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    r"""The softmax kernel matrix $K = \exp(q k^\top)$.

    Parameters
    ----------
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)

    Returns
    -------
    Tensor, shape (..., n, m), dtype ``promote(q.dtype, k.dtype)``. The dot products are
    accumulated in float64 (a float32 rounding of $q^\top k \approx 100$ would already be a
    relative error of ~1e-5 in the kernel); entries overflow only where $e^{q^\top k}$ is not
    representable in the output dtype.

    Notes
    -----
    For attention, pass $q d^{-1/4}$ and $k d^{-1/4}$ so that
    $K = \exp(qk^\top/\sqrt d)$ (the Performer convention); nothing is rescaled here.

    Examples
    --------
    >>> softmax_kernel(torch.zeros(2, 3), torch.zeros(4, 3))
    tensor([[1., 1., 1., 1.],
            [1., 1., 1., 1.]])
    """
    check_qkv(q, k)
    out = torch.promote_types(q.dtype, k.dtype)
    return torch.exp(torch.matmul(q.double(), k.double().mT)).to(out)


@no_autocast
def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    *,
    chunk_size: int = 1024,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Exact softmax attention with the unscaled kernel $\exp(q^\top k)$.

    $$
    o_i = \frac{\sum_{j \in J_i} e^{q_i^\top k_j} v_j}{\sum_{j \in J_i} e^{q_i^\top k_j}},
    \qquad J_i = \{j \text{ not padded}\}\ (\cap\ \{j \le i\} \text{ if causal}).
    $$

    Chunked over queries (``chunk_size`` queries at a time) with a max-subtracted softmax, so peak
    memory is $O(\text{chunk\_size}\cdot m)$ per head and no $n\times m$ matrix is held
    (in inference; under autograd every chunk's softmax is saved for backward, $O(nm)$ in all).

    Parameters
    ----------
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)
    v : Tensor, shape (..., m, dv)
    causal : bool, default False
        Mask keys ``j > i`` (needs ``n == m``).
    chunk_size : int, default 1024
        Queries per chunk.
    key_padding_mask : Tensor, optional
        Keys to ignore, as in `kernelapprox.linear_attention` (the reference of its masked
        forms): bool ``True`` = padded, or float 0/-inf; shape (batch, m) or broadcasting with
        ``k.shape[:-1]``. A row without any allowed key gives 0 (SDPA gives NaN there).

    Returns
    -------
    Tensor, shape (..., n, dv), dtype ``promote(q, k, v)``.

    Examples
    --------
    >>> q = k = v = torch.randn(1, 8, 4)
    >>> softmax_attention(q, k, v, causal=True).shape
    torch.Size([1, 8, 4])
    """
    check_qkv(q, k, v, causal=causal)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    out_dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    pad = padding_mask(key_padding_mask, k.shape)
    cdt = compute_dtype(out_dtype)
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    n, m = q.shape[-2], k.shape[-2]
    outs = []
    for s in range(0, n, chunk_size):
        e = min(n, s + chunk_size)
        scores = torch.matmul(q[..., s:e, :], k.mT)
        blocked = None if pad is None else pad.unsqueeze(-2)  # (..., 1, m)
        if causal:
            i = torch.arange(s, e, device=q.device).unsqueeze(-1)
            j = torch.arange(m, device=q.device)
            blocked = j > i if blocked is None else blocked | (j > i)
        if blocked is None:
            outs.append(torch.matmul(torch.softmax(scores, dim=-1), v))
            continue
        scores = scores.masked_fill(blocked, float("-inf"))
        empty = blocked.all(dim=-1, keepdim=True)  # rows without any allowed key: 0, not NaN
        p = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
        outs.append(torch.matmul(p, v))
    return torch.cat(outs, dim=-2).to(out_dtype)
