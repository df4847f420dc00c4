import torch, deep_gemm, traceback
from deep_gemm.utils import per_token_cast_to_fp8, per_block_cast_to_fp8
print("sgl deep_gemm", deep_gemm.__file__)
m, n, k = 256, 512, 1024
a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16); b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
try:
    print("get_tma_aligned_size", deep_gemm._C.get_tma_aligned_size(100, 4))
except Exception as e: print("tma size:", repr(e)[:300])
try:
    sf = torch.rand(m, k // 128, device="cuda")
    r = deep_gemm.get_mn_major_tma_aligned_tensor(sf)
    print("get_mn_major_tma_aligned_tensor ok", tuple(r.shape), tuple(r.stride()))
except Exception as e: print("mn_major:", repr(e)[:300])
try:
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    deep_gemm.fp8_gemm_nt(per_token_cast_to_fp8(a, use_ue8m0=False), per_block_cast_to_fp8(b, use_ue8m0=False), d)
    torch.cuda.synchronize(); print("fp8_gemm_nt ok, max err", (d.float() - a.float() @ b.float().T).abs().max().item())
except Exception as e: print("fp8_gemm_nt:", repr(e)[:400])
