#!/usr/bin/env bash
# Several training runs at once on one lent GPU, then tools.evaluate of each: the GPU buys breadth
# (the tiny DiT's steps are bound by kernel launches and Python: eight runs at once each train about
# as fast as one on 2 CPU cores; benchmarks/results/quality_sweep_h200.txt). GPU figures choose a
# recipe; the CPU run of the chosen recipe is what the docs report.
#   bash benchmarks/gpu/fetch_wheels.sh                       # here: diffusers, Hydra, OmegaConf, ANTLR, PyAV wheels
#   device run: bash benchmarks/gpu/sweep.sh JOBS [deadline_s] [overrides for every job]   (carry [".whl", ...])
# JOBS: a file of lines `name | overrides | evaluations`, evaluations `;`-separated sets of
# tools.evaluate flags (e.g. `--heldout; --heldout --given-video`), each written to
# RUN/eval/e<k>. Runs not done by the deadline are stopped (SIGTERM) and evaluated from their
# newest checkpoint (train.ckpt_every=500); an evaluation still running after $EVAL_S s (default
# 600) is stopped, so the whole call ends inside the device tool's 10 minutes. Results: $OUT/sweep.tgz
# (metrics, evaluate.json, grids of every run), $OUT/weights_<k>.tgz (EMA weights + config, two
# runs a file) and one table on stdout (benchmarks/gpu/sweep_table.py). On an H200 (2026-11-28) an
# evaluation of 48 held-out clips took over 150 s with 12 at once: give EVAL_S 300 or more.
set -uo pipefail
cd "$(dirname "$0")/../.."
jobs_file=$1
deadline=${2:-420}
extra=${3:-}  # overrides for every job, after its own (a dry run here: "train.steps=4 train.sample_every=0")
out=${OUT:-/tmp/gpu_sweep}
runs=/tmp/gpu_sweep_runs
mkdir -p "$out" "$runs"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dit_site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/dit_site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
device=$(python3 -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
common="train.progress=false train.ckpt_every=500 parallel.threads_per_worker=1 data.cache_dir=/tmp/dit_cache data.decoder=pyav"
mapfile -t lines < <(grep -v '^\s*#' "$jobs_file" | grep -v '^\s*$')
field() { echo "$1" | cut -d'|' -f"$2" | sed 's/^ *//; s/ *$//'; }
# each job's data first, one after another (the jobs would race to write the same sets)
for line in "${lines[@]}"; do
    python3 - $(field "$line" 2) $common $extra <<'EOF' || exit 1
import sys
from dit_train.compose import compose
from dit_train.data_pipelines import prepare_data
cfg = compose(sys.argv[1:])
prepare_data(cfg.data, cfg.model)
EOF
done
start=$(date +%s)
pids=()
for line in "${lines[@]}"; do
    name=$(field "$line" 1); over=$(field "$line" 2)
    ( python3 -m dit_train $over $common $extra hydra.run.dir=$runs/$name > $runs/$name.log 2>&1 ) &
    pids+=($!)
done
while (( $(date +%s) - start < deadline )); do
    alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    (( alive )) || break
    sleep 5
done
pkill -TERM -f "python3 -m dit_train " 2>/dev/null; sleep 20; pkill -KILL -f "python3 -m dit_train " 2>/dev/null
echo "training took $(( $(date +%s) - start )) s"
for line in "${lines[@]}"; do
    name=$(field "$line" 1)
    [ -f $runs/$name/config.yaml ] || { echo "$name: no run"; tail -5 $runs/$name.log; continue; }
    IFS=';' read -ra evals <<< "$(field "$line" 3)"
    for k in "${!evals[@]}"; do
        ( timeout ${EVAL_S:-600} python3 -m dit_train.tools.evaluate $runs/$name ${evals[$k]} --device $device --out $runs/$name/eval/e$k \
            > $runs/$name/eval_e$k.log 2>&1 ) &
    done
done
wait
python3 benchmarks/gpu/sweep_table.py "$runs"
tar czf "$out/sweep.tgz" -C "$runs" --exclude='*.safetensors' --exclude='checkpoints' --exclude='*.mp4' . 2>/dev/null
# EMA weights + config of every run, two runs a file (a returned file holds at most 16 MiB; ~6 MB a
# run): evaluations cut by $EVAL_S can be rerun here (tools.evaluate on the unpacked folder)
names=($(cd $runs && ls -d */ | tr -d /))
for ((k = 0; k < ${#names[@]}; k += 2)); do
    files=(); for n in "${names[@]:$k:2}"; do files+=($(cd $runs && ls $n/weights_ema.safetensors $n/config.yaml $n/run.json 2>/dev/null)); done
    (( ${#files[@]} )) && tar czf "$out/weights_$k.tgz" -C "$runs" "${files[@]}"
done
ls -la "$out"
