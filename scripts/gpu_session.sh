#!/usr/bin/env bash
# A short lease on a GPU machine that cannot reach the internet: build here, measure there.
#
#   scripts/gpu_session.sh wheels            # here: loom's wheel and its pure-Python dependencies into .whl/
#   scripts/gpu_session.sh measure OUT       # there, from the checkout (tests/ is read): figures into OUT/
#   scripts/gpu_session.sh tests OUT         # there: `pytest -m gpu` alone (when measure left it no time)
#   scripts/gpu_session.sh profile OUT       # there, if the lease has minutes left: where the step's time goes
#
# Each part writes its own files into OUT (status_PART.txt says how each of its steps ended) and refuses an OUT
# that holds that part's files from an earlier session.
#
# A lent machine runs one command for at most 10 minutes, so each part fits one call (MEASURE_SECONDS, default
# 585), and every part has its own time limit so a lease cut short still returns what finished. `measure`:
# `loom bench gpu` (docs/gpu.md's table; its rows are logged as they finish) leaving TESTS_SECONDS (150) for
# `pytest -m gpu`, which then gets what is left: the figures first, as a failing row no longer ends the bench.
# Each limit is a SIGTERM, then a SIGKILL 15 s later (`timeout -k`; 45 s for the bench, which holds a SIGTERM
# until a step that compiles ends, then writes what it measured), so a step that does not stop cannot take the
# next one's time; pytest writes each failure to pytest_gpu_failures*.txt as it happens (tests/conftest.py), as a
# pytest cut short prints no summary.
# `profile`: the kernel breakdown of loom's defaults beside the plain loop, with the time the device waited for
# the host, then loom with FP8 alone, then loom without gradient-accumulation fusion (`loom bench profile`, 4 min).
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
measure | tests | profile)
    part=$1
    [ -n "${2:-}" ] || { echo "usage: $0 $part OUT (a folder for the figures)" >&2; exit 2; }
    if [ -e "$2" ] && [ ! -d "$2" ]; then
        echo "error: OUT $2 is a file; give a folder" >&2
        exit 2
    fi
    out=$(realpath -m "$2") # absolute: the parts run from the checkout
    case $part in # what each part writes: a part never writes over an earlier session's (or part's) files
    measure) files="status_measure.txt bench_gpu.json bench_gpu.md bench_gpu.log pytest_gpu.txt pytest_gpu_failures.txt" ;;
    tests) files="status_tests.txt pytest_gpu_tests.txt pytest_gpu_failures_tests.txt" ;;
    profile) files="status_profile.txt kernel_profile.md kernel_profile_fp8.md kernel_profile_unfused.md" ;;
    esac
    for file in $files; do
        if [ -e "$out/$file" ]; then
            echo "error: $out/$file exists (from an earlier $part); give an empty folder, or move it away" >&2
            exit 2
        fi
    done
    if ! ls "$here"/.whl/*.whl >/dev/null 2>&1; then
        echo "error: no wheels in $here/.whl; run scripts/gpu_session.sh wheels first (where PyPI is reachable)" >&2
        exit 2
    fi
    mkdir -p "$out" || exit 1
    cd "$here" || exit 1
    status="$out/status_$part.txt"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/loom-site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/loom-site
    nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv >>"$status" 2>&1
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >>"$status" 2>&1
    left() { # seconds left of MEASURE_SECONDS, less $1, at least 10 (timeout refuses a negative limit; 0 is none)
        local s=$((${MEASURE_SECONDS:-585} - SECONDS - ${1:-0}))
        echo $((s > 10 ? s : 10))
    }
    if [ "$part" = measure ]; then
        timeout -k 45 "$(left "${TESTS_SECONDS:-150}")" python3 -m loom.launch.cli bench gpu --output "$out/bench_gpu.json" \
            >"$out/bench_gpu.md" 2>"$out/bench_gpu.log"
        echo "bench gpu: exit $? (124: cut short; finished rows are in bench_gpu.log)" >>"$status"
        LOOM_FAILURES_FILE="$out/pytest_gpu_failures.txt" timeout -k 15 "$(left)" python3 -m pytest -m gpu -q \
            -p no:cacheprovider --durations=20 tests/test_gpu.py >"$out/pytest_gpu.txt" 2>&1
        echo "pytest -m gpu: exit $?" >>"$status"
        grep "^bench:" "$out/bench_gpu.log"
        cat "$out/bench_gpu.md"
        tail -60 "$out/pytest_gpu.txt" # the durations table, and the last failure above it
        head -c 6000 "$out/pytest_gpu_failures.txt" 2>/dev/null # each failure, also when pytest was cut short
    elif [ "$part" = tests ]; then
        LOOM_FAILURES_FILE="$out/pytest_gpu_failures_tests.txt" timeout -k 15 "$(left)" python3 -m pytest -m gpu -q \
            -p no:cacheprovider --durations=20 tests/test_gpu.py >"$out/pytest_gpu_tests.txt" 2>&1
        echo "pytest -m gpu: exit $?" >>"$status"
        tail -60 "$out/pytest_gpu_tests.txt"
        head -c 6000 "$out/pytest_gpu_failures_tests.txt" 2>/dev/null
    else
        timeout -k 15 100 python3 -m loom.launch.cli bench profile >"$out/kernel_profile.md" 2>&1
        echo "kernel_profile: exit $?" >>"$status"
        timeout -k 15 "$(left)" python3 -m loom.launch.cli bench profile --no-plain --train.precision bf16 --train.fp8 current \
            >"$out/kernel_profile_fp8.md" 2>&1
        echo "kernel_profile fp8: exit $?" >>"$status"
        timeout -k 15 "$(left)" python3 -m loom.launch.cli bench profile --no-plain --optim.grad_accumulation_fusion false \
            >"$out/kernel_profile_unfused.md" 2>&1
        echo "kernel_profile without gradient-accumulation fusion: exit $?" >>"$status"
        cat "$out/kernel_profile.md" "$out/kernel_profile_fp8.md" "$out/kernel_profile_unfused.md"
    fi
    cat "$status"
    ;;
*)
    [ -n "${1:-}" ] && echo "error: unknown part '$1'; the parts are wheels, measure, tests and profile" >&2
    sed -n '2,10p' "$0" | cut -c3- >&2
    exit 2
    ;;
esac
