"""The benchmarks' command line: ``python -m benchmarks`` lists them, ``python -m benchmarks
NAME ARGS...`` runs one; ``core`` reports a failing group and goes on; the GPU benchmark's case
list, runner and tables on a CPU."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import benchmarks
import kernelapprox as ka
from benchmarks.__main__ import main as cli

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("core", "mc", "sklearn", "train", "decode", "gpu")


def test_listing_names_every_benchmark(capsys) -> None:
    assert tuple(benchmarks.BENCHMARKS) == NAMES
    for name in NAMES:  # one module per benchmark, each with a main
        assert (ROOT / "benchmarks" / f"{name}.py").is_file()
    assert cli([]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines()[1:]]
    assert listed == list(NAMES), out


def test_listing_from_the_command_line() -> None:
    res = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert [line.split()[0] for line in res.stdout.splitlines()[1:]] == list(NAMES), res.stdout


def test_unknown_name_is_a_usage_error(capsys) -> None:
    assert cli(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nope'" in err and "core, mc, sklearn, train, decode, gpu" in err
    with pytest.raises(ValueError, match="unknown benchmark"):
        benchmarks.run("nope", [])


def test_mc_smoke_run_at_a_small_size(capsys) -> None:
    """One case of the Monte Carlo benchmark, quick (500 draws of a 64 x 64 kernel, one pair):
    about 2 s. ``main`` returns its results as a dict, which `benchmarks.run` turns into status 0."""
    assert benchmarks.run("mc", ["--quick", "--repeats", "1", "--only", "kernel_error d16"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip().startswith("kernel_error")]
    assert len(rows) == 1, out
    m = re.search(r"kernel_error d16 r64 n64 S500\s+([0-9.]+)x\s+\(\s*([0-9.]+) ms\)", rows[0])
    assert m is not None, rows[0]
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0


def test_no_forwarding_modules_remain() -> None:
    """The benchmarks and the study engine each have one home: no ``studies/bench_NAME.py`` or
    ``studies/_framework.py`` forwards to them."""
    left = [p.name for p in (ROOT / "studies").glob("bench_*.py")] + [
        p.name for p in (ROOT / "studies").glob("_framework.py")]
    assert not left, left


def test_mc_error_vs_r_cell_runs(capsys) -> None:
    """The study-cell case of the Monte Carlo group (it stopped with ``KeyError: 'spec'`` when the
    study's cells changed their keys): quick, one pair, under a second of work."""
    assert benchmarks.run("mc", ["--quick", "--repeats", "1", "--only", "error_vs_r"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"error_vs_r cell positive-gaussian d16\s+[0-9.]+x", out), out


# ------------------------------------------------------------------------------------------------
# core: every group runs; a failing group is reported and the others go on
# ------------------------------------------------------------------------------------------------
CORE_GROUPS = ("bench_feature_maps", "bench_structured_qmc", "bench_attention", "bench_memory",
               "bench_train_memory", "bench_recurrent", "bench_league", "bench_check", "bench_short_causal",
               "bench_hybrid", "bench_hybrid_memory")


def test_core_reports_a_failing_group_and_runs_the_others(monkeypatch, capsys) -> None:
    """Every group replaced by a stub, one of which raises: the others still print, the failure is
    reported with its type, message and place, and the status is 1."""
    from benchmarks import core, mc

    calls = []

    def stub(name):
        def fn(*args, **kwargs):
            calls.append(name)
            if name == "bench_attention":
                raise KeyError("spec")
            if name == "bench_feature_maps":  # the group's verdict lines read these
                return {f"{m}-gaussian/matmul": 1.0 for m in core.FEATURE_TARGETS} | {f"{name}_value": 1.0}
            if name == "bench_hybrid":
                return {"hybrid/parallel_block/linear": 1.0, f"{name}_value": 1.0}
            return {f"{name}_value": 1.0}
        return fn

    for name in CORE_GROUPS:
        monkeypatch.setattr(core, name, stub(name))
    monkeypatch.setattr(mc, "bench_mc", stub("bench_mc"))
    status = benchmarks.run("core", ["--quick"])
    out, err = capsys.readouterr()
    assert status == 1
    assert sorted(calls) == sorted((*CORE_GROUPS, "bench_mc"))  # every group ran
    assert "-- attention: FAILED" in out and "KeyError: 'spec'" in out and "test_benchmarks.py" in out, out
    for name in set(CORE_GROUPS) - {"bench_attention"}:
        assert f"{name}_value" in out, name
    assert "1 group(s) failed: attention" in err
    # a group whose results lack what its verdict reads fails in the same way
    monkeypatch.setattr(core, "bench_attention", stub("bench_recurrent"))
    monkeypatch.setattr(core, "bench_hybrid", stub("bench_recurrent"))
    assert benchmarks.run("core", ["--quick"]) == 1
    out = capsys.readouterr().out
    assert "-- hybrid (w=64: token and block window / linear attention): FAILED" in out and "KeyError" in out
    # without a failure: the results, status 0
    monkeypatch.setattr(core, "bench_hybrid", stub("bench_hybrid"))
    assert benchmarks.run("core", ["--quick"]) == 0


@pytest.mark.slow
def test_core_quick_runs_every_group(capsys) -> None:
    """``python -m benchmarks core --quick``: every group at its quick size, none failing (about 20 s
    on one thread of a loaded 2-core machine)."""
    from benchmarks import core

    res = core.main(["--quick", "--threads", "1"])
    out = capsys.readouterr().out
    assert isinstance(res, dict), out
    assert "FAILED" not in out
    heads = [line for line in out.splitlines() if line.startswith("-- ")]
    assert len(heads) == 12, heads
    assert "positive-gaussian/matmul" in res and "error_vs_r cell positive-gaussian d16/floor" in res


# ------------------------------------------------------------------------------------------------
# gpu: the case list, the runner (isolation, budget), the tables, no CUDA
# ------------------------------------------------------------------------------------------------
def test_gpu_case_list() -> None:
    from benchmarks import gpu

    full = gpu.cases()
    keys = [c.key for c in full]
    assert len(keys) == len(set(keys))
    modes = [c.mode for c in full]
    assert modes == sorted(modes, key=lambda m: m == "fwd+bwd")  # every backward after every forward
    att = [c for c in full if c.group == "attention"]
    assert {int(c.p("n")) for c in att} == {1024, 4096, 16384, 65536}
    assert {(int(c.p("n")), int(c.p("B")), int(c.p("H"))) for c in att} == set(gpu.ATTN_SIZES)
    assert {int(c.p("F")) for c in att if c.p("fmap") == "favor+"} == {64, 128, 256}
    impls = {c.impl for c in att}
    for name in ("sdpa causal", "sdpa non-causal", "fla chunk_linear_attn elu+1", "fla chunk_simple_gla favor+",
                 "kernelapprox favor+ causal", "kernelapprox elu+1 non-causal", "performer causal"):
        assert name in impls, name
    assert not any(c.impl.startswith("fla") and not c.p("causal") for c in att)  # fla is causal only
    # every case's reference exists, with the same mode
    for c in full:
        assert c.ref in keys, c.key
        assert c.ref.endswith(c.mode)
    maps = {c.p("estimator") for c in full if c.group == "maps"} - {None}
    assert maps == {e.name for e in ka.estimators() if e.is_random}
    short = [c for c in full if c.group == "short"]
    assert {int(c.p("n")) for c in short} == set(gpu.SHORT_NS)
    assert {(c.p("B"), c.p("H"), c.p("d"), c.p("F")) for c in short} == set(gpu.SHORT_SHAPES)
    assert {gpu.SHORT_QUADRATIC, gpu.SHORT_SCAN, "kernelapprox favor+ causal"} <= {c.impl for c in short}
    assert any(c.group == "decode" and c.impl.startswith("RecurrentHybridAttention") for c in full)
    # decoding: every recurrent path and the SDPA KV-cache step at each prompt length
    dec = [c for c in full if c.group == "decode"]
    for impl in ["sdpa KV-cache step"] + [i for i, _, _ in gpu.DECODE_IMPLS]:
        assert {int(c.p("t")) for c in dec if c.impl == impl} == {512, 4096, 16384}, impl
    qdec = [c for c in gpu.cases(quick=True) if c.group == "decode"]
    assert {int(c.p("t")) for c in qdec} == {512, 4096}
    assert not any("compiled" in c.impl for c in qdec)
    assert any(c.group == "favor" and c.shape == "B8 H16 n4096 d64 F128" for c in full)
    quick = gpu.cases(quick=True)
    assert set(c.key for c in quick) < set(keys) and len(quick) < len(full) / 2


def test_gpu_short_call_crossover() -> None:
    """The least n from which the forced scan is at least as fast as the forced quadratic form,
    per shape and mode, from the rows (failed rows left out; 'none' if the scan never wins)."""
    from benchmarks import gpu

    rows = []
    for n, tq, ts in ((16, 1.0, 3.0), (64, 2.0, 2.5), (128, 4.0, 3.9), (256, 9.0, 5.0)):
        shape = f"B32 H4 n{n} d16 F64"
        rows += [gpu.Row("short", gpu.SHORT_QUADRATIC, shape, "fwd", ms=tq),
                 gpu.Row("short", gpu.SHORT_SCAN, shape, "fwd", ms=ts),
                 gpu.Row("short", gpu.SHORT_QUADRATIC, shape, "fwd+bwd", ms=tq),
                 gpu.Row("short", gpu.SHORT_SCAN, shape, "fwd+bwd", ms=10 * ts),
                 gpu.Row("short", "sdpa causal", shape, "fwd", ms=0.1)]
    rows.append(gpu.Row("short", gpu.SHORT_SCAN, "B32 H4 n512 d16 F64", "fwd", status="OOM"))
    lines = gpu.short_crossover(rows)
    assert len(lines) == 2
    assert "B32 H4 d16 F64 fwd: scan at least as fast as the quadratic form from n = 128" in lines[0]
    assert "n16 1/3" in lines[0] and "n512" not in lines[0]
    assert "fwd+bwd" in lines[1] and "from n = none" in lines[1]


def test_gpu_runner_isolates_cases_and_keeps_the_budget() -> None:
    """A case that raises (or is refused, or unavailable) gets its status and the run goes on; the
    budget skips the cases after it; ratios are against the reference rows."""
    from benchmarks import gpu

    cs = [gpu.Case("g", "ref", "s", "fwd", ref="g|ref|s|fwd"), gpu.Case("g", "boom", "s", "fwd", ref="g|ref|s|fwd"),
          gpu.Case("g", "fast", "s", "fwd", ref="g|ref|s|fwd"), gpu.Case("g", "none", "s", "fwd", ref="g|ref|s|fwd"),
          gpu.Case("g", "bwd", "s", "fwd+bwd"), gpu.Case("g", "late", "s", "fwd+bwd")]
    times = {"ref": 2.0, "fast": 1.0, "late": 4.0}

    def builder(c, device, dtype):
        if c.impl == "boom":
            raise RuntimeError("broken\nsecond line")
        if c.impl == "none":
            raise gpu.Unavailable("fla-core not installed")
        if c.impl == "bwd":
            return gpu._with_backward(lambda: torch.ones(2, requires_grad=True) * 0 + _raise(), [])
        return lambda: times[c.impl]

    def _raise():
        raise RuntimeError("backward not supported on this GPU")

    now = [0.0]

    def clock():
        now[0] += 1.0
        return now[0]

    rows, warm = gpu.run_cases(cs, torch.device("cpu"), torch.float32, timer=lambda fn: fn(), budget_s=21.5,
                               builder=builder, clock=clock, log=lambda s: None)
    by = {r.impl: r for r in rows}
    assert by["ref"].status == "ok" and by["ref"].ms == 2.0 and by["ref"].ratio == 1.0
    assert by["fast"].ratio == 0.5
    assert by["boom"].status.startswith("error: RuntimeError: broken (at ") and math.isnan(by["boom"].ms)
    assert by["none"].status == "unavailable: fla-core not installed"
    assert by["bwd"].status.startswith("error: RuntimeError: backward not supported")
    assert by["late"].status == "skipped (budget)"
    assert warm > 0


def test_gpu_refused_backward_is_reported() -> None:
    from benchmarks import gpu

    x = torch.ones(3, requires_grad=True)

    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("gated backward disabled for Triton < 3.7.1 on Hopper")

    run = gpu._with_backward(lambda: NoBackward.apply(x), [x])
    with pytest.raises(gpu.Refused) as info:
        run()
    assert gpu._status(info.value) == "refused: RuntimeError: gated backward disabled for Triton < 3.7.1 on Hopper"


def test_gpu_tables() -> None:
    from benchmarks import gpu

    rows = [gpu.Row("attention", "sdpa causal", "B8 H16 n4096 d64", "fwd", ms=0.63, ratio=1.0, peak_mib=96.0),
            gpu.Row("attention", "fla chunk_simple_gla favor+", "B8 H16 n4096 d64 F128", "fwd+bwd",
                    status="refused: a|b")]
    env = {"machine": "NVIDIA H200", "torch": "2.11.0 (CUDA 13.0)", "triton": "3.6.0", "fla-core": "0.6.0",
           "performer-pytorch": "not installed", "kernelapprox": "0.1.0", "commit": "abc1234", "python": "3.12"}
    md = gpu.to_markdown(rows, env, 123.4, "do_bench", "bfloat16", date="2026-12-04",
                         skipped=["hybrid x B1 fwd"])
    lines = md.splitlines()
    assert lines[0] == "### NVIDIA H200, 2026-12-04"
    for text in ("torch 2.11.0 (CUDA 13.0)", "Triton 3.6.0", "fla-core 0.6.0", "123.4 s", "`abc1234`", "bfloat16"):
        assert text in md, text
    table = [line for line in lines if line.startswith("|")]
    assert table[0] == "| group | case | shape | mode | ms | × ref | peak MiB | status |"
    assert all(line.count("|") == 9 for line in table)  # a "|" in a status does not break the table
    assert table[2] == "| attention | sdpa causal | B8 H16 n4096 d64 | fwd | 0.63 | 1 | 96 | ok |"
    assert "| — | — | — | refused: a/b |" in table[3]
    assert "Skipped by the time budget (1): hybrid x B1 fwd." in md
    import csv
    import io

    back = list(csv.DictReader(io.StringIO(gpu.to_csv(rows))))
    assert [r["impl"] for r in back] == ["sdpa causal", "fla chunk_simple_gla favor+"]
    assert float(back[0]["ms"]) == 0.63 and back[1]["ms"] == "nan" and back[1]["status"] == "refused: a|b"


def test_gpu_without_cuda_exits_with_a_message(monkeypatch, capsys) -> None:
    from benchmarks import gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert benchmarks.run("gpu", ["--quick"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--dry-run" in err
    assert gpu.main(["--dry-run", "--quick"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"{len(gpu.cases(quick=True))} cases")


def test_gpu_gated_scan_equals_causal_linear_attention() -> None:
    """The fla ``chunk_simple_gla`` case's formulation (running-maximum keys, the change of maximum
    as log-gate, values padded with [1, 0] for the normaliser), driven through a step-by-step torch
    scan with fla's signature, equals the library's causal linear attention in float64."""
    from benchmarks import gpu

    def scan(q, k, v, g, scale):  # (B, T, H, K/V), g (B, T, H): S_t = e^{g_t} S_{t-1} + k_t v_t^T
        B, T, H, K = q.shape
        S = q.new_zeros(B, H, K, v.shape[-1])
        outs = []
        for t in range(T):
            S = S * g[:, t, :, None, None].exp() + k[:, t, :, :, None] * v[:, t, :, None, :]
            outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
        return torch.stack(outs, 1), S

    g = torch.Generator().manual_seed(0)
    B, H, n, d, r = 2, 3, 40, 8, 16
    q, k, v = (torch.randn(B, n, H, d, generator=g, dtype=torch.float64) for _ in range(3))
    k = k * 1.5  # keys of varied size: the running maximum moves
    fm = ka.PositiveRF(d, r, seed=0, dtype=torch.float64)
    got = gpu._gated_scan(fm, q, k, v, scan)
    ref = ka.linear_attention(*(t.transpose(1, 2) for t in (q, k, v)), fm, causal=True, eps=0.0).transpose(1, 2)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_gpu_harness_runs_every_case_on_a_cpu_at_a_tiny_size(tmp_path) -> None:
    """Every builder at its tiny size on the CPU (one call per phase; fla absent here: its rows say
    so): no case errors, and the tables are written."""
    from benchmarks import gpu

    rows, _ = gpu.run_cases(gpu.cases(tiny=True), torch.device("cpu"), torch.bfloat16, timer=lambda fn: (fn(), 1.0)[1],
                            log=lambda s: None)
    bad = [(r.impl, r.shape, r.mode, r.status) for r in rows
           if r.status != "ok" and not (r.impl.startswith("fla") and r.status.startswith("unavailable"))
           and not (r.impl.startswith("performer") and r.status.startswith("unavailable"))
           and not ("graphed" in r.impl and r.status == "unavailable: CUDA graphs need a CUDA device")]
    assert not bad, bad
    assert gpu.main(["--dry-run", "--tiny"]) == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_harness_on_cuda_at_a_tiny_size(tmp_path) -> None:
    """The GPU benchmark at its tiny size on the device (do_bench or CUDA events, peak memory):
    every library and SDPA case runs; fla's and performer's rows are ok, refused or unavailable."""
    from benchmarks import gpu

    assert gpu.main(["--tiny", "--out", str(tmp_path), "--budget", "60"]) == 0
    text = (tmp_path / "gpu.md").read_text()
    assert text.startswith(f"### {torch.cuda.get_device_name()}")
    import csv

    rows = list(csv.DictReader((tmp_path / "gpu.csv").open()))
    for r in rows:
        if r["impl"].startswith(("fla", "performer")):
            assert r["status"] == "ok" or r["status"].startswith(("refused", "unavailable")), r
        elif r["status"] != "skipped (budget)":
            assert r["status"] == "ok", r
            assert float(r["ms"]) > 0 and float(r["peak_mib"]) >= 0, r
