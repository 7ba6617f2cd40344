#!/usr/bin/env bash
# Downloads, for a GPU machine that has no package registry, the Python 3.12 manylinux wheels the project's
# code needs beside the torch, triton and numpy that machine's image holds: what `bench/gpu_check.sh` installs.
# Run on a machine with network access, from the repository root (or anywhere in it):
#
#     bash bench/gpu_wheels.sh [FOLDER]          # default .gpu-wheels
#
# The folder is kept out of git (`.git/info/exclude`, never committed) and travels to the GPU machine as a
# carried path. Every version is pinned to the one the project runs with; --no-deps: the list is the closure.
set -euo pipefail

cd "$(git rev-parse --show-toplevel)"
folder="${1:-.gpu-wheels}"
python="${PYTHON:-.venv/bin/python}"

wheels=(
    transformers==5.23.0
    huggingface_hub==2.4.0
    httpx2==2.16.2
    httpcore2==2.16.2
    truststore==0.10.5
    tokenizers==0.23.3
    grpcio==1.85.1
    grpcio-health-checking==1.85.1
    grpcio-reflection==1.85.1
    protobuf==7.36.2
    googleapis-common-protos==1.76.0
    llguidance==1.9.1
    opentelemetry-api==1.45.2
    opentelemetry-sdk==1.45.2
    opentelemetry-proto==1.45.2
    opentelemetry-exporter-otlp-proto-common==1.45.2
    opentelemetry-exporter-otlp-proto-grpc==1.45.2
    opentelemetry-exporter-otlp-common==0.66b2
    opentelemetry-semantic-conventions==0.66b2
    redis==8.1.0
    xxhash==4.1.0
    prometheus_client==0.26.0
    py-spy==0.4.3
    ninja==1.13.2
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
du -sh "$folder"
