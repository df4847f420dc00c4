#!/usr/bin/env bash
out="${OUT:-/tmp/out}"; mkdir -p "$out"
[[ -d /tmp/dgpkg/deep_gemm ]] || { bash tools/gpu_session.sh none >/dev/null 2>&1; bash tools/build_deepgemm.sh .dg_src/src /tmp/dgpkg /tmp/site/deep_gemm/include | tail -1; }
export PYTHONPATH=/tmp/dgpkg:/tmp/site:$PWD
timeout 80 python3 -m pytest -q -p no:cacheprovider -n 4 tests/nvidia/test_deepgemm_provider.py 2>&1 | tail -2
timeout 100 python3 - <<'PY'
import torch
from triton.testing import do_bench
from deepinfer_nvidia_sm100 import deepgemm
from deepinfer_nvidia_sm100.kernels import moe
E, D, I, K = 256, 7168, 2048, 8
w13, s13 = moe._bench_weights(E, 2 * I, D, True, "cuda"); w2, s2 = moe._bench_weights(E, D, I, True, "cuda")
for T in (512, 1024, 4096, 16384):
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16); ids = torch.rand(T, E, device="cuda").topk(K, dim=-1).indices; w = torch.rand(T, K, device="cuda")
    tiles = moe.expert_tiles(ids.numel(), E)
    t = do_bench(lambda: moe._run_experts(x, w13, w2, w, ids, s13, s2, (128, 128), tiles, False), return_mode="median")
    g = do_bench(lambda: deepgemm.grouped_experts(x, w13, w2, w, ids, s13, s2), return_mode="median")
    print(f"T={T}: triton {t:.3f} ms, deepgemm {g:.3f} ms, ratio {g / t:.3f}", flush=True)
PY
