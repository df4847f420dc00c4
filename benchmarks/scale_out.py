"""End-to-end decode throughput per GPU under data x expert parallelism, against one GPU, through
``LLM.generate`` (the multi-GPU issue's scaling efficiency). Random weights, real DeepSeek shapes.

    python -m benchmarks.scale_out --model v2-lite --model v3-slice --ep 1,2,4,8 --out DIR
    python -m benchmarks.scale_out --quick --accelerator cpu --dtype float32 --out /tmp/s   # a CPU smoke run (gloo)

For each model and each size N of ``--ep`` (N GPUs of this host; 1 = one GPU, no group): one fresh
``LLM(data_parallel_size=N, expert_parallel=N > 1)`` with ``--per-gpu-batch`` b sequences a rank,
so every size runs the same batch per GPU (weak scaling); N*b prompts of ``--context`` random
tokens, greedy, ignore_eos, ``--max-tokens`` M outputs. Timed as ``benchmarks.generate`` does: the
first call (before any other), a prefill-only call (max_tokens=1), the repeated call (min of
``--repeats``); decode step = (repeat - prefill) / (M - 1), decode cadence from rank 0's steps
(``StepClock``). tokens/s per GPU = b / step; the scaling efficiency of size N is its tokens/s
per GPU over one GPU's at the same b. Under expert parallelism decode steps run without CUDA
graphs (the exchange's sizes change every step), so one GPU is also run with ``enforce_eager``
(the size-1 point with ``eager`` true): the efficiency is given against both (``efficiency``,
``efficiency_vs_eager``).

Random weights are the same model at every N (``init_dummy_weights``: a rank draws every expert
in turn and keeps its own). ``same_tokens``: of the first b prompts (those one GPU ran), how many
got exactly one GPU's greedy tokens. In bf16 a different batch composition can flip a near-tie of
random weights' flat logits, so this is reported, not asserted (``tests/nvidia/test_multi_gpu.py``
asserts equality in float32). ``--batch-invariant`` runs every size in batch-invariant mode: the
batch no longer moves a row's numbers, though the EP combine may still add a token's experts in
another order than one GPU's expert op. EPLB runs as configured (``DEEPINFER_EPLB_INTERVAL``);
the re-placements rank 0 saw are counted. NVLink multicast is kept off (NCCL_NVLS_ENABLE=0 and
the like): on a shared host it can take the GPUs out of service.

Writes DIR/scale_out.json after every point and DIR/scale_out.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.all_to_all import keep_multicast_off
from benchmarks.generate import (CONFIGS, StepClock, decode_step, engine_info, guarded, metadata, prompts, params, sync, timed,
                                 write_model)

FULL = {"models": ["v2-lite", "v3-slice"], "ep": "1,2,4,8", "per_gpu_batch": 32, "context": 1024, "max_tokens": 33, "repeats": 2}
QUICK = {"models": ["tiny"], "ep": "1,2", "per_gpu_batch": 2, "context": 16, "max_tokens": 5, "repeats": 1}


def available(args) -> int:
    """How many ranks this host can run: its GPUs (CPU runs: any number, gloo)."""
    if args.accelerator == "cpu":
        return max(args.ep)
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def point(args, model_dir: Path, size: int, eager: bool = False) -> dict:
    """One LLM of ``size`` ranks: start-up, first call, prefill, repeated calls (see the docstring)."""
    from deepinfer_core import LLM

    batch = args.per_gpu_batch
    group = prompts(random.Random(0), args.vocab, size * batch, args.context)  # the first b are every size's first b
    parallel = {"data_parallel_size": size, "expert_parallel": True} if size > 1 else {}
    started = time.perf_counter()
    llm = LLM(str(model_dir), accelerator=args.accelerator, dtype=args.dtype, load_format="dummy", progress=False,
              max_model_len=args.max_model_len, max_num_seqs=batch, enforce_eager=eager,
              gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
              batch_invariant=args.batch_invariant, **parallel)
    try:
        sync(llm.engine.device)
        startup = time.perf_counter() - started
        first, outputs = timed(llm, group, params(args.max_tokens))
        prefill = min(timed(llm, group, params(1))[0] for _ in range(args.repeats))
        repeats, cadences, replacements = [], [], 0
        for _ in range(args.repeats):
            with StepClock(llm.engine) as clock:
                seconds, _ = timed(llm, group, params(args.max_tokens))
            repeats.append(seconds)
            if (c := clock.decode_cadence()) is not None:
                cadences.append(c)
            replacements += sum(1 for _, s in clock.marks if "eplb" in s.extra)
        repeat = min(repeats)
        step = decode_step(repeat, prefill, args.max_tokens)
        cadence = min(cadences, default=None)
        emitted = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {"size": size, "eager": eager or size > 1, "per_gpu_batch": batch, "batch": size * batch,
                "startup_s": startup, "first_s": first, "prefill_s": prefill, "repeat_s": repeat, "repeat_runs_s": repeats,
                "first_over_repeat": first / repeat, "decode_step_s": step, "decode_cadence_s": cadence,
                "output_tokens": emitted, "expected_output_tokens": size * batch * args.max_tokens,
                "tokens_per_s_per_gpu": batch / step if step > 0 else None,
                "cadence_tokens_per_s_per_gpu": batch / cadence if cadence else None,
                "eplb_replacements_seen": replacements, "engine": engine_info(llm),
                "tokens": [list(o.outputs[0].token_ids) for o in outputs[:batch]]}
    finally:
        llm.close()  # its ranks stop; guarded() then frees this process's memory for the next LLM


def compare(points: list[dict]) -> None:
    """Efficiency and token agreement of every point against the one-GPU points (in place)."""
    one = next((p for p in points if p.get("size") == 1 and not p.get("eager") and "error" not in p), None)
    eager = next((p for p in points if p.get("size") == 1 and p.get("eager") and "error" not in p), None)
    for p in points:
        if "error" in p or p["size"] == 1:
            continue
        for key, base in (("efficiency", one), ("efficiency_vs_eager", eager)):
            if base and p["tokens_per_s_per_gpu"] and base["tokens_per_s_per_gpu"]:
                p[key] = p["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
        if one:
            same = [a == b for a, b in zip(p["tokens"], one["tokens"])]
            p["same_tokens"] = f"{sum(same)}/{len(same)}"


def plot(report: dict, out: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for model, points in report["models"].items():
        done = [p for p in points if "error" not in p and not (p["size"] == 1 and p["eager"])]
        a.plot([p["size"] for p in done], [p["tokens_per_s_per_gpu"] for p in done], "o-", label=model)
        scaled = [p for p in done if "efficiency" in p]
        b.plot([1] + [p["size"] for p in scaled], [1.0] + [p["efficiency"] for p in scaled], "o-", label=f"{model} vs 1 GPU (graphs)")
        scaled = [p for p in done if "efficiency_vs_eager" in p]
        b.plot([1] + [p["size"] for p in scaled], [1.0] + [p["efficiency_vs_eager"] for p in scaled], "s--",
               label=f"{model} vs 1 GPU (eager)")
    a.set(xscale="log", xlabel="GPUs (DP = EP)", ylabel="decode tokens/s per GPU",
          title=f"b={report['args']['per_gpu_batch']} per GPU, L={report['args']['context']}")
    b.set(xscale="log", xlabel="GPUs (DP = EP)", ylabel="tokens/s per GPU / one GPU's", title="scaling efficiency")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path := out / "scale_out.png", dpi=120)
    plt.close(fig)
    return path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", dest="models", action="append", choices=sorted(CONFIGS), help="repeatable (default v2-lite, v3-slice)")
    p.add_argument("--ep", help="sizes to run, comma-separated (default 1,2,4,8; those above the host's GPUs are skipped)")
    p.add_argument("--per-gpu-batch", type=int)
    p.add_argument("--context", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--no-eager-baseline", dest="eager_baseline", action="store_false", help="skip one GPU under enforce_eager")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--batch-invariant", action="store_true", help="LLM(batch_invariant=True) at every size")
    p.add_argument("--accelerator", help="cpu, nvidia, ... (default: auto)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a CPU smoke run")
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.ep = sorted({int(v) for v in str(args.ep).split(",")})
    if min(args.ep) < 1 or 1 not in args.ep:
        p.error("--ep must list positive sizes including 1 (one GPU is what every size is compared with)")
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2 (one token from the prefill, at least one decode step)")
    args.max_model_len = -(-(args.context + args.max_tokens + 16) // 64) * 64
    return args


def run(args) -> dict:
    keep_multicast_off()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"meta": metadata(args), "gpus_on_host": available(args),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "models": {}}
    path = args.out / "scale_out.json"

    def save() -> None:
        report["meta"]["finished"] = datetime.datetime.now(datetime.UTC).isoformat()
        path.write_text(json.dumps(report, indent=1))

    for model in args.models:
        model_dir = write_model(model, None, Path(tempfile.mkdtemp(prefix="deepinfer-scale-")))
        args.vocab = CONFIGS[model]["vocab_size"]
        report["models"][model] = points = []
        runs = [(1, False)] + [(1, True)] * args.eager_baseline + [(n, False) for n in args.ep if n > 1]
        for size, eager in runs:
            if size > report["gpus_on_host"]:
                points.append({"size": size, "eager": True, "error": f"skipped: {size} ranks, {report['gpus_on_host']} GPUs here"})
            else:
                points.append({"size": size, "eager": eager, **guarded(point, args, model_dir, size, eager)})
            compare(points)
            p = points[-1]
            label = f"[{model}] {size} rank{'s' if size > 1 else ''}{' (eager)' if eager else ''}"
            print(f"{label}: " + (p.get("error") or (
                f"start-up {p['startup_s']:.1f}s, first {p['first_s']:.3f}s, repeat {p['repeat_s']:.3f}s, step "
                f"{p['decode_step_s'] * 1e3:.2f} ms, {p['tokens_per_s_per_gpu']:.1f} tok/s per GPU"
                + (f", efficiency {p['efficiency']:.3f}" if "efficiency" in p else "")
                + (f" ({p['efficiency_vs_eager']:.3f} vs eager)" if "efficiency_vs_eager" in p else "")
                + (f", same tokens as one GPU {p['same_tokens']}" if "same_tokens" in p else "")
                + f", {p['eplb_replacements_seen']} EPLB re-placements")), flush=True)
            save()
    figure = plot(report, args.out)
    print(f"wrote {path}" + (f" and {figure}" if figure else " (no plot: matplotlib is not installed)"), flush=True)
    return report


def main(argv=None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
