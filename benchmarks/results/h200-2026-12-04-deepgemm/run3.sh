#!/usr/bin/env bash
set -u
out="${OUT:-/tmp/out}"; mkdir -p "$out"
bash tools/gpu_session.sh none > "$out/setup.log" 2>&1; tail -1 "$out/setup.log"
echo "== the sgl wheel alone (torch 2.11): supported?"
PYTHONPATH=/tmp/site:$PWD python3 -c "from deepinfer_nvidia_sm100 import deepgemm; print('deepgemm', deepgemm.version(), 'supported:', deepgemm.supported('cuda'))" 2>&1 | tail -3
bash tools/build_deepgemm.sh .dg_src/src /tmp/dgpkg /tmp/site/deep_gemm/include 2>&1 | tail -1
export PYTHONPATH=/tmp/dgpkg:/tmp/site:$PWD
python3 -c "from deepinfer_nvidia_sm100 import deepgemm; print('deepgemm', deepgemm.version(), 'supported:', deepgemm.supported('cuda'))"
deepinfer backends 2>&1 | grep -i "moe_experts" | head -3
echo "== tests"
timeout 260 python3 -m pytest -q -p no:cacheprovider -n 4 -rfE tests/nvidia/test_deepgemm_provider.py tests/nvidia/test_cublas_fp8_provider.py tests/nvidia/test_moe_kernels.py "tests/nvidia/test_dense_kernels.py" -k "deepgemm or quantiz or fp8 or experts or slots or gather" > "$out/tests.log" 2>&1; tail -6 "$out/tests.log"
echo "== conformance bf16"
timeout 200 deepinfer conformance --backend nvidia --dtype bfloat16 --ops moe_experts,fp8_block_linear,silu_and_mul --quiet --json "$out/conformance_nvidia_bfloat16.json" > "$out/conformance.log" 2>&1; tail -12 "$out/conformance.log"
echo "== kernels moe (bucketed rows)"
timeout 150 python3 -m benchmarks.kernels --only moe --out "$out" > "$out/kernels_moe.log" 2>&1; grep -E "V3/fp8 " "$out/kernels_moe.log" | sed -E "s/ +/ /g" | cut -c1-150
