"""Decode-sized bf16 linears in a graph chain rms_norm -> linear -> rms_norm -> ...: cuBLAS against a
Triton skinny GEMM launched with PDL, with and without an L2 prefetch of its weight rows issued
before it waits for the kernel before it."""
import json, os, sys
import torch, triton, triton.language as tl
import torch.nn.functional as F
from deepinfer_nvidia_sm100.kernels import device as dev
from deepinfer_nvidia_sm100.kernels.device import await_inputs, launch_options
from deepinfer_nvidia_sm100.kernels import elementwise

@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, s_xm, s_wn, s_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                   PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH:
        rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * s_wn
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;", "=r,l,r",
                                  [rows, tl.full([BLOCK_N], 0, tl.int32) + row_bytes], dtype=tl.int32, is_pure=False, pack=1)
    await_inputs(PDL)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * s_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * s_wn + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(out_ptr + rm[:, None] * s_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

CFG = {}
def skinny(x, w, prefetch, block_n=16, block_k=256, warps=4, stages=3):
    m, k = x.shape; n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, bm))
    _skinny_kernel[grid](x, w, out, m, n, k, k * x.element_size(), x.stride(0), w.stride(0), out.stride(0),
                         BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, PREFETCH=prefetch, num_warps=warps,
                         num_stages=stages, **launch_options(x.device))
    return out

def make(m, shapes, layers):
    torch.manual_seed(0)
    ws = []
    for i in range(layers):
        n, k = shapes[i % len(shapes)]
        ws.append(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5)
    norms = {k: torch.ones(k, device="cuda", dtype=torch.bfloat16) for _, k in shapes}
    x = torch.randn(m, shapes[0][1], device="cuda", dtype=torch.bfloat16)
    return x, ws, norms

def chain(x, ws, norms, lin):
    for w in ws:
        x = lin(elementwise.rms_norm(x, norms[w.shape[1]], 1e-6), w)
    return x

def run(m, shapes, layers, lin, pdl=True):
    dev.PDL = pdl
    x, ws, norms = make(m, shapes, layers)
    ref = chain(x, ws, norms, lambda a, w: F.linear(a, w))
    static = x.clone()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(static, ws, norms, lin)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(static, ws, norms, lin)
    ts = []
    for _ in range(25):
        e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / layers)
    ts.sort()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    wbytes = sum(w.numel() * 2 for w in ws) / layers
    return ts[len(ts) // 2], err, wbytes

if __name__ == "__main__":
    print(torch.cuda.get_device_name())
    res = []
    for label, shapes in (("qkv_a-like 3648x2048 / 2048x3648", [(3648, 2048), (2048, 3648)]), ("o_proj-like 2048x2048", [(2048, 2048)])):
        for m in (1, 8, 64):
            rows = {}
            rows["cublas, norms PDL"] = run(m, shapes, 40, lambda a, w: F.linear(a, w))
            rows["cublas, norms plain"] = run(m, shapes, 40, lambda a, w: F.linear(a, w), pdl=False)
            for bn, bk, wp in ((16, 256, 4), (32, 128, 4), (16, 128, 4), (64, 128, 4)):
                rows[f"triton bn{bn} bk{bk} PDL"] = run(m, shapes, 40, lambda a, w: skinny(a, w, False, bn, bk, wp))
                rows[f"triton bn{bn} bk{bk} PDL+prefetch"] = run(m, shapes, 40, lambda a, w: skinny(a, w, True, bn, bk, wp))
            for name, (us, err, wb) in rows.items():
                print(f"{label:34s} M={m:3d} {name:32s} {us:7.2f} us/(norm+linear)  weights {wb/us/1e6:5.2f} TB/s  rel err {err:.2e}", flush=True)
                res.append({"shape": label, "m": m, "variant": name, "us": us, "rel_err": err, "weight_bytes": wb})
    json.dump(res, open(os.environ.get("OUT", "/tmp") + "/linear_probe.json", "w"), indent=1)
