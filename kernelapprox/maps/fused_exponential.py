r"""Fused feature maps in Triton: one kernel per map call for the random exponential and
trigonometric families (FAVOR+, hyperbolic, OPRF/FAVOR++, SADERF/SDERF, sin/cos, offset).

Every one of these maps is an affine exponent followed by a pointwise function,

$$
u = \alpha\, x W^\top + b_{\text{col}}, \qquad c = \gamma \tfrac12\|x\|^2 + c_0 + b_{\text{row}},
$$

with ``exp`` features $f = 2^{u - \max_j u_j}$, log-scale $\max_j u_j/\log_2 e + c$
(``alpha = log2(e)``); ``pm`` (hyperbolic) $[2^{u - m}, 2^{-u - m}]$, $m = \max_j |u_j|$;
``sincos`` $[\sin u, \cos u]$ and ``cos`` $\cos u$ with log-scale $c$. One program loads a block
of rows of ``x`` and the whole (r, d) projection, runs the GEMM with ``tl.dot`` (16-bit or float32
operands, float32 accumulation), adds the column bias, forms $\|x\|^2$ from the same tile,
takes the row maximum, and writes the features in the input's dtype with the float32 row
log-scale: the (n, r) exponent never leaves the chip. ``plain`` writes $\varphi(x) = f e^{c}$
instead (the maps' ``forward``).

The backward pass is the torch map's own (`torch.autograd.Function`: the torch path re-run under
autograd on the saved input), so gradients are those of the reference implementation. Fixed
block sizes by shape, no autotuning; Triton is imported when this module is, which
`kernelapprox.backends` does only when it chooses this path (CUDA, Triton installed,
``KERNELAPPROX_BACKEND`` not ``"torch"``). Under ``TRITON_INTERPRET=1`` the kernels run on CPU
tensors (float32 and float16; the interpreter's bfloat16 ``tl.dot`` is not exact).

Examples
--------
>>> import torch, kernelapprox as ka                                     # doctest: +SKIP
>>> from kernelapprox.maps import fused_exponential as fx                # doctest: +SKIP
>>> fm = ka.PositiveRF(64, 128, seed=0).cuda()                           # doctest: +SKIP
>>> f, log_scale = fx.log_features(fm, torch.randn(4096, 64, device="cuda", dtype=torch.bfloat16))  # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

from .._logdomain import LOG2E
from .._validation import broadcast_shapes

__all__ = ["ExponentForm", "exponent_form", "log_features", "features", "supported"]

#: Pointwise modes of the kernel.
MODES = {"exp": 0, "pm": 1, "sincos": 2, "cos": 3}
#: Largest number of projections one program holds (the whole r x d projection per program).
MAX_R = 512
MAX_D = 256
#: Largest projection tile (bytes) one program holds.
MAX_TILE_BYTES = 64 * 1024


class ExponentForm(NamedTuple):
    """The affine exponent of a map (module docstring): ``weight`` (*wb, r, d) in the compute
    dtype, ``col_bias`` (*wb, r) or None (in the units of ``u``), ``row_bias`` (..., n) or None
    (natural log), ``norm_coef`` $\\gamma$, ``const`` $c_0$, ``alpha``, ``mode``."""

    weight: torch.Tensor
    col_bias: torch.Tensor | None
    row_bias: torch.Tensor | None
    norm_coef: float
    const: float
    alpha: float
    mode: str


def exponent_form(fm: Any, x: torch.Tensor, key: bool = False) -> ExponentForm | None:
    """The `ExponentForm` of the feature map ``fm`` for the input ``x`` (..., n, d), or ``None``
    when the map (or a subclass that overrides how its features are computed) has none, or
    computes in float64."""
    from .dense_exponential import SADERF, SDERF, OptimalPositiveRF
    from .exponential import HyperbolicRF, PositiveRF
    from .trig import TrigRF

    cls = type(fm)
    cdt = fm.compute_dtype(x.dtype)
    if cdt != torch.float32:
        return None
    W = fm.projection.gemm_weight(cdt)
    if W is None:
        return None
    r = fm.num_features
    if cls is PositiveRF:
        return ExponentForm(W, None, None, -1.0, -0.5 * math.log(r), LOG2E, "exp")
    if cls is HyperbolicRF:
        return ExponentForm(W, None, None, -1.0, -0.5 * math.log(2 * r), LOG2E, "pm")
    if cls is TrigRF:
        if x.dtype != torch.float32:  # 16-bit angles ruin the sines: the torch path's float32 GEMM
            return None
        if fm.variant == "sincos":
            return ExponentForm(W, None, None, 1.0, -0.5 * math.log(r), 1.0, "sincos")
        return ExponentForm(W, fm.offsets.to(cdt), None, 1.0, 0.5 * math.log(2.0 / r), 1.0, "cos")
    if cls in (OptimalPositiveRF, SADERF, SDERF):
        with torch.no_grad():
            Weff, a, c = fm._weights(x.detach().to(cdt), key, True)
        return ExponentForm(Weff, a * LOG2E, c.to(torch.float32), 0.0, 0.0, LOG2E, "exp")
    return None


def supported(form: ExponentForm, xc: torch.Tensor) -> bool:
    """Whether the kernel takes this form and input (sizes within one program's reach, a weight
    batch that the input's leading dimensions end with)."""
    r, d = form.weight.shape[-2:]
    if r > MAX_R or d > MAX_D or xc.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    tile = max(16, triton.next_power_of_2(r)) * max(16, triton.next_power_of_2(d)) * xc.element_size()
    if tile > MAX_TILE_BYTES:  # the whole projection sits in one program's shared memory
        return False
    wb = tuple(form.weight.shape[:-2])
    lead = tuple(xc.shape[:-2])
    if wb and (len(wb) > len(lead) or lead[len(lead) - len(wb):] != wb):
        return False
    if form.row_bias is not None and tuple(form.row_bias.shape) != tuple(xc.shape[:-1]):
        return False
    return not (form.col_bias is not None and tuple(form.col_bias.shape[:-1]) != wb)


@triton.jit
def _fused_kernel(
    X, W, CB, RB, F, LS,
    N, R, D, NW,
    stride_xb, stride_xn, stride_wb, stride_wr, stride_fb, stride_fn,
    norm_coef, const, alpha,
    MODE: tl.constexpr, PLAIN: tl.constexpr, HAS_CB: tl.constexpr, HAS_RB: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    wb = b % NW
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_R)
    ds = tl.arange(0, BLOCK_D)
    rmask = rows < N
    cmask = cols < R
    dmask = ds < D
    x = tl.load(X + b * stride_xb + rows[:, None] * stride_xn + ds[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    w = tl.load(W + wb * stride_wb + cols[:, None] * stride_wr + ds[None, :],
                mask=cmask[:, None] & dmask[None, :], other=0.0)
    if IEEE:
        u = tl.dot(x, tl.trans(w), input_precision="ieee") * alpha  # float32 operands: no TF32
    else:
        u = tl.dot(x, tl.trans(w)) * alpha  # 16-bit operands, float32 accumulation
    if HAS_CB:
        cb = tl.load(CB + wb * R + cols, mask=cmask, other=0.0).to(tl.float32)
        u = u + cb[None, :]
    xf = x.to(tl.float32)
    c = norm_coef * 0.5 * tl.sum(xf * xf, axis=1) + const
    if HAS_RB:
        c = c + tl.load(RB + b * N + rows, mask=rmask, other=0.0).to(tl.float32)
    fbase = F + b * stride_fb + rows[:, None] * stride_fn + cols[None, :]
    omask = rmask[:, None] & cmask[None, :]
    if MODE == 0:
        if PLAIN:
            f = tl.exp2(u + (c * 1.4426950408889634)[:, None])
            ls = c
        else:
            m = tl.max(tl.where(cmask[None, :], u, float("-inf")), axis=1)
            f = tl.exp2(u - m[:, None])
            ls = m * 0.6931471805599453 + c
        tl.store(fbase, f.to(F.dtype.element_ty), mask=omask)
    elif MODE == 1:
        if PLAIN:
            sh = -(c * 1.4426950408889634)
            ls = c
        else:
            sh = tl.max(tl.where(cmask[None, :], tl.abs(u), float("-inf")), axis=1)
            ls = sh * 0.6931471805599453 + c
        fp = tl.exp2(u - sh[:, None])
        fm_ = tl.exp2(-u - sh[:, None])
        tl.store(fbase, fp.to(F.dtype.element_ty), mask=omask)
        tl.store(fbase + R, fm_.to(F.dtype.element_ty), mask=omask)
    elif MODE == 2:
        s = tl.sin(u)
        co = tl.cos(u)
        if PLAIN:
            e = tl.exp(c)[:, None]
            s = s * e
            co = co * e
        ls = c
        tl.store(fbase, s.to(F.dtype.element_ty), mask=omask)
        tl.store(fbase + R, co.to(F.dtype.element_ty), mask=omask)
    else:
        f = tl.cos(u)
        if PLAIN:
            f = f * tl.exp(c)[:, None]
        ls = c
        tl.store(fbase, f.to(F.dtype.element_ty), mask=omask)
    if not PLAIN:
        tl.store(LS + b * N + rows, ls, mask=rmask)


def _block_n(r: int, d: int) -> int:
    """Rows per program: fixed by shape (the projection and the (BLOCK_N, r) exponent in registers)."""
    big = max(triton.next_power_of_2(r), triton.next_power_of_2(d))
    return 64 if big <= 128 else 32 if big <= 256 else 16


def _launch(form: ExponentForm, x: torch.Tensor, plain: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel: x (..., n, d) in its own dtype -> features (..., n, F) in x's dtype and the
    float32 row log-scale (..., n) (empty for ``plain``)."""
    W = form.weight
    r, d = W.shape[-2:]
    wb = tuple(W.shape[:-2])
    lead = broadcast_shapes(tuple(x.shape[:-2]), wb)
    n = x.shape[-2]
    xb = x.expand(*lead, n, d).reshape(-1, n, d).contiguous()
    B = xb.shape[0]
    Wg = W.to(x.dtype).reshape(-1, r, d).contiguous()
    NW = Wg.shape[0]
    F = 2 * r if form.mode in ("pm", "sincos") else r
    f = torch.empty(B, n, F, device=x.device, dtype=x.dtype)
    ls = torch.empty(B, n, device=x.device, dtype=torch.float32)
    cb = form.col_bias.to(torch.float32).reshape(NW, r).contiguous() if form.col_bias is not None else ls
    rb = (form.row_bias.to(torch.float32).expand(*lead, n).reshape(B, n).contiguous()
          if form.row_bias is not None else ls)
    BLOCK_R = max(16, triton.next_power_of_2(r))
    BLOCK_D = max(16, triton.next_power_of_2(d))
    BLOCK_N = _block_n(r, d)
    grid = (triton.cdiv(n, BLOCK_N), B)
    _fused_kernel[grid](
        xb, Wg, cb, rb, f, ls,
        n, r, d, NW,
        xb.stride(0), xb.stride(1), Wg.stride(0), Wg.stride(1), f.stride(0), f.stride(1),
        float(form.norm_coef), float(form.const), float(form.alpha),
        MODE=MODES[form.mode], PLAIN=plain, HAS_CB=form.col_bias is not None,
        HAS_RB=form.row_bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, num_warps=4, num_stages=1,
    )
    return f.view(*lead, n, F), ls.view(*lead, n)


class _Fused(torch.autograd.Function):
    """Forward: the fused kernel. Backward: the torch map's own, re-run under autograd."""

    @staticmethod
    def forward(ctx, x, fm, key, plain, form):
        ctx.fm, ctx.key, ctx.plain = fm, key, plain
        ctx.save_for_backward(x)
        return _launch(form, x, plain)

    @staticmethod
    def backward(ctx, gf, gls):
        from .. import backends

        (x,) = ctx.saved_tensors
        fm = ctx.fm
        with backends.torch_path(), torch.enable_grad():
            xr = x.detach().requires_grad_(True)
            if ctx.plain:
                outs: tuple[torch.Tensor, ...] = (fm.key_features(xr) if ctx.key else fm(xr),)
                gouts: tuple[torch.Tensor | None, ...] = (gf,)
            else:
                outs = fm.key_log_features(xr) if ctx.key else fm.log_features(xr)
                gouts = (gf, gls)
            pairs = [(o, g) for o, g in zip(outs, gouts, strict=True) if g is not None and o.requires_grad]
            if not pairs:
                return None, None, None, None, None
            (gx,) = torch.autograd.grad([o for o, _ in pairs], [xr], [g.to(o.dtype) for o, g in pairs],
                                        allow_unused=True)
        return gx, None, None, None, None


def _run(fm: Any, x: torch.Tensor, key: bool, plain: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    form = exponent_form(fm, x, key)
    if form is None or not supported(form, x):
        return None
    return _Fused.apply(x, fm, key, plain, form)


def log_features(
    fm: Any, x: torch.Tensor, shared: bool = False, key: bool = False
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(f, log_scale)`` of ``fm.log_features(x, shared)`` (``key``: of ``key_log_features``) from
    the fused kernel: ``f`` in ``x``'s dtype, ``log_scale`` float32; ``None`` when the map has no
    `ExponentForm` or the shape is out of the kernel's reach (the caller then takes the torch path).
    ``x`` (..., n, d) is the raw input (16-bit or float32), validated by the caller."""
    out = _run(fm, x, key, plain=False)
    if out is None or not shared:
        return out
    f, ls = out
    with torch.no_grad():
        M = ls.amax(dim=-1, keepdim=True)
    w = torch.exp(ls - M).unsqueeze(-1)
    return (f * w.to(f.dtype)), M


def features(fm: Any, x: torch.Tensor, key: bool = False) -> torch.Tensor | None:
    r"""$\varphi(x)$ (``fm(x)``; ``key``: ``fm.key_features(x)``) from the fused kernel, in
    ``x``'s dtype, or ``None`` (see `log_features`)."""
    out = _run(fm, x, key, plain=True)
    return None if out is None else out[0]
