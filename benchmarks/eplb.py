"""Expert-parallel dispatch and load imbalance, with and without EPLB: a simulation at the real
expert counts of DeepSeek-V3 and V4.1-Flash under a Zipf-skewed router.

    python -m benchmarks.eplb --out results/ [--ep 8,16,32,64] [--skew 1.0] [--tokens 4096]

The router is synthetic:
- Each MoE layer gets an expert popularity of 1/rank^skew, with the ranks shuffled per layer.
- Each token picks its top-k experts by popularity plus Gumbel noise: k distinct experts, the
  popular ones more often.
- V3 first picks its top-4 of 8 expert groups (by each group's best score) and takes its 8
  experts from those.
- Tokens are spread evenly over the EP ranks (attention data parallel).

For each EP size G (nodes of 8 GPUs), three placements are compared:
- `static`: experts [g*E/G, (g+1)*E/G) on GPU g, no copies.
- `eplb`: deepinfer_core.parallel.eplb's global form, with 32 extra slots rounded up to a multiple
  of G. It is computed from `--history` earlier steps and judged on fresh ones.
- `eplb_hier`: the hierarchical form, groups packed to nodes (V3 only, when G > 8).

Reported per placement:
- The load imbalance: the busiest GPU's (token, expert) pairs over the mean, per layer, mean
  and max over layers.
- The dispatch volume: (token, GPU) pairs that leave their rank, and those that leave their
  node, per token per layer. A token sends once to each GPU that holds one of its experts'
  copies; the copy used is picked by the token's source rank.
- Bytes per token per MoE layer: FP8 dispatch (hidden + a 4-byte scale per 128) and bf16
  combine (2 x hidden) per pair that leaves the rank.

Then a **projection** (``project``): V3's per-GPU decode tokens/s at EP 8..64. It combines
the measured single-GPU kernel times of the V3 slice on an H200, the simulated imbalance, and
DeepEP's published low-latency dispatch and combine times. It is labelled as a projection in
the JSON.

Writes eplb.json and eplb.png. Nothing here runs on a GPU or measures time.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from benchmarks.generate import metadata
from benchmarks.models import MODELS
from deepinfer_core.parallel.eplb import Placement, num_physical_experts, rebalance

GPUS_PER_NODE = 8


def shapes() -> dict[str, dict]:
    v3, v41 = MODELS["v3"], MODELS["v41-flash"]["text_config"]
    return {
        "v3": {"experts": v3["n_routed_experts"], "top_k": v3["num_experts_per_tok"], "groups": v3["n_group"],
               "top_groups": v3["topk_group"], "hidden": v3["hidden_size"]},
        "v41-flash": {"experts": v41["n_routed_experts"], "top_k": v41["num_experts_per_tok"], "groups": 1, "top_groups": 1,
                      "hidden": v41["hidden_size"]},
    }


def popularity(layers: int, experts: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    base = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** skew
    return torch.stack([base[torch.randperm(experts, generator=gen)] for _ in range(layers)]) / base.sum()


def route(pop: torch.Tensor, tokens: int, shape: dict, gen: torch.Generator) -> torch.Tensor:
    """[layers, tokens, top_k] expert ids: each token's k distinct experts (group-limited for V3)."""
    layers, experts = pop.shape
    gumbel = -torch.log(-torch.log(torch.rand((layers, tokens, experts), generator=gen, dtype=torch.float64).clamp_min(1e-300)))
    score = pop.log()[:, None, :] + gumbel
    if shape["groups"] > 1:
        grouped = score.view(layers, tokens, shape["groups"], -1)
        keep = grouped.max(-1).values.topk(shape["top_groups"], dim=-1).indices
        mask = torch.full_like(grouped[..., 0], float("-inf")).scatter(-1, keep, 0.0)
        score = (grouped + mask[..., None]).view(layers, tokens, experts)
    return score.topk(shape["top_k"], dim=-1).indices


def expert_load(ids: torch.Tensor, experts: int) -> torch.Tensor:
    layers = ids.shape[0]
    return torch.zeros((layers, experts), dtype=torch.float64).scatter_add_(1, ids.view(layers, -1),
                                                                             torch.ones(ids.view(layers, -1).shape, dtype=torch.float64))


def judge(placement: Placement, ids: torch.Tensor, shape: dict) -> dict:
    """Imbalance and dispatch volume of routed ``ids`` [layers, tokens, k] under ``placement``."""
    layers, tokens, _ = ids.shape
    gpus, per_gpu = placement.num_gpus, placement.slots_per_gpu
    source = torch.arange(tokens) % gpus  # attention DP: tokens spread over the ranks
    copies = placement.replicas.gather(1, ids.view(layers, -1)).view(ids.shape)
    pick = source[None, :, None] % copies  # the copy a token uses: by its source rank
    slot = torch.stack([placement.log2phy[l][ids[l], pick[l]] for l in range(layers)])
    dest = slot // per_gpu
    gpu_pairs = torch.zeros((layers, gpus), dtype=torch.float64).scatter_add_(1, dest.view(layers, -1),
                                                                             torch.ones(dest.view(layers, -1).shape, dtype=torch.float64))
    imbalance = gpu_pairs.max(-1).values / gpu_pairs.mean(-1)
    sent = torch.zeros((layers, tokens, gpus), dtype=torch.bool).scatter_(2, dest, True)  # once per destination GPU
    sent[:, torch.arange(tokens), source] = False  # its own rank: no transfer
    node_of = torch.arange(gpus) // GPUS_PER_NODE
    remote = sent & (node_of[None, None, :] != node_of[source][None, :, None])
    pairs, remote_pairs = sent.sum().item() / (layers * tokens), remote.sum().item() / (layers * tokens)
    hidden = shape["hidden"]
    return {"imbalance_mean": imbalance.mean().item(), "imbalance_max": imbalance.max().item(),
            "pairs_sent_per_token": pairs, "pairs_cross_node_per_token": remote_pairs,
            "dispatch_bytes_per_token": pairs * (hidden + 4 * (hidden // 128)), "combine_bytes_per_token": pairs * 2 * hidden}


def simulate(name: str, shape: dict, args) -> list[dict]:
    gen = torch.Generator().manual_seed(args.seed)
    pop = popularity(args.layers, shape["experts"], args.skew, gen)
    history = expert_load(route(pop, args.history * args.tokens, shape, gen), shape["experts"])
    fresh = route(pop, args.tokens, shape, gen)
    rows = []
    for gpus in args.ep:
        if shape["experts"] % gpus:
            continue
        slots = num_physical_experts(shape["experts"], gpus, args.extra)
        nodes = max(1, gpus // GPUS_PER_NODE)
        placements = {"static": Placement.contiguous(args.layers, shape["experts"], gpus),
                      "eplb": rebalance(history, slots, gpus)}
        if shape["groups"] > 1 and nodes > 1 and shape["groups"] % nodes == 0:
            placements["eplb_hier"] = rebalance(history, slots, gpus, num_groups=shape["groups"], num_nodes=nodes)
        for kind, placement in placements.items():
            row = {"model": name, "ep": gpus, "nodes": nodes, "placement": kind, "slots": placement.phy2log.shape[1],
                   **judge(placement, fresh, shape)}
            rows.append(row)
            print(f"[eplb] {name:9s} EP={gpus:2d} {kind:9s}: imbalance {row['imbalance_mean']:.2f} (max {row['imbalance_max']:.2f}), "
                  f"{row['pairs_sent_per_token']:.2f} GPUs per token ({row['pairs_cross_node_per_token']:.2f} off-node), "
                  f"{(row['dispatch_bytes_per_token'] + row['combine_bytes_per_token']) / 1024:.1f} KiB per token per layer", flush=True)
    return rows


# DeepEP's published low-latency kernels (H800 + CX7 400 Gb/s, 128 tokens per rank, V3's hidden
# size and top-8, FP8 dispatch, bf16 combine), microseconds by EP size: github.com/deepseek-ai/DeepEP
DEEPEP_LL_US = {8: (77, 114), 16: (118, 195), 32: (155, 273), 64: (173, 314)}
PROFILE = Path(__file__).parent / "results" / "h200-2026-11-30" / "profile_step.json"
ASSUMED_EXPERT_TFLOPS = 700.0  # our FP8 expert GEMM when compute-bound: about half the H200's measured ~1430 (issue 17)


def project(rows: list[dict], args) -> list[dict]:
    """A projection, not a measurement: V3's per-GPU decode tokens/s at each EP size, from
    - the single-GPU kernel times of the V3 slice on an H200 (``PROFILE``, 64 sequences of 4096
      tokens; attention scaled linearly to ``--rank-batch`` sequences),
    - the simulated imbalance of the EPLB placement (the busiest GPU sets the pace),
    - DeepEP's published low-latency dispatch and combine times.
    Each GPU's MoE layer time is the larger of reading its resident experts' weights (the
    measured per-expert time) and computing its pairs at ASSUMED_EXPERT_TFLOPS. "serial" adds
    the communication to every MoE layer; "overlapped" assumes DeepSeek's two micro-batches
    hide the shorter of the two."""
    profile = json.loads(PROFILE.read_text())["v3-slice"]["64x4096"]["kernels_ms"]
    v3 = MODELS["v3"]
    experts, k, hidden, inter = v3["n_routed_experts"], v3["num_experts_per_tok"], v3["hidden_size"], v3["moe_intermediate_size"]
    moe_layers = v3["num_hidden_layers"] - v3["first_k_dense_replace"]
    slice_layers, slice_moe = MODELS["v3-slice"]["num_hidden_layers"], MODELS["v3-slice"]["num_hidden_layers"] - 1
    touched = experts * (1 - (1 - k / experts) ** 64)  # experts the 64 measured sequences reached, per layer
    expert_read_ms = profile["_expert_gemm_kernel"] / slice_moe / touched
    b, b_scale = args.rank_batch, args.rank_batch / 64
    attention_ms = sum(v for n, v in profile.items() if n.startswith("_mla_decode")) / slice_layers * b_scale
    projections_ms = sum(v for n, v in profile.items() if n.startswith(("_fp8_block_gemm", "_split_k_reduce"))) / slice_layers
    head_ms = max(v for n, v in profile.items() if n.startswith("nvjet"))  # the LM head, once a step
    flops_per_pair = 6 * hidden * inter
    out = []
    for r in rows:
        if r["model"] != "v3" or r["placement"] != "eplb" or r["ep"] not in DEEPEP_LL_US:
            continue
        gpus = r["ep"]
        read = r["slots"] / gpus * expert_read_ms
        compute = b * k * r["imbalance_mean"] * flops_per_pair / (ASSUMED_EXPERT_TFLOPS * 1e9)
        moe = max(read, compute)
        comm = sum(DEEPEP_LL_US[gpus]) / 1e3
        dense = attention_ms + projections_ms
        serial = v3["num_hidden_layers"] * dense + moe_layers * (moe + comm) + head_ms
        overlapped = v3["num_hidden_layers"] * dense + moe_layers * max(moe, comm) + head_ms
        row = {"model": "v3", "ep": gpus, "rank_batch": b, "moe_layer_ms": moe, "moe_bound": "weights" if read >= compute else "compute",
               "comm_layer_ms": comm, "dense_layer_ms": dense, "step_ms_serial": serial, "step_ms_overlapped": overlapped,
               "tokens_per_s_per_gpu_serial": b / serial * 1e3, "tokens_per_s_per_gpu_overlapped": b / overlapped * 1e3}
        out.append(row)
        print(f"[projection] v3 EP={gpus:2d}, {b} sequences per GPU: MoE layer {moe * 1e3:.0f} us ({row['moe_bound']}-bound), "
              f"DeepEP {comm * 1e3:.0f} us; {row['tokens_per_s_per_gpu_serial']:.0f} tok/s per GPU serial, "
              f"{row['tokens_per_s_per_gpu_overlapped']:.0f} overlapped", flush=True)
    return out


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for model in models:
        for kind, style in (("static", "o--"), ("eplb", "o-"), ("eplb_hier", "s:")):
            pts = [r for r in rows if r["model"] == model and r["placement"] == kind]
            if pts:
                axes[0].plot([r["ep"] for r in pts], [r["imbalance_mean"] for r in pts], style, label=f"{model} {kind}")
                axes[1].plot([r["ep"] for r in pts], [r["pairs_sent_per_token"] for r in pts], style, label=f"{model} {kind}")
    axes[0].set(xlabel="EP size (GPUs)", ylabel="busiest GPU / mean (pairs)", xscale="log", title="load imbalance")
    axes[1].set(xlabel="EP size (GPUs)", ylabel="GPUs a token is sent to", xscale="log", title="dispatch fan-out")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="v3,v41-flash")
    p.add_argument("--ep", default="8,16,32,64")
    p.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of expert popularity")
    p.add_argument("--layers", type=int, default=8, help="MoE layers simulated (each its own popularity)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the judged step")
    p.add_argument("--history", type=int, default=4, help="steps of the same size the placement is computed from")
    p.add_argument("--extra", type=int, default=None, help="redundant slots (default: DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS or 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rank-batch", type=int, default=128, help="projection: decoding sequences per GPU (DeepEP's setting)")
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    args = p.parse_args(argv)
    args.ep = [int(v) for v in args.ep.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"meta": metadata(args), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "shapes": shapes(), "rows": []}
    for name in args.models.split(","):
        report["rows"] += simulate(name, shapes()[name], args)
    report["projection"] = {"label": "PROJECTION from measured single-GPU kernel times, simulated imbalance and DeepEP's "
                                     "published latencies; not measured on several GPUs",
                            "assumed_expert_tflops": ASSUMED_EXPERT_TFLOPS, "deepep_ll_us": DEEPEP_LL_US,
                            "profile": str(PROFILE.relative_to(Path(__file__).parent.parent)),
                            "rows": project(report["rows"], args) if "v3" in args.models.split(",") else []}
    report["meta"]["finished"] = datetime.datetime.now(datetime.UTC).isoformat()
    (args.out / "eplb.json").write_text(json.dumps(report, indent=1))
    plot(report["rows"], args.out / "eplb.png")
    print(f"wrote {args.out / 'eplb.json'}", flush=True)


if __name__ == "__main__":
    main()
