#!/usr/bin/env bash
# DeepInfer build script.
#   ./build.sh          create .venv and install the core, the backend plugins, the dev tools, lm-eval (eval/) and
#                       the prefill/decode extra (NIXL, vllm-router)
#   ./build.sh run      ... then run examples/offline_inference.py on the embedded default model
#   ./build.sh test     ... then run the test suite
# DEEPINFER_ACCELERATOR=cpu|nvidia|ascend (auto when unset) chooses which torch build is installed
# when .venv has none yet: cpu takes torch 2.13.0; nvidia a CUDA build of torch >= 2.11; ascend (an
# Ascend machine with CANN's set_env.sh sourced) the CPU build of torch 2.13.0 and then torch_npu
# for the installed torch (torch-npu==X.Y.* for torch X.Y; DEEPINFER_TORCH_NPU_SPEC overrides).
set -euo pipefail
cd "$(dirname "$0")"

accel="${DEEPINFER_ACCELERATOR:-auto}"
if [[ "$accel" == auto ]]; then
  if [[ -e /dev/nvidiactl ]]; then accel=nvidia
  elif compgen -G "/dev/davinci[0-9]*" >/dev/null; then accel=ascend
  else accel=cpu; fi
fi

if [[ "$accel" == ascend && ( -z "${ASCEND_HOME_PATH:-}" || ! -d "${ASCEND_HOME_PATH:-}" ) ]]; then
  # torch_npu loads CANN's libraries when torch is imported: installed without them, it breaks torch.
  cann_state="unset"; [[ -n "${ASCEND_HOME_PATH:-}" ]] && cann_state="$ASCEND_HOME_PATH, not a directory"
  echo "DEEPINFER_ACCELERATOR=ascend installs torch_npu, which needs CANN's environment (ASCEND_HOME_PATH:" \
       "$cann_state). Fix: install CANN 9.2 and" \
       "source /usr/local/Ascend/cann/set_env.sh (CANN <= 8.3: /usr/local/Ascend/ascend-toolkit/set_env.sh), then" \
       "run ./build.sh again; without an Ascend NPU use DEEPINFER_ACCELERATOR=cpu. Nothing was installed." >&2
  exit 1
fi

python="${PYTHON:-python3}"
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip -q --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  case "$accel" in
    # triton: the NVIDIA kernels' tests run in its interpreter here; 3.6.0 is the version the
    # kernels were validated with on the GPU (the one torch 2.11's CUDA build ships).
    cpu) "${pip[@]}" install "${DEEPINFER_TORCH_SPEC:-torch==2.13.0}" "${DEEPINFER_TRITON_SPEC:-triton==3.6.0}" ;;
    nvidia) "${pip[@]}" install "${DEEPINFER_TORCH_SPEC:-torch>=2.11}" ;;
    # torch_npu runs on the CPU build of torch (PyPI's x86_64 torch is the CUDA one)
    ascend) "${pip[@]}" install --extra-index-url https://download.pytorch.org/whl/cpu "${DEEPINFER_TORCH_SPEC:-torch==2.13.0}" ;;
    *) "${pip[@]}" install "${DEEPINFER_TORCH_SPEC:-torch==2.13.0}" ;;
  esac
fi
if [[ "$accel" == ascend ]] && ! .venv/bin/python -c "import importlib.metadata as m; m.version('torch_npu')" 2>/dev/null; then
  # each torch_npu release is built for one torch release (torch-npu 2.13.0 requires torch 2.13.0)
  torch_mm=$(.venv/bin/python -c "import importlib.metadata as m; print('.'.join(m.version('torch').split('+')[0].split('.')[:2]))")
  "${pip[@]}" install "${DEEPINFER_TORCH_NPU_SPEC:-torch-npu==$torch_mm.*}"
  .venv/bin/python -c "import torch, torch_npu; print('torch', torch.__version__, 'torch_npu', torch_npu.__version__, 'NPUs', torch.npu.device_count())" \
    || { echo "torch_npu is installed but does not import with this CANN ($ASCEND_HOME_PATH): check that CANN and torch_npu match (README of plugins/ascend_950)" >&2; exit 1; }
fi
# The plugins are small and probe-only until selected, so both are always installed:
# `deepinfer backends` then shows why each can or cannot run here. The Ascend plugin's tilelang
# extra (TileLang, ~80 MB of wheels: its tests lower the Ascend kernels to AscendC on any machine)
# comes with it. The installs are editable, so
# pip runs again only when tools/venv_is_current.py says the pyproject files changed since the
# last install or the venv lacks what it installed.
stamp=.venv/.deepinfer-install
if ! .venv/bin/python -P tools/venv_is_current.py "$PWD" "$stamp" 2>/dev/null; then
  "${pip[@]}" install -e ".[dev,eval,pd]" -e plugins/nvidia_sm100 -e "plugins/ascend_950[tilelang]"
  .venv/bin/python -P tools/venv_is_current.py "$PWD" "$stamp" --write
fi

case "${1:-build}" in
  build) echo "built: .venv (backend for this machine: $accel). Try ./build.sh run or ./build.sh test" ;;
  run) shift; exec .venv/bin/python examples/offline_inference.py "$@" ;;
  test) shift; exec .venv/bin/python -m pytest -q "$@" ;;
  *) echo "usage: ./build.sh [build|run|test]" >&2; exit 2 ;;
esac
