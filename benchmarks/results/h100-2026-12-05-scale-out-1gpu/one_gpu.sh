#!/usr/bin/env bash
# Issue 20's parts one GPU can run: the NCCL world-size-1 exchange, scale_out at EP=1, a DeepEP source build.
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/nvidia_sm100 -e plugins/ascend_950 >/dev/null || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import torch, importlib.util as u; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'ninja', u.find_spec('ninja') is not None, 'nvshmem', u.find_spec('nvidia.nvshmem') is not None)"
which ninja nvcc
( cd scratch/deepep && start=$(date +%s) && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=12 timeout 420 python3 setup.py build_ext --inplace >"$out/deepep_build.log" 2>&1; echo "deepep build rc=$? in $(( $(date +%s) - start )) s" >>"$out/deepep_build.log" ) &
build=$!
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/nvidia/test_multi_gpu.py tests/test_expert_parallel.py >"$out/multi_tests.log" 2>&1
tail -6 "$out/multi_tests.log"
timeout 330 python3 -m benchmarks.scale_out --model v2-lite --ep 1 --out "$out" >"$out/scale_out.log" 2>&1
grep -v "^INFO\|WARNING" "$out/scale_out.log" | tail -8
wait $build
tail -5 "$out/deepep_build.log"
ls scratch/deepep/*.so 2>/dev/null && PYTHONPATH=scratch/deepep:$PYTHONPATH python3 -c "
import deep_ep, torch
print('deep_ep imports; sm90 compiled:', deep_ep.Buffer.is_sm90_compiled())" 2>&1 | tail -3
