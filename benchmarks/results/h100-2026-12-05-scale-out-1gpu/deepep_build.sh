#!/usr/bin/env bash
# DeepEP v1.2.1 from source against the image's torch: with NVSHMEM (the pip nvidia-nvshmem the image has), CUDA 13's
# libcu++ headers (cuda/std/...) under include/cccl; if that fails, intranode only (NVSHMEM hidden from setup.py).
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
cuda=$(dirname "$(dirname "$(command -v nvcc)")")
ls -d "$cuda/include/cccl/cuda/std" && ls "$cuda/include/cccl/cuda/std" | head -3
cd scratch/deepep
start=$(date +%s)
NVCC_APPEND_FLAGS="-I$cuda/include/cccl" CPLUS_INCLUDE_PATH="$cuda/include/cccl" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=14 \
  timeout 400 python3 setup.py build_ext --inplace >"$out/deepep_full.log" 2>&1
echo "full build rc=$? in $(( $(date +%s) - start )) s"; grep -m5 -n "error" "$out/deepep_full.log"
if ! ls deep_ep_cpp*.so >/dev/null 2>&1; then
  start=$(date +%s)
  NVCC_APPEND_FLAGS="-I$cuda/include/cccl" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=14 timeout 150 python3 -c "
import importlib.util as u, sys
find = u.find_spec
u.find_spec = lambda name, *a: None if name == 'nvidia.nvshmem' else find(name, *a)
sys.argv = ['setup.py', 'build_ext', '--inplace']
exec(compile(open('setup.py').read(), 'setup.py', 'exec'))" >"$out/deepep_intranode.log" 2>&1
  echo "intranode build rc=$? in $(( $(date +%s) - start )) s"; grep -m5 -n "error" "$out/deepep_intranode.log"
fi
ls -la deep_ep_cpp*.so 2>&1
PYTHONPATH=.:$PYTHONPATH python3 -c "
import torch, deep_ep
print('deep_ep imports; sm90 compiled:', deep_ep.Buffer.is_sm90_compiled())" 2>&1 | tail -4
