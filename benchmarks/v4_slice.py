"""DeepSeek-V4-Flash slice on a GPU: what users get through LLM.generate, and where a decode
step's time goes, op by op (the input of the V4 kernel work).

    python -m benchmarks.v4_slice --out benchmarks/results/<run>/v4_slice

The model is benchmarks.models' ``v4-flash-slice`` (V4-Flash's config.json, its first 4 layers:
sliding-only, sliding-only, CSA, HCA) with random weights (``load_format="dummy"``) in bf16, FP8
linears kept in FP8 where the backend says it can, routed experts dequantised to bf16. Every op
the backend lacks runs its reference implementation on the GPU.

1. ``generate``: batches of B prompts of P tokens, N greedy tokens each; the first call at a
   batch size and a repeat, wall time and output tokens per second.
2. ``profile``: decode steps of a batch at a context length, each op of the op table wrapped in
   a ``record_function`` range; GPU time per op (kernels launched inside its range) and the
   step's wall time, so the share of time outside the GPU (Python, syncs) shows too.
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


def build(max_num_seqs: int, max_model_len: int, accelerator: str, model_dir: Path | None = None):
    from deepinfer_core import LLM

    model_dir = model_dir or write_config("v4-flash-slice", Path(tempfile.mkdtemp(prefix="deepinfer-v4-")))
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), accelerator=accelerator, dtype="bfloat16", load_format="dummy",
              max_num_seqs=max_num_seqs, max_model_len=max_model_len, progress=False)
    return llm, time.perf_counter() - t0


def generate_points(llm, batches, prompt_len: int, new_tokens: int) -> list[dict]:
    from deepinfer_core import SamplingParams

    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out = []
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(2, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
        for call in ("first", "repeat"):
            _sync()
            t0 = time.perf_counter()
            res = llm.generate(prompts, params, use_tqdm=False)
            _sync()
            dt = time.perf_counter() - t0
            emitted = sum(len(r.outputs[0].token_ids) for r in res)
            row = {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "call": call,
                   "seconds": dt, "output_tokens": emitted, "output_tok_per_s": emitted / dt}
            print(f"generate B={batch} P={prompt_len} N={new_tokens} {call}: {dt:.2f} s, {emitted / dt:.1f} output tok/s", flush=True)
            out.append(row)
    return out


def _wrap_ops(ops) -> None:
    from deepinfer_core.ops import OP_NAMES

    for name in OP_NAMES:
        fn = ops[name]

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            with torch.profiler.record_function(f"op::{_name}"):
                return _fn(*args, **kwargs)

        setattr(ops, name, wrapped)


def profile_decode(llm, batch: int, context: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from deepinfer_core import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        engine.add_request(torch.randint(2, vocab, (context,), generator=g).tolist(), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (real: the compressed caches hold what the prompt made)
    for _ in range(2):
        engine.step()
    _sync()
    _wrap_ops(engine.model.ops)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        wall = (time.perf_counter() - t0) / steps
    engine.abort_all()
    per_op: dict[str, float] = defaultdict(float)
    per_op_cpu: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    kernels_ms = 0.0
    for avg in prof.key_averages():
        if avg.key.startswith("op::"):
            per_op[avg.key[4:]] += avg.device_time_total / 1e3 / steps
            per_op_cpu[avg.key[4:]] += avg.cpu_time_total / 1e3 / steps
            calls[avg.key[4:]] += avg.count // steps
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels_ms += event.device_time_total / 1e3 / steps
    rows = sorted(per_op.items(), key=lambda kv: -kv[1])
    print(f"decode B={batch} context={context}: wall {wall * 1e3:.2f} ms/step, GPU kernels {kernels_ms:.2f} ms/step "
          f"({100 * kernels_ms / (wall * 1e3):.0f}% busy)", flush=True)
    for name, ms in rows:
        print(f"    {ms:8.3f} ms GPU {per_op_cpu[name]:8.3f} ms host  {calls[name]:5d} calls  {name}", flush=True)
    return {"batch": batch, "context": context, "steps": steps, "wall_ms_per_step": wall * 1e3,
            "gpu_kernel_ms_per_step": kernels_ms, "ops_gpu_ms_per_step": dict(rows),
            "ops_host_ms_per_step": dict(per_op_cpu), "op_calls_per_step": dict(calls),
            "providers": dict(engine.ops.providers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", default="nvidia")
    parser.add_argument("--batch", type=int, action="append", default=None)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--profile", default="8x2048", help="BATCHxCONTEXT of the decode profile")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model-dir", type=Path, default=None, help="another V4 config.json directory (smoke tests)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    batches = args.batch or [1, 8, 32]
    pb, pc = map(int, args.profile.split("x"))
    llm, load_s = build(max(max(batches), pb), max(args.prompt_len, pc) + args.new_tokens + args.steps + 64, args.accelerator,
                          args.model_dir)
    result = {"model": "v4-flash-slice", "load_seconds": load_s, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "generate": generate_points(llm, batches, args.prompt_len, args.new_tokens),
              "profile": profile_decode(llm, pb, pc, args.steps)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "v4_slice.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
