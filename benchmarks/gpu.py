r"""GPU benchmark: kernelapprox against fla, torch SDPA and performer-pytorch, in one process.

Run: ``python -m benchmarks gpu [--quick] [--out DIR] [--budget SECONDS] [--dtype bfloat16]
[--dry-run] [--device cuda|cpu] [--tiny] [--only GROUP ...]``

Every case calls the library through its public API only (``ka.linear_attention``,
``ka.hybrid_attention``, the feature maps, ``RecurrentLinearAttention.step``,
``RecurrentHybridAttention.step``), so faster paths chosen inside the library are measured as
they land. The field:

* fla (``fla-core``): ``fla.ops.linear_attn.chunk_linear_attn`` (``normalize=True``) and
  ``fla.ops.simple_gla.chunk_simple_gla`` on the *same features* as the library (computed by the
  library's map inside the timed call; fla's layout ``[B, T, H, K]``, ``scale=1``). For
  ``chunk_simple_gla`` the map's log-features enter as a gated scan: with
  $a_{t} = \log_2\psi(k_t)$, $m_t = \max_{s\le t}\max_f a_{s,f}$, keys $2^{a_t - m_t}$, the
  log-gate $g_t = (m_{t-1} - m_t)\ln 2 \le 0$, queries $2^{b_t - \max_f b_{t,f}}$, and values
  padded to $[v, 1, 0]$ so that the same scan yields the normaliser (Katharopoulos et al. 2020,
  *Transformers are RNNs*; Yang et al. 2024, *Gated Linear Attention Transformers with
  Hardware-Efficient Training*). fla is causal only.
* ``torch.nn.functional.scaled_dot_product_attention``, causal and not (exact softmax).
* ``performer_pytorch.FastAttention`` where installed (Choromanski et al. 2021, *Rethinking
  Attention with Performers*).

Groups (d = 64 unless said; inputs in ``--dtype``, bf16 by default):

* ``attention``: n = 1k, 4k (B8 H16), 16k (B2 H16), 64k (B1 H16); elu+1 (F = 64) and FAVOR+
  (F = 64, 128, 256); causal and non-causal; forward and forward + backward;
* ``maps``: every random map of the registry at B4 H8 n4096 d64 r256 against a bf16 GEMM
  ``x @ W.mT`` of its projection's shape writing a 16-bit output;
* ``favor``: FAVOR+ r128 on q and k (``fm(q)``, ``fm.key_features(k)``) at B8 H16 n4096,
  against the two GEMMs;
* ``short``: causal calls at n = 16 ... 1024 (B32 H4 d16 FAVOR+ r64, and B8 H16 d64 r128): the
  library's choice, its two accelerator forms forced (the quadratic form and the log-domain scan,
  ``kernelapprox.backends.SHORT_CALL_N`` moved around ``n`` for the call), its naive quadratic
  form and SDPA; the run ends with the crossover of the two forms per shape and mode (the least
  ``n`` from which the scan is at least as fast), the measurement behind ``SHORT_CALL_N``;
* ``decode``: one token per step after a prompt of t = 512, 4096, 16384 tokens (B8 H16, FAVOR+
  r128) against one SDPA step on a KV cache of t tokens (``sdpa(q_t, K, V)``, the cache not
  appended to): ``RecurrentLinearAttention.step`` on the torch step (``KERNELAPPROX_BACKEND=torch``
  around each call) and on fla's fused recurrent kernel (``fla fused_recurrent step``:
  ``KERNELAPPROX_BACKEND=fla``, unavailable where `kernelapprox.backends.decode_plan` does not
  choose fla), each eager and replayed from a CUDA graph (``RecurrentLinearAttention.capture``;
  ``compiled+graphed``: the step compiled by Inductor, then captured; a graphed row first checks
  one replay against the eager step and reports an error past 1e-2 of the output's scale; inputs
  are copied into the graph's static tensors inside the timed call), and
  ``RecurrentHybridAttention.step`` (w = 64 + 1 sink). The per-token cost of the recurrent rows
  does not depend on t; the SDPA step reads the t cached keys and values. ``--quick``: t = 512 and
  4096, without the compiled rows (Inductor's compilation would take a third of its budget; nor
  with ``--tiny``), the hybrid row at 4096 only;
* ``hybrid``: ``hybrid_attention`` w = 64 + 1 sink, FAVOR+ r128, causal, against SDPA causal (its
  window term is a compiled ``flex_attention``: the warm-up phase compiles it, once per shape).

Method. A *warm-up phase* first calls every case once (fla autotunes each kernel and shape on its
first call, minutes on a fresh machine; Inductor and cuBLAS pick their kernels) and reports its
time apart. The *timing phase* then measures the peak memory of one call
(``torch.cuda.max_memory_allocated`` above what was allocated before it) and the time:
``triton.testing.do_bench`` (median) where Triton is installed, else the median of CUDA-event
timings. Forward + backward cases (``out.backward(ones)``, gradients of q, k, v) come after every
forward case, and fla's cases last in each phase (so that its autotuning, if it outlasts the
budget, cuts only fla); a backward that a library refuses is reported as ``refused: <reason>``. Each case
is isolated: an exception or an out-of-memory error is written in its row and the run goes on.
``--budget`` stops adding cases once that many seconds have passed and lists those skipped.
Ratios (column ``× ref``) are against the case's reference: SDPA of the same shape, causality and
mode (attention, short, hybrid), the GEMM (maps, favor), the SDPA decode step (decode).

``--out DIR`` writes ``gpu.md`` (a dated Markdown block for ``docs/performance.md``: machine,
versions, warm-up, one table) and ``gpu.csv`` (every row). Without CUDA the command exits with
status 2 and says so; ``--dry-run`` lists the cases on any machine, and ``--device cpu --tiny``
runs every case at a tiny size on the CPU (a check of the harness, not a measurement).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import kernelapprox as ka

D = 64
#: (n, B, H) of the attention and hybrid groups.
ATTN_SIZES = ((1024, 8, 16), (4096, 8, 16), (16384, 2, 16), (65536, 1, 16))
FEATURES = (64, 128, 256)
SHORT_NS = (16, 32, 64, 128, 256, 512, 1024)
#: (B, H, d, F) of the short group.
SHORT_SHAPES = ((32, 4, 16, 64), (8, 16, 64, 128))
#: The short group's forms forced on either side of ``SHORT_CALL_N`` (their crossover is printed).
SHORT_QUADRATIC, SHORT_SCAN = "kernelapprox quadratic form", "kernelapprox scan form"
DECODE_TS = (512, 4096, 16384)
QUICK_DECODE_TS = (512, 4096)
#: (impl, backend, how): the recurrent rows of the decode group.
DECODE_IMPLS = (
    ("RecurrentLinearAttention.step torch", "torch", "eager"),
    ("RecurrentLinearAttention.step torch graphed", "torch", "graphed"),
    ("RecurrentLinearAttention.step torch compiled+graphed", "torch", "compiled"),
    ("fla fused_recurrent step", "fla", "eager"),
    ("fla fused_recurrent step graphed", "fla", "graphed"),
)
WINDOW, SINKS = 64, 1
#: --quick: a subset that fits in < 4 minutes with fla's autotuning.
QUICK_SIZES = ((4096, 8, 16),)
QUICK_FEATURES = (128,)
QUICK_BUDGET_S = 150.0


@dataclass(frozen=True)
class Case:
    """One measured call: a group, an implementation, a shape and a mode (``fwd`` or ``fwd+bwd``).

    ``params`` holds what the builder needs (n, B, H, d, F, causal, ...); ``ref`` is the ``key``
    of the case it is compared with ('' for none)."""

    group: str
    impl: str
    shape: str
    mode: str
    params: tuple[tuple[str, object], ...] = ()
    ref: str = ""

    @property
    def key(self) -> str:
        return f"{self.group}|{self.impl}|{self.shape}|{self.mode}"

    def p(self, name: str, default: object = None) -> object:
        return dict(self.params).get(name, default)


@dataclass
class Row:
    """The result of one case: time (ms, median), ratio to its reference, peak memory (MiB), the
    first call's time (s) and a status (``ok``, ``refused: ...``, ``error: ...``, ``OOM``,
    ``unavailable: ...``, ``skipped (budget)``)."""

    group: str
    impl: str
    shape: str
    mode: str
    ms: float = math.nan
    ratio: float = math.nan
    peak_mib: float = math.nan
    first_call_s: float = math.nan
    status: str = "ok"
    ref: str = field(default="", repr=False)


def _shape(B: int, H: int, n: int, d: int, F: int | None = None) -> str:
    return f"B{B} H{H} n{n} d{d}" + (f" F{F}" if F is not None else "")


def cases(quick: bool = False, tiny: bool = False) -> list[Case]:
    """The case list, forward cases first and every forward + backward case after them.

    ``quick``: n = 4k, F = 128, fewer short lengths; ``tiny``: every case at a size that
    runs in a second on a CPU (the same implementations and groups; for checking the harness)."""
    sizes = QUICK_SIZES if quick else ATTN_SIZES
    feats = QUICK_FEATURES if quick else FEATURES
    d = D
    if tiny:
        sizes, feats, d = ((64, 1, 2), (128, 1, 2)), (8,), 8
    out: list[Case] = []
    fb: list[Case] = []

    def add(group, impl, shape, ref_impl, *, backward=True, **params):
        pr = tuple(sorted(params.items()))
        for mode in ("fwd", "fwd+bwd") if backward else ("fwd",):
            ref = f"{group}|{ref_impl}|{shape}|{mode}" if ref_impl else ""
            (out if mode == "fwd" else fb).append(Case(group, impl, shape, mode, pr, ref))

    for n, B, H in sizes:
        for causal in (True, False):
            c = "causal" if causal else "non-causal"
            sdpa = f"sdpa {c}"
            shape = _shape(B, H, n, d)
            add("attention", sdpa, shape, sdpa, n=n, B=B, H=H, d=d, causal=causal)
            feature_sets = [("elu+1", d)] + [("favor+", F) for F in feats]
            for fmap, F in feature_sets:
                fshape = _shape(B, H, n, d, F)
                kw = dict(n=n, B=B, H=H, d=d, F=F, causal=causal, fmap=fmap)
                add("attention", f"kernelapprox {fmap} {c}", fshape, sdpa, **kw)
                if causal:
                    add("attention", f"fla chunk_linear_attn {fmap}", fshape, sdpa, **kw)
                    if fmap == "favor+":
                        add("attention", f"fla chunk_simple_gla {fmap}", fshape, sdpa, **kw)
                if fmap == "favor+":
                    add("attention", f"performer {c}", fshape, sdpa, **kw)
    # the reference rows of the attention group are keyed by the shape without F
    out = [_sdpa_ref(c) for c in out]
    fb = [_sdpa_ref(c) for c in fb]

    mB, mH, mn, mr = (1, 2, 128, 16) if tiny else (4, 8, 4096, 256)
    shape = _shape(mB, mH, mn, d, mr)
    add("maps", "bf16 GEMM x @ W.mT", shape, "bf16 GEMM x @ W.mT", backward=False, B=mB, H=mH, n=mn, d=d, r=mr)
    for est in ka.estimators():
        if est.is_random:
            add("maps", f"map {est.name}", shape, "bf16 GEMM x @ W.mT", backward=False,
                B=mB, H=mH, n=mn, d=d, r=mr, estimator=est.name)

    fB, fH, fn_, fr = (1, 2, 128, 16) if tiny else (8, 16, 4096, 128)
    shape = _shape(fB, fH, fn_, d, fr)
    add("favor", "two bf16 GEMMs (q, k)", shape, "two bf16 GEMMs (q, k)", B=fB, H=fH, n=fn_, d=d, r=fr)
    add("favor", "FAVOR+ fm(q), fm.key_features(k)", shape, "two bf16 GEMMs (q, k)",
        B=fB, H=fH, n=fn_, d=d, r=fr)

    short_shapes = ((2, 2, 8, 8),) if tiny else (SHORT_SHAPES[:1] if quick else SHORT_SHAPES)
    for sB, sH, sd, sr in short_shapes:
        for n in ((16, 64) if tiny else ((16, 64, 128, 512) if quick else SHORT_NS)):
            shape = _shape(sB, sH, n, sd, sr)
            for impl in ("sdpa causal", "kernelapprox favor+ causal", SHORT_QUADRATIC, SHORT_SCAN,
                         "kernelapprox naive quadratic causal"):
                add("short", impl, shape, "sdpa causal", n=n, B=sB, H=sH, d=sd, F=sr, causal=True, fmap="favor+")

    dB, dH, dr = (1, 2, 8) if tiny else (8, 16, 128)
    dts = (32, 64) if tiny else (QUICK_DECODE_TS if quick else DECODE_TS)
    for dt in dts:
        shape = f"B{dB} H{dH} t{dt} d{d} F{dr}"
        impls = ["sdpa KV-cache step"] + [
            impl for impl, _, how in DECODE_IMPLS if not ((quick or tiny) and how == "compiled")]
        if not quick or dt == 4096:
            impls.append(f"RecurrentHybridAttention.step w{WINDOW}+{SINKS}")
        for impl in impls:
            add("decode", impl, shape, "sdpa KV-cache step", backward=False, B=dB, H=dH, t=dt, d=d, F=dr)

    hr = 8 if tiny else 128
    for n, B, H in sizes:
        shape = _shape(B, H, n, d)
        add("hybrid", "sdpa causal", shape, "sdpa causal", n=n, B=B, H=H, d=d, causal=True)
        add("hybrid", f"kernelapprox hybrid w{WINDOW}+{SINKS} favor+ r{hr}", shape, "sdpa causal",
            n=n, B=B, H=H, d=d, F=hr, causal=True)
    # fla last within each phase: its first calls autotune for minutes, and a budget then cuts fla,
    # not the rest
    return sorted(out + fb, key=lambda c: (c.mode == "fwd+bwd", c.impl.startswith("fla")))


def _sdpa_ref(c: Case) -> Case:
    """Point an attention case's reference at the SDPA row of the same (B, H, n, d)."""
    if c.group != "attention" or not c.ref:
        return c
    shape = _shape(int(c.p("B")), int(c.p("H")), int(c.p("n")), int(c.p("d")))  # type: ignore[call-overload]
    impl = c.ref.split("|")[1]
    return Case(c.group, c.impl, c.shape, c.mode, c.params, f"attention|{impl}|{shape}|{c.mode}")


# ----------------------------------------------------------------------------------------------
# builders: a case -> a zero-argument callable (inputs made here, outside the timed call)
# ----------------------------------------------------------------------------------------------
class Unavailable(Exception):
    """The implementation is not installed (or does not apply) on this machine."""


class Refused(Exception):
    """A library refused the backward (raised inside ``backward``)."""


def _randn(*shape: int, device, dtype, scale: float = 1.0, grad: bool = False) -> torch.Tensor:
    t = (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)
    return t.requires_grad_(grad)


def _feature_map(fmap: str, d: int, F: int, device) -> ka.FeatureMap:
    if fmap == "elu+1":
        return ka.EluFeatures(d).to(device)
    return ka.PositiveRF(d, F, sampler="orthogonal", seed=0).to(device)


def _fla(name: str):
    try:
        if name == "linear_attn":
            from fla.ops.linear_attn import chunk_linear_attn
            return chunk_linear_attn
        from fla.ops.simple_gla import chunk_simple_gla
        return chunk_simple_gla
    except ImportError as e:
        raise Unavailable(f"fla-core not installed ({e.name})") from None


def _gated_scan(fm: ka.FeatureMap, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scan) -> torch.Tensor:
    """Causal attention of the map's features through fla's gated scan, layout (B, T, H, .)
    (module docstring): keys scaled by their running maximum, the change of maximum as gate."""
    a = fm.key_log2_features(k)
    b = fm.query_log2_features(q)
    if a is None or b is None:
        raise Unavailable("the map has no log2 features")
    sdt = torch.promote_types(q.dtype, torch.float32)  # statistics in float32 (float64 stays)
    m = torch.cummax(a.detach().amax(-1).to(sdt), dim=1).values  # (B, T, H)
    kt = torch.exp2(a.to(sdt) - m.unsqueeze(-1)).to(q.dtype)
    qt = torch.exp2(b.to(sdt) - b.detach().amax(-1, keepdim=True).to(sdt)).to(q.dtype)
    g = (torch.cat([m[:, :1], m[:, :-1]], dim=1) - m) * math.log(2.0)
    one = v.new_ones(*v.shape[:-1], 1)
    vp = torch.cat([v, one, torch.zeros_like(one)], dim=-1)
    o, _ = scan(qt, kt, vp, g=g, scale=1.0)
    dv = v.shape[-1]
    return o[..., :dv] / o[..., dv:dv + 1]


def _forced_short_call(limit: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       fm: ka.FeatureMap) -> torch.Tensor:
    """The library's causal torch forms with ``backends.SHORT_CALL_N = limit`` for the call:
    above ``n`` the quadratic form, 0 the log-domain scan (`kernelapprox.attention.chunk_linear_attention`
    takes the scan for every accelerator plan but the quadratic one, fla's included)."""
    from kernelapprox import backends

    old = backends.SHORT_CALL_N
    backends.SHORT_CALL_N = limit
    try:
        return ka.attention.chunk_linear_attention(q, k, v, fm)  # type: ignore[return-value]
    finally:
        backends.SHORT_CALL_N = old


def short_crossover(rows: Sequence[Row]) -> list[str]:
    """Per short-group shape (without n) and mode, the times of the quadratic and the scan form at
    each n and the least n from which the scan is at least as fast ('none' if it never is)."""
    table: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for r in rows:
        if r.group != "short" or r.impl not in (SHORT_QUADRATIC, SHORT_SCAN) or r.status != "ok":
            continue
        parts = r.shape.split()
        n = int(next(p for p in parts if p.startswith("n"))[1:])
        key = (" ".join(p for p in parts if not p.startswith("n")), r.mode)
        table.setdefault(key, {}).setdefault(n, {})[r.impl] = r.ms
    lines = []
    for (shape, mode), by_n in table.items():
        both = {n: t for n, t in sorted(by_n.items()) if len(t) == 2}
        if not both:
            continue
        cross = next((n for n, t in both.items() if t[SHORT_SCAN] <= t[SHORT_QUADRATIC]), None)
        times = ", ".join(f"n{n} {t[SHORT_QUADRATIC]:.3g}/{t[SHORT_SCAN]:.3g}" for n, t in both.items())
        lines.append(f"short-call crossover {shape} {mode}: scan at least as fast as the quadratic form from "
                     f"n = {cross if cross is not None else 'none'} (quadratic/scan ms: {times})")
    return lines


def _attention_fn(c: Case, device, dtype) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor]]:
    n, B, H, d = (int(c.p(x)) for x in ("n", "B", "H", "d"))  # type: ignore[call-overload]
    causal = bool(c.p("causal"))
    grad = c.mode == "fwd+bwd"
    impl = c.impl
    bthd = impl.startswith("fla")  # fla's layout
    shp = (B, n, H, d) if bthd else (B, H, n, d)
    q, k = (_randn(*shp, device=device, dtype=dtype, scale=d**-0.25, grad=grad) for _ in range(2))
    v = _randn(*shp, device=device, dtype=dtype, grad=grad)
    leaves = [q, k, v]
    F = int(c.p("F", d))  # type: ignore[call-overload]
    fmap = str(c.p("fmap", ""))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if impl.startswith("sdpa"):
        return (lambda: sdpa(q, k, v, is_causal=causal)), leaves
    if impl in (SHORT_QUADRATIC, SHORT_SCAN):
        fm = _feature_map("favor+", d, F, device)
        limit = n + 1 if impl == SHORT_QUADRATIC else 0
        return (lambda: _forced_short_call(limit, q, k, v, fm)), leaves
    if impl.startswith("kernelapprox naive"):
        fm = _feature_map("favor+", d, F, device)
        return (lambda: ka.naive_linear_attention(q, k, v, fm, causal=causal)), leaves
    if impl.startswith("kernelapprox hybrid"):
        fm = _feature_map("favor+", d, F, device)
        return (lambda: ka.hybrid_attention(q, k, v, fm, window=WINDOW, sinks=SINKS, causal=causal)), leaves
    if impl.startswith("kernelapprox"):
        fm = _feature_map(fmap, d, F, device)
        return (lambda: ka.linear_attention(q, k, v, fm, causal=causal)), leaves
    if impl.startswith("fla chunk_linear_attn"):
        scan = _fla("linear_attn")
        fm = _feature_map(fmap, d, F, device)

        def fla_linear():
            o, _ = scan(fm(q).to(dtype), fm.key_features(k).to(dtype), v, scale=1.0, normalize=True)
            return o
        return fla_linear, leaves
    if impl.startswith("fla chunk_simple_gla"):
        scan = _fla("simple_gla")
        fm = _feature_map(fmap, d, F, device)
        return (lambda: _gated_scan(fm, q, k, v, scan)), leaves
    if impl.startswith("performer"):
        import warnings

        with warnings.catch_warnings():  # its own imports warn (distutils versions)
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                from performer_pytorch import FastAttention
            except ImportError:
                raise Unavailable("performer-pytorch not installed") from None
            attn = FastAttention(dim_heads=d, nb_features=F, causal=causal).to(device)
        return (lambda: attn(q, k, v)), leaves
    raise ValueError(f"no builder for {impl!r}")


def _with_backward(fn: Callable[[], torch.Tensor], leaves: Sequence[torch.Tensor]) -> Callable[[], object]:
    """Forward + backward of ``fn`` (gradient of ones), gradients reset each call; an error raised
    by the backward becomes `Refused`."""
    grad_out: list[torch.Tensor] = []

    def run():
        for t in leaves:
            t.grad = None
        out = fn()
        if not grad_out:
            grad_out.append(torch.ones_like(out))
        try:
            out.backward(grad_out[0])
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - reported in the case's row
            raise Refused(f"{type(e).__name__}: {_first_line(e)}") from e
    return run


def build(c: Case, device: torch.device, dtype: torch.dtype) -> Callable[[], object]:
    """A zero-argument callable running case ``c`` (inputs prepared here, not in the call).

    Raises `Unavailable` where the implementation is not installed."""
    torch.manual_seed(0)
    if c.group in ("attention", "short", "hybrid"):
        fn, leaves = _attention_fn(c, device, dtype)
        if c.mode == "fwd+bwd":
            return _with_backward(fn, leaves)
        return lambda: _no_grad(fn)
    if c.group == "maps":
        B, H, n, d, r = (int(c.p(x)) for x in ("B", "H", "n", "d", "r"))  # type: ignore[call-overload]
        x = _randn(B, H, n, d, device=device, dtype=dtype, scale=d**-0.25)
        if c.p("estimator") is None:
            W = _randn(r, d, device=device, dtype=dtype)
            return lambda: torch.matmul(x, W.mT)
        est = ka.get_estimator(str(c.p("estimator")))
        fm = est.build(d, r, seed=0).to(device)
        if est.data_dependent:
            with torch.no_grad():
                fm.fit(x, x)
        return lambda: _no_grad(lambda: fm(x))
    if c.group == "favor":
        B, H, n, d, r = (int(c.p(x)) for x in ("B", "H", "n", "d", "r"))  # type: ignore[call-overload]
        grad = c.mode == "fwd+bwd"
        q, k = (_randn(B, H, n, d, device=device, dtype=dtype, scale=d**-0.25, grad=grad) for _ in range(2))
        W = _randn(r, d, device=device, dtype=dtype)
        fm = _feature_map("favor+", d, r, device)
        gemm = c.impl.startswith("two")

        def both():
            a, b = (torch.matmul(q, W.mT), torch.matmul(k, W.mT)) if gemm else (fm(q), fm.key_features(k))
            return a.float().sum() + b.float().sum() if grad else (a, b)
        if grad:
            return _with_backward(both, [q, k])
        return lambda: _no_grad(both)
    if c.group == "decode":
        return _decode_fn(c, device, dtype)
    raise ValueError(f"no builder for group {c.group!r}")


def _decode_fn(c: Case, device, dtype) -> Callable[[], object]:
    B, H, t, d, F = (int(c.p(x)) for x in ("B", "H", "t", "d", "F"))  # type: ignore[call-overload]
    q, k, v = (_randn(B, H, t, d, device=device, dtype=dtype, scale=s) for s in (d**-0.25, d**-0.25, 1.0))
    qt, kt, vt = (x[:, :, -1] for x in (q, k, v))
    if c.impl.startswith("sdpa"):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        q1 = qt.unsqueeze(2)
        return lambda: _no_grad(lambda: sdpa(q1, k, v))
    fm = _feature_map("favor+", d, F, device)
    if c.impl.startswith("RecurrentHybrid"):
        with torch.no_grad():
            _, hstate = ka.hybrid_attention(q, k, v, fm, window=WINDOW, sinks=SINKS, causal=True,
                                            return_state=True)
        hyb = ka.RecurrentHybridAttention(fm, window=WINDOW, sinks=SINKS, state=hstate)
        return lambda: _no_grad(lambda: hyb.step(qt, kt, vt))
    backend, how = next((b, h) for impl, b, h in DECODE_IMPLS if impl == c.impl)
    if backend == "fla":
        from kernelapprox import backends
        from kernelapprox.attention import fla_mode

        with _backend_env("fla"):
            plan = backends.decode_plan(device, torch.float32, mode=fla_mode(fm), warn=False)
        if plan.path != "fla":
            raise Unavailable(str(plan.reason))
    if how != "eager" and device.type != "cuda":
        raise Unavailable("CUDA graphs need a CUDA device")
    with torch.no_grad():
        _, state = ka.linear_attention(q, k, v, fm, causal=True, return_state=True)
    rnn = ka.RecurrentLinearAttention(fm, state=state)
    if how == "eager":
        def eager() -> object:
            with torch.no_grad(), _backend_env(backend):
                return rnn.step(qt, kt, vt)
        return eager
    with _backend_env(backend):
        step = rnn.capture(qt, kt, vt, compile=how == "compiled")
        assert rnn.state is not None
        twin = ka.RecurrentLinearAttention(fm, state=ka.LinearAttentionState(
            rnn.state.kv.clone(), rnn.state.log_scale.clone()))
        with torch.no_grad():
            want = twin.step(qt, kt, vt).float()
    got = step(qt, kt, vt).float()
    err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
    if not err <= 1e-2:
        raise RuntimeError(f"a replay differs from the eager step by {err:.2e} (relative to its largest entry)")
    return lambda: step(qt, kt, vt)


class _backend_env:  # noqa: N801 - a context manager, like contextlib's
    """``KERNELAPPROX_BACKEND=value`` within the block (the previous value restored on exit)."""

    def __init__(self, value: str) -> None:
        self.value = value

    def __enter__(self) -> None:
        self.prev = os.environ.get("KERNELAPPROX_BACKEND")
        os.environ["KERNELAPPROX_BACKEND"] = self.value

    def __exit__(self, *exc: object) -> None:
        if self.prev is None:
            os.environ.pop("KERNELAPPROX_BACKEND", None)
        else:
            os.environ["KERNELAPPROX_BACKEND"] = self.prev


def _no_grad(fn: Callable[[], object]) -> object:
    with torch.no_grad():
        return fn()


# ----------------------------------------------------------------------------------------------
# timing and the run
# ----------------------------------------------------------------------------------------------
def make_timer(device: torch.device, quick: bool = False) -> tuple[Callable[[Callable[[], object]], float], str]:
    """A function timing a callable in ms (median) on ``device``, and its description:
    ``triton.testing.do_bench`` where Triton is installed, else CUDA events; on a CPU wall clock."""
    if device.type != "cuda":
        def wall(fn):
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return 1e3 * statistics.median(ts)
        return wall, "wall clock, median of 3 (CPU: a harness check, not a measurement)"
    warm, rep = (5, 40) if quick else (25, 100)
    try:
        from triton.testing import do_bench

        def bench(fn):
            return float(do_bench(fn, warmup=warm, rep=rep, return_mode="median"))
        return bench, f"triton.testing.do_bench (median; warmup {warm} ms, rep {rep} ms)"
    except ImportError:
        pass

    def events(fn, calls: int = 20):
        for _ in range(3):
            fn()
        ts = []
        for _ in range(calls):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        return statistics.median(ts)
    return events, "CUDA events (median of 20 calls after 3)"


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0][:200] if s else ""


def _status(e: BaseException) -> str:
    if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower():
        return "OOM"
    if isinstance(e, Unavailable):
        return f"unavailable: {e}"
    if isinstance(e, Refused):
        return f"refused: {e}"
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"error: {type(e).__name__}: {_first_line(e)}{where}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cleanup(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_cases(
    case_list: Sequence[Case],
    device: torch.device,
    dtype: torch.dtype,
    timer: Callable[[Callable[[], object]], float],
    budget_s: float = math.inf,
    builder: Callable[[Case, torch.device, torch.dtype], Callable[[], object]] = build,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = print,
) -> tuple[list[Row], float]:
    """Warm every case up (one call each), then measure each: rows and the warm-up time (s).

    A case that raises in either phase gets the error in its row (`_status`) and the run goes on;
    once ``budget_s`` seconds have passed (``clock``), the remaining cases are ``skipped (budget)``."""
    start = clock()
    rows = {c.key: Row(c.group, c.impl, c.shape, c.mode, ref=c.ref) for c in case_list}
    failed: set[str] = set()
    log(f"warm-up: {len(case_list)} cases, one call each")
    for c in case_list:
        row = rows[c.key]
        if clock() - start > budget_s:
            row.status = "skipped (budget)"
            failed.add(c.key)
            continue
        t0 = clock()
        try:
            fn = builder(c, device, dtype)
            fn()
            _sync(device)
        except Exception as e:  # noqa: BLE001 - one case never stops the run
            row.status = _status(e)
            failed.add(c.key)
        row.first_call_s = clock() - t0
        fn = None  # type: ignore[assignment]
        _cleanup(device)
        log(f"  {c.key}: {row.first_call_s:.1f} s  {'' if row.status == 'ok' else row.status}")
    warmup_s = clock() - start
    log(f"warm-up done in {warmup_s:.1f} s")
    for c in case_list:
        row = rows[c.key]
        if c.key in failed:
            continue
        if clock() - start > budget_s:
            row.status = "skipped (budget)"
            continue
        try:
            fn = builder(c, device, dtype)
            fn()
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                fn()
                _sync(device)
                row.peak_mib = (torch.cuda.max_memory_allocated(device) - base) / 2**20
            row.ms = timer(fn)
        except Exception as e:  # noqa: BLE001
            row.status = _status(e)
        fn = None  # type: ignore[assignment]
        _cleanup(device)
        log(f"  {c.key}: {row.ms:.4g} ms  {'' if row.status == 'ok' else row.status}")
    by_key = {k: r for k, r in rows.items()}
    for r in rows.values():
        ref = by_key.get(r.ref)
        if ref is not None and ref.status == "ok" and r.status == "ok" and ref.ms > 0:
            r.ratio = r.ms / ref.ms
    return list(rows.values()), warmup_s


# ----------------------------------------------------------------------------------------------
# versions and tables
# ----------------------------------------------------------------------------------------------
def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment(device: torch.device) -> dict[str, str]:
    """Machine and versions: the GPU, torch (and its CUDA), Triton, fla-core, performer-pytorch,
    kernelapprox and the git commit of this checkout (where there is one)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1], timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    return {
        "machine": gpu,
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "triton": _version("triton"),
        "fla-core": _version("fla-core"),
        "performer-pytorch": _version("performer-pytorch"),
        "kernelapprox": getattr(ka, "__version__", _version("kernelapprox")),
        "commit": commit or "unknown",
        "python": platform.python_version(),
    }


def _fmt(x: float, digits: int = 3) -> str:
    return "—" if math.isnan(x) else f"{x:.{digits}g}"


def to_markdown(rows: Sequence[Row], env: dict[str, str], warmup_s: float, timer: str, dtype: str,
                date: str | None = None, skipped: Sequence[str] = ()) -> str:
    """A dated Markdown block for ``docs/performance.md``: the machine, the versions, the method,
    the warm-up time and one table of every row (ms, × its reference, peak MiB, status)."""
    date = date or datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    lines = [
        f"### {env['machine']}, {date}",
        "",
        f"Measured {date} by `python -m benchmarks gpu` at commit `{env['commit']}`: torch {env['torch']}, "
        f"Triton {env['triton']}, fla-core {env['fla-core']}, performer-pytorch {env['performer-pytorch']}, "
        f"Python {env['python']}; inputs {dtype}; times: {timer}. Warm-up phase (one call of every case, "
        f"fla's autotuning included): {warmup_s:.1f} s. × ref: time / the group's reference (SDPA of the "
        "same shape, causality and mode; the GEMM for maps; the SDPA KV-cache step for decoding).",
        "",
        "| group | case | shape | mode | ms | × ref | peak MiB | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.group} | {r.impl} | {r.shape} | {r.mode} | {_fmt(r.ms)} | {_fmt(r.ratio)} | "
                     f"{_fmt(r.peak_mib, 4)} | {r.status.replace('|', '/')} |")
    if skipped:
        lines += ["", f"Skipped by the time budget ({len(skipped)}): " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


CSV_FIELDS = ("group", "impl", "shape", "mode", "ms", "ratio", "peak_mib", "first_call_s", "status", "ref")


def to_csv(rows: Sequence[Row]) -> str:
    """Every row as CSV (the `Row` fields, NaN where not measured)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow(asdict(r))
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring); returns the exit status (2 without CUDA)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"a subset (n = 4k, F = 128) within "
                   f"{QUICK_BUDGET_S:.0f} s of cases unless --budget says otherwise")
    p.add_argument("--out", help="write gpu.md and gpu.csv into this folder")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds after which no further case starts (the rest are listed as skipped)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny: a harness check)")
    p.add_argument("--dry-run", action="store_true", help="list the cases and exit")
    p.add_argument("--tiny", action="store_true", help="every case at a tiny size (harness check)")
    p.add_argument("--only", nargs="+", metavar="GROUP", help="run only these groups (attention, maps, favor, "
                   "short, decode, hybrid)")
    a = p.parse_args(argv)
    case_list = cases(quick=a.quick, tiny=a.tiny)
    if a.only:
        case_list = [c for c in case_list if c.group in a.only]
    if a.dry_run:
        for c in case_list:
            print(f"{c.group:9s} {c.mode:7s} {c.shape:24s} {c.impl}")
        print(f"{len(case_list)} cases")
        return 0
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"python -m benchmarks gpu: no CUDA device (torch {torch.__version__}, "
              f"torch.cuda.is_available() is False); this benchmark measures a GPU. "
              "`--dry-run` lists its cases; `--device cpu --tiny` checks the harness on a CPU.",
              file=sys.stderr)
        return 2
    dtype = getattr(torch, a.dtype)
    budget = a.budget if a.budget is not None else (QUICK_BUDGET_S if a.quick else math.inf)
    timer, how = make_timer(device, a.quick)
    env = environment(device)
    print("; ".join(f"{k} {v}" for k, v in env.items()))
    rows, warmup_s = run_cases(case_list, device, dtype, timer, budget)
    skipped = [f"{r.group} {r.impl} {r.shape} {r.mode}" for r in rows if r.status == "skipped (budget)"]
    md = to_markdown(rows, env, warmup_s, how, a.dtype, skipped=skipped)
    cross = short_crossover(rows)
    if cross:
        md += "\n" + "\n".join(f"- {line}" for line in cross) + "\n"
    print(md)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu.md").write_text(md)
        (out / "gpu.csv").write_text(to_csv(rows))
        print(f"wrote {out / 'gpu.md'} and {out / 'gpu.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
