#!/usr/bin/env bash
# The GPU check (make gpu-check): on a machine with an NVIDIA GPU and torch + torchvision installed,
#   1. installs what is missing (snakemake, DALI) from wheels in .whl/ (no network needed; see
#      bench/GPU_RUNBOOK.md), in a venv on top of the system's site-packages;
#   2. runs the real pipeline with config/gpu.yaml (ImageNet-sized demo set -> .rec -> DDP training on
#      every GPU -> evaluation -> results/report.html);
#   3. runs bench/gpu_efficiency.py (each loader from the .rec vs synthetic data, ResNet-50/18 at 224 and 160 px);
#   4. runs bench/oom_cap.py (11 GB cap: the preflight message at batch 256 and batch_size auto);
#   5. writes report.html, metrics.json, run.json, the efficiency table, the OOM text, summary.txt and
#      the logs into OUTDIR (first argument, else $OUT, else bench/out/gpu).
# Each part has its own time limit; the whole check is sized for < 8 minutes on one H200 with 16 cores.
# Without DALI the pipeline still runs (torch loader, GPU decode) and the bench marks DALI as skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-bench/out/gpu}}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
LOG="$OUTDIR/gpu_check.log"
exec > >(tee -a "$LOG") 2>&1
T0=$SECONDS
FAILED=()
step() { echo "== [$((SECONDS - T0)) s] $*"; }
# run LIMIT NAME CMD...: one part under its own time limit; a failure is recorded, the check goes on.
run() {
    local limit=$1 name=$2; shift 2
    step "$name (limit ${limit} s): $*"
    local t=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "== $name: rc=$rc after $((SECONDS - t)) s"
    [ $rc -eq 0 ] || FAILED+=("$name (rc=$rc$([ $rc -eq 124 ] && echo ', timed out'))")
    return $rc
}

PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/workflow${PYTHONPATH:+:$PYTHONPATH}"

# --- 1. environment ------------------------------------------------------------------------------
step "environment"
nvidia-smi -L || echo "nvidia-smi not found"
"$PY" -c "import sys, torch, torchvision; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| torchvision', torchvision.__version__, '| GPUs', torch.cuda.device_count())" \
    || { echo "torch/torchvision missing for $PY: this check needs them preinstalled"; exit 2; }
if [ -d .whl ]; then
    # The wheels travel as one tar split into parts, one per carry (bench/fetch_gpu_wheels.sh): join
    # <file>.part-aa, -ab, ... back into <file>, then unpack every tar.
    for first in .whl/*.part-aa; do
        [ -e "$first" ] || continue
        whole=${first%.part-aa}
        echo "parts of $(basename "$whole"): $(cd .whl && ls "$(basename "$whole")".part-* | sed 's/.*part-//' | tr '\n' ' ')"
        cat "$whole".part-* > "$whole.tmp" && mv "$whole.tmp" "$whole" && rm -f "$whole".part-*
        echo "joined $whole ($(du -h "$whole" | cut -f1))"
    done
    for t in .whl/*.tar; do
        [ -e "$t" ] || continue
        if tar -xf "$t" -C .whl; then echo "unpacked $t"; else echo "$t is damaged or incomplete (a part missing?)"; fi
        rm -f "$t"
    done
    # A venv that sees the system's torch, with what is missing from .whl/ (no index). snakemake and
    # DALI resolve together (snakemake pins packaging < 26, DALI <= 26.3: one resolve suits both); if
    # that fails (a lost part), snakemake alone, and the pipeline runs with the torch loader.
    install() {  # install "<wheel folders under .whl>" <requirements...>
        local dirs=$1 links=(--no-index) d
        for d in $dirs; do links+=(--find-links ".whl/$d"); done
        shift
        if [ ! -x .venv-gpu/bin/python ]; then
            "$PY" -m venv --system-site-packages .venv-gpu || rm -rf .venv-gpu
        fi
        if [ -x .venv-gpu/bin/python ]; then
            run 150 "install from $dirs" .venv-gpu/bin/python -m pip install -q "${links[@]}" "$@" && PY=.venv-gpu/bin/python
        else  # no venv module: a folder on PYTHONPATH instead
            run 150 "install from $dirs" "$PY" -m pip install -q "${links[@]}" --target .gpu-site "$@" \
                && export PYTHONPATH="$PWD/.gpu-site:$PYTHONPATH"
        fi
    }
    sm=() dali=()
    "$PY" -c "import snakemake" 2>/dev/null || sm=(snakemake)
    if ! "$PY" -c "import nvidia.dali" 2>/dev/null; then
        for w in .whl/dali/nvidia_dali_cuda*.whl; do [ -e "$w" ] && dali=("$w"); done
    fi
    if [ $((${#sm[@]} + ${#dali[@]})) -gt 0 ]; then
        # the fallback looks in sm/ only: a cut-short tar may have left a broken wheel in dali/
        install "sm dali" "${sm[@]}" "${dali[@]}" || { [ ${#sm[@]} -gt 0 ] && [ ${#dali[@]} -gt 0 ] && install sm "${sm[@]}"; }
    fi
fi
"$PY" -c "import snakemake" || { echo "snakemake is not importable: put its wheels in .whl/ (bench/GPU_RUNBOOK.md)"; exit 2; }
"$PY" -c "import nvidia.dali as d; print('DALI', d.__version__)" || echo "DALI not installed: the pipeline uses the torch loader (GPU decode)"
export PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"

# --- 2. the pipeline -----------------------------------------------------------------------------
# GPU_CHECK_SNAKEMAKE_ARGS: extra arguments, e.g. --config overrides for a small CPU rehearsal.
run 300 pipeline "$PY" -m snakemake --cores all --configfile config/gpu.yaml --rerun-incomplete \
    results/report.html ${GPU_CHECK_SNAKEMAKE_ARGS:-}

# --- 3. efficiency: loaders vs synthetic -------------------------------------------------------------
REC=results/fast_storage/gpudemo/train.rec
if [ -f "$REC" ]; then
    run 170 efficiency "$PY" bench/gpu_efficiency.py --rec "$REC" --idx "${REC%.rec}.idx" --out "$OUTDIR" \
        --steps 30 --warmup 8 --batch 256
    rm -f "$OUTDIR"/bench_side*.rec "$OUTDIR"/bench_side*.idx   # the bench's .rec copies: large, not results
else
    FAILED+=("efficiency (no $REC: the pipeline did not pack)")
fi

# --- 4. the 11 GB card -----------------------------------------------------------------------------
run 90 oom_cap "$PY" bench/oom_cap.py --cap-gb 11 --model resnet50 --size 224 --batch 256 --out "$OUTDIR"

# --- 5. collect ----------------------------------------------------------------------------------
step "collect"
cp -f results/report.html "$OUTDIR/" 2>/dev/null
cp -f results/gpudemo/eval/metrics.json results/gpudemo/eval/per_class.csv "$OUTDIR/" 2>/dev/null
for f in run.json epochs.csv steps.csv system.csv; do cp -f "results/gpudemo/train/$f" "$OUTDIR/train_$f" 2>/dev/null; done
mkdir -p "$OUTDIR/logs" && cp -rf logs/. "$OUTDIR/logs/" 2>/dev/null
cp -rf benchmarks "$OUTDIR/" 2>/dev/null
"$PY" bench/gpu_summary.py --dataset gpudemo --out "$OUTDIR" >/dev/null || FAILED+=("summary")
{
    echo "gpu_check: $((SECONDS - T0)) s in all"
    if [ ${#FAILED[@]} -eq 0 ]; then echo "all parts passed"; else printf 'FAILED: %s\n' "${FAILED[@]}"; fi
} >> "$OUTDIR/summary.txt"
cat "$OUTDIR/summary.txt"
[ ${#FAILED[@]} -eq 0 ]
