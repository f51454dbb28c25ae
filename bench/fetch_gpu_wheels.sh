#!/usr/bin/env bash
# Fetch, on a machine with the package index, what the lent GPU machine lacks (it has no network):
# snakemake and DALI for CUDA 13 with everything they depend on, as wheels for the device's Python
# (3.12), packed into one tar and split into parts that each fit one carry (64 MiB). Writes .whl/
# (gitignored); bench/GPU_RUNBOOK.md says how to carry the parts over, and bench/gpu_check.sh joins,
# unpacks and installs them there with pip --no-index.
#   bash bench/fetch_gpu_wheels.sh [--no-dali]
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
PYVER=${DEVICE_PYTHON:-3.12}
PART=${PART:-58M}   # one part per carry: 58 MiB + the working tree stays under the 64 MiB limit
rm -rf .whl && mkdir -p .whl/sm .whl/dali
target=(--only-binary=:all: --python-version "$PYVER" --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# connection_pool (a snakemake dependency) is published as a source archive only: build its (pure
# Python) wheel here so the binary-only download below, and the offline install there, find it.
"$PIP" wheel -q --no-deps -w .whl/sm connection_pool==0.0.3
"$PIP" download -q "${target[@]}" --find-links .whl/sm -d .whl/sm snakemake==9.27.1
if [ "${1:-}" != "--no-dali" ]; then
    # DALI 2.x needs its dependencies too (nvImageCodec decodes the JPEGs, nvCOMP, libcst, ...): a
    # --no-deps download would leave pip --no-index on the device unable to install it.
    "$PIP" download -q "${target[@]}" -d .whl/dali nvidia-dali-cuda130==2.4.0
fi
# The device has numpy (torch needs it); its own copy is the one to keep.
rm -f .whl/sm/numpy-*.whl .whl/dali/numpy-*.whl
# snakemake's wheels first: should a late part be lost, the pipeline still installs (without DALI).
tar -cf .whl/gpu-wheels.tar -C .whl sm dali && rm -rf .whl/sm .whl/dali
split -b "$PART" .whl/gpu-wheels.tar .whl/gpu-wheels.tar.part- && rm .whl/gpu-wheels.tar
ls -la .whl
echo "$(ls .whl | wc -l) parts: carry one per run call, in order, without pausing (bench/GPU_RUNBOOK.md)"
