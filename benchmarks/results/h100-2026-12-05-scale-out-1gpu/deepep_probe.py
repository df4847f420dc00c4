"""DeepEP's intranode Buffer on one rank (NCCL world size 1): does dispatch + combine run and round-trip?"""
import os, time, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
import deep_ep
try:
    buf = deep_ep.Buffer(dist.group.WORLD, 1 << 30, 0)
    print("Buffer made")
    for T in (8, 128, 4096):
        x = torch.randn(T, 7168, device="cuda", dtype=torch.bfloat16)
        w, ids = torch.rand(T, 256, device="cuda").topk(8, dim=1)
        layout = buf.get_dispatch_layout(ids, 256)
        kw = dict(num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1], num_tokens_per_expert=layout[2], is_token_in_rank=layout[3])
        recv, _, _, _, handle, _ = buf.dispatch(x, topk_idx=ids, topk_weights=w, **kw)
        out, _, _ = buf.combine(recv, handle)
        torch.cuda.synchronize()
        print(T, "round trip max err", float((out.float() - x.float()).abs().max()))
except Exception as e:
    print("DeepEP one-rank probe:", type(e).__name__, e)
dist.destroy_process_group()
