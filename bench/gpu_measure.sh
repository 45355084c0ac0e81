#!/usr/bin/env bash
# GPU measurement, after the smoke test passes: the MoE block at a realistic shape, one-GPU training MFU, FP8.
#   bash bench/gpu_measure.sh --out DIR     # on one GPU, under 7 minutes: DIR/gpu_measure.json and gpu_measure.log
# On a machine without CUDA it prints "no CUDA device: skipped" and exits 0 (bench/gpu_measure.py --device cpu runs
# the same parts at toy sizes).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
exec "$PY" bench/gpu_measure.py "$@"
