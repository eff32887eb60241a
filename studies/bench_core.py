"""Core performance benchmark (issue 2): ratios measured within one process.

Run: ``python -m studies.bench_core [--device cpu|cuda] [--dtype float32|bfloat16] [--quick]``

Prints four groups of ratios for B=4, H=8, n=4096, d=64, r=256:

1. feature map time / bare ``x @ W.mT`` of the same shape (positive and trigonometric maps);
2. non-causal ``linear_attention`` / its matmul floor (two feature matmuls + phi(K)^T V + phi(Q) S);
3. causal / non-causal time, and peak memory of the causal form at n = 4096 and 16384;
4. a recurrent ``step`` at t = 100 000 / at t = 10.

Times are medians over repeats after warm-up (``torch.cuda.synchronize`` on GPU). Peak memory
is ``torch.cuda.max_memory_allocated`` on GPU; on CPU the peak resident-set growth of a fresh
subprocess running only that call (``VmHWM`` after resetting it through ``/proc/self/clear_refs``,
minus ``VmRSS`` before the call), so it includes allocator slack.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable

import torch

import kernelapprox as ka


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn: Callable[[], object], device: torch.device, repeats: int = 7, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in seconds."""
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        _sync(device)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def _inputs(B, H, n, d, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, B, H, n, d, generator=g).unbind(0)
    s = d**-0.25
    return (q * s).to(device, dtype), (k * s).to(device, dtype), v.to(device, dtype)


def bench_feature_maps(B, H, n, d, r, device, dtype, repeats) -> dict[str, float]:
    q, _, _ = _inputs(B, H, n, d, device, dtype)
    W = torch.randn(r, d, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    t_mm = timeit(lambda: q @ W.mT, device, repeats)
    out = {"matmul_ms": 1e3 * t_mm}
    maps = {
        "positive-gaussian": ka.PositiveRF(d, r, seed=0),
        "positive-orthogonal": ka.PositiveRF(d, r, sampler="orthogonal", seed=0),
        "positive-qmc": ka.PositiveRF(d, r, sampler="qmc", seed=0),
        "hyperbolic-gaussian": ka.HyperbolicRF(d, r, seed=0),
        "trig-sincos-gaussian": ka.TrigRF(d, r, seed=0),
        "trig-offset-gaussian": ka.TrigRF(d, r, variant="offset", seed=0),
        "positive-structured": ka.PositiveRF(d, r, sampler="structured", seed=0),
    }
    for name, fm in maps.items():
        fm = fm.to(device)
        t = timeit(lambda fm=fm: fm(q), device, repeats)
        out[f"{name}/matmul"] = t / t_mm
    return out


def bench_attention(B, H, n, d, r, device, dtype, repeats) -> dict[str, float]:
    q, k, v = _inputs(B, H, n, d, device, dtype)
    fm = ka.PositiveRF(d, r, sampler="orthogonal", seed=0).to(device)
    cdt = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    W = fm.weight.to(cdt)
    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
    Kp = (kc @ W.mT).exp_()
    S = Kp.mT @ vc

    def floor():
        a = qc @ W.mT
        b = kc @ W.mT
        s = b.mT @ vc
        return a @ s

    t_floor = timeit(floor, device, repeats)
    t_par = timeit(lambda: ka.linear_attention(q, k, v, fm), device, repeats)
    t_cau = timeit(lambda: ka.linear_attention(q, k, v, fm, causal=True), device, repeats)
    del Kp, S
    return {
        "floor_ms": 1e3 * t_floor,
        "parallel_ms": 1e3 * t_par,
        "causal_ms": 1e3 * t_cau,
        "parallel/floor": t_par / t_floor,
        "causal/parallel": t_cau / t_par,
    }


_MEM_CHILD = r"""
import json, sys, torch, kernelapprox as ka

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024  # MiB

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


def bench_memory(device: torch.device, ns=(4096, 16384)) -> dict[str, float]:
    out = {}
    for causal in (False, True):
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
                res = subprocess.run(
                    [sys.executable, "-c", _MEM_CHILD, str(n), "1" if causal else "0"],
                    capture_output=True, text=True, check=True,
                )
                peak = json.loads(res.stdout.strip().splitlines()[-1])["peak_mib"]
            out[f"{'causal' if causal else 'parallel'}_peak_mib_n{n}"] = peak
    for kind in ("parallel", "causal"):
        a, b = out[f"{kind}_peak_mib_n{ns[0]}"], out[f"{kind}_peak_mib_n{ns[1]}"]
        out[f"{kind}_peak_ratio_n{ns[1]}/n{ns[0]}"] = b / a
    return out


def bench_recurrent(device: torch.device, dtype, repeats: int, t_long: int = 100_000) -> dict[str, float]:
    H, d, r = 8, 64, 256
    fm = ka.PositiveRF(d, r, sampler="orthogonal", seed=0).to(device)
    res = {}
    for t in (10, t_long):
        q, k, v = _inputs(1, H, t, d, device, dtype, seed=2)
        with torch.no_grad():
            _, state = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=256, return_state=True)
        qt, kt, vt = (x[:, :, 0, :] for x in _inputs(1, H, 1, d, device, dtype, seed=3))
        rnn = ka.RecurrentLinearAttention(fm, state=state)

        def steps(rnn=rnn, st=state, qt=qt, kt=kt, vt=vt):
            rnn.state = st
            for _ in range(50):
                rnn.step(qt, kt, vt)

        res[f"step_us_t{t}"] = 1e6 * timeit(steps, device, repeats) / 50
    res[f"step_t{t_long}/step_t10"] = res[f"step_us_t{t_long}"] / res["step_us_t10"]
    return res


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="n=512, fewer repeats (a smoke run)")
    p.add_argument("--json", help="also write the results to this JSON file")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    B, H, n, d, r = 4, 8, (512 if a.quick else 4096), 64, 256
    reps = 2 if a.quick else a.repeats
    print(f"device={device} dtype={dtype} B={B} H={H} n={n} d={d} r={r} threads={torch.get_num_threads()}")
    results: dict[str, float] = {}
    for name, fn in (
        ("feature maps", lambda: bench_feature_maps(B, H, n, d, r, device, dtype, reps)),
        ("attention", lambda: bench_attention(B, H, n, d, r, device, dtype, reps)),
        ("memory", lambda: bench_memory(device, (n, 4 * n))),
        ("recurrent", lambda: bench_recurrent(device, dtype, reps, 1000 if a.quick else 100_000)),
    ):
        part = fn()
        print(f"-- {name}")
        for key, val in part.items():
            print(f"   {key:42s} {val:10.3f}")
        results.update(part)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": str(device), "dtype": a.dtype, **results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
