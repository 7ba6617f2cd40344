#!/usr/bin/env bash
# The engine measured on a GPU machine in one command (docs/benchmarks.md, "On a GPU"): a preflight, then the
# triton attention kernel's tests, the decode step against its HBM floor on each backend, serving throughput
# against transformers' continuous batching (gather before, triton after), split against colocated serving,
# greedy parity in float32 over TCP and shared memory, the share of the wall time the device is busy, and a
# cost profile, in that order (the most telling first). diptych-1b in bfloat16, on one H200.
#
#     bash bench/gpu_check.sh             # on the GPU machine: wheels from .gpu-wheels (bench/gpu_wheels.sh)
#     bash bench/gpu_check.sh --smoke     # here: every step on the CPU, diptych-tiny, a few requests, the
#                                         # triton steps under Triton's interpreter
#
# The preflight (bench.gpu_preflight) runs first; when it fails nothing else runs and the script exits 1.
# Each step has a time limit, and the limits add up to GPU_CHECK_BUDGET seconds at most (540 by default, 900
# with --smoke; the script refuses to start otherwise); a step may also take what the steps before it left
# unspent, never what the later steps' limits hold. The summary lists every step's status,
# and the exit status is 0 only when every step ended rc=0. GPU_CHECK_ATTENTION names the backend under test
# (default triton; the before is gather). Everything it prints goes to $OUT/gpu-check.txt too ($OUT unset:
# .diptych/gpu-check/), and each step's output to $OUT/<step>.txt.
set -uo pipefail

# kernel_tests PYTEST_ARGS...: pytest, failing unless some test passed and none was skipped: a kernel test
# skipped for want of a device would otherwise read as the kernel checked. The kernel's tests need no plugin,
# and the machine's (pytest-django here) would only add their start.
kernel_tests() {
    local log rc summary passed skipped
    log=$(mktemp)
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$py" -m pytest -q -rs -p no:cacheprovider "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    summary=$(grep -E '^=* ?[0-9]+ (passed|failed|skipped|errors?|deselected)' "$log" | tail -1)
    rm -f "$log"
    passed=$(grep -oE '[0-9]+ passed' <<<"$summary" | grep -oE '[0-9]+' || echo 0)
    skipped=$(grep -oE '[0-9]+ skipped' <<<"$summary" | grep -oE '[0-9]+' || echo 0)
    if [ "$rc" -eq 0 ] && { [ "$passed" -eq 0 ] || [ "$skipped" -gt 0 ]; }; then
        echo "kernel tests: $passed passed, $skipped skipped: the kernel was not tested whole" >&2
        return 1
    fi
    return "$rc"
}

progress() { echo "[gpu-check $((SECONDS - started)) s] $*"; }

# step NAME TITLE COMMAND...: runs COMMAND under what is left of the budget beside the limits of the steps after
# it: its own limit, and what the steps before it left unspent (less, where they overran theirs)
step() {
    local name=$1 title=$2
    shift 2
    local limit=$((budget - (SECONDS - started))) later passed=0
    for later in "${order[@]}"; do
        [ "$passed" -eq 1 ] && limit=$((limit - limits[$later]))
        [ "$later" = "$name" ] && passed=1
    done
    echo
    echo "== $title"
    if [ "$limit" -lt 10 ]; then
        progress "$name: NOT RUN: ${limit} s of the budget left to it"
        summary+=("$name: not run (${limit} s of the budget left to it)")
        failed=1
        return 1
    fi
    progress "start (limit ${limit} s): $*"
    local t0=$SECONDS rc=0
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    rc=${PIPESTATUS[0]}
    local status="rc=$rc"
    { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && status="timed out after ${limit} s (rc=$rc)"
    progress "$name: $status in $((SECONDS - t0)) s"
    summary+=("$name: $status in $((SECONDS - t0)) s")
    [ "$rc" -eq 0 ] || failed=1
    return "$rc"
}

print_summary() {
    echo
    echo "== summary ($((SECONDS - started)) s of a ${budget} s budget)"
    printf '%s\n' "${summary[@]}"
}

# the figures of before ($before) and after ($attention) from the steps' outputs, side by side
print_before_after() {
    echo
    echo "== before ($before) and after ($attention), side by side"
    [ -f "$out/floor.txt" ] && sed -n '/^side by side/,$p' "$out/floor.txt"
    [ -f "$out/serving.txt" ] && grep -E '^(engine |transformers continuous batching|diptych, )' "$out/serving.txt"
    for name in split parity parity-shm; do
        [ -f "$out/$name.txt" ] && grep -E '^(split \(|colocated \(|greedy outputs equal|transformers generate)' \
            "$out/$name.txt" | sed "s/^/$name: /"
    done
    return 0
}

main() {
    cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
    mode="${1:-gpu}"
    out="${OUT:-.diptych/gpu-check}"
    mkdir -p "$out" && out=$(cd "$out" && pwd)
    exec > >(tee "$out/gpu-check.txt") 2>&1

    budget="${GPU_CHECK_BUDGET:-540}"
    attention="${GPU_CHECK_ATTENTION:-triton}"
    before=gather
    started=$SECONDS
    summary=()
    failed=0
    declare -gA limits
    case "$mode" in
    gpu)
        py=python3
        setup=40 # installing the wheels and reading the machine, before the first step
        limits=([preflight]=20 [kernel]=45 [floor]=65 [serving]=120 [split]=55 [parity]=45 [parity-shm]=30
            [busy]=50 [costs]=50)
        unset TRITON_INTERPRET # kernels made for the interpreter refuse the GPU
        device=cuda model=diptych-1b step_attention=$attention
        kernel_args=(tests/workers/test_triton_attention.py -k cuda)
        floor_args=(--batches 1,8,32,64 --context 512)
        serving_args=(--requests 128 --concurrency 64 --output-tokens 64)
        split_args=(--requests 128 --concurrency 32 --prompt-tokens 512 --output-tokens 64)
        parity_args=(--dtype float32 --requests 32 --concurrency 16 --prompt-tokens 256 --output-tokens 32)
        busy_args=(--concurrency 64 --requests-per-stream 2 --output-tokens 64 --kv-cache-mib 8192)
        costs_args=(--prefill-tokens 64,256,1024 --decode-batches 1,8,32 --decode-contexts 512,2048
            --kv-tokens 128,2048 --live-prompts 128 --live-rounds 1 --repeats 3 --kv-cache-mib 4096)
        ;;
    --smoke)
        py=.venv/bin/python
        # about 2 minutes on 2 idle cores; the limits allow for 5 times that, for cores that other work shares
        budget="${GPU_CHECK_BUDGET:-900}" setup=5
        limits=([preflight]=60 [kernel]=120 [floor]=90 [serving]=120 [split]=60 [parity]=75 [parity-shm]=60
            [busy]=60 [costs]=120)
        export TRITON_INTERPRET=1 # the triton kernels run on the CPU under Triton's interpreter
        # the interpreter is far too slow to serve whole runs: the steps beyond the kernel's own take auto
        device=cpu model=diptych-tiny step_attention=auto
        kernel_args=(tests/workers/test_triton_attention.py -k greedy_tokens_on_triton)
        floor_args=(--batches 1,2 --context 32 --repeats 2 --threads 1)
        serving_args=(--requests 2 --concurrency 2 --prompt-tokens 8 --output-tokens 4 --kv-cache-mib 16 --threads 1)
        split_args=(--requests 6 --concurrency 3 --prompt-tokens 24 --output-tokens 6 --threads 1)
        parity_args=(--dtype float32 "${split_args[@]}")
        busy_args=(--concurrency 1,4 --requests-per-stream 2 --output-tokens 8 --profiler)
        costs_args=(--prefill-tokens 16,64 --decode-batches 1,4 --decode-contexts 64 --kv-tokens 16
            --live-prompts 48 --live-rounds 1 --live-output-tokens 4 --repeats 1 --kv-cache-mib 16)
        ;;
    *)
        echo "usage: bash bench/gpu_check.sh [--smoke]" >&2
        exit 2
        ;;
    esac
    order=(preflight kernel floor serving split parity parity-shm busy costs)
    local total=$setup name
    for name in "${order[@]}"; do total=$((total + limits[$name])); done
    if [ "$total" -gt "$budget" ]; then
        echo "the steps' limits and the setup add up to ${total} s, over the ${budget} s budget: nothing run" >&2
        exit 2
    fi
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false py

    echo "== the machine"
    if commit=$(git rev-parse --short HEAD 2>/dev/null); then
        git diff --quiet HEAD || commit="$commit, with changes"
        progress "commit $commit"
    fi
    command -v nvidia-smi >/dev/null &&
        nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm --format=csv
    if [ "$mode" = gpu ]; then
        local wheels="${GPU_WHEELS:-.gpu-wheels}"
        if ! compgen -G "$wheels/*.whl" >/dev/null; then
            echo "no wheels in $wheels: run bench/gpu_wheels.sh where a registry is reachable, and carry the folder"
            exit 2
        fi
        progress "installing $(ls "$wheels"/*.whl | wc -l) wheels from $wheels into /tmp/site"
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$wheels"/*.whl || exit 2
        export PYTHONPATH="/tmp/site:$PWD:$PWD/proto/src"
    else
        # the GPU machine has no Django: hidden here too, so that a step needing it fails as it would there
        mkdir -p "$out/hidden/django"
        echo 'raise ImportError("no Django on the GPU machine (bench/gpu_check.sh --smoke hides it)")' \
            >"$out/hidden/django/__init__.py"
        export PYTHONPATH="$out/hidden:$PWD:$PWD/proto/src"
    fi

    if ! step preflight "bench.gpu_preflight: versions, imports, APIs, the attention each backend gets" \
        "$py" -m bench.gpu_preflight --device $device --attention "$attention"; then
        echo "the preflight failed: no step runs" >&2
        print_summary
        exit 1
    fi
    step kernel "the $attention attention kernel's tests (pytest ${kernel_args[*]})" \
        bash -c 'kernel_tests "$@"' kernel_tests "${kernel_args[@]}"
    step floor "bench.decode_floor, $before and $attention side by side" \
        "$py" -m bench.decode_floor --device $device --model $model --attention "$before,$attention" "${floor_args[@]}"
    step serving "bench.gpu_serving: transformers continuous batching against $before and $attention" \
        "$py" -m bench.gpu_serving --device $device --model $model --attention "$before,$attention" "${serving_args[@]}"
    step split "bench.gpu_serving --split (split against colocated, TTFT; default dtype)" \
        "$py" -m bench.gpu_serving --split --device $device --model $model --attention $step_attention \
        "${split_args[@]}"
    step parity "bench.gpu_split float32 parity over TCP, with transformers generate" \
        "$py" -m bench.gpu_split --device $device --model $model --attention $step_attention "${parity_args[@]}" \
        --reference 8
    step parity-shm "bench.gpu_split float32 parity over shared memory" \
        "$py" -m bench.gpu_split --device $device --model $model --attention $step_attention "${parity_args[@]}" --shm
    step busy "bench.gpu_busy (host time per step per sequence; the device's busy share)" \
        "$py" -m bench.gpu_busy --device $device --model $model --attention $step_attention "${busy_args[@]}"
    step costs "bench.phase_costs on the device, live requests to workers in process (a cost profile)" \
        "$py" -m bench.phase_costs --device $device --model $model --live workers "${costs_args[@]}" \
        --out "$out/phase-costs-$model.json"

    print_summary
    print_before_after
    exit "$failed"
}

export -f kernel_tests
# sourced (the tests call kernel_tests alone): defines the functions and runs nothing
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    main "$@"
fi
