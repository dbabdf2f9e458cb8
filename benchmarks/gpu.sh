#!/usr/bin/env bash
# The benchmarks for a lent GPU, in one command that fits in 8 minutes on one H100 or H200:
#
#   bash benchmarks/gpu.sh OUT_DIR            # on the GPU machine, from the repository root
#   bash benchmarks/gpu.sh OUT_DIR --dry-run  # the same code on a CPU machine, under a minute
#
# It writes OUT_DIR/gpu_report.md (the environment and the API check, step time and memory of every
# registry entry on the GPU and on 8 simulated CPU devices, the collectives' schedule, the kernels,
# quality on a 28.6M-parameter transformer), gpu_results.json (every row) and gpu_log.txt. It uses
# the package from this source tree (PYTHONPATH), never pip, and needs no network. benchmarks/
# gpu_run.py holds the plan and the budget and runs the lanes, gpu_report.py writes the report;
# PYTHON picks the interpreter (default: python3).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: bash benchmarks/gpu.sh OUT_DIR [--dry-run] [--budget SECONDS]" >&2
  exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" "$root/benchmarks/gpu_run.py" "$@"
