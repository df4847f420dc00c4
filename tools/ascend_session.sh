#!/usr/bin/env bash
# One command on an Ascend 950 machine: the npu-marked tests, the op-level conformance suite (the
# ascend-950 conformance reports), and the ascend-950 end-to-end baseline, recorded and then
# re-checked in a fresh process.
#   source /usr/local/Ascend/cann/set_env.sh && DEEPINFER_ACCELERATOR=ascend ./build.sh   # once
#   bash tools/ascend_session.sh [OUT_DIR]        # default OUT_DIR: ascend-session-<date>
# What comes out: OUT_DIR/session.log (everything), tests.log, conformance_ascend_<dtype>.json (op reports),
# e2e_ascend.json, and specs/baselines/offline_decode_ppl.json with a new or refreshed "ascend-950" entry
# (review its diff like code, set its tolerance from repeated runs: specs/baselines/README.md).
# Exit status 0 only when every part passed; 1 at once when the backend cannot run here (the log says why).
# PYTHON (default .venv/bin/python), NPU_TEST_PATHS (default tests: every npu-marked test), CONF_DTYPES.
# ASCEND_LAUNCH_BLOCKING=1 gives exact error stacks (slow; the graph test then fails by design).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-ascend-session-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
py="${PYTHON:-.venv/bin/python}"
exec > >(tee -a "$out/session.log") 2>&1
status=0
command -v npu-smi >/dev/null && npu-smi info
echo "ASCEND_HOME_PATH=${ASCEND_HOME_PATH:-unset} ASCEND_RT_VISIBLE_DEVICES=${ASCEND_RT_VISIBLE_DEVICES:-unset}"
# the probe and the op table, or why the backend cannot run here (then nothing else is worth running)
"$py" -m deepinfer_core.cli backends --accelerator ascend || exit 1
"$py" -c "import torch, torch_npu; print('torch', torch.__version__, 'torch_npu', torch_npu.__version__, torch.npu.get_device_name(0))"
"$py" -m pytest -q -p no:cacheprovider -m npu -rfEs ${NPU_TEST_PATHS:-tests} >"$out/tests.log" 2>&1 || status=1
tail -40 "$out/tests.log"
for dt in ${CONF_DTYPES:-bfloat16 float32 float16}; do
  "$py" -m deepinfer_core.cli conformance --backend ascend --dtype "$dt" --quiet --json "$out/conformance_ascend_$dt.json" || status=1
done
"$py" -m deepinfer_core.cli conformance --e2e --refresh --backend ascend || status=1   # writes the ascend-950 entry
"$py" -m deepinfer_core.cli conformance --e2e --backend ascend --json "$out/e2e_ascend.json" || status=1
cp specs/baselines/offline_decode_ppl.json "$out/"
git diff --stat -- specs/baselines 2>/dev/null
echo "session status: $status (0: every part passed)"
exit $status
