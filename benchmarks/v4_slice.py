"""DeepSeek-V4-Flash slice on a GPU: what users get through LLM.generate, and where a decode
step's time goes, op by op (the input of the V4 kernel work).

    python -m benchmarks.v4_slice --out benchmarks/results/<run>/v4_slice

The model is benchmarks.models' ``v4-flash-slice`` (V4-Flash's config.json, its first 4 layers:
sliding-only, sliding-only, CSA, HCA) with random weights (``load_format="dummy"``) in bf16, FP8
linears kept in FP8 where the backend says it can, routed experts dequantised to bf16. Every op
the backend lacks runs its reference implementation on the GPU.

1. ``generate``: batches of B prompts of P tokens, N greedy tokens each; the first call at a
   batch size and a repeat, wall time and output tokens per second; then the decode cadence
   through ``LLM.generate``: (time of N tokens - time of 1 token) / (N - 1), both repeats, set
   beside the step's HBM floor (``step_floor_bytes``) over the copy bandwidth of the same run.
2. ``profile``: decode steps of a batch at a context length (after a real prefill). Each op of
   the op table is timed between two device synchronisations (its wall time: host work,
   launches and kernels; their sum is the step), then steps run under torch.profiler for the
   GPU kernel time per step (how busy the GPU is) and, per op, the time of the aten kernels
   inside its range (Triton kernels are not attributed to a range; they count in the total).
3. ``--hf-peer``: transformers' DeepseekV4ForCausalLM on the very same weight tensors
   (``benchmarks.e2e.hf_peer``: prefill of B x P, then greedy decode steps with its cache).
Writes JSON to --out and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.models import write_config


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def slice_dir(model: str, expert_dtype: str | None) -> Path:
    """A config-only checkpoint of ``model`` (benchmarks.models), its experts stored as
    ``expert_dtype`` says ("fp4": MXFP4, kept packed where the platform can; "bf16"), or as the
    real config has them (None)."""
    path = write_config(model, Path(tempfile.mkdtemp(prefix="deepinfer-v4-")))
    if expert_dtype is not None:
        config = json.loads((path / "config.json").read_text())
        config["expert_dtype"] = expert_dtype
        (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def build(max_num_seqs: int, max_model_len: int, accelerator: str, model_dir: Path | None = None, **kwargs):
    from deepinfer_core import LLM

    model_dir = model_dir or write_config("v4-flash-slice", Path(tempfile.mkdtemp(prefix="deepinfer-v4-")))
    t0 = time.perf_counter()
    blocks = max_num_seqs * (-(-max_model_len // 16) + 1)  # every sequence at full length, whatever the block size (>= 16)
    llm = LLM(model=str(model_dir), accelerator=accelerator, dtype="bfloat16", load_format="dummy",
              max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_kv_blocks=blocks, progress=False, **kwargs)
    return llm, time.perf_counter() - t0


def step_floor_bytes(model, batch: int, context: int) -> dict:
    """Bytes one V4 decode step of ``batch`` sequences at ``context`` tokens must read: every dense
    weight once, the expected distinct routed experts E (1 - (1 - k/E)^B) per MoE layer in their
    stored format (uniform routing), B embedding rows, the LM head; per layer and sequence its
    window (min(L, sliding_window) rows), on CSA layers the selected entries (min(top-k, L/m)) and
    every indexer key (the indexer scores them all), on HCA layers every entry (L/m). No MTP block."""
    from benchmarks.e2e import touched_weight_bytes

    c = model.config
    weights = touched_weight_bytes(model, batch)
    elem = torch.empty((), dtype=model.dtype).element_size()
    cache = 0.0
    for kind in c.layer_types:
        rows = min(context, c.sliding_window) * c.head_dim
        if kind == "compressed_sparse_attention":
            entries = context // c.csa_ratio
            rows += min(c.index_topk, entries) * c.head_dim + entries * c.index_head_dim
        elif kind == "heavily_compressed_attention":
            rows += (context // c.hca_ratio) * c.head_dim
        cache += batch * rows * elem
    return {"weight_bytes": weights, "cache_bytes": cache, "bytes": weights + cache}


def cadence_points(llm, batches, prompt_len: int, new_tokens: int, bandwidth: float | None, repeats: int = 5) -> list[dict]:
    """Decode cadence through LLM.generate: (t(new_tokens) - t(1)) / (new_tokens - 1), t the median
    of ``repeats`` timed calls each (after one untimed pair; calls of 1 and of new_tokens alternate;
    new random prompts every call: no prefix-cache hit). One pair alone moved the cadence by ~25%
    between identical H100 runs (2026-12-07): the difference of two prefill-dominated times."""
    import statistics

    from deepinfer_core import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(1000)
    out = []
    for batch in batches:
        samples: dict[int, list[float]] = {1: [], new_tokens: []}
        for r in range(repeats + 1):  # round 0 warms up
            for n in (1, new_tokens):
                params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                prompts = [torch.randint(2, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
                _sync()
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                _sync()
                if r:
                    samples[n].append(time.perf_counter() - t0)
        times = {n: statistics.median(ts) for n, ts in samples.items()}
        step = (times[new_tokens] - times[1]) / (new_tokens - 1)
        pairs = [(b - a) / (new_tokens - 1) * 1e3 for a, b in zip(samples[1], samples[new_tokens])]
        floor = step_floor_bytes(llm.engine.model, batch, prompt_len + new_tokens // 2)
        row = {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "seconds_1": times[1],
               "seconds_n": times[new_tokens], "decode_step_ms": step * 1e3, "decode_step_ms_pairs": pairs, "repeats": repeats,
               "prefill_tokens_per_s": batch * prompt_len / times[1],
               **floor}
        if bandwidth:
            row["floor_ms"] = floor["bytes"] / bandwidth * 1e3
            row["step_over_floor"] = step / (floor["bytes"] / bandwidth)
        print(f"cadence B={batch} P={prompt_len}: decode {step * 1e3:.2f} ms/step (median of {repeats}; pairs "
              f"{min(pairs):.2f}-{max(pairs):.2f})"
              + (f", HBM floor {row['floor_ms']:.3f} ms ({row['step_over_floor']:.1f}x)" if bandwidth else "")
              + f"; prefill {row['prefill_tokens_per_s']:.0f} tok/s", flush=True)
        out.append(row)
    return out


def plot_cadence(result: dict, out: Path) -> Path | None:
    """cadence.png: the decode step through LLM.generate and its HBM floor against the batch size
    (log-log), with transformers' step where it ran. None where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib: cadence.png not drawn (pip install 'deepinfer[bench]')", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.get("cadence", [])
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.plot([r["batch"] for r in rows], [r["decode_step_ms"] for r in rows], "o-", label="DeepInfer (LLM.generate)")
    if rows and "floor_ms" in rows[0]:
        ax.plot([r["batch"] for r in rows], [r["floor_ms"] for r in rows], "k--", label="HBM floor (copy bandwidth)")
    peers = [p for p in result.get("transformers", []) if "step_s" in p]
    if peers:
        ax.plot([p["batch"] for p in peers], [p["step_s"] * 1e3 for p in peers], "s", label="transformers")
    ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode step (ms)",
           title=f"{result['model']} ({result['experts_stored_as']} experts), {result['device']}")
    ax.grid(alpha=0.3)
    ax.legend()
    path = out / "cadence.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def generate_points(llm, batches, prompt_len: int, new_tokens: int) -> list[dict]:
    """Per batch size: a first call, a repeat on new prompts of the same shape (what a warm engine
    costs: no prefix-cache hits) and the repeat's prompts again ("cached": prefix-cache hits).
    Each call records its slowest engine steps (wall time, tokens scheduled), which is where a
    first call's compilation or allocation shows."""
    from deepinfer_core import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out = []
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        fresh = [[torch.randint(2, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)] for _ in range(2)]
        for call, prompts in (("first", fresh[0]), ("repeat", fresh[1]), ("cached", fresh[1])):
            _sync()
            with _StepTimes(llm.engine) as steps:
                t0 = time.perf_counter()
                res = llm.generate(prompts, params, use_tqdm=False)
                _sync()
                dt = time.perf_counter() - t0
            emitted = sum(len(r.outputs[0].token_ids) for r in res)
            row = {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "call": call,
                   "seconds": dt, "output_tokens": emitted, "output_tok_per_s": emitted / dt,
                   "steps": len(steps.rows), "slowest_steps": steps.slowest(3)}
            slow = ", ".join(f"{r['seconds'] * 1e3:.0f} ms ({r['tokens']} tok)" for r in row["slowest_steps"])
            print(f"generate B={batch} P={prompt_len} N={new_tokens} {call}: {dt:.2f} s, {emitted / dt:.1f} output tok/s, "
                  f"{len(steps.rows)} steps, slowest {slow}", flush=True)
            out.append(row)
    return out


class _StepTimes:
    """Every step's StepStats while active (chained before the engine's own observer, if any):
    ``seconds`` runs from the step's launch to its tokens being processed."""

    def __init__(self, engine):
        self.engine, self.rows = engine, []

    def __enter__(self):
        self.saved = self.engine.observer

        def observe(stats, _next=self.saved):
            self.rows.append({"seconds": stats.seconds, "tokens": stats.num_prefill_tokens + stats.num_decode_tokens,
                              "prefill_tokens": stats.num_prefill_tokens})
            if _next is not None:
                _next(stats)

        self.engine.observer = observe
        return self

    def __exit__(self, *exc):
        self.engine.observer = self.saved
        return False

    def slowest(self, n: int) -> list[dict]:
        return sorted(self.rows, key=lambda r: -r["seconds"])[:n]


def _wrap_ops(ops, timings: dict | None = None) -> dict:
    """Put every op of the table in a record_function range; with ``timings``, also time each
    call between two device synchronisations (its wall time: launches, host work and kernels)."""
    from deepinfer_core.ops import OP_NAMES

    originals = {name: ops[name] for name in OP_NAMES}
    for name, fn in originals.items():

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            with torch.profiler.record_function(f"op::{_name}"):
                if timings is None:
                    return _fn(*args, **kwargs)
                _sync()
                t0 = time.perf_counter()
                out = _fn(*args, **kwargs)
                _sync()
                timings[_name] = timings.get(_name, 0.0) + time.perf_counter() - t0
                return out

        setattr(ops, name, wrapped)
    return originals


def _unwrap_ops(ops, originals: dict) -> None:
    for name, fn in originals.items():
        setattr(ops, name, fn)


def profile_decode(llm, batch: int, context: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from deepinfer_core import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 8, ignore_eos=True)  # none finishes while measured
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        engine.add_request(torch.randint(2, vocab, (context,), generator=g).tolist(), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (real: the compressed caches hold what the prompt made)
    for _ in range(2):
        engine.step()
    _sync()
    running = len(engine.scheduler.running)
    timings: dict[str, float] = {}
    originals = _wrap_ops(engine.model.ops, timings)
    t0 = time.perf_counter()
    for _ in range(steps):  # each op timed between device syncs: its wall time
        engine.step()
    _sync()
    synced_wall = (time.perf_counter() - t0) / steps
    _unwrap_ops(engine.model.ops, originals)
    _wrap_ops(engine.model.ops)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        wall = (time.perf_counter() - t0) / steps
    _unwrap_ops(engine.model.ops, originals)
    engine.abort_all()
    per_op: dict[str, float] = defaultdict(float)
    per_op_cpu: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    kernels_ms = 0.0
    for avg in prof.key_averages():
        # the CPU-side range (its device time = the kernels launched inside it); the GPU-side
        # annotation of the same name would count them twice
        if avg.key.startswith("op::") and avg.device_type == torch.autograd.DeviceType.CPU:
            per_op[avg.key[4:]] += avg.device_time_total / 1e3 / steps
            per_op_cpu[avg.key[4:]] += avg.cpu_time_total / 1e3 / steps
            calls[avg.key[4:]] += avg.count // steps
    by_kernel: dict[str, float] = defaultdict(float)  # graph replays' kernels too: where the GPU time goes
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith("op::"):
            kernels_ms += event.device_time_total / 1e3 / steps
            by_kernel[event.name[:90]] += event.device_time_total / 1e3 / steps
    top_kernels = dict(sorted(by_kernel.items(), key=lambda kv: -kv[1])[:15])
    rows = sorted(per_op.items(), key=lambda kv: -kv[1])
    synced = {name: t * 1e3 / steps for name, t in sorted(timings.items(), key=lambda kv: -kv[1])}
    print(f"decode B={batch} ({running} running) context={context}: wall {wall * 1e3:.2f} ms/step, GPU kernels "
          f"{kernels_ms:.2f} ms/step ({100 * kernels_ms / (wall * 1e3):.0f}% busy); ops timed between syncs: "
          f"{synced_wall * 1e3:.2f} ms/step", flush=True)
    for name, ms in synced.items():
        print(f"    {ms:8.3f} ms synced {per_op.get(name, 0.0):8.3f} ms aten GPU {calls[name]:5d} calls  {name}", flush=True)
    for name, ms in top_kernels.items():
        print(f"    {ms:8.3f} ms GPU  kernel {name}", flush=True)
    return {"batch": batch, "running": running, "context": context, "steps": steps, "wall_ms_per_step": wall * 1e3,
            "synced_wall_ms_per_step": synced_wall * 1e3, "ops_synced_ms_per_step": synced,
            "gpu_kernel_ms_per_step": kernels_ms, "top_kernels_ms_per_step": top_kernels, "ops_aten_gpu_ms_per_step": dict(rows),
            "ops_host_ms_per_step": dict(per_op_cpu), "op_calls_per_step": dict(calls),
            "providers": dict(engine.ops.providers)}


# SGLang's published DeepSeek-V4-Flash TPOT on H200 at concurrency 1 (TP4 + MTP): set beside
# this slice's per-layer decode time x the real model's layers, a projection, not a comparison.
SGLANG_V4_FLASH_TPOT_MS = 3.28
REAL_LAYERS = {"v4-flash-slice": 43, "v4-pro-slice": 61}


def summarize(result: dict, slice_layers: int) -> dict:
    """The issue's ratios from this run's numbers: decode step over its HBM floor, transformers'
    decode step and prefill time over ours at the same batch and prompt length, the first call
    over the repeat, and the per-layer projection beside SGLang's TPOT (labelled as one)."""
    out: dict = {"cadence_over_floor": {r["batch"]: r.get("step_over_floor") for r in result.get("cadence", [])}}
    cadence = {r["batch"]: r for r in result.get("cadence", [])}
    versus = []
    for peer in result.get("transformers", []):
        ours = cadence.get(peer.get("batch"))
        if ours is None or "step_s" not in peer or ours["prompt_len"] != peer.get("context"):
            continue
        versus.append({"batch": peer["batch"], "context": peer["context"],
                       "decode_x_transformers": peer["step_s"] * 1e3 / ours["decode_step_ms"],
                       # ours: a 1-token generate (prefill + one step) against transformers' prefill alone
                       "prefill_x_transformers": peer["prefill_s"] / ours["seconds_1"]})
    out["versus_transformers"] = versus
    calls = defaultdict(dict)
    for row in result.get("generate", []):
        calls[row["batch"]][row["call"]] = row["seconds"]
    out["first_over_repeat"] = {b: c["first"] / c["repeat"] for b, c in calls.items() if {"first", "repeat"} <= c.keys()}
    one = cadence.get(1)
    layers = REAL_LAYERS.get(result["model"])
    if one and layers:
        per_layer = one["decode_step_ms"] / slice_layers
        out["projection"] = {"per_layer_decode_ms_b1": per_layer, "real_layers": layers,
                             "projected_tpot_ms": per_layer * layers, "sglang_published_tpot_ms": SGLANG_V4_FLASH_TPOT_MS,
                             "label": "projection: this slice's B=1 decode step per layer x the real model's layers "
                                      "(one GPU, no MTP, embedding and head counted in every layer), beside SGLang's "
                                      "published V4-Flash TPOT (H200, TP4 + MTP, concurrency 1); not a comparison"}
    for key, value in out.items():
        print(f"summary {key}: {value}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", default="nvidia")
    parser.add_argument("--batch", type=int, action="append", default=None)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--profile", action="append", default=None, help="BATCHxCONTEXT of a decode profile (repeatable)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per point of the cadence (median)")
    parser.add_argument("--model", default="v4-flash-slice", choices=("v4-flash-slice", "v4-pro-slice"))
    parser.add_argument("--expert-dtype", choices=("fp4", "bf16"), default=None,
                        help="the routed experts' stored format (default: the real config's, MXFP4)")
    parser.add_argument("--model-dir", type=Path, default=None, help="another V4 config.json directory (smoke tests)")
    parser.add_argument("--cadence", action="store_true", help="decode cadence through LLM.generate against the HBM floor")
    parser.add_argument("--hf-peer", action="append", default=None, metavar="BATCHxCONTEXT",
                        help="transformers on the same weights at this point (repeatable)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="the window and compressed caches: the model dtype, or V4's FP8 records")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    batches = args.batch or [1, 8, 32]
    points = [tuple(map(int, p.split("x"))) for p in (args.profile or ["1x2048", "8x2048", "32x2048"])]
    pb, pc = max(b for b, _ in points), max(c for _, c in points)
    model_dir = args.model_dir or slice_dir(args.model, args.expert_dtype)
    llm, load_s = build(max(max(batches), pb), max(args.prompt_len, pc) + args.new_tokens + args.steps + 64, args.accelerator,
                        model_dir, kv_cache_dtype=args.kv_cache_dtype)
    experts = llm.engine.model.model.layers[0].mlp.experts.gate_up_proj
    result = {"model": args.model, "expert_dtype": args.expert_dtype or "config", "experts_stored_as": str(experts.dtype),
              "kv_cache_dtype": args.kv_cache_dtype,
              "load_seconds": load_s, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "generate": generate_points(llm, batches, args.prompt_len, args.new_tokens),
              "profile": [profile_decode(llm, b, c, args.steps) for b, c in points]}
    if args.cadence:
        bandwidth = None
        if torch.cuda.is_available():
            from benchmarks.ceilings import copy_bandwidth

            bandwidth = copy_bandwidth()
            print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
        result["copy_bandwidth"] = bandwidth
        result["cadence"] = cadence_points(llm, batches, args.prompt_len, args.new_tokens, bandwidth, args.repeats)
    for point in args.hf_peer or []:
        from benchmarks.e2e import hf_peer

        b, c = map(int, point.split("x"))
        try:
            peer = hf_peer(llm, model_dir, b, c, args.steps)
            print(f"transformers B={b} L={c}: decode {peer['step_s'] * 1e3:.2f} ms/step, prefill {peer['prefill_s']:.3f} s", flush=True)
        except Exception as e:  # recorded, not fatal: the engine's numbers stand on their own
            peer = {"batch": b, "context": c, "error": f"{type(e).__name__}: {e}"}
            print(f"transformers B={b} L={c}: {peer['error']}", flush=True)
        result.setdefault("transformers", []).append(peer)
    result["summary"] = summarize(result, len(llm.engine.model.model.layers))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "v4_slice.json").write_text(json.dumps(result, indent=1))
    if args.cadence:
        plot_cadence(result, args.out)


if __name__ == "__main__":
    main()
