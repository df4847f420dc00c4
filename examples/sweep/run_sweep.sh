#!/usr/bin/env bash
# The NVIDIA benchmark sweep: ceilings, kernels at DeepSeek-V3 / V2-Lite shapes, end to end on a
# V2-Lite-shaped model (with transformers beside it) and a V3-shaped FP8 slice, then the plots.
#   examples/sweep/run_sweep.sh [OUT_DIR] [--quick]
# Needs one NVIDIA sm_90/sm_100 GPU with ~100 GB free (V2-Lite's 15.7B bf16 parameters + KV).
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-bench_results}"
quick=()
[[ "${2:-}" == --quick ]] && quick=(--quick)
# The project's .venv (./build.sh) when there is one; needs `pip install -e '.[bench]'` for the plots.
python="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
mkdir -p "$out"
"$python" -m benchmarks.kernels --out "$out" 2>&1 | tee "$out/kernels.log"
"$python" -m benchmarks.e2e --model v2-lite --model v3-slice --hf-peer --out "$out" "${quick[@]}" 2>&1 | tee "$out/e2e.log"
"$python" -m benchmarks.plots "$out"
