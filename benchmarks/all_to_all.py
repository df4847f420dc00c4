"""Expert-parallel dispatch and combine side by side in one run: DeepInfer's exchange
(``dist/expert_parallel.py`` over torch.distributed's all-to-all), the bare all-to-all under it,
and DeepEP's intranode kernels where ``deep_ep`` loads, at decode and prefill sizes.

    python -m benchmarks.all_to_all --ranks 8 --out DIR                        # 8 GPUs of this host, NCCL
    python -m benchmarks.all_to_all --ranks 2 --cpu --quick --out /tmp/a       # a gloo smoke run on the CPU

Each rank (rank r on GPU r) holds T tokens of V3's width (hidden 7168, bf16) routed to top-8 of
256 experts with random scores, experts contiguous over the ranks (``Placement.contiguous``).
Per T, the median over ``--iters`` timed iterations (all ranks synchronised before each; the
slowest rank's time) of:

- ``ours``: one ``moe_expert_parallel`` call with an identity expert (each received row sent
  back as it came), i.e. dispatch + combine with all their bookkeeping (routing to slots, the
  count exchange and its host sync, the (weight, slot) pairs, the weighted sum in expert order).
  Checked: every token's output is its row times the sum of its routing weights.
- ``a2a_dispatch`` / ``a2a_combine``: the bare ``all_to_all_single`` of the same pair rows with
  the counts known (what the exchange costs without the bookkeeping).
- ``deep_ep_dispatch`` / ``deep_ep_combine``: DeepEP's normal-mode ``Buffer.dispatch`` /
  ``combine`` (one row per (token, destination rank), deduplicated), layout computed outside the
  timing. Checked: the combine of the dispatched rows is each row times the ranks it went to.
  DeepEP's low-latency mode needs NVSHMEM with IBGDA and is not run. Where ``deep_ep`` does not
  import or its buffer cannot be made, the reason is recorded and the rest still runs.

GB/s: the bytes a rank sends to other ranks (its own rows stay) over the time; ours and the bare
all-to-all send one row per (token, expert) pair, DeepEP one per (token, rank). NVLink multicast
is kept off (NCCL_NVLS_ENABLE=0 and the like). Writes DIR/all_to_all.json and all_to_all.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core.parallel.communicator import TorchCommunicator
from deepinfer_core.parallel.eplb import Placement
from deepinfer_core.parallel.expert_parallel import ExpertShard, moe_expert_parallel

# NVLink multicast off: on a shared host it can take the GPUs out of service (the scale-out runs and tests use these too)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FULL = {"hidden": 7168, "experts": 256, "top_k": 8, "tokens": "1,8,32,128,512,2048,4096", "iters": 20}
QUICK = {"hidden": 64, "experts": 16, "top_k": 4, "tokens": "1,8,64", "iters": 3}
DEEP_EP_NVL_BYTES = 1 << 30  # DeepEP's NVLink buffer per rank


def keep_multicast_off() -> None:
    """NO_MULTICAST in this process's environment (and so its children's), where not set already."""
    for name, value in NO_MULTICAST.items():
        os.environ.setdefault(name, value)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls, the group synchronised before each; the
    slowest rank's median (a collective)."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def routing(tokens: int, args, rank: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    x = torch.randn(tokens, args.hidden, generator=g, device=device).to(args.dtype)
    scores = torch.rand(tokens, args.experts, generator=g, device=device)
    weights, ids = scores.topk(args.top_k, dim=1)
    return x, weights, ids


def identity_experts(x, w13, w2, weights, slots, *rest):
    """The received rows back unchanged (the routing weight is applied after the combine)."""
    return x * weights.to(x.dtype)


def ours(tokens: int, args, comm, device) -> dict:
    placement = Placement.contiguous(1, args.experts, comm.size)
    per = placement.slots_per_gpu
    empty = torch.empty(per, 0, 0, device=device, dtype=args.dtype)
    shard = ExpertShard(empty, empty, placement)
    x, weights, ids = routing(tokens, args, comm.rank, device)
    out, _ = moe_expert_parallel(x, weights, ids, shard, comm, identity_experts)
    want = x.float() * weights.sum(1, keepdim=True)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    dest = ids // per
    remote = int((dest != comm.rank).sum())
    seconds = timed(lambda: moe_expert_parallel(x, weights, ids, shard, comm, identity_experts), device, args.iters)

    # the bare all-to-all of the same pair rows, counts known
    order = torch.argsort(dest.reshape(-1), stable=True)
    rows = x.repeat_interleave(args.top_k, dim=0)[order].contiguous()
    send = torch.bincount(dest.reshape(-1), minlength=comm.size)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    send, recv = send.tolist(), recv.tolist()
    back = rows.new_empty((sum(recv), args.hidden))
    dispatch = timed(lambda: dist.all_to_all_single(back, rows, recv, send), device, args.iters)
    combine = timed(lambda: dist.all_to_all_single(rows, back, send, recv), device, args.iters)
    nbytes = remote * args.hidden * x.element_size()
    return {"ours_s": seconds, "a2a_dispatch_s": dispatch, "a2a_combine_s": combine, "pair_rows_sent_remote": remote,
            "ours_gbps": 2 * nbytes / seconds / 1e9, "a2a_dispatch_gbps": nbytes / dispatch / 1e9,
            "a2a_combine_gbps": nbytes / combine / 1e9}


def deep_ep_buffer(group):
    """(DeepEP's Buffer for ``group``, None) or (None, why not)."""
    try:
        import deep_ep
    except Exception as e:  # noqa: BLE001 - a wheel built for another torch fails with any error
        return None, f"import deep_ep: {type(e).__name__}: {e}"
    try:
        return deep_ep.Buffer(group, DEEP_EP_NVL_BYTES, 0), None
    except Exception as e:  # noqa: BLE001 - recorded, the torch side still runs
        return None, f"deep_ep.Buffer: {type(e).__name__}: {e}"


def deep_ep(tokens: int, args, buffer, rank: int, size: int, device) -> dict:
    import deep_ep as de

    x, weights, ids = routing(tokens, args, rank, device)
    ids = ids.to(getattr(de, "topk_idx_t", torch.int64))
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, args.experts)
    layout = {"num_tokens_per_rank": per_rank, "num_tokens_per_rdma_rank": per_rdma, "is_token_in_rank": in_rank,
              "num_tokens_per_expert": per_expert}

    def dispatch():
        return buffer.dispatch(x, topk_idx=ids, topk_weights=weights, **layout)

    recv_x, _, _, _, handle, _ = dispatch()
    combined, _, _ = buffer.combine(recv_x, handle)
    want = x.float() * in_rank.sum(1, keepdim=True).float()
    torch.testing.assert_close(combined.float(), want, rtol=2e-2, atol=2e-2)
    remote = int(in_rank.sum()) - int(in_rank[:, rank].sum())
    nbytes = remote * args.hidden * x.element_size()
    t_dispatch = timed(dispatch, device, args.iters)
    t_combine = timed(lambda: buffer.combine(recv_x, handle), device, args.iters)
    return {"deep_ep_dispatch_s": t_dispatch, "deep_ep_combine_s": t_combine, "token_rows_sent_remote": remote,
            "deep_ep_dispatch_gbps": nbytes / t_dispatch / 1e9, "deep_ep_combine_gbps": nbytes / t_combine / 1e9}


def worker(rank: int, size: int, store_path: str, args) -> None:
    os.environ.update(NO_MULTICAST)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the ranks share the host's cores
    dist.init_process_group("gloo" if args.cpu else "nccl", store=dist.FileStore(store_path, size), rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=300), **({} if args.cpu else {"device_id": device}))
    try:
        comm = TorchCommunicator()
        buffer, why = (None, "not run on the CPU") if args.cpu else deep_ep_buffer(dist.group.WORLD)
        points = []
        for tokens in args.tokens:
            point = {"tokens_per_rank": tokens, **ours(tokens, args, comm, device)}
            if buffer is not None:
                try:
                    point.update(deep_ep(tokens, args, buffer, rank, size, device))
                except Exception as e:  # noqa: BLE001 - recorded (every rank fails alike: same kernels, same check)
                    point["deep_ep_error"] = f"{type(e).__name__}: {e}"
                    buffer, why = None, f"failed at T={tokens}: {point['deep_ep_error']}"
            points.append(point)
            if rank == 0:
                print(describe(point), flush=True)
        if rank == 0:
            write(args, size, points, why)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def describe(p: dict) -> str:
    parts = [f"T={p['tokens_per_rank']}: ours {p['ours_s'] * 1e6:.0f} us ({p['ours_gbps']:.1f} GB/s)",
             f"a2a dispatch {p['a2a_dispatch_s'] * 1e6:.0f} us, combine {p['a2a_combine_s'] * 1e6:.0f} us"]
    if "deep_ep_dispatch_s" in p:
        parts.append(f"DeepEP dispatch {p['deep_ep_dispatch_s'] * 1e6:.0f} us, combine {p['deep_ep_combine_s'] * 1e6:.0f} us")
    return "; ".join(parts)


def write(args, size: int, points: list[dict], deep_ep_missing: str | None) -> None:
    from benchmarks.generate import metadata

    args.out.mkdir(parents=True, exist_ok=True)
    meta = metadata(argparse.Namespace(accelerator="cpu" if args.cpu else "nvidia"))
    report = {"meta": meta, "ranks": size, "deep_ep": deep_ep_missing or "ran",
              "args": {k: str(v) for k, v in vars(args).items()}, "points": points}
    (args.out / "all_to_all.json").write_text(json.dumps(report, indent=1))
    try:
        import matplotlib
    except ImportError:
        print(f"wrote {args.out / 'all_to_all.json'} (no plot: matplotlib is not installed)", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    t = [p["tokens_per_rank"] for p in points]
    for key, label in (("ours_s", "ours (dispatch + combine)"), ("a2a_dispatch_s", "all_to_all dispatch"),
                       ("a2a_combine_s", "all_to_all combine"), ("deep_ep_dispatch_s", "DeepEP dispatch"),
                       ("deep_ep_combine_s", "DeepEP combine")):
        if all(key in p for p in points):
            ax.plot(t, [p[key] * 1e6 for p in points], "o-", label=label)
    ax.set(xscale="log", yscale="log", xlabel="tokens per rank", ylabel="us (slowest rank, median)",
           title=f"EP exchange, {size} ranks, hidden {args.hidden}, top-{args.top_k} of {args.experts}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "all_to_all.png", dpi=120)
    plt.close(fig)
    print(f"wrote {args.out / 'all_to_all.json'} and all_to_all.png", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, required=True, help="processes, one per GPU of this host")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU (a smoke run; no DeepEP)")
    p.add_argument("--quick", action="store_true", help="toy sizes")
    for key in FULL:
        p.add_argument("--" + key.replace("_", "-"), type=str if key == "tokens" else int)
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.tokens = [int(v) for v in str(args.tokens).split(",")]
    args.dtype = torch.float32 if args.cpu else torch.bfloat16
    if args.ranks < 2:
        p.error("--ranks must be at least 2 (an exchange needs two ranks)")
    if args.experts % args.ranks:
        p.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks} (contiguous placement)")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not args.cpu and gpus < args.ranks:
        p.error(f"--ranks {args.ranks} needs as many GPUs; this host has {gpus} (or pass --cpu)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as rendezvous:  # a file store: no port to find
        mp.spawn(worker, args=(args.ranks, str(Path(rendezvous) / "store"), args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
