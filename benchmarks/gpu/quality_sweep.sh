#!/usr/bin/env bash
# The embedded world's recipe ablation (issue 44) on a lent GPU: the eight runs of
# benchmarks/gpu/quality_jobs.txt at once, each then evaluated on the 48 held-out compositions and
# on 48 training captions (benchmarks/gpu/sweep.sh does the work).
#   bash benchmarks/gpu/fetch_wheels.sh          # here: diffusers, Hydra, OmegaConf, ANTLR, PyAV wheels
#   device run: bash benchmarks/gpu/quality_sweep.sh [deadline_s] [overrides for every job]     (carry [".whl"])
# Measured on an H200 (2026-11-26, benchmarks/results/quality_sweep_h200.txt): eight runs at once
# each trained ~6400 tokens/s, no faster than one run on 2 CPU cores: the tiny DiT's steps are
# bound by kernel launches and Python, so the GPU buys breadth (variants at once), not speed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/quality_sweep} exec bash benchmarks/gpu/sweep.sh benchmarks/gpu/quality_jobs.txt "${1:-420}" "${2:-}"
