#!/usr/bin/env bash
# The engine measured on a GPU machine in one command (docs/benchmarks.md, "On a GPU"): the decode step against
# its HBM floor, serving throughput against transformers' continuous batching, split against colocated serving
# (bfloat16 for speed, float32 for greedy parity over TCP and shared memory), and the share of the wall time
# the device is busy. About 6 minutes on one H200 (diptych-1b in bfloat16).
#
#     bash bench/gpu_check.sh             # on the GPU machine: wheels from .gpu-wheels (bench/gpu_wheels.sh)
#     bash bench/gpu_check.sh --smoke     # here: every step on the CPU, diptych-tiny, a few requests
#
# Everything it prints goes to $OUT/gpu-check.txt too ($OUT unset: .diptych/gpu-check/). Each step runs under
# its own time limit, all of them within GPU_CHECK_BUDGET seconds (default 540): a step that would start with
# too little time left is skipped and said so, and the summary at the end lists every step's status.
set -uo pipefail

cd "$(dirname "$0")/.."
mode="${1:-gpu}"
out="${OUT:-.diptych/gpu-check}"
mkdir -p "$out"
exec > >(tee "$out/gpu-check.txt") 2>&1

budget="${GPU_CHECK_BUDGET:-540}"
started=$SECONDS
summary=()

progress() { echo "[gpu-check $((SECONDS - started)) s] $*"; }

# step NAME LIMIT_SECONDS COMMAND...: runs COMMAND under the smaller of its limit and the time left
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((budget - (SECONDS - started) - 5))
    echo
    echo "== $name"
    if [ "$left" -lt 20 ]; then
        progress "skipped: ${left} s of the budget left"
        summary+=("$name: skipped")
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    progress "start (limit ${limit} s): $*"
    local t0=$SECONDS rc=0
    timeout --kill-after=10 "$limit" "$@" || rc=$?
    local status="rc=$rc"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status="timed out after ${limit} s"
    progress "$name: $status in $((SECONDS - t0)) s"
    summary+=("$name: $status in $((SECONDS - t0)) s")
}

case "$mode" in
gpu)
    py=python3
    wheels="${GPU_WHEELS:-.gpu-wheels}"
    if ! compgen -G "$wheels/*.whl" >/dev/null; then
        echo "no wheels in $wheels: run bench/gpu_wheels.sh where a registry is reachable, and carry the folder"
        exit 2
    fi
    progress "installing $(ls "$wheels"/*.whl | wc -l) wheels from $wheels into /tmp/site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$wheels"/*.whl || exit 2
    export PYTHONPATH="/tmp/site:$PWD:$PWD/proto/src"
    device=cuda model=diptych-1b
    floor_args=(--batches 1,8,32,64 --context 512)
    serving_args=(--requests 128 --concurrency 64)
    split_args=(--requests 128 --concurrency 32 --prompt-tokens 512 --output-tokens 64)
    parity_args=(--dtype float32 --requests 32 --concurrency 16 --prompt-tokens 256 --output-tokens 32)
    busy_args=(--concurrency 64 --requests-per-stream 2 --output-tokens 128 --kv-cache-mib 8192)
    costs_args=(--prefill-tokens 64,256,1024 --decode-batches 1,8,32 --decode-contexts 512,2048 --kv-tokens 128,2048
        --live-prompts 128 --live-rounds 1 --repeats 3 --kv-cache-mib 4096)
    ;;
--smoke)
    py=.venv/bin/python
    export PYTHONPATH="$PWD:$PWD/proto/src"
    device=cpu model=diptych-tiny
    floor_args=(--batches 1,8 --context 64 --repeats 3 --threads 1)
    serving_args=(--requests 6 --concurrency 3 --prompt-tokens 16 --output-tokens 8 --kv-cache-mib 16 --threads 1)
    split_args=(--requests 6 --concurrency 3 --prompt-tokens 24 --output-tokens 6 --threads 1)
    parity_args=(--dtype float32 "${split_args[@]}")
    busy_args=(--concurrency 1,4 --requests-per-stream 2 --output-tokens 8 --profiler)
    costs_args=(--prefill-tokens 16,64 --decode-batches 1,4 --decode-contexts 64 --kv-tokens 16,64
        --live-prompts 48 --live-rounds 1 --live-output-tokens 4 --repeats 1 --kv-cache-mib 16)
    ;;
*)
    echo "usage: bash bench/gpu_check.sh [--smoke]" >&2
    exit 2
    ;;
esac
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

echo "== the machine"
if commit=$(git rev-parse --short HEAD 2>/dev/null); then
    git diff --quiet HEAD || commit="$commit, with changes"
    progress "commit $commit"
fi
command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm --format=csv
"$py" - <<'EOF' || exit 2
import platform

import torch
import transformers

print(f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}: {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} multiprocessors, "
          f"compute capability {p.major}.{p.minor}, CUDA {torch.version.cuda}")
else:
    print(f"no CUDA device; {torch.get_num_threads()} CPU threads")
EOF

step "bench.decode_floor" 120 \
    "$py" -m bench.decode_floor --device $device --model $model "${floor_args[@]}"
# 80 s: the suite builds the paged-cpu operator first (about 20 s where a compiler is), though only these run
step "the flash-varlen attention kernel against gather (pytest)" 80 \
    "$py" -m pytest -q -p no:cacheprovider tests/workers/test_attention_backends.py -k "flash_varlen or cuda"
step "bench.gpu_serving (transformers continuous batching; gather with graphs off and on; flash-varlen)" 240 \
    "$py" -m bench.gpu_serving --device $device --model $model "${serving_args[@]}"
step "bench.gpu_serving --split (default dtype)" 150 \
    "$py" -m bench.gpu_serving --split --device $device --model $model "${split_args[@]}"
step "bench.gpu_split float32 parity over TCP, with transformers generate" 120 \
    "$py" -m bench.gpu_split --device $device --model $model "${parity_args[@]}" --reference 8
step "bench.gpu_split float32 parity over shared memory" 90 \
    "$py" -m bench.gpu_split --device $device --model $model "${parity_args[@]}" --shm
step "bench.gpu_busy (host time per step per sequence; the device's busy share)" 150 \
    "$py" -m bench.gpu_busy --device $device --model $model "${busy_args[@]}"
step "bench.phase_costs on the device (a cost profile for diptych plan)" 150 \
    "$py" -m bench.phase_costs --device $device --model $model "${costs_args[@]}" --out "$out/phase-costs-$model.json"

echo
echo "== summary ($((SECONDS - started)) s)"
printf '%s\n' "${summary[@]}"
