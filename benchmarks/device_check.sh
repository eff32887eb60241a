#!/usr/bin/env bash
# One run on a GPU machine, under four and a half minutes: the CUDA tests (less the slow ones: a
# compiled capture; in 4 processes, since the hybrid tests compile flex_attention per variant),
# then the quick GPU benchmark.
#
#   bash benchmarks/device_check.sh [OUT_DIR]        (default: $OUT, else ./device-check)
#
# Run from the repository root. Wheels in a `.whl/` folder (e.g. fla-core, fetched beforehand with
# `pip download --no-deps --only-binary=:all: -d .whl fla-core==0.6.0 einops`) are installed into
# /tmp/site without the network first. Writes under OUT_DIR: env.txt (machine and versions),
# pytest-cuda.log, gpu.log, gpu.md and gpu.csv. The exit status is non-zero if the tests or the
# benchmark failed (both always run).
set -u
out="${1:-${OUT:-device-check}}"
mkdir -p "$out"
py="${PYTHON:-python3}"

if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > "$out/pip.log" 2>&1 \
        || echo "wheel install failed (see pip.log)" >&2
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

{
    date -u +"%Y-%m-%d %H:%M UTC"
    git rev-parse --short HEAD 2>/dev/null || true
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    "$py" - <<'PY'
import importlib.metadata as md, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for dist in ("triton", "fla-core", "performer-pytorch", "einops"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "not installed")
PY
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

start=$(date +%s)
xdist=""
"$py" -c "import xdist" 2> /dev/null && xdist="-n 4"
timeout -k 5 120 "$py" -m pytest -q $xdist -m "cuda and not slow" -p no:cacheprovider > "$out/pytest-cuda.log" 2>&1
tests=$?
[ "$tests" -eq 5 ] && tests=0  # no test selected is not a failure
# a run that printed its summary without failures but lingered at exit past the timeout passed
summary=$(tail -n 1 "$out/pytest-cuda.log")
if [ "$tests" -eq 124 ] && [[ "$summary" =~ (passed|skipped|deselected) ]] && ! [[ "$summary" =~ (failed|error) ]]; then
    tests=0
fi
echo "pytest -m \"cuda and not slow\": status $tests in $(( $(date +%s) - start )) s ($(tail -n 1 "$out/pytest-cuda.log"))"

start=$(date +%s)
timeout -k 5 130 "$py" -m benchmarks gpu --quick --budget 100 --out "$out" > "$out/gpu.log" 2>&1
bench=$?
echo "benchmarks gpu --quick: status $bench in $(( $(date +%s) - start )) s; table in $out/gpu.md"

[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
