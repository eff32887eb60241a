"""Core performance benchmark: ratios measured within one process.

Run: ``python -m benchmarks core [--device cpu|cuda] [--dtype float32|bfloat16] [--quick]
[--threads N] [--only league] [--json FILE]``

Prints these groups of ratios for B=4, H=8, n=4096, d=64, r=256:

0. the Monte Carlo engine: every ``ka.montecarlo`` driver (and error-vs-r's inner loop) / the
   batched-matmul floor of the same work (``benchmarks.mc``; target <= 2x);
1. feature map time / bare ``x @ W.mT`` of the same shape (positive and trigonometric maps;
   targets 1.2x and 1.6x), eager and through ``torch.compile``, beside the floors that no eager
   map can beat (the GEMM into a preallocated buffer plus a new output r or 2r wide: fresh
   memory costs page faults on CPU, see ``bench_feature_maps``); 1b. the structured (SORF) projection / a dense projection (target
   1.5x) and QMC milliseconds per draw, vectorised scramble vs one scipy engine per draw;
2. non-causal ``linear_attention`` / its floor (two feature matmuls with their exp, phi(K)^T V,
   phi(Q) S), and / the same floor with phi(Q) written into phi(K)'s memory;
3. causal / non-causal time, and peak memory of the causal form at n = 4096 and 16384, in
   inference and in training (forward + backward, B = 1: the old autograd path against the
   recomputing backward, and the running-maximum path of signed maps and CUDA with and without
   recomputation; ``--only memory`` runs both memory groups);
4. a recurrent ``step`` at t = 100 000 / at t = 10;
5. the league: every registered estimator (from the registry, so new maps enter by registering),
   at equal feature dimension F = 256 (r from the registered ``feature_dim`` rule; where no r
   gives 256, the largest r with F < 256; maps with a fixed F at their own F), against FAVOR+
   (``PositiveRF``, r = F = 256, same iid sampler): ``features`` = fit(q, k) (data-dependent maps
   only: FAVOR++, FAVOR#, Nystrom fit per batch) + phi(q) + psi(k) (``fm(q)``,
   ``fm.key_features(k)``), and ``attention`` = non-causal ``linear_attention(..., fit=True)``;
   each divided by FAVOR+'s time. The target is <= 1.5x for each new map. Learned maps
   are timed untrained (training is a one-off cost).
6. the cost of ``linear_attention``'s opt-in closed-form check (``check=True``) relative to the
   call without it, and a default call on a small input, (1, 1, 64, 16) with r = 32, relative to
   the bare computation (`parallel_linear_attention`, the path without the entry point's wrapper;
   target < 2 %);
7. short causal calls: B = 32, H = 4, d_h = 16, r = 64 at n = 16, 48, 128, 512, forward and
   forward + backward, against the naive quadratic form (`naive_linear_attention`) and
   ``torch.nn.functional.scaled_dot_product_attention`` (``--only short``).
8. hybrid attention (``--only hybrid``): ``hybrid_attention`` with a window of w = 64 and
   FAVOR+ (r = 256) on the rest, the sliding token window (``window_mode="token"``) and the
   block-aligned one (``"block"``), each / ``linear_attention`` of the same causality
   (non-causal target <= 1.6x), forward without autograd; non-causal also with ``window = 33``
   (``|i - j| <= 32``: 65 keys, the causal window's size); and their peak memory at n = 4096 and
   16384 (the ``VmHWM`` method of group 3, B = 4, H = 8; a ratio near 4 = linear in n).

Times are medians over repeats after warm-up (``torch.cuda.synchronize`` on GPU). Peak memory
is ``torch.cuda.max_memory_allocated`` on GPU; on CPU the peak resident-set growth of a fresh
subprocess running only that call (``VmHWM`` after resetting it through ``/proc/self/clear_refs``,
minus ``VmRSS`` before the call), so it includes allocator slack; inference peaks are the least
of `MEM_TRIES` subprocesses.

Fresh memory: on CPU, glibc serves large tensors by ``mmap`` and their first write costs page
faults (~0.25 ms per MB here), as much as the GEMM for a (4, 8, 4096, 256) output. Ratios
therefore depend on the allocator: with PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` (transparent huge
pages) the GEMM baseline halves and every ratio against it rises. State it with the figures
(``docs/performance.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

import kernelapprox as ka
from benchmarks._common import median, timeit


def _inputs(B, H, n, d, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, B, H, n, d, generator=g).unbind(0)
    s = d**-0.25
    return (q * s).to(device, dtype), (k * s).to(device, dtype), v.to(device, dtype)


FEATURE_TARGETS = {"positive": 1.2, "hyperbolic": 1.6, "trig-sincos": 1.6}  # time / GEMM


COMPILED_MAPS = ("positive-gaussian", "hyperbolic-gaussian", "trig-sincos-gaussian", "trig-offset-gaussian")


def bench_feature_maps(B, H, n, d, r, device, dtype, repeats, rounds: int = 3,
                       compile_maps: bool = True) -> dict[str, float]:
    """Group 1: feature map time / bare ``q @ W.mT`` of the same shape. Each round times the GEMM
    and every map back to back; the ratio reported is the median over ``rounds`` of the per-round
    ratios (a load change on a shared machine then hits numerator and denominator alike).

    Also, per round and relative to the same GEMM: the GEMM into a preallocated buffer, and the
    allocation plus first write of an output r and 2r wide (``torch.empty(...).fill_``). On CPU
    a fresh buffer of this size is served by ``mmap``, and its first touch costs page faults,
    about as much as the GEMM itself; ``floor_*_wide`` = GEMM into a buffer + a new output of the
    map's width is what no eager map can beat, and it is already ~2x the GEMM for the 2r-wide
    maps (sin/cos, hyperbolic). With ``compile_maps``, the maps in `COMPILED_MAPS` are also timed
    through ``torch.compile(fm, fullgraph=True)`` (inductor fuses the bias and the exp/sin/cos
    into one pass after the GEMM; compile time not counted). ``exp_pass``, ``exp2_pass`` and
    ``sin+cos_pass`` are one elementwise pass over an (n, r) tensor into a warm buffer, relative to
    the same GEMM: the transcendental work a map cannot skip (exp2 is what the exponential maps use,
    `kernelapprox._logdomain.LOG2E`)."""
    q, _, _ = _inputs(B, H, n, d, device, dtype)
    W = torch.randn(r, d, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    maps = {
        "positive-gaussian": ka.PositiveRF(d, r, seed=0),
        "positive-orthogonal": ka.PositiveRF(d, r, sampler="orthogonal", seed=0),
        "positive-qmc": ka.PositiveRF(d, r, sampler="qmc", seed=0),
        "hyperbolic-gaussian": ka.HyperbolicRF(d, r, seed=0),
        "trig-sincos-gaussian": ka.TrigRF(d, r, seed=0),
        "trig-offset-gaussian": ka.TrigRF(d, r, variant="offset", seed=0),
        "positive-structured": ka.PositiveRF(d, r, sampler="structured", seed=0),
    }
    maps = {k: fm.to(device) for k, fm in maps.items()}
    compiled = {}
    if compile_maps:
        for name in COMPILED_MAPS:
            try:  # needs a C++ compiler on CPU (inductor); a missing one must not stop the benchmark
                cf = torch.compile(maps[name], dynamic=False, fullgraph=True)
                with torch.no_grad():
                    cf(q)
                compiled[f"compiled-{name}"] = cf
            except Exception as e:  # noqa: BLE001
                print(f"   compiled {name}: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    ratios: dict[str, list[float]] = {k: [] for k in (*maps, *compiled)}
    t_mms, t_warm, t_r, t_2r = [], [], [], []
    passes: dict[str, list[float]] = {"exp": [], "exp2": [], "sin+cos": []}
    buf = torch.empty(B, H, n, r, device=device, dtype=dtype)
    u = torch.matmul(q, W.mT).mul_(0.1)  # exponents of a realistic size (|u| of order 1)
    for _ in range(rounds):
        t_mm = timeit(lambda: q @ W.mT, device, repeats)
        t_mms.append(t_mm)
        t_warm.append(timeit(lambda: torch.matmul(q, W.mT, out=buf), device, repeats) / t_mm)
        t_r.append(timeit(lambda: torch.empty(B, H, n, r, device=device, dtype=dtype).fill_(1.0), device,
                          repeats) / t_mm)
        t_2r.append(timeit(lambda: torch.empty(B, H, n, 2 * r, device=device, dtype=dtype).fill_(1.0), device,
                           repeats) / t_mm)
        # one elementwise pass over an (n, r) input into a warm (n, r) buffer: the compute that
        # no map of that kind skips (sin/cos: both, two passes)
        passes["exp"].append(timeit(lambda: torch.exp(u, out=buf), device, repeats) / t_mm)
        passes["exp2"].append(timeit(lambda: torch.exp2(u, out=buf), device, repeats) / t_mm)
        passes["sin+cos"].append(timeit(lambda: (torch.sin(u, out=buf), torch.cos(u, out=buf)), device,
                                        repeats) / t_mm)
        for name, fm in (*maps.items(), *compiled.items()):
            ratios[name].append(timeit(lambda fm=fm: fm(q), device, repeats) / t_mm)

    out = {"matmul_ms": 1e3 * median(t_mms), "matmul_into_buffer/matmul": median(t_warm),
           "new_output_r/matmul": median(t_r), "new_output_2r/matmul": median(t_2r)}
    # No eager map can beat the GEMM into a warm buffer plus allocating and writing its output.
    out["floor_r_wide/matmul"] = out["matmul_into_buffer/matmul"] + out["new_output_r/matmul"]
    out["floor_2r_wide/matmul"] = out["matmul_into_buffer/matmul"] + out["new_output_2r/matmul"]
    for name, rs in passes.items():
        out[f"{name}_pass/matmul"] = median(rs)
    for name, rs in ratios.items():
        out[f"{name}/matmul"] = median(rs)
    return out


def bench_structured_qmc(B, H, n, d, r, device, dtype, repeats, rounds: int = 3,
                         qmc_draws: int = 200) -> dict[str, float]:
    """Group 1b: the SORF projection / a dense projection of the same shape (target <= 1.5 at
    d = 64), now (cached dense W below ``HadamardProjection.dense_max_dim``) and before (three
    butterfly FWHTs); and the QMC sampler's time per draw, vectorised scramble (now) against one
    scipy engine per draw (before), at (r, d) = (256, 64) and (16, 4)."""
    import warnings

    import numpy as np

    from kernelapprox.samplers import QMCSampler, make_generator

    q, _, _ = _inputs(B, H, n, d, device, dtype)
    W = torch.randn(r, d, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    proj = ka.PositiveRF(d, r, sampler="structured", seed=0).to(device).projection
    now, before = [], []
    for _ in range(rounds):
        t_dense = timeit(lambda: q @ W.mT, device, repeats)
        now.append(timeit(lambda: proj(q), device, repeats) / t_dense)
        before.append(timeit(lambda: proj._apply_transform(q, "butterfly"), device, max(1, repeats // 3)) / t_dense)
    out = {
        "structured_projection/dense": median(now),
        "structured_projection_butterfly/dense": median(before),
    }
    for rq, dq in ((r, d), (16, 4)):
        for method in ("sobol", "halton"):
            smp = QMCSampler(method)
            smp.sample(rq, dq, batch_shape=(2,), generator=make_generator(0))  # warm (scipy import)
            t0 = time.perf_counter()
            smp.sample(rq, dq, batch_shape=(qmc_draws,), generator=make_generator(0))
            t_new = (time.perf_counter() - t0) / qmc_draws
            k = max(5, qmc_draws // 10)
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                for i in range(k):  # the old path: one scrambled scipy engine per draw
                    smp._engine(dq, scramble=True, rng=np.random.default_rng(i)).random(rq)
            t_old = (time.perf_counter() - t0) / k
            out[f"qmc-{method}_r{rq}_d{dq}_ms_per_draw_now"] = 1e3 * t_new
            out[f"qmc-{method}_r{rq}_d{dq}_ms_per_draw_before"] = 1e3 * t_old
            out[f"qmc-{method}_r{rq}_d{dq}_speedup"] = t_old / t_new
    return out


def bench_attention(B, H, n, d, r, device, dtype, repeats, rounds: int = 3) -> dict[str, float]:
    r"""Group 2 and the times of group 3 (module docstring). The floor is the work no linear
    attention can skip: the two feature GEMMs with their exponential (``exp2`` in place, $\log_2 e$
    folded into $W$), $\varphi(K)^\top V$
    and $\varphi(Q) S$; ``floor_recycled`` is the same work with $\varphi(Q)$ written into the
    memory of $\varphi(K)$ (as the non-causal ``linear_attention`` does without autograd: a fresh
    buffer costs page faults on CPU). The calls are timed in interleaved rounds and each keeps its
    fastest round, so that a change of load on a shared machine hits all of them alike."""
    q, k, v = _inputs(B, H, n, d, device, dtype)
    fm = ka.PositiveRF(d, r, sampler="orthogonal", seed=0).to(device)
    cdt = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    # log2(e) folded into W and exp2 in place: the fastest exponential there is (torch.exp2 is
    # 2.5x faster than torch.exp on CPU), as the library's maps use it
    W = fm.weight.to(cdt) * ka._logdomain.LOG2E
    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)

    def floor():
        a = torch.matmul(qc, W.mT).exp2_()
        b = torch.matmul(kc, W.mT).exp2_()
        return torch.matmul(a, torch.matmul(b.mT, vc))

    def floor_recycled():
        # the same work with phi(Q) written into the memory of phi(K), as linear_attention does
        b = torch.matmul(kc, W.mT).exp2_()
        S = torch.matmul(b.mT, vc)
        a = torch.matmul(qc, W.mT, out=b).exp2_()
        return torch.matmul(a, S)

    fns = {
        "floor": floor,
        "floor_recycled": floor_recycled,
        "parallel": lambda: ka.linear_attention(q, k, v, fm, check=False),
        "causal": lambda: ka.linear_attention(q, k, v, fm, causal=True, check=False),
    }
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], timeit(fn, device, max(1, repeats // rounds + 1), warmup=1))
    return {
        "floor_ms": 1e3 * best["floor"],
        "floor_recycled_ms": 1e3 * best["floor_recycled"],
        "parallel_ms": 1e3 * best["parallel"],
        "causal_ms": 1e3 * best["causal"],
        "parallel/floor": best["parallel"] / best["floor"],
        "parallel/floor_recycled": best["parallel"] / best["floor_recycled"],
        "causal/floor": best["causal"] / best["floor"],
        "causal/parallel": best["causal"] / best["parallel"],
    }


# What both peak-memory subprocesses start with: imports and VmRSS/VmHWM from /proc.
_CHILD_PRELUDE = r"""
import json, sys, torch, kernelapprox as ka

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024  # MiB
"""

_MEM_CHILD = _CHILD_PRELUDE + r"""
n, causal = int(sys.argv[1]), sys.argv[2] == "1"
B, H, d, r = 4, 8, 64, 256
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B, H, n, d, generator=g) for _ in range(3))
q.mul_(d ** -0.25)
k.mul_(d ** -0.25)
fm = ka.PositiveRF(d, r, sampler="orthogonal", seed=0)
small = ka.linear_attention(q[..., :64, :], k[..., :64, :], v[..., :64, :], fm, causal=causal)
with open("/proc/self/clear_refs", "w") as f:  # reset the peak-RSS mark (VmHWM)
    f.write("5")
base = status("VmRSS")
with torch.no_grad():
    out = ka.linear_attention(q, k, v, fm, causal=causal)
peak = status("VmHWM")
print(json.dumps({"peak_mib": peak - base, "inputs_mib": 3 * q.numel() * 4 / 2**20,
                  "features_mib": 2 * B * H * n * r * 4 / 2**20}))
"""


#: ``n`` of the memory figures under ``--quick`` (the memory group: n and 4n). Each figure is a
#: fresh subprocess whose imports cost ~1.5 s of CPU, so the compute at this n is a fraction of it.
QUICK_MEM_N = 256

#: Subprocesses per CPU peak-memory figure; the least is reported. The resident-set peak includes
#: what glibc keeps of freed memory, which varies from run to run (causal inference at n = 16 384:
#: 1352, 1677 and 1352 MiB in three runs of the same call), while the least slack is reproducible.
MEM_TRIES = 3


def bench_memory(device: torch.device, ns=(4096, 16384), tries: int = MEM_TRIES,
                 causals=(False, True)) -> dict[str, float]:
    """Group 3, memory: peak memory of one inference call of ``linear_attention`` (B = 4, H = 8,
    d = 64, r = 256) at each ``n`` of ``ns`` (two values), non-causal and causal (``causals``), and
    the ratio of the second to the first (CPU: the least of ``tries`` fresh subprocesses; CUDA:
    ``max_memory_allocated``)."""
    out = {}
    for causal in causals:
        for n in ns:
            if device.type == "cuda":
                q, k, v = _inputs(4, 8, n, 64, device, torch.float32)
                fm = ka.PositiveRF(64, 256, sampler="orthogonal", seed=0).to(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                with torch.no_grad():
                    ka.linear_attention(q, k, v, fm, causal=causal)
                peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
            else:
                peaks = []
                for _ in range(tries):
                    res = subprocess.run(
                        [sys.executable, "-c", _MEM_CHILD, str(n), "1" if causal else "0"],
                        capture_output=True, text=True, check=True,
                    )
                    peaks.append(json.loads(res.stdout.strip().splitlines()[-1])["peak_mib"])
                peak = min(peaks)
            out[f"{'causal' if causal else 'parallel'}_peak_mib_n{n}"] = peak
    for kind in ("causal" if c else "parallel" for c in causals):
        a, b = out[f"{kind}_peak_mib_n{ns[0]}"], out[f"{kind}_peak_mib_n{ns[1]}"]
        out[f"{kind}_peak_ratio_n{ns[1]}/n{ns[0]}"] = b / a
    return out


_TRAIN_CHILD = _CHILD_PRELUDE + r"""
from benchmarks.core import train_path

n, path, B = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
H, d, r = 8, 64, 256
fm, kw = train_path(path, d, r)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B, H, n, d, generator=g) for _ in range(3))
q.mul_(d ** -0.25)
k.mul_(d ** -0.25)
q, k, v = (t.requires_grad_() for t in (q, k, v))
small = ka.chunk_linear_attention(q[..., :64, :], k[..., :64, :], v[..., :64, :], fm, **kw)
small.sum().backward()
q.grad = k.grad = v.grad = None
with open("/proc/self/clear_refs", "w") as f:  # reset the peak-RSS mark (VmHWM)
    f.write("5")
base = status("VmRSS")
ka.chunk_linear_attention(q, k, v, fm, **kw).sum().backward()
peak = status("VmHWM")
print(json.dumps({"peak_mib": peak - base, "features_mib": 2 * B * H * n * r * 4 / 2**20}))
"""


_REPO = str(Path(__file__).resolve().parents[1])  # where `benchmarks` is importable
TRAIN_PATHS = ("old", "new", "runmax", "trig-autograd", "trig")


def train_path(path: str, d: int, r: int) -> tuple[ka.FeatureMap, dict[str, object]]:
    """The map of ``path`` (one of `TRAIN_PATHS`) and the arguments of ``chunk_linear_attention``
    that choose its algorithm: "old" plain autograd through the running-maximum path; "new" the
    shared-scale path with its recomputing backward; "runmax" the running-maximum path with
    recomputed runs (what CUDA and signed maps take); "trig" / "trig-autograd" ``TrigRF`` (signed)
    with / without recomputation."""
    kw: dict[str, object] = {"_path": "shared" if path == "new" else "runmax",
                             "_recompute": path in ("new", "runmax", "trig")}
    if path.startswith("trig"):
        return ka.TrigRF(d, r, seed=0), kw
    return ka.PositiveRF(d, r, sampler="orthogonal", seed=0), kw


def bench_train_memory(device: torch.device, ns=(4096, 16384), B: int = 1,
                       paths: tuple[str, ...] = TRAIN_PATHS) -> dict[str, float]:
    """Peak memory of causal training (forward + backward of ``linear_attention(causal=True)``,
    B x H=8 heads, d=64, r=256, float32), per path of `TRAIN_PATHS`: FAVOR+ on the
    running-maximum path with autograd through every chunk ("old"), on the shared-scale path with
    the recomputing backward ("new", which saves only its inputs), and on the running-maximum
    path with recomputed runs of 8 chunks ("runmax", the path of CUDA tensors); ``TrigRF``
    (signed features, always the running-maximum path) without and with recomputation. CPU: the
    ``VmHWM`` method of `bench_memory` in a fresh subprocess; CUDA: ``max_memory_allocated``.
    ``paths``: a subset of `TRAIN_PATHS` (the ratios of the paths measured)."""
    out: dict[str, float] = {}
    for n in ns:
        for path in paths:
            if device.type == "cuda":
                fm, kw = train_path(path, 64, 256)
                fm = fm.to(device)
                q, k, v = (t.requires_grad_() for t in _inputs(B, 8, n, 64, device, torch.float32))
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                ka.chunk_linear_attention(q, k, v, fm, **kw).sum().backward()  # type: ignore[union-attr]
                peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
            else:
                res = subprocess.run(  # the child imports train_path from this package
                    [sys.executable, "-c", _TRAIN_CHILD, str(n), path, str(B)],
                    capture_output=True, text=True, check=True, cwd=_REPO,
                )
                peak = json.loads(res.stdout.strip().splitlines()[-1])["peak_mib"]
            out[f"train_{path}_peak_mib_n{n}"] = peak
        for a, b in (("new", "old"), ("runmax", "old"), ("trig", "trig-autograd")):
            if a in paths and b in paths:
                out[f"train_{a}/{b}_n{n}"] = out[f"train_{a}_peak_mib_n{n}"] / out[f"train_{b}_peak_mib_n{n}"]
    return out


#: Target of the non-causal hybrid: time / non-causal linear attention.
HYBRID_TARGET = 1.6


def bench_hybrid(B, H, n, d, r, device, dtype, repeats, window: int = 64, rounds: int = 3) -> dict[str, float]:
    """Group 8, times: ``hybrid_attention`` (token and block window) / ``linear_attention``, per
    causality. Interleaved rounds, each call keeps its fastest round (as `bench_attention`)."""
    q, k, v = _inputs(B, H, n, d, device, dtype)
    fm = ka.PositiveRF(d, r, sampler="orthogonal", seed=0).to(device)
    fns = {}
    for causal in (False, True):
        kind = "causal" if causal else "parallel"
        fns[f"{kind}/linear"] = lambda c=causal: ka.linear_attention(q, k, v, fm, causal=c, check=False)
        for mode in ("token", "block"):
            fns[f"{kind}/hybrid_{mode}"] = lambda c=causal, m=mode: ka.hybrid_attention(
                q, k, v, fm, window=window, causal=c, window_mode=m)
    # non-causal with a window of `window` keys in all (|i - j| <= window // 2), the causal
    # window's size: ``window`` alone is |i - j| < window, 2 window - 1 keys
    half = window // 2 + 1
    for mode in ("token", "block"):
        fns[f"parallel_keys{window}/hybrid_{mode}"] = lambda m=mode: ka.hybrid_attention(
            q, k, v, fm, window=half, causal=False, window_mode=m)
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], timeit(fn, device, max(1, repeats // rounds + 1), warmup=1))
    out = {f"hybrid/{name}_ms": 1e3 * t for name, t in best.items()}
    for kind in ("parallel", "causal"):
        for mode in ("token", "block"):
            out[f"hybrid/{kind}_{mode}/linear"] = best[f"{kind}/hybrid_{mode}"] / best[f"{kind}/linear"]
    for mode in ("token", "block"):
        out[f"hybrid/parallel_keys{window}_{mode}/linear"] = (best[f"parallel_keys{window}/hybrid_{mode}"]
                                                             / best["parallel/linear"])
    return out


_HYBRID_MEM_CHILD = _CHILD_PRELUDE + r"""
n, causal, mode, B, H, d, r, w = sys.argv[1], sys.argv[2] == "1", sys.argv[3], *map(int, sys.argv[4:9])
n = int(n)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B, H, n, d, generator=g) for _ in range(3))
q.mul_(d ** -0.25)
k.mul_(d ** -0.25)
fm = ka.PositiveRF(d, r, sampler="orthogonal", seed=0)
def call(q, k, v):
    if mode == "linear":
        return ka.linear_attention(q, k, v, fm, causal=causal)
    return ka.hybrid_attention(q, k, v, fm, window=w, causal=causal, window_mode=mode)
small = call(q[..., :4 * w, :], k[..., :4 * w, :], v[..., :4 * w, :])
with open("/proc/self/clear_refs", "w") as f:  # reset the peak-RSS mark (VmHWM)
    f.write("5")
base = status("VmRSS")
with torch.no_grad():
    out = call(q, k, v)
peak = status("VmHWM")
print(json.dumps({"peak_mib": peak - base}))
"""


def bench_hybrid_memory(device: torch.device, ns=(4096, 16384), B: int = 4, H: int = 8, d: int = 64, r: int = 256,
                        window: int = 64, tries: int = MEM_TRIES, modes=("linear", "token", "block"),
                        causals=(False, True)) -> dict[str, float]:
    """Group 8, memory: peak memory of one inference call of linear attention and of the token- and
    block-window hybrids (``modes``), at each ``n`` of ``ns``, and the ratio of the last to the first
    when there are two or more (CPU: the least peak resident-set growth of ``tries`` fresh
    subprocesses, `bench_memory`'s method; CUDA: ``max_memory_allocated``)."""
    out: dict[str, float] = {}
    for causal in causals:
        kind = "causal" if causal else "parallel"
        for mode in modes:
            for n in ns:
                if device.type == "cuda":
                    q, k, v = _inputs(B, H, n, d, device, torch.float32)
                    fm = ka.PositiveRF(d, r, sampler="orthogonal", seed=0).to(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                    with torch.no_grad():
                        if mode == "linear":
                            ka.linear_attention(q, k, v, fm, causal=causal)
                        else:
                            ka.hybrid_attention(q, k, v, fm, window=window, causal=causal, window_mode=mode)
                    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
                else:
                    peaks = []
                    for _ in range(tries):
                        res = subprocess.run(
                            [sys.executable, "-c", _HYBRID_MEM_CHILD, str(n), "1" if causal else "0", mode,
                             str(B), str(H), str(d), str(r), str(window)],
                            capture_output=True, text=True, check=True, cwd=_REPO,
                        )
                        peaks.append(json.loads(res.stdout.strip().splitlines()[-1])["peak_mib"])
                    peak = min(peaks)
                out[f"hybrid_mem/{kind}_{mode}_peak_mib_n{n}"] = peak
            if len(ns) > 1:  # the growth with n (one n, as under --quick: no ratio)
                a, b = out[f"hybrid_mem/{kind}_{mode}_peak_mib_n{ns[0]}"], out[f"hybrid_mem/{kind}_{mode}_peak_mib_n{ns[-1]}"]
                out[f"hybrid_mem/{kind}_{mode}_ratio_n{ns[-1]}/n{ns[0]}"] = b / a if a > 0 else float("nan")
    return out


def bench_recurrent(device: torch.device, dtype, repeats: int, t_long: int = 100_000,
                    steps: int = 50) -> dict[str, float]:
    """Group 4: microseconds per ``RecurrentLinearAttention.step`` (H = 8, d = 64, r = 256) after a
    prefill of t = 10 and t = ``t_long`` tokens, each the median over ``repeats`` runs of ``steps``
    steps, and their ratio (the state does not grow with t: a ratio near 1)."""
    H, d, r = 8, 64, 256
    fm = ka.PositiveRF(d, r, sampler="orthogonal", seed=0).to(device)
    res = {}
    for t in (10, t_long):
        q, k, v = _inputs(1, H, t, d, device, dtype, seed=2)
        with torch.no_grad():
            _, state = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=256, return_state=True)
        qt, kt, vt = (x[:, :, 0, :] for x in _inputs(1, H, 1, d, device, dtype, seed=3))
        rnn = ka.RecurrentLinearAttention(fm, state=state)

        def run(rnn=rnn, st=state, qt=qt, kt=kt, vt=vt, n_steps=steps):
            rnn.state = st
            for _ in range(n_steps):
                rnn.step(qt, kt, vt)

        res[f"step_us_t{t}"] = 1e6 * timeit(run, device, repeats) / steps
    res[f"step_t{t_long}/step_t10"] = res[f"step_us_t{t_long}"] / res["step_us_t10"]
    return res


LEAGUE_F = 256
LEAGUE_TARGET = 1.5  # the bound on each new map's time relative to FAVOR+


def _league_r(est: ka.Estimator, F: int, d: int) -> int:
    """r with feature_dim(r, d) = F, else the largest r with feature_dim(r, d) < F; ``d`` for
    maps whose feature_dim does not depend on r."""
    def fd(r: int) -> int:
        return est.feature_dim(r, d)

    if fd(16) == fd(32):
        return d
    r = 1
    while fd(r + 1) <= F and r < 8 * F:
        r += 1
    return r


def bench_league(B, H, n, d, device, dtype, repeats, F: int = LEAGUE_F) -> dict[str, float]:
    """Group 5 (module docstring): per registered estimator, time relative to FAVOR+."""
    q, k, v = _inputs(B, H, n, d, device, dtype)
    out: dict[str, float] = {}

    def fwd(fm, fit: bool):
        def run():
            if fit:
                fm.fit(q, k)
            fm(q)
            fm.key_features(k)
        return run

    ref = ka.PositiveRF(d, F, seed=0).to(device)
    t_feat = timeit(fwd(ref, False), device, repeats)
    t_attn = timeit(lambda: ka.linear_attention(q, k, v, ref), device, repeats)
    out["favor+_features_ms"] = 1e3 * t_feat
    out["favor+_attention_ms"] = 1e3 * t_attn
    for est in ka.estimators():
        if est.name == "positive":
            continue
        r = _league_r(est, F, d)
        try:
            kw = {"sampler": "gaussian"} if est.is_random else {}  # FAVOR+'s iid rows
            fm = est.build(d, r, seed=0, **kw).to(device)
            fit = bool(getattr(est, "data_dependent", False))
            tf = timeit(fwd(fm, fit), device, repeats)
            ta = timeit(lambda fm=fm, fit=fit: ka.linear_attention(q, k, v, fm, fit=fit), device, repeats)
        except Exception as e:  # noqa: BLE001 - one broken map must not stop the benchmark
            print(f"   league/{est.name}: failed ({type(e).__name__}: {e})")
            continue
        out[f"league/{est.name}/r"] = float(r)
        out[f"league/{est.name}/F"] = float(fm.feature_dim)
        out[f"league/{est.name}/features_vs_favor+"] = tf / t_feat
        out[f"league/{est.name}/attention_vs_favor+"] = ta / t_attn
        if abs(fm.feature_dim - F) > 0.1 * F:
            # a map whose feature_dim is fixed far from F (Taylor: 1 + d + d(d+1)/2) is also
            # compared with FAVOR+ at its own feature_dim
            ref2 = ka.PositiveRF(d, fm.feature_dim, seed=0).to(device)
            out[f"league/{est.name}/features_vs_favor+_same_F"] = tf / timeit(fwd(ref2, False), device, repeats)
            out[f"league/{est.name}/attention_vs_favor+_same_F"] = ta / timeit(
                lambda ref2=ref2: ka.linear_attention(q, k, v, ref2), device, repeats)
    return out


def bench_check(B, H, n, d, r, device, dtype, repeats, quick: bool = False) -> dict[str, float]:
    """Group 6: cost of ``linear_attention``'s closed-form check (``check=True``, opt-in)
    relative to the call without it, non-causal and causal, FAVOR+ with orthogonal rows. Inputs at
    sigma = 0.25 so that nothing warns (the cost of the check, not of printing a warning).
    ``quick``: one round, and the small-call rows from 2 rounds of 25 calls (a smoke run)."""
    q, k, v = _inputs(B, H, n, d, device, dtype)
    q, k = 0.25 * q, 0.25 * k
    fm = ka.PositiveRF(d, r, sampler="orthogonal", batch_shape=(H,), seed=0).to(device)
    out: dict[str, float] = {}
    for causal in (False, True):
        name = "causal" if causal else "parallel"
        # interleaved repeats of the two variants, so that a load change hits both alike
        on, off = [], []
        for _ in range(1 if quick else 3):
            on.append(timeit(lambda c=causal: ka.linear_attention(q, k, v, fm, causal=c), device, repeats))
            off.append(timeit(lambda c=causal: ka.linear_attention(q, k, v, fm, causal=c, check=False),
                              device, repeats))
        out[f"check/{name}_ms_with"] = 1e3 * min(on)
        out[f"check/{name}_ms_without"] = 1e3 * min(off)
        out[f"check/{name}_overhead"] = min(on) / min(off) - 1.0
    # the check alone (an A/B of whole calls is within their noise): its time / the call's time
    from kernelapprox.diagnose import quick_relative_mse

    t_check = timeit(lambda: quick_relative_mse(fm, q, k), device, repeats)
    out["check/alone_ms"] = 1e3 * t_check
    out["check/alone_vs_parallel"] = t_check / min(out["check/parallel_ms_without"] / 1e3, 1e9)
    out["check/alone_vs_causal"] = t_check / (out["check/causal_ms_without"] / 1e3)
    out.update(bench_small_call(device, dtype, 1, rounds=2, calls=25) if quick
               else bench_small_call(device, dtype, max(repeats, 7)))
    return out


def bench_small_call(device: torch.device, dtype, repeats: int, rounds: int = 5,
                     calls: int = 200) -> dict[str, float]:
    """A default ``ka.linear_attention`` call on (1, 1, 64, 16), r = 32, FAVOR+, against the bare
    computation (``parallel_linear_attention``, the same path without the entry point's wrapper):
    interleaved rounds of ``calls`` calls each, the least time per call of each."""
    from kernelapprox.attention import parallel_linear_attention

    q, k, v = _inputs(1, 1, 64, 16, device, dtype)
    fm = ka.PositiveRF(16, 32, seed=0).to(device)

    def many(fn):
        def run():
            for _ in range(calls):
                fn()
        return run

    fns = {"default": many(lambda: ka.linear_attention(q, k, v, fm)),
           "bare": many(lambda: parallel_linear_attention(q, k, v, fm))}
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], timeit(fn, device, repeats, warmup=1) / calls)
    return {"small_call/default_us": 1e6 * best["default"], "small_call/bare_us": 1e6 * best["bare"],
            "small_call/default_vs_bare": best["default"] / best["bare"] - 1.0}


SHORT_NS = (16, 48, 128, 512)


def bench_short_causal(device: torch.device, dtype, repeats: int, ns=SHORT_NS,
                       B: int = 32, H: int = 4, dh: int = 16, r: int = 64, rounds: int = 3) -> dict[str, float]:
    """Group 7: causal calls on short sequences, forward and forward + backward (of the sum of the
    output, with respect to q, k and v), in milliseconds: ``linear_attention(causal=True)``, the
    naive quadratic form and SDPA (``is_causal=True``, exact softmax attention). Interleaved rounds,
    the least time of each."""
    fm = ka.PositiveRF(dh, r, sampler="orthogonal", seed=0).to(device)
    out: dict[str, float] = {}
    for n in ns:
        q, k, v = _inputs(B, H, n, dh, device, dtype)
        fns = {
            "linear": lambda q, k, v: ka.linear_attention(q, k, v, fm, causal=True),
            "naive": lambda q, k, v: ka.naive_linear_attention(q, k, v, fm, causal=True),
            "sdpa": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
        }
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

        def train(fn, leaves=leaves):
            def run():
                with torch.enable_grad():
                    fn(*leaves).sum().backward()
                for t in leaves:
                    t.grad = None
            return run

        best: dict[str, float] = {}
        for _ in range(rounds):
            for name, fn in fns.items():
                for mode, call in (("fwd", lambda fn=fn, q=q, k=k, v=v: fn(q, k, v)), ("fwdbwd", train(fn))):
                    key = f"short/{name}_{mode}_ms_n{n}"
                    best[key] = min(best.get(key, float("inf")), 1e3 * timeit(call, device, repeats, warmup=1))
        out.update(best)
        for mode in ("fwd", "fwdbwd"):
            lin = best[f"short/linear_{mode}_ms_n{n}"]
            out[f"short/linear/naive_{mode}_n{n}"] = lin / best[f"short/naive_{mode}_ms_n{n}"]
            out[f"short/linear/sdpa_{mode}_n{n}"] = lin / best[f"short/sdpa_{mode}_ms_n{n}"]
    return out


def _league_verdicts(res: dict[str, float]) -> list[str]:
    """One line per estimator: its two ratios against the 1.5x target."""
    lines = []
    names = sorted({k.split("/")[1] for k in res if k.startswith("league/")})
    for name in names:
        f, a = res.get(f"league/{name}/features_vs_favor+"), res.get(f"league/{name}/attention_vs_favor+")
        if f is None or a is None:
            continue
        ok = max(f, a) <= LEAGUE_TARGET
        line = (f"   {name:20s} F={int(res[f'league/{name}/F']):5d}  features x{f:6.2f}  "
                f"attention x{a:6.2f}  {'within' if ok else 'ABOVE'} {LEAGUE_TARGET}x FAVOR+")
        fs, as_ = res.get(f"league/{name}/features_vs_favor+_same_F"), res.get(f"league/{name}/attention_vs_favor+_same_F")
        if fs is not None and as_ is not None:
            line += f"  (vs FAVOR+ at the same F: features x{fs:.2f}, attention x{as_:.2f})"
        lines.append(line)
    return lines


def _verdicts(name: str, part: dict[str, float]) -> list[str]:
    """The lines comparing a group's ratios with their targets (league, hybrid, feature maps)."""
    if name.startswith("league"):
        return _league_verdicts(part)
    if name.startswith("hybrid (w"):
        val = part["hybrid/parallel_block/linear"]
        return [f"   non-causal block hybrid x{val:5.2f} linear attention  "
                f"{'within' if val <= HYBRID_TARGET else 'ABOVE'} target {HYBRID_TARGET}x"]
    if name == "feature maps":
        return [f"   {m:20s} x{part[f'{m}-gaussian/matmul']:5.2f} GEMM  "
                f"{'within' if part[f'{m}-gaussian/matmul'] <= t else 'ABOVE'} target {t}x"
                for m, t in FEATURE_TARGETS.items()]
    return []


def _cpu_seconds() -> float:
    """CPU time of this process and its finished subprocesses (user + system), in seconds."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _error_summary(e: BaseException, frames: int = 3) -> str:
    """``Type: message`` of ``e`` and the last ``frames`` frames of its traceback, indented."""
    tb = traceback.extract_tb(e.__traceback__)[-frames:]
    lines = [f"   {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]
    lines += [f"     at {Path(f.filename).name}:{f.lineno} in {f.name}: {(f.line or '').strip()}" for f in tb]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, float] | int:
    """Command line: print every group's ratios; a group that raises is reported (its error and
    where) and the others run; the status is 1 if any failed, else the results as a dict."""
    p = argparse.ArgumentParser(prog="python -m benchmarks core", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="n=512 (memory n=256), fewer repeats (a smoke run)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's own)")
    p.add_argument("--only", default="", help="run only the groups whose name starts with this "
                   "(monte carlo | feature maps | attention | memory | memory in training | recurrent | league | "
                   "check | short | hybrid)")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    B, H, n, d, r = 4, 8, (512 if a.quick else 4096), 64, 256
    reps = 2 if a.quick else a.repeats
    # --quick: every group at small sizes (the league at B=1, H=2, hybrid times at B=2, H=4, the
    # memory figures at n = QUICK_MEM_N), one round (one Monte Carlo pair, a twentieth of its
    # draws), one subprocess per memory figure and fewer of them, as each costs its imports (~1.5 s
    # of CPU): inference causal only, training the old and new paths at one n, hybrid linear and
    # token windows, causal, at one n; no torch.compile of the feature maps (minutes of Inductor on
    # a CPU): a smoke run of every group (CPU seconds in docs/performance.md)
    rounds = 1 if a.quick else 3
    tries = 1 if a.quick else MEM_TRIES
    n_mem = QUICK_MEM_N if a.quick else n
    print(f"device={device} dtype={dtype} B={B} H={H} n={n} d={d} r={r} threads={torch.get_num_threads()}")
    results: dict[str, float] = {}
    failed: list[str] = []
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    from benchmarks.mc import bench_mc

    for name, fn in (
        ("monte carlo (driver / batched-matmul floor)",
         lambda: bench_mc(device, dtype, 1 if a.quick else reps, quick=a.quick)),
        ("feature maps", lambda: bench_feature_maps(B, H, n, d, r, device, dtype, reps, rounds,
                                                    compile_maps=not a.quick)),
        ("feature maps: structured projection and QMC draws",
         lambda: bench_structured_qmc(B, H, n, d, r, device, dtype, reps, rounds, 20 if a.quick else 200)),
        ("attention", lambda: bench_attention(B, H, n, d, r, device, dtype, reps, rounds)),
        ("memory", lambda: bench_memory(device, (n_mem, 4 * n_mem), tries,
                                        causals=(True,) if a.quick else (False, True))),
        ("memory in training (causal, B=1, forward + backward)",
         lambda: bench_train_memory(device, (n_mem,) if a.quick else (n, 4 * n),
                                    paths=("old", "new") if a.quick else TRAIN_PATHS)),
        ("recurrent", lambda: bench_recurrent(device, dtype, reps, 1000 if a.quick else 100_000,
                                              steps=10 if a.quick else 50)),
        (f"league (equal feature_dim F = {LEAGUE_F}, time / FAVOR+, fit included)",
         lambda: bench_league(1 if a.quick else B, 2 if a.quick else H, n, d, device, dtype, reps)),
        ("check (the KernelApproxWarning prediction, opt-in; and a small default call / bare)",
         lambda: bench_check(B, H, n, d, r, device, dtype, reps, quick=a.quick)),
        ("short causal (B=32, H=4, d_h=16, r=64; ms and ratios)",
         lambda: bench_short_causal(device, dtype, reps, (16, 128) if a.quick else SHORT_NS, rounds=rounds)),
        ("hybrid (w=64: token and block window / linear attention)",
         lambda: bench_hybrid(2 if a.quick else B, 4 if a.quick else H, n, d, r, device, dtype, reps,
                              rounds=rounds)),
        ("hybrid memory (peak MiB, inference)",
         lambda: bench_hybrid_memory(device, (n_mem,) if a.quick else (n, 4 * n), tries=tries,
                                     modes=("linear", "token") if a.quick else ("linear", "token", "block"),
                                     causals=(True,) if a.quick else (False, True))),
    ):
        if a.only and not name.startswith(a.only):
            continue
        t0, c0 = time.perf_counter(), _cpu_seconds()
        try:
            part = fn()
            lines = [f"-- {name} ({time.perf_counter() - t0:.1f} s wall, {_cpu_seconds() - c0:.1f} s CPU)"]
            lines += [f"   {key:42s} {val:10.3f}" for key, val in part.items()]
            lines += _verdicts(name, part)
        except Exception as e:  # noqa: BLE001 - one failing group must not stop the others
            failed.append(name)
            print(f"-- {name}: FAILED after {time.perf_counter() - t0:.1f} s")
            print(_error_summary(e))
            continue
        print("\n".join(lines))
        results.update(part)
    print(f"{len(results)} figures, {len(failed)} failed group(s); {time.perf_counter() - start:.1f} s wall, "
          f"{_cpu_seconds() - cpu_start:.1f} s CPU")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": str(device), "dtype": a.dtype, **results, "failed": failed}, f, indent=1)
    if failed:
        print(f"{len(failed)} group(s) failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return results


if __name__ == "__main__":
    res = main()
    sys.exit(res if isinstance(res, int) else 0)
