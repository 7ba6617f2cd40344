#!/usr/bin/env bash
# Downloads, for a GPU machine that has no package registry, the Python 3.12 manylinux wheels the GPU run's
# code needs beside what that machine's image holds (bench/gpu_image_packages.txt): what `bench/gpu_check.sh`
# installs. Run on a machine with network access, from the repository root (or anywhere in it):
#
#     bash bench/gpu_wheels.sh [FOLDER]          # default .gpu-wheels
#
# The folder is kept out of git (`.git/info/exclude`, never committed; added there if missing) and travels to
# the GPU machine as a carried path, which must stay under 60 MiB (the device call carries 64 MiB in all).
# Every version is pinned to the one the project runs with; --no-deps: the list is the closure, checked by
# tests/bench/test_gpu_wheels.py against the imports of the GPU steps and the image's packages.
#
# Not carried, though the project pins them: what the image holds at a version that serves (torch, triton,
# numpy, safetensors; tokenizers 0.23.2 and huggingface_hub 1.33.0, both within transformers 5.23's
# requirements, so neither httpx2, httpcore2 nor truststore, which only huggingface_hub 2 needs); what no GPU
# step imports (redis and grpcio-reflection are the gateway's, ninja builds the CPU operator, py-spy profiles
# by hand). Nothing here may depend on torch: the image's torch is the one every wheel must run against.
set -euo pipefail

cd "$(git rev-parse --show-toplevel)"
folder="${1:-.gpu-wheels}"
python="${PYTHON:-.venv/bin/python}"
limit_mib=60

wheels=(
    transformers==5.23.0  # the project's pin (parity is checked against its generate); the image has 5.17
    grpcio==1.85.1        # the generated stubs need grpcio >= 1.85.1 and protobuf >= 7.35.1: the image's are older
    grpcio-health-checking==1.85.1
    protobuf==7.36.2
    llguidance==1.9.1
    opentelemetry-api==1.45.2
    opentelemetry-sdk==1.45.2
    opentelemetry-semantic-conventions==0.66b2
    opentelemetry-proto==1.45.2
    opentelemetry-exporter-otlp-proto-common==1.45.2
    opentelemetry-exporter-otlp-proto-grpc==1.45.2
    opentelemetry-exporter-otlp-common==0.66b2
    googleapis-common-protos==1.76.0
    xxhash==4.1.0            # in the image, at a version nobody recorded: the pinned one is 0.5 MB
    prometheus_client==0.26.0 # likewise, 0.06 MB
)

exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF "/${folder#./}/" "$exclude" 2>/dev/null || echo "/${folder#./}/" >>"$exclude"

mkdir -p "$folder"
"$python" -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_31_x86_64 -d "$folder" "${wheels[@]}"

# one file per pinned name: a second version of one would stop the whole install there
count=$(find "$folder" -maxdepth 1 -name '*.whl' | wc -l)
if [ "$count" -ne "${#wheels[@]}" ]; then
    echo "expected ${#wheels[@]} wheels in $folder, found $count: remove the folder's stale ones" >&2
    exit 1
fi
size_kib=$(du -sk "$folder" | cut -f1)
echo "$folder: $count wheels, $((size_kib / 1024)) MiB ($size_kib KiB; the limit is $limit_mib MiB)"
if [ "$size_kib" -gt $((limit_mib * 1024)) ]; then
    echo "$folder is over $limit_mib MiB: the device call could not carry it beside the checkout" >&2
    exit 1
fi
