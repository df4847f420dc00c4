"""End-to-end throughput of DeepInfer on real DeepSeek shapes with random weights, and
HuggingFace transformers on the same model, same GPU, same run.

    python -m benchmarks.e2e --model v2-lite --out results/ [--hf-peer] [--quick]

Decode: B sequences whose context of L tokens is already in the KV cache (random latents: the
prefill is not repeated for every point) step through ``Engine.step()`` (scheduler, CUDA-graph
replay, GPU sampling, bookkeeping), greedy. Reported per (B, L): step time, output tokens/s per
GPU (B / step) and per user (1 / step), and the step's HBM floor: the bytes it must read (every
weight a step touches: all dense weights, the expected number of distinct routed experts
E * (1 - (1 - k/E)^B) per MoE layer under uniform routing, B embedding rows, the whole lm_head
(also when it is tied to the embedding), the absorbed W_UK/W_UV instead of kv_b_proj; no MTP
layer; plus the cached latents every layer attends over: B * L' tokens, L' the mean context of
the timed steps, L + DECODE_WARMUP_STEPS + (steps - 1) / 2, since each step adds one token)
over the copy bandwidth measured in the same run. Token accounting: one output token per
sequence per step (no speculative tokens). tests/test_benchmark_floor.py checks this arithmetic
against a hand count.

Prefill: ``LLM.generate`` of B prompts of L random tokens with max_tokens=1 (second of two runs,
so kernel compilation is excluded): prompt tokens/s and the batch's latency.

transformers (``--hf-peer``, v2-lite only): DeepseekV2ForCausalLM built on the very same weight
tensors (shared, not copied), its defaults (sdpa attention, grouped_mm experts, DynamicCache),
prefill of B x L then greedy decode steps, timed the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.ceilings import measure
from benchmarks.models import MODELS, write_config

DECODE_BATCHES = (1, 8, 32, 64, 128, 256)
DECODE_CONTEXTS = (1024, 4096, 16384)
PREFILL_POINTS = ((1, 1024), (1, 4096), (1, 16384), (4, 4096), (16, 1024), (32, 1024), (64, 1024))
HF_POINT = (32, 1024)
DECODE_WARMUP_STEPS = 3  # untimed steps of decode_point before the timed ones (graph capture)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def touched_weight_bytes(model, batch: int, skip: str | None = None) -> float:
    """Bytes of the parameters one decode step of ``batch`` sequences reads, in their stored
    format: every dense weight, the expected distinct routed experts E (1 - (1 - k/E)^B) of each
    MoE layer (uniform routing), B embedding rows, the whole LM head; no MTP layer, nor the
    parameters whose name holds ``skip``."""
    cfg = model.config
    total = 0.0
    # remove_duplicate=False: a tied lm_head shares the embedding's tensor but reads all of it.
    for name, p in model.named_parameters(remove_duplicate=False):
        nbytes = p.numel() * p.element_size()
        if name.startswith("mtp.") or nbytes == 0 or (skip is not None and skip in name):
            continue
        if ".mlp.experts." in name:
            e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
            total += nbytes * (1 - (1 - k / e) ** batch)
        elif "embed_tokens" in name:
            total += batch * p.shape[-1] * p.element_size()
        else:
            total += nbytes
    return total


def step_weight_bytes(model, batch: int) -> float:
    """Bytes of weights one decode step of ``batch`` sequences reads (see the module docstring)."""
    total = touched_weight_bytes(model, batch, skip="kv_b_proj")  # decode reads the absorbed copies below instead
    for _, attn in model.attention_layers():
        if attn.w_uk_t is not None and not _is_mtp(attn, model):
            total += (attn.w_uk_t.numel() + attn.w_uv.numel()) * attn.w_uk_t.element_size()
    return total


def _is_mtp(attn, model) -> bool:
    return any(attn is layer.self_attn for layer in model.mtp.layers)


def kv_bytes(engine, batch: int, context: float) -> float:
    """Bytes of the paged caches ``batch`` sequences of ``context`` tokens each attend over."""
    return batch * context * sum(g.bytes_per_token() for g in engine.cache_groups)


def timed_context(context: int, steps: int) -> float:
    """Mean tokens attended over in decode_point's timed steps: its first step attends over the
    ``context`` tokens, each step adds one, and DECODE_WARMUP_STEPS untimed steps come first."""
    return context + DECODE_WARMUP_STEPS + (steps - 1) / 2


def decode_point(llm, batch: int, context: int, steps: int) -> dict | None:
    from deepinfer_core.engine.sequence import Status
    from deepinfer_core.sampling.params import SamplingParams

    engine = llm.engine
    blocks = math.ceil((context + steps + 4) / engine.kv.block_size)
    if batch * blocks > engine.kv.num_free or context + steps + 4 > engine.max_model_len or batch > engine.max_num_seqs:
        return None
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    prompt = [random.randrange(engine.model_config.vocab_size) for _ in range(context)]
    for _ in range(batch):
        engine.add_request(prompt, params)
    sched = engine.scheduler
    while sched.waiting:  # the context is "already prefilled": its latents are the cache's random values
        seq = sched.waiting.popleft()
        engine.kv.allocate(seq, context)
        seq.num_computed_tokens = context - 1
        seq.status = Status.RUNNING
        sched.running.append(seq)
    for _ in range(DECODE_WARMUP_STEPS):  # warm-up (captures the graph of this batch/width)
        engine.step()
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    step = (time.perf_counter() - t0) / steps
    engine.abort_all()
    return {"batch": batch, "context": context, "step_s": step, "kv_context": timed_context(context, steps)}


def prefill_point(llm, batch: int, length: int) -> dict | None:
    from deepinfer_core.sampling.params import SamplingParams

    engine = llm.engine
    if length + 2 > engine.max_model_len or batch * math.ceil((length + 2) / engine.kv.block_size) > engine.kv.num_free:
        return None
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times = []
    for _ in range(2):  # the first run compiles kernels for these shapes
        prompts = [[random.randrange(vocab) for _ in range(length)] for _ in range(batch)]
        _sync()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        _sync()
        times.append(time.perf_counter() - t0)
    return {"batch": batch, "length": length, "latency_s": times[-1], "tokens_per_s": batch * length / times[-1]}


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Our parameters under transformers' names (fused MLP gate/up and the stacked attention
    input projections split back into views; block-FP8 weights dequantised, see peer_params)."""
    from deepinfer_core.models.layers import checkpoint_weights

    out = {}
    for name, p in peer_params(dict(model.named_parameters()), getattr(model.config, "fp8_block", None)).items():
        if p.numel() == 0 or name.startswith("mtp."):
            continue  # released (fused) weights
        if p.dtype == torch.uint8 and name.endswith("_proj"):
            raise ValueError(f"{name} is kept as packed MXFP4, which transformers' model cannot share; "
                             "run the transformers peer on a slice with --expert-dtype bf16")
        out.update(checkpoint_weights(model, name.removesuffix(".weight"), p) if name.endswith(".weight") else {name: p})
    return out


def peer_params(params: dict[str, torch.Tensor], block) -> dict[str, torch.Tensor]:
    """The parameters to hand transformers: a block-FP8 weight we keep in FP8 (V4's dense linears
    and shared experts) dequantised to bf16 and its ``weight_scale_inv`` dropped, before a stacked
    weight is split (its scale rows go with it): a transformers model built from a config (no
    quantizer) takes bf16 weights, so its peer runs those linears in bf16 (our engine reads FP8)."""
    from deepinfer_core.ops.linear import dequantize_fp8_block

    fp8 = {name for name, p in params.items() if p.dtype == torch.float8_e4m3fn and name + "_scale_inv" in params}
    scales = {name + "_scale_inv" for name in fp8}
    return {name: dequantize_fp8_block(p, params[name + "_scale_inv"], block or (128, 128), torch.bfloat16) if name in fp8 else p
            for name, p in params.items() if name not in scales}


@torch.inference_mode()
def hf_peer(llm, model_dir: Path, batch: int, context: int, steps: int) -> dict:
    import transformers
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = hf.load_state_dict(hf_state_dict(llm.engine.model), strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"weight sharing with transformers failed: missing {missing[:5]}, unexpected {unexpected[:5]}")
    hf = hf.to(llm.engine.device).eval()
    ids = torch.randint(0, config.vocab_size, (batch, context), device=llm.engine.device)
    result = {"batch": batch, "context": context, "transformers": transformers.__version__,
              "attn_implementation": hf.config._attn_implementation,
              "experts_implementation": getattr(hf.config, "_experts_implementation", None)}
    for attempt in range(2):  # the first run warms up
        cache = DynamicCache(config=config)
        _sync()
        t0 = time.perf_counter()
        out = hf(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        _sync()
        prefill = time.perf_counter() - t0
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        n = 2 if attempt == 0 else steps
        _sync()
        t0 = time.perf_counter()
        for _ in range(n):
            out = hf(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync()
        decode = (time.perf_counter() - t0) / n
        del cache, out
    result.update(prefill_s=prefill, prefill_tokens_per_s=batch * context / prefill, step_s=decode, decode_tokens_per_s=batch / decode)
    del hf
    torch.cuda.empty_cache()
    return result


def run(name: str, out_dir: Path, hf: bool, quick: bool, ceilings: dict | None = None) -> dict:
    from deepinfer_core import LLM

    random.seed(0)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = write_config(name, Path(tempfile.mkdtemp(prefix="deepinfer-bench-")))
    ceilings = ceilings or measure()
    contexts = DECODE_CONTEXTS[:2] if quick else DECODE_CONTEXTS
    batches = (1, 32, 64) if quick else DECODE_BATCHES
    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir), accelerator="nvidia", dtype="bfloat16", load_format="dummy",
        max_num_seqs=max(batches), max_num_batched_tokens=16384, max_model_len=max(contexts) + 64,
        gpu_memory_utilization=0.8 if hf else 0.9, progress=False,
    )
    engine = llm.engine
    startup = time.perf_counter() - t0
    for cache in engine.kv_cache.tensors.values():
        cache.normal_()
    params = sum(p.numel() for n, p in engine.model.named_parameters() if not n.startswith("mtp."))
    report = {
        "model": name, "config": MODELS[name], "ceilings": ceilings, "parameters": params, "startup_s": startup,
        "kv_blocks": engine.kv.num_blocks, "block_size": engine.kv.block_size,
        "ops": engine.ops.implementations, "decode": [], "prefill": [], "skipped": [],
    }
    bw = ceilings["copy_bytes_per_s"]
    print(f"[{name}] {params / 1e9:.2f}B parameters, start-up {startup:.1f}s, {engine.kv.num_blocks} KV blocks", flush=True)
    for context in contexts:
        for batch in batches:
            point = decode_point(llm, batch, context, steps=8 if quick else 16)
            if point is None:
                report["skipped"].append({"decode": [batch, context], "why": "KV cache too small"})
                continue
            wbytes, cbytes = step_weight_bytes(engine.model, batch), kv_bytes(engine, batch, point["kv_context"])
            floor = (wbytes + cbytes) / bw
            point.update(
                weight_bytes=wbytes, kv_bytes=cbytes, hbm_floor_s=floor, over_floor=point["step_s"] / floor,
                tokens_per_s=batch / point["step_s"], tokens_per_s_per_user=1 / point["step_s"],
            )
            report["decode"].append(point)
            print(f"[{name}] decode B={batch:4d} L={context:6d}: step {point['step_s'] * 1e3:7.2f} ms, "
                  f"{point['tokens_per_s']:9.0f} tok/s, floor {floor * 1e3:6.2f} ms ({point['over_floor']:.2f}x)", flush=True)
    for batch, length in (PREFILL_POINTS[:3] if quick else PREFILL_POINTS):
        point = prefill_point(llm, batch, length)
        if point is None:
            report["skipped"].append({"prefill": [batch, length], "why": "too long or KV cache too small"})
            continue
        report["prefill"].append(point)
        print(f"[{name}] prefill B={batch:3d} L={length:6d}: {point['latency_s']:.3f} s, {point['tokens_per_s']:9.0f} tok/s", flush=True)
    if hf:
        peer = hf_peer(llm, model_dir, *HF_POINT, steps=8)
        ours = next((p for p in report["decode"] if (p["batch"], p["context"]) == HF_POINT), None)
        if ours is not None:
            peer["deepinfer_decode_tokens_per_s"] = ours["tokens_per_s"]
            peer["decode_speedup"] = ours["tokens_per_s"] / peer["decode_tokens_per_s"]
        report["transformers"] = peer
        print(f"[{name}] transformers B={HF_POINT[0]} L={HF_POINT[1]}: decode {peer['decode_tokens_per_s']:.0f} tok/s "
              f"(step {peer['step_s'] * 1e3:.1f} ms), prefill {peer['prefill_tokens_per_s']:.0f} tok/s; "
              f"DeepInfer/transformers decode {peer.get('decode_speedup', float('nan')):.1f}x", flush=True)
    (out_dir / f"e2e_{name}.json").write_text(json.dumps(report, indent=1))
    del llm, engine
    torch.cuda.empty_cache()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), action="append", required=True)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--hf-peer", action="store_true", help="also run transformers on the same weights (v2-lite)")
    parser.add_argument("--quick", action="store_true", help="fewer points")
    args = parser.parse_args()
    ceilings = measure()
    print(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 {ceilings['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s, "
          f"fp8 {(ceilings['fp8_flop_per_s'] or 0) / 1e12:.0f} TFLOP/s", flush=True)
    for name in args.model:
        run(name, args.out, hf=args.hf_peer and name == "v2-lite", quick=args.quick, ceilings=ceilings)


if __name__ == "__main__":
    main()
