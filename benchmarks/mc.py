r"""Monte Carlo engine benchmark: each driver against its batched-matmul floor.

Run: ``python -m benchmarks mc [--device cpu|cuda] [--dtype float32|float64|bfloat16] [--repeats N]
[--quick] [--threads N] [--json FILE]``

Every ``kernelapprox.montecarlo`` driver evaluates ``S`` independent projections through a feature
map's ``batch_shape`` and accumulates float64 power sums. Its *floor* is the same work written by
hand as batched matmuls, with nothing else: per chunk of 1 000 draws, a Gaussian projection
$W$ of shape ``(c, r, d)`` (``torch.randn``), the positive features
$\varphi(x)=e^{Wx-\|x\|^2/2}/\sqrt r$ of queries and keys (FAVOR+, Choromanski et al. 2021,
*Rethinking Attention with Performers*, ICLR, Lemma 1), the Gram products
$\hat K = \varphi(q)\varphi(k)^\top$ and the float64 sums of $e, e^2, e^3, e^4$ over the
chunk, $e = \hat K - K$ (for attention: row-normalised $\hat K$ times $V$, then the same sums
of $\hat o - o$). The driver does more than the floor (stabilised log-domain features, per-draw
metrics, confidence intervals and quantiles at the end), so a ratio of 1 is not reachable; the
target is <= 2.

Ratios printed (``driver time / floor time``, each the median over ``repeats`` back-to-back
pairs, so that a load change on a shared machine hits both sides of a pair):

* ``kernel_error d16 r64 n64 S10000``: the small setting (``PositiveRF``, 64 x 64 kernel);
* ``kernel_error d64 r256 n128 S2000``: a bigger one;
* ``attention_error d16 r64 n64 dv16 S5000`` non-causal and causal;
* ``error_vs_r cell``: one cell of the slowest study (``studies.error_vs_r.run_cell`` for
  ``positive-gaussian`` at d = 64: every r of the grid, every data regime, the closed-form
  theory per point) against the same draws, features, Gram products and per-draw relative
  errors written by hand.

``bench_mc`` returns them as a dict (``<name>/floor`` ratios and ``<name>_ms`` driver times);
``benchmarks.core`` prints them with its own groups.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

import kernelapprox as ka
from benchmarks._common import median, sync

FLOOR_CHUNK = 1000


def paired_ratio(
    driver: Callable[[], object], floor: Callable[[], object], device: torch.device, repeats: int
) -> tuple[float, float, float]:
    """Median of ``repeats`` back-to-back (driver, floor) time ratios, and the median times (s).

    One warm-up call of each first (imports, allocator, one-off caches).
    """
    ratios, td, tf = [], [], []
    with torch.no_grad():
        driver()
        floor()
        sync(device)
        for _ in range(repeats):
            t0 = time.perf_counter()
            driver()
            sync(device)
            t1 = time.perf_counter()
            floor()
            sync(device)
            t2 = time.perf_counter()
            td.append(t1 - t0)
            tf.append(t2 - t1)
            ratios.append((t1 - t0) / (t2 - t1))
    return median(ratios), median(td), median(tf)


def _positive_features(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    r"""$e^{Wx - \|x\|^2/2}/\sqrt r$ of all draws, transposed: W (c, r, d), x (n, d) -> (c, r, n).

    One (c r, d) x (d, n) GEMM for all draws, bias and exp in place; in base 2 ($\log_2 e$ folded
    into x, then ``exp2``: the fastest exponential on CPU, as the library's maps use it)."""
    c, r, d = W.shape
    L = 1.4426950408889634  # log2(e)
    u = (W.reshape(c * r, d) @ (x * L).mT).reshape(c, r, -1)
    return u.sub_(L * (0.5 * (x * x).sum(-1) + 0.5 * math.log(r))).exp2_()


def _gram(W: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    r"""$\hat K$ of all draws, (c, n, m): a batched product of the transposed features."""
    return _positive_features(W, q).mT @ _positive_features(W, k)


def _power_sums(e: torch.Tensor, sums: torch.Tensor) -> None:
    """``sums += [sum e, sum e^2, sum e^3, sum e^4]`` over the chunk axis (float64), the sums as
    products with a vector of ones (a GEMV: one read of the block)."""
    c = e.shape[0]
    e = e.reshape(c, -1)
    ones = e.new_ones(c)
    e2 = e * e
    p = e2 * e
    for i, t in enumerate((e, e2, p, p)):
        if i == 3:
            p.mul_(e)
        sums[i] += (ones @ t).view(sums.shape[1:])


def kernel_floor(q: torch.Tensor, k: torch.Tensor, r: int, draws: int) -> torch.Tensor:
    """Batched-matmul floor of ``kernel_error(PositiveRF(d, r), q, k, draws)``: power sums (4, n, m)."""
    K = torch.exp(q.double() @ k.double().mT)
    sums = torch.zeros(4, *K.shape, dtype=torch.float64, device=q.device)
    for start in range(0, draws, FLOOR_CHUNK):
        c = min(FLOOR_CHUNK, draws - start)
        W = torch.randn(c, r, q.shape[-1], dtype=q.dtype, device=q.device)
        _power_sums(_gram(W, q, k).to(torch.float64).sub_(K), sums)
    return sums


def attention_floor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: int, draws: int,
                    causal: bool) -> torch.Tensor:
    """Floor of ``attention_error``: features, Gram, (mask), normalise, times V, power sums."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    exact = ka.softmax_attention(q64, k64, v64, causal=causal)
    sums = torch.zeros(4, *exact.shape, dtype=torch.float64, device=q.device)
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
    for start in range(0, draws, FLOOR_CHUNK):
        c = min(FLOOR_CHUNK, draws - start)
        W = torch.randn(c, r, q.shape[-1], dtype=q.dtype, device=q.device)
        G = _gram(W, q, k).to(torch.float64)
        if causal:
            G.masked_fill_(mask, 0.0)
        _power_sums(torch.matmul(G.div_(G.sum(-1, keepdim=True)), v64).sub_(exact), sums)
    return sums


def error_vs_r_floor(d: int, quick: bool, device: torch.device, dtype: torch.dtype) -> list[float]:
    """Floor of one ``error_vs_r`` cell of ``positive-gaussian``: for every r and regime, the same
    number of Gaussian draws, positive features, Gram products and the two per-draw relative
    errors (mean over pairs of ((K^ - K)/K)^2 and ||K^ - K||_F^2/||K||_F^2), averaged."""
    from studies import error_vs_r as E

    ctx = _ctx(quick, device, dtype)
    regimes = E.REGIMES_QUICK if quick else E.REGIMES
    data = [E.make_data(reg, d, ctx) for reg in regimes]
    out = []
    for r in E.R_GRID_QUICK if quick else E.R_GRID:
        S = E.n_draws(r, d, quick)
        W = torch.randn(S, r, d, dtype=dtype, device=device)
        for q, k in data:
            K = torch.exp(q @ k.mT)
            e = _gram(W, q, k).sub_(K)
            out.append(float((e * e).sum((-2, -1)).div_((K * K).sum()).mean()))
            out.append(float(e.div_(K).square_().mean((-2, -1)).mean()))
    return out


def _ctx(quick: bool, device: torch.device, dtype: torch.dtype):
    from studies._engine import Context

    return Context(device=device, seed=0, quick=quick, out=Path("."), dtype=dtype, study="error-vs-r")


def bench_mc(device: torch.device, dtype: torch.dtype, repeats: int, quick: bool = False,
             only: str = "") -> dict[str, float]:
    """Driver / batched-matmul floor ratios of the Monte Carlo engine (see the module docstring).

    Parameters
    ----------
    device : torch.device
    dtype : torch.dtype
        Dtype of the inputs and projections of the ``kernel_error``/``attention_error`` cases (the
        drivers' statistics are float64 whatever it is; 16-bit types compute in float32). The
        ``error_vs_r`` cell always runs in float64, the study's dtype.
    repeats : int
        Back-to-back (driver, floor) pairs per case; the median ratio is reported.
    quick : bool, default False
        A twentieth of the draws (a smoke run, a few seconds; the error_vs_r cell at the study's
        quick grid, d = 16).
    only : str, default ""
        Run only the cases whose name starts with this (``"kernel_error"``, ``"attention_error"``,
        ``"error_vs_r"``).

    Returns
    -------
    dict[str, float]
        ``"<case>/floor"``: median ratio; ``"<case>_ms"``: median driver time in ms.
    """
    mc = ka.montecarlo
    device = torch.device(device)
    cdt = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    g = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}

    def add(name: str, driver: Callable[[], object], floor: Callable[[], object]) -> None:
        if not name.startswith(only):
            return
        ratio, td, _ = paired_ratio(driver, floor, device, repeats)
        out[f"{name}/floor"] = ratio
        out[f"{name}_ms"] = 1e3 * td

    for d, r, n, S in ((16, 64, 64, 10_000), (64, 256, 128, 2_000)):
        S = S // 20 if quick else S
        q, k = (torch.randn(2, n, d, generator=g) / d**0.25).to(device, cdt).unbind(0)
        fm = ka.PositiveRF(d, r, seed=0)
        add(f"kernel_error d{d} r{r} n{n} S{S}",
            lambda fm=fm, q=q, k=k, S=S: mc.kernel_error(fm, q, k, draws=S, dtype=cdt),
            lambda q=q, k=k, r=r, S=S: kernel_floor(q, k, r, S))
    d, r, n, dv, S = 16, 64, 64, 16, (250 if quick else 5_000)
    q, k, v = torch.randn(3, n, d, generator=g).to(device, cdt).unbind(0)
    q, k, v = q / d**0.25, k / d**0.25, v[:, :dv]
    fm = ka.PositiveRF(d, r, seed=0)
    for causal in (False, True):
        add(f"attention_error{' causal' if causal else ''} d{d} r{r} n{n} dv{dv} S{S}",
            lambda causal=causal: mc.attention_error(fm, q, k, v, draws=S, causal=causal, dtype=cdt),
            lambda causal=causal: attention_floor(q, k, v, r, S, causal))

    from studies import error_vs_r as E

    d = 16 if quick else 64
    ctx = _ctx(quick, device, torch.float64)
    add(f"error_vs_r cell positive-gaussian d{d}",
        lambda: E.run_cell({"spec": "positive-gaussian", "d": d}, ctx),
        lambda: error_vs_r_floor(d, quick, device, torch.float64))
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Command line: print the ratios (and optionally write them to JSON)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks mc", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="fewer draws (a smoke run)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's own)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--only", default="", help="run only the cases whose name starts with this")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    res = bench_mc(torch.device(a.device), getattr(torch, a.dtype), a.repeats, a.quick, a.only)
    print(f"Monte Carlo driver / batched-matmul floor ({a.device}, {a.dtype}, "
          f"{torch.get_num_threads()} threads, median of {a.repeats} pairs; target <= 2)")
    for key, val in res.items():
        if key.endswith("/floor"):
            name = key[: -len("/floor")]
            print(f"  {name:<48s} {val:6.2f}x   ({res[name + '_ms']:9.1f} ms)")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    main()
