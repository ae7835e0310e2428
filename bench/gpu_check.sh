#!/usr/bin/env bash
# One prepared GPU check, under 5 minutes: run it on a CUDA machine from the repository root,
#   bash bench/gpu_check.sh [--full]
# It uses the machine's python3 (PYTHON overrides) with this tree on PYTHONPATH, installs
# wheels from .whl/ first when that folder exists (dp-accounting and what the machine lacks:
# such machines may reach no package index), runs the CUDA tests (the CPU/CUDA device
# parametrisations of clipping, sampling, REC and the batched local solver) and prints the GPU
# numbers beside the CPU ones (bench/gpu_check.py). Without CUDA it says so and prints the CPU
# side only.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/privkit-gpu-site}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
        .whl/*.whl || exit 2
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import dp_accounting, torch" || {
    echo "gpu_check: needs torch and dp-accounting importable (put wheels in .whl/)"; exit 2; }
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    echo "== CUDA tests"
    timeout 180 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -k "cuda or every_device" \
        tests/privkit/mechanisms/test_sampling.py tests/privkit/mechanisms/test_clipping.py \
        tests/privkit/mechanisms/test_rec.py tests/fl_examples/core/test_local.py
    echo "CUDA tests exit status: $?"
else
    echo "== no GPU present: the CUDA tests are not run; CPU numbers only"
fi
echo "== numbers"
timeout 240 "$PY" bench/gpu_check.py "$@"
