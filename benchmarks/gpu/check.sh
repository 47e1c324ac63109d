#!/usr/bin/env bash
# The GPU check on a bare machine with its own torch + CUDA: install the wheels fetch_wheels.sh
# carried in .whl/ into a scratch folder (never over the machine's torch), then run
#   python -m dit_train.tools.gpu_check   (JSON + log into $OUT, or benchmarks/results/gpu_check)
# Arguments go to the check, e.g. `--only mfu_compile,planner --budget-s 200`.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-benchmarks/results/gpu_check}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dit_site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/dit_site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,temperature.gpu --format=csv 2>&1 | tee "$out/nvidia_smi.txt"
PYTHONUNBUFFERED=1 python3 -m dit_train.tools.gpu_check --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
