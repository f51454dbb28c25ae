#!/usr/bin/env bash
# The GPU check (make gpu-check): on a machine with an NVIDIA GPU and torch + torchvision installed,
#   1. installs what is missing (snakemake, DALI) from the wheel parts in .whl/ (no network needed; see
#      bench/GPU_RUNBOOK.md), in a venv on top of the system's site-packages;
#   2. runs the real pipeline with config/gpu.yaml (ImageNet-sized demo set -> .rec -> DDP training on
#      every GPU -> evaluation -> results/report.html) in the work folder;
#   3. runs bench/gpu_efficiency.py (each loader from the .rec vs synthetic data, ResNet-50/18 at 224 and 160 px);
#   4. runs bench/oom_cap.py (11 GB cap: the preflight message at batch 256 and batch_size auto) and
#      bench/decoder_memory.py (what DALI's decoder holds per pack variant, padding and thread);
#   5. on exit, however it ends (done, a part cut at its limit, a signal): summary.txt and one archive.
# OUTDIR (first argument, else $OUT, else bench/out/gpu) receives only what a lent GPU machine can send
# back (at most 8 files of 16 MiB): summary.txt, gpu_efficiency.md, oom_cap.txt, decoder_memory.md, gpu_check.log and
# gpu_check.tar.gz (the logs, report, telemetry and JSON tables, capped at ARCHIVE_CAP_MB). Scratch data
# (the bench's re-packed .rec copies, the unpacked wheels' venv) stays outside it.
# Without DALI the pipeline still runs (torch loader, GPU decode) and the bench marks DALI as skipped.
#
# Environment: PYTHON (default python3); GPU_CHECK_WORK (the pipeline's working folder, default the
# repository); GPU_CHECK_SCRATCH (default $TMPDIR/rectrain-gpu-check-<uid>, used only when it is the
# user's own and writable by no one else); GPU_CHECK_WHEELS (the wheel
# parts, default .whl; unpacked only when snakemake or DALI is missing); GPU_CHECK_SNAKEMAKE_ARGS (extra
# arguments, e.g. --config overrides for a small CPU rehearsal); GPU_CHECK_EFFICIENCY_ARGS (extra
# arguments for bench/gpu_efficiency.py, e.g. --runs resnet50:224 --hw-decoder-load 0.9); GPU_CHECK_DEADLINE_S (end every part
# by this many seconds after the start, default BUDGET_S - LIMIT_SUMMARY_S: a rehearsal can shorten it);
# GPU_CHECK_FOCUS=efficiency (issue 25's device run, bench/GPU_RUNBOOK.md "The decode and compile run"):
# the pipeline only packs the demo set, the 11 GB check is skipped, and the efficiency bench gets their
# time for EFFICIENCY_FOCUS_ARGS (eager and compiled, DALI roi and full, two repeats).
set -uo pipefail

# --- time limits, in seconds: the one place they are set ----------------------------------------
# One device command may run 600 s; the parts and the summary add up to BUDGET_S, which leaves ~100 s
# for the interpreter's start and the transfer back. tests/test_gpu_check.py checks the sum and that
# bench/GPU_RUNBOOK.md quotes these numbers.
BUDGET_S=500
LIMIT_SETUP_S=60       # join + unpack the wheel parts, install snakemake and DALI offline
LIMIT_PIPELINE_S=200   # demo data, pack, 3 epochs ResNet-50, evaluation, report (~150 s on the H200)
LIMIT_EFFICIENCY_S=120 # 4 model/size runs x (synthetic + DALI + torch)
LIMIT_OOM_CAP_S=50     # preflight at batch 256 and batch_size auto under an 11 GB cap
LIMIT_DECODER_MEMORY_S=40 # DALI's decoder memory by pack variant, padding and threads (issue 23 point 8)
LIMIT_SUMMARY_S=30     # summary.txt and the archive, from the exit trap
ARCHIVE_CAP_MB=12      # the archive stays well under the 16 MiB a returned file may have
FOCUS=${GPU_CHECK_FOCUS:-}
# The decode and compile run (issue 25, point 6): ResNet-50 at 224 (as packed) and 176 (from a .rec
# copy at shorter side 201 = 176 / 0.875), ResNet-18 at 160 (side 182) and 224; each eager and compiled,
# DALI's roi and full decode paths against the synthetic ceiling of the same compile mode, two
# repeats; ResNet-50 at 224 first (the acceptance number), so a cut run still has it.
EFFICIENCY_FOCUS_ARGS="--runs resnet50:224,resnet18:224,resnet50:176@201,resnet18:160@182 --compile eager,default --decodes roi,full --loaders dali --repeats 2"
if [ "$FOCUS" = efficiency ]; then
    # The parts it skips give it their time (run_part still ends it by the deadline).
    LIMIT_EFFICIENCY_S=$((LIMIT_EFFICIENCY_S + LIMIT_PIPELINE_S + LIMIT_OOM_CAP_S + LIMIT_DECODER_MEMORY_S - 60))
    LIMIT_PIPELINE_S=60  # demo set, index and pack only: 36 s on the H200 (2026-11-30)
elif [ -n "$FOCUS" ]; then
    echo "gpu_check: GPU_CHECK_FOCUS=$FOCUS: the only focus is 'efficiency'" >&2
    exit 2
fi

cd "$(dirname "$0")/.."
REPO=$PWD
OUTDIR=${1:-${OUT:-bench/out/gpu}}
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=${GPU_CHECK_WORK:-$REPO}
SCRATCH=${GPU_CHECK_SCRATCH:-${TMPDIR:-/tmp}/rectrain-gpu-check-$(id -u)}
# The scratch folder holds the venv the check installs into and runs: in a shared /tmp, one made by
# someone else (or a link to theirs) would run their code. Used only when it is ours, no link, and
# writable by nobody else; a new one is made 0700.
mkdir -m 700 -p "$SCRATCH" 2>/dev/null
if [ -L "$SCRATCH" ] || [ ! -d "$SCRATCH" ] || [ ! -O "$SCRATCH" ] || [ -n "$(find "$SCRATCH" -maxdepth 0 -perm /022)" ]; then
    echo "gpu_check: refusing scratch folder $SCRATCH: it is not a folder of $(id -un)'s that only they can write (a link, another user's, or writable by others), and the check would run the venv inside it. Remove it, or set GPU_CHECK_SCRATCH to a folder of your own." \
        | tee "$OUTDIR/summary.txt" >&2
    exit 2
fi
WHEELS=${GPU_CHECK_WHEELS:-$REPO/.whl}
rm -rf "$SCRATCH/tables" "$SCRATCH/whl"  # a previous run's tables must not pass for this run's
mkdir -p "$WORK" "$SCRATCH/tables" && WORK=$(cd "$WORK" && pwd)
DEADLINE_S=${GPU_CHECK_DEADLINE_S:-$((BUDGET_S - LIMIT_SUMMARY_S))}
LOG="$OUTDIR/gpu_check.log"
exec > >(tee -a "$LOG") 2>&1
T0=$SECONDS
FAILED=()
PART_PID=
STOPPED_BY=
PY=${PYTHON:-python3}
export PYTHONPATH="$REPO/workflow${PYTHONPATH:+:$PYTHONPATH}"
step() { echo "== [$((SECONDS - T0)) s] $*"; }

# run_part NAME LIMIT CMD...: one part under its own limit, cut short at the deadline; a failure is
# recorded and the check goes on. The part runs in the background so a signal reaches the trap at once.
run_part() {
    local name=$1 limit=$2 left=$((DEADLINE_S - (SECONDS - T0)))
    shift 2
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        FAILED+=("$name (skipped: no time left before the ${DEADLINE_S} s deadline)")
        step "$name: skipped, no time left"
        return 1
    fi
    step "$name (limit ${limit} s): $*"
    local t=$SECONDS rc
    timeout --kill-after=5 "$limit" "$@" &
    PART_PID=$!
    wait "$PART_PID"
    rc=$?
    PART_PID=
    echo "== $name: rc=$rc after $((SECONDS - t)) s"
    # 124: stopped at its limit; 137 after the limit: still running 5 s after that TERM, so killed.
    local cut=
    { [ $rc -eq 124 ] || { [ $rc -eq 137 ] && [ $((SECONDS - t)) -ge "$limit" ]; }; } && cut=", timed out after $limit s"
    [ $rc -eq 0 ] || FAILED+=("$name (rc=$rc$cut)")
    return $rc
}

# finish: from the exit trap, so a cut or killed check still reports. Stops the running part, writes
# summary.txt (gpu_summary.py, else a plain fallback) and the archive, appends the outcome.
finish() {
    local rc=$?
    trap - EXIT TERM INT HUP
    if [ -n "$PART_PID" ]; then
        kill -TERM "$PART_PID" 2>/dev/null
        wait "$PART_PID" 2>/dev/null
        FAILED+=("the part running at ${STOPPED_BY:-exit} was stopped")
    fi
    [ -n "$STOPPED_BY" ] && FAILED+=("check stopped by $STOPPED_BY after $((SECONDS - T0)) s")
    step "summary"
    timeout --kill-after=5 "$LIMIT_SUMMARY_S" "$PY" "$REPO/bench/gpu_summary.py" --dataset gpudemo \
        --results "$WORK/results" --work "$WORK" --tables "$SCRATCH/tables" --out "$OUTDIR" \
        --archive-cap-mb "$ARCHIVE_CAP_MB" >/dev/null \
        || { FAILED+=("summary (gpu_summary.py failed: see gpu_check.log)")
             echo "gpu_summary.py failed: see gpu_check.log" > "$OUTDIR/summary.txt"; }
    {
        echo "gpu_check: $((SECONDS - T0)) s in all (limits: budget $BUDGET_S s, parts by $DEADLINE_S s)"
        [ -n "$FOCUS" ] && echo "focus: $FOCUS (the pipeline only packed, no training or report; oom_cap and decoder_memory skipped)"
        if [ ${#FAILED[@]} -eq 0 ]; then echo "all parts passed"; else printf 'FAILED: %s\n' "${FAILED[@]}"; fi
    } >> "$OUTDIR/summary.txt"
    cat "$OUTDIR/summary.txt"
    [ ${#FAILED[@]} -eq 0 ] && [ "$rc" -eq 0 ] && exit 0
    exit $((rc ? rc : 1))
}
trap finish EXIT
for sig in TERM INT HUP; do trap "STOPPED_BY=SIG$sig; exit 143" "$sig"; done

# --- 1. environment ------------------------------------------------------------------------------
# The environment check, unpacking and installing share LIMIT_SETUP_S.
SETUP_END=$((SECONDS - T0 + LIMIT_SETUP_S))
setup_left() { echo $((SETUP_END - (SECONDS - T0))); }
step "work folder $WORK, scratch $SCRATCH"
nvidia-smi -L || echo "nvidia-smi not found"
run_part environment "$(setup_left)" "$PY" -c "import sys, torch, torchvision; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| torchvision', torchvision.__version__, '| GPUs', torch.cuda.device_count())" \
    || { rc=$?
         # cut at its limit is not "missing": on a loaded machine importing torch alone can outlast it
         if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
             FAILED+=("the environment check (importing torch and torchvision) did not finish within its limit: a loaded machine or a slow disk; nothing after it ran")
         elif [[ "${FAILED[-1]}" != *skipped* ]]; then
             FAILED+=("torch/torchvision missing for $PY: this check needs them preinstalled")
         fi
         exit 2; }
need_sm=0 need_dali=0
"$PY" -c "import snakemake" 2>/dev/null || need_sm=1
"$PY" -c "import nvidia.dali" 2>/dev/null || need_dali=1
if [ $((need_sm + need_dali)) -gt 0 ] && compgen -G "$WHEELS/*.part-a*" >/dev/null; then
    # The wheels travel as one xz'd tar split into parts, one per device call (bench/fetch_gpu_wheels.sh).
    echo "wheel parts: $(cd "$WHEELS" && ls -- *.part-* | sed 's/.*part-//' | tr '\n' ' ')"
    mkdir -p "$SCRATCH/whl"
    run_part unpack "$(setup_left)" bash -c 'cat "$2"/*.part-* | "$0" -c "import sys, tarfile
with tarfile.open(fileobj=sys.stdin.buffer, mode=\"r|xz\") as t: t.extractall(sys.argv[1], filter=\"data\")" "$1"' \
        "$PY" "$SCRATCH/whl" "$WHEELS" || echo "the wheel archive is damaged or incomplete (a part missing?): installing what was unpacked"
    # A venv that sees the system's torch, with what is missing (no index). snakemake and DALI resolve
    # together (snakemake pins packaging < 26, DALI <= 26.3: one resolve suits both); if that fails (a
    # lost part), snakemake alone from sm/, and the pipeline runs with the torch loader.
    VENV="$SCRATCH/venv"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV" || rm -rf "$VENV"
    # Without ensurepip (a Debian python3 without python3-venv) the venv cannot get a pip of its own:
    # use the system's, which --system-site-packages makes importable inside it. (pip --target is no
    # way out: it ignores installed packages, so DALI's numpy, left out of the wheels, cannot resolve.)
    [ -x "$VENV/bin/python" ] || { "$PY" -m pip --version >/dev/null 2>&1 \
        && "$PY" -m venv --without-pip --system-site-packages "$VENV"; } || rm -rf "$VENV"
    [ -x "$VENV/bin/python" ] || { FAILED+=("no venv module or no pip for $PY: cannot install the wheels"); exit 2; }
    # The venv must also see packages outside the base interpreter's site folders ($PY may itself be a
    # venv, as on the lent machine): bench/overlay_venv.py.
    "$PY" "$REPO/bench/overlay_venv.py" "$VENV" || { FAILED+=("overlay_venv.py failed: the venv cannot see $PY's packages"); exit 2; }
    pip_install() {  # pip_install "<wheel folders>" <requirements...>
        local links=(--no-index) d dirs=$1
        shift
        for d in $dirs; do links+=(--find-links "$SCRATCH/whl/$d"); done
        run_part "install from $dirs" "$(setup_left)" \
            "$VENV/bin/python" -m pip install -q --no-compile "${links[@]}" "$@"
    }
    sm=() dali=()
    [ $need_sm -eq 1 ] && sm=(snakemake)
    if [ $need_dali -eq 1 ]; then
        for w in "$SCRATCH"/whl/dali/nvidia_dali_cuda*.whl; do [ -e "$w" ] && dali=("$w"); done
    fi
    if [ $((${#sm[@]} + ${#dali[@]})) -gt 0 ]; then
        pip_install "sm dali" "${sm[@]}" "${dali[@]}" \
            || { [ ${#sm[@]} -gt 0 ] && [ ${#dali[@]} -gt 0 ] && pip_install sm "${sm[@]}"; }
    fi
    "$VENV/bin/python" -c "import snakemake" 2>/dev/null && PY=$VENV/bin/python
fi
"$PY" -c "import snakemake" \
    || { FAILED+=("snakemake is not importable: carry its wheels in .whl/ (bench/GPU_RUNBOOK.md)"); exit 2; }
"$PY" -c "import nvidia.dali as d; print('DALI', d.__version__)" || echo "DALI not installed: the pipeline uses the torch loader (GPU decode)"
export PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"

# --- 2. the pipeline -----------------------------------------------------------------------------
# shellcheck disable=SC2086 # GPU_CHECK_SNAKEMAKE_ARGS is a list of words
TARGET=results/report.html
[ "$FOCUS" = efficiency ] && TARGET=results/fast_storage/gpudemo/train.rec
run_part pipeline "$LIMIT_PIPELINE_S" "$PY" -m snakemake --snakefile "$REPO/Snakefile" --directory "$WORK" \
    --cores all --configfile "$REPO/config/gpu.yaml" --rerun-incomplete "$TARGET" \
    ${GPU_CHECK_SNAKEMAKE_ARGS:-}

# --- 3. efficiency: loaders vs synthetic -------------------------------------------------------------
REC=$WORK/results/fast_storage/gpudemo/train.rec
if [ -f "$REC" ]; then
    # shellcheck disable=SC2086 # GPU_CHECK_EFFICIENCY_ARGS is a list of words
    run_part efficiency "$LIMIT_EFFICIENCY_S" "$PY" bench/gpu_efficiency.py --rec "$REC" --idx "${REC%.rec}.idx" \
        --out "$SCRATCH/tables" --scratch "$SCRATCH/efficiency" --steps 25 --warmup 6 --batch 256 \
        $([ "$FOCUS" = efficiency ] && echo "$EFFICIENCY_FOCUS_ARGS") ${GPU_CHECK_EFFICIENCY_ARGS:-}
    cp -f "$SCRATCH/tables/gpu_efficiency.md" "$OUTDIR/" 2>/dev/null
else
    FAILED+=("efficiency (skipped: no $REC, the pipeline did not pack)")
fi

# --- 4. the 11 GB card -----------------------------------------------------------------------------
[ "$FOCUS" = efficiency ] && { step "oom_cap: skipped (GPU_CHECK_FOCUS=efficiency)"; exit 0; }
run_part oom_cap "$LIMIT_OOM_CAP_S" "$PY" bench/oom_cap.py --cap-gb 11 --model resnet50 --size 224 --batch 256 \
    --out "$SCRATCH/tables"
cp -f "$SCRATCH/tables/oom_cap.txt" "$OUTDIR/" 2>/dev/null

# --- 5. what DALI's decoder needs (the padding default for 11 GB cards) -------------------------------
run_part decoder_memory "$LIMIT_DECODER_MEMORY_S" "$PY" bench/decoder_memory.py --out "$SCRATCH/tables" \
    --scratch "$SCRATCH"
cp -f "$SCRATCH/tables/decoder_memory.md" "$OUTDIR/" 2>/dev/null
exit 0  # the exit trap writes the summary and the archive
