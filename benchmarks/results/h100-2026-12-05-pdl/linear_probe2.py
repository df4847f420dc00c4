"""Round 2 of linear_probe.py (run beside it): more tile configurations of the Triton skinny GEMM, and a
plain FMA GEMV for one row, against cuBLAS in the same rms_norm -> linear graph chain."""
import json, os
import torch, triton, triton.language as tl
import torch.nn.functional as F
from deepinfer_nvidia_sm100.kernels.device import await_inputs, launch_options
from linear_probe import run, skinny

@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, s_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * s_wn + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K), other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(out_ptr + rn, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rn < N)

def gemv(x, w, block_n, block_k, warps, stages):
    n, k = w.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, w, out, n, k, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                             num_warps=warps, num_stages=stages, **launch_options(x.device))
    return out
print(torch.cuda.get_device_name())
res = []
for label, shapes in (("qkv_a-like 3648x2048 / 2048x3648", [(3648, 2048), (2048, 3648)]), ("o_proj-like 2048x2048", [(2048, 2048)])):
    for m in (1, 8, 64):
        rows = {"cublas": run(m, shapes, 40, lambda a, w: F.linear(a, w))}
        for bn, bk, wp, st in ((16, 256, 4, 3), (16, 512, 4, 3), (16, 256, 8, 4), (16, 512, 8, 2), (16, 256, 4, 5), (32, 256, 8, 3)):
            rows[f"dot bn{bn} bk{bk} w{wp} s{st}"] = run(m, shapes, 40, lambda a, w: skinny(a, w, False, bn, bk, wp, st))
        if m == 1:
            for bn, bk, wp, st in ((8, 512, 4, 3), (4, 1024, 4, 3), (8, 256, 4, 4), (16, 256, 4, 3)):
                rows[f"fma bn{bn} bk{bk} w{wp} s{st}"] = run(m, shapes, 40, lambda a, w: gemv(a, w, bn, bk, wp, st))
        for name, (us, err, wb) in rows.items():
            print(f"{label:34s} M={m:3d} {name:24s} {us:7.2f} us/(norm+linear)  weights {wb/us/1e6:5.2f} TB/s  rel err {err:.2e}", flush=True)
            res.append({"shape": label, "m": m, "variant": name, "us": us, "rel_err": err, "weight_bytes": wb})
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/linear_probe2.json", "w"), indent=1)
