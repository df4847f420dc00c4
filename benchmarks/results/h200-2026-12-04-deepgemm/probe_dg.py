"""DeepGEMM built against this torch: dense and m-grouped FP8 GEMMs at V3 shapes, beside cuBLAS and our Triton experts."""
import json, sys, time, traceback
import torch
from triton.testing import do_bench
out = sys.argv[1]
res = {}
t0 = time.time()
import deep_gemm
from deep_gemm.utils import per_token_cast_to_fp8, per_block_cast_to_fp8
print("deep_gemm", deep_gemm.__version__, deep_gemm.__file__, f"import {time.time()-t0:.1f}s", flush=True)
torch.manual_seed(0)
dev = "cuda"

def tflops(m, n, k, ms): return 2 * m * n * k / ms / 1e9

# cuBLAS FP8 rate at 8192^3 (tensor-wise scales), the limit the README uses
a8 = torch.randn(8192, 8192, device=dev).to(torch.float8_e4m3fn); b8 = torch.randn(8192, 8192, device=dev).to(torch.float8_e4m3fn)
one = torch.ones((), device=dev)
ms = do_bench(lambda: torch._scaled_mm(a8, b8.T, one, one, out_dtype=torch.bfloat16), return_mode="median")
res["cublas_fp8_8192"] = tflops(8192, 8192, 8192, ms); print(f"cuBLAS FP8 8192^3: {res['cublas_fp8_8192']:.0f} TFLOP/s", flush=True)
del a8, b8

from deepinfer_nvidia_sm100 import cublas_fp8
dense = []
for name, n, k in (("o_proj", 7168, 16384), ("q_b", 24576, 1536), ("gate_up", 36864, 7168), ("down", 7168, 18432)):
    for m in (128, 1024, 4096):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16); w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        xa, wb = per_token_cast_to_fp8(x, use_ue8m0=False), per_block_cast_to_fp8(w, use_ue8m0=False)
        d = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        row = {"name": name, "m": m, "n": n, "k": k}
        try:
            t1 = time.time(); deep_gemm.fp8_gemm_nt(xa, wb, d); torch.cuda.synchronize(); row["first_call_s"] = time.time() - t1
            ref = x.float() @ w.float().T
            row["rel_err"] = ((d.float() - ref).norm() / ref.norm()).item()
            row["deepgemm_ms"] = do_bench(lambda: deep_gemm.fp8_gemm_nt(xa, wb, d), return_mode="median")
        except Exception as e:
            row["deepgemm_error"] = repr(e)[:300]
        try:
            wq, ws = wb
            row["cublas_block_ms"] = do_bench(lambda: cublas_fp8.block_fp8_linear(x, wq, ws, (128, 128)), return_mode="median")
        except Exception as e:
            row["cublas_error"] = repr(e)[:300]
        for key in ("deepgemm_ms", "cublas_block_ms"):
            if key in row: row[key.replace("_ms", "_tflops")] = tflops(m, n, k, row[key])
        print(row, flush=True); dense.append(row)
res["dense"] = dense

# m-grouped contiguous: V3 routed experts (E=256, k=8), random routing
from deepinfer_nvidia_sm100.kernels import moe
align = deep_gemm.get_mk_alignment_for_contiguous_layout(); print("mk alignment", align, flush=True)
E, D, I, K = 256, 7168, 2048, 8
w13 = torch.empty(E, 2 * I, D, device=dev, dtype=torch.float8_e4m3fn); w2 = torch.empty(E, D, I, device=dev, dtype=torch.float8_e4m3fn)
for e in range(E):
    w13[e] = (torch.randn(2 * I, D, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    w2[e] = (torch.randn(D, I, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
s13 = torch.full((E, 2 * I // 128, D // 128), 0.01 / D**0.5, device=dev); s2 = torch.full((E, D // 128, I // 128), 0.01 / I**0.5, device=dev)
grouped = []
for T in (256, 1024, 4096, 16384):
    ids = torch.rand(T, E, device=dev).topk(K, dim=-1).indices
    counts = torch.bincount(ids.flatten(), minlength=E).tolist()
    segs = [((c + align - 1) // align) * align for c in counts]
    Mp = sum(segs)
    layout = torch.full((Mp,), -1, dtype=torch.int32, device=dev)
    start = 0
    for e, (c, s) in enumerate(zip(counts, segs)):
        layout[start:start + c] = e; start += s
    row = {"T": T, "rows": T * K, "padded_rows": Mp}
    a = torch.randn(Mp, D, device=dev, dtype=torch.bfloat16)
    h = torch.randn(Mp, I, device=dev, dtype=torch.bfloat16)
    try:
        aq, hq = per_token_cast_to_fp8(a, use_ue8m0=False), per_token_cast_to_fp8(h, use_ue8m0=False)
        d1 = torch.empty(Mp, 2 * I, device=dev, dtype=torch.bfloat16); d2 = torch.empty(Mp, D, device=dev, dtype=torch.bfloat16)
        t1 = time.time()
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(aq, (w13, s13), d1, layout)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(hq, (w2, s2), d2, layout)
        torch.cuda.synchronize(); row["first_call_s"] = time.time() - t1
        e0 = int(ids[0, 0]); r0 = (layout == e0).nonzero()[0, 0].item()
        wd = (w13[e0].float().view(2 * I // 128, 128, D // 128, 128) * s13[e0][:, None, :, None]).view(2 * I, D)
        ref = a[r0].float() @ wd.T
        row["rel_err_one_row"] = ((d1[r0].float() - ref).norm() / ref.norm()).item()
        g1 = do_bench(lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(aq, (w13, s13), d1, layout), return_mode="median")
        g2 = do_bench(lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(hq, (w2, s2), d2, layout), return_mode="median")
        row.update(deepgemm_up_ms=g1, deepgemm_down_ms=g2,
                   deepgemm_tflops=2 * T * K * 3 * D * I / (g1 + g2) / 1e9)
    except Exception as e:
        row["deepgemm_error"] = repr(e)[:400]; traceback.print_exc()
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16); wts = torch.rand(T, K, device=dev)
    tiles = moe.expert_tiles(ids.numel(), E)
    row["triton_moe_experts_ms"] = do_bench(lambda: moe._run_experts(x, w13, w2, wts, ids, s13, s2, (128, 128), tiles, False), return_mode="median")
    row["triton_tflops"] = 2 * T * K * 3 * D * I / row["triton_moe_experts_ms"] / 1e9
    print(row, flush=True); grouped.append(row)
res["grouped"] = grouped
json.dump(res, open(f"{out}/deepgemm_probe.json", "w"), indent=1)
