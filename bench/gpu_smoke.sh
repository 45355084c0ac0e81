#!/usr/bin/env bash
# GPU smoke test: one line per check, non-zero exit if any fails, under 8 minutes on one GPU.
#   bash bench/gpu_smoke.sh                 # on a machine with CUDA (uses .venv when present)
# On a machine without CUDA it prints "no CUDA device: skipped" and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
exec "$PY" bench/gpu_smoke.py "$@"
