#!/usr/bin/env bash
# A short lease on a GPU machine that cannot reach the internet: build here, measure there.
#
#   scripts/gpu_session.sh wheels            # here: loom's wheel and its pure-Python dependencies into .whl/
#   scripts/gpu_session.sh measure OUT       # there, from the checkout (tests/ is read): figures into OUT/
#
# `measure` installs the wheels beside the machine's own torch, then runs, each under its own time limit so a lease
# cut short still returns what finished, most telling first: `pytest -m gpu` (3.5 min), the kernel breakdown with
# the time the device waited for the host (tools/bench/kernel_profile.py, 1.5 min) and `loom bench gpu`
# (docs/gpu.md's table; BENCH_SECONDS, default 330: its rows are logged as they finish). About 11 minutes in all.
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
wheels)
    cd "$here" || exit 1
    grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >>.git/info/exclude
    rm -rf .whl && mkdir .whl
    python -m pip wheel --quiet --no-deps . -w .whl || exit 1
    python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl datasketch submitit ftfy wcwidth py3langid || exit 1
    ls .whl
    ;;
measure)
    out=${2:?usage: $0 measure OUT}
    mkdir -p "$out"
    cd "$here" || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/loom-site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/loom-site
    nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv >"$out/gpu.csv" 2>&1
    timeout 210 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py >"$out/pytest_gpu.txt" 2>&1
    echo "pytest -m gpu: exit $?" >>"$out/status.txt"
    timeout 100 python3 -m loom.tools.bench.kernel_profile >"$out/kernel_profile.md" 2>&1
    echo "kernel_profile: exit $?" >>"$out/status.txt"
    timeout "${BENCH_SECONDS:-330}" python3 -m loom.launch.cli bench gpu --output "$out/bench_gpu.json" \
        >"$out/bench_gpu.md" 2>"$out/bench_gpu.log"
    echo "bench gpu: exit $? (124: cut at BENCH_SECONDS; finished rows are in bench_gpu.log)" >>"$out/status.txt"
    cat "$out/status.txt"
    tail -3 "$out/pytest_gpu.txt"
    cat "$out/kernel_profile.md" "$out/bench_gpu.md"
    grep "^bench:" "$out/bench_gpu.log"
    ;;
*)
    sed -n '2,10p' "$0" | cut -c3-
    exit 2
    ;;
esac
