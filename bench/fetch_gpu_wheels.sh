#!/usr/bin/env bash
# Fetch, on a machine with the package index, what the lent GPU machine lacks (it has no network):
# snakemake and DALI for CUDA 13 with everything they depend on, as wheels for the device's Python
# (3.12), packed into one xz-compressed tar and split into parts that each fit one device call (64 MiB,
# the working tree included). Writes .whl/ (gitignored); bench/GPU_RUNBOOK.md says how to carry the
# parts over, and bench/gpu_check.sh joins, unpacks and installs them there with pip --no-index.
#   bash bench/fetch_gpu_wheels.sh [--no-dali]
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
PY=${PY:-.venv/bin/python}
PYVER=${DEVICE_PYTHON:-3.12}
# A call carries at most 64 MiB in all: what is left beside the working tree (tracked files), less 1 MiB.
TREE_MB=$(git ls-files -z | du -c -m --files0-from=- | tail -1 | cut -f1)
PART_MB=${PART_MB:-$((63 - TREE_MB))}
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
# Wheels are zips deflated file by file; stored uncompressed and xz'd as one stream, DALI's CUDA
# libraries pack much smaller (fewer parts, so fewer device calls). pip installs stored wheels as is.
"$PY" - <<'EOF'
import pathlib
import zipfile

for wheel in sorted(pathlib.Path(".whl").glob("*/*.whl")):
    tmp = wheel.with_name(wheel.name + ".tmp")
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            info.compress_type = zipfile.ZIP_STORED
            zout.writestr(info, data)
    tmp.replace(wheel)
EOF
# snakemake's wheels first: should a late part be lost, the pipeline still installs (without DALI).
tar -cf - -C .whl sm dali | xz -1 -T0 > .whl/gpu-wheels.tar.xz && rm -rf .whl/sm .whl/dali
split -b "${PART_MB}M" .whl/gpu-wheels.tar.xz .whl/gpu-wheels.tar.xz.part- && rm .whl/gpu-wheels.tar.xz
ls -la .whl
echo "$(ls .whl | wc -l) parts of ${PART_MB} MiB at most: carry one per run call, in order, without pausing (bench/GPU_RUNBOOK.md)"
