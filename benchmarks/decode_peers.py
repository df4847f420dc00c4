"""Decode and prefill through ``LLM.generate`` with peer kernel libraries providing ops against
the backend's own kernels, side by side in one run, and both against limits measured in the
same run.

    python -m benchmarks.decode_peers --out DIR [--models v2-lite,v3-slice] [--batches 1,8,32,64]
        [--contexts 1024,4096] [--max-tokens 33] [--repeats 2]

For each model, two LLMs live side by side (random weights, bf16 or the model's FP8, prefix
caching off, 40% of the GPU's memory each (``--memory-share``), the same 64-token KV blocks so that only the kernels
differ): ``peers`` (DEEPINFER_EXTERNAL_KERNELS=1: FlashMLA decodes where installed, cuBLAS's
block-scaled FP8 GEMM runs the FP8 linears on sm_90, each where its shapes fit) and ``own``
(DEEPINFER_EXTERNAL_KERNELS=0: the backend's Triton kernels). Each point records which
implementation each of those ops had. At each batch B and context L: B prompts of L random
tokens, greedy, ignore_eos; the first M-token call on each LLM, then in turns on each,
max_tokens=1 (the prefill) and the M-token call again, ``--repeats`` times, the minimum kept (two
LLMs built one after the other drifted apart by up to 13% on an H200, more than the kernels
differ). Decode step = (generate time - prefill time) / (M - 1), as ``benchmarks.generate``
measures it: the first token comes from the prefill. ``decode_step_first_s`` uses the first call
instead; prefill tokens/s = B L / prefill time. ``decode_cadence_s`` (min over the repeats):
the mean time between the ends of consecutive decode-only steps of a repeated call at its
full batch (``generate.StepClock``), which has no prefill in it; ``cadence_over_floor`` its ratio. The floor is the bytes a step must read
(``benchmarks.e2e.step_weight_bytes``: weights, expected distinct experts; plus the cached
latents at the steps' mean context L + M / 2) over the copy bandwidth of ``benchmarks.ceilings``.
Writes DIR/decode_peers.json after every point and DIR/decode_peers.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
from pathlib import Path

import torch

from benchmarks.e2e import kv_bytes, step_weight_bytes
from benchmarks.generate import decode_step, metadata, params, prompts, timed, timed_decode, write_model

PROVIDERS = {"peers": "1", "own": "0"}  # DEEPINFER_EXTERNAL_KERNELS of each LLM
PEER_OPS = ("mla_decode_attention", "fp8_block_linear", "moe_experts")  # the ops a peer library may provide
BLOCK_SIZE = 64  # FlashMLA's page size, used by both so that only the kernel differs
MEMORY_SHARE = 0.4  # of the GPU's memory for each of the two LLMs, alive together


def build(model_dir: Path, provider: str, max_batch: int, max_len: int, memory: float):
    from deepinfer_core import LLM

    before = os.environ.get("DEEPINFER_EXTERNAL_KERNELS")
    os.environ["DEEPINFER_EXTERNAL_KERNELS"] = PROVIDERS[provider]  # read when the LLM builds its op table
    try:
        return LLM(model=str(model_dir), accelerator="nvidia", load_format="dummy", block_size=BLOCK_SIZE,
                   max_num_seqs=max_batch, max_model_len=max_len, enable_prefix_caching=False, progress=False,
                   gpu_memory_utilization=memory)
    finally:
        if before is None:
            del os.environ["DEEPINFER_EXTERNAL_KERNELS"]
        else:
            os.environ["DEEPINFER_EXTERNAL_KERNELS"] = before


def points(llms: dict, batch: int, context: int, max_tokens: int, repeats: int, bandwidth: float) -> dict:
    """One (B, L) on every LLM, their calls interleaved (first calls, then each repeat on each in
    turn), so that drift over the run falls on all of them alike."""
    any_llm = next(iter(llms.values()))
    group = prompts(random.Random(batch * 100003 + context), any_llm.engine.model_config.vocab_size, batch, context)
    first = {name: timed(llm, group, params(max_tokens)) for name, llm in llms.items()}
    prefill, repeat, cadence = ({name: [] for name in llms} for _ in range(3))
    for _ in range(repeats):
        for name, llm in llms.items():
            prefill[name].append(timed(llm, group, params(1))[0])
            seconds, _, steady = timed_decode(llm, group, params(max_tokens))
            repeat[name].append(seconds)
            if steady is not None:
                cadence[name].append(steady)
    out = {}
    for name, llm in llms.items():
        p, r, (f, outputs) = min(prefill[name]), min(repeat[name]), first[name]
        step, step_first = (decode_step(t, p, max_tokens) for t in (r, f))
        c = min(cadence[name], default=None)
        floor_bytes = step_weight_bytes(llm.engine.model, batch) + kv_bytes(llm.engine, batch, context + max_tokens / 2)
        floor = floor_bytes / bandwidth
        out[name] = {"batch": batch, "context": context, "max_tokens": max_tokens,
                     "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                     "first_s": f, "prefill_s": p, "repeat_s": r, "prefill_runs_s": prefill[name], "repeat_runs_s": repeat[name],
                     "decode_step_s": step, "decode_step_first_s": step_first, "decode_tokens_per_s": batch / step,
                     "decode_cadence_s": c, "decode_cadence_runs_s": cadence[name],
                     "cadence_over_floor": None if c is None else c / floor,
                     "floor_bytes": floor_bytes, "floor_s": floor, "step_over_floor": step / floor,
                     "prefill_tokens_per_s": batch * context / p,
                     "implementations": {op: llm.engine.ops.implementations.get(op) for op in PEER_OPS}}
    return out


def describe(p: dict) -> str:
    """One line for a point of ``points``."""
    cadence = "n/a" if p["decode_cadence_s"] is None else (
        f"{p['decode_cadence_s'] * 1e3:7.2f} ms ({p['cadence_over_floor']:.2f}x)")
    return (f"step {p['decode_step_s'] * 1e3:7.2f} ms (first call {p['decode_step_first_s'] * 1e3:7.2f}) "
            f"floor {p['floor_s'] * 1e3:6.2f} ms -> {p['step_over_floor']:.2f}x, cadence {cadence}, "
            f"{p['decode_tokens_per_s']:8.0f} tok/s; prefill {p['prefill_tokens_per_s']:8.0f} tok/s")


def variant_points(tag: str, model: str, llms: dict, ratio: tuple[str, str], args, bandwidth: float, report: dict,
                   path: Path) -> None:
    """``points`` of two LLMs ("variants") at every (L, B) of ``args``, into ``report`` (points, and
    the decode step's and cadence's ratio[0] / ratio[1] per point), printed, written to ``path``
    after each point (benchmarks/shared_fusion.py, benchmarks/constants_ab.py)."""
    top, bottom = ratio
    for context in args.contexts:
        for batch in args.batches:
            done = points(llms, batch, context, args.max_tokens, args.repeats, bandwidth)
            for label, p in done.items():
                report["points"].append({"model": model, "variant": label, **p})
                print(f"[{tag}] {model} {label:8s} B={batch:<4d} L={context:<6d} {describe(p)}", flush=True)
            a, b = done[top], done[bottom]
            row = {"model": model, "batch": batch, "context": context, f"{top}_over_{bottom}_step": a["decode_step_s"] / b["decode_step_s"],
                   f"{top}_over_{bottom}_cadence": None if None in (a["decode_cadence_s"], b["decode_cadence_s"])
                   else a["decode_cadence_s"] / b["decode_cadence_s"], f"{top}_over_{bottom}_prefill": a["prefill_s"] / b["prefill_s"]}
            report["ratios"].append(row)
            print(f"[{tag}] {model} B={batch} L={context}: {top} / {bottom} decode step "
                  f"{row[f'{top}_over_{bottom}_step']:.3f}, cadence {row[f'{top}_over_{bottom}_cadence'] or float('nan'):.3f}, "
                  f"prefill time {row[f'{top}_over_{bottom}_prefill']:.3f}", flush=True)
            path.write_text(json.dumps(report, indent=1))


def run(args) -> dict:
    from benchmarks.ceilings import measure

    args.out.mkdir(parents=True, exist_ok=True)
    ceilings = measure()
    report = {"meta": metadata(argparse.Namespace(accelerator="nvidia")), "ceilings": ceilings,
              "args": {k: str(v) for k, v in vars(args).items()}, "points": []}
    path = args.out / "decode_peers.json"
    max_len = -(-(max(args.contexts) + args.max_tokens + 16) // BLOCK_SIZE) * BLOCK_SIZE
    for name in args.models:
        model_dir = write_model(name, None, Path(tempfile.mkdtemp(prefix="deepinfer-peers-")))
        # gpu_memory_utilization counts what is in use already: the second LLM's share ends at 2 x --memory-share
        llms = {provider: build(model_dir, provider, max(args.batches), max_len, args.memory_share * (i + 1))
                for i, provider in enumerate(PROVIDERS)}
        for context in args.contexts:
            for batch in args.batches:
                try:
                    done = points(llms, batch, context, args.max_tokens, args.repeats, ceilings["copy_bytes_per_s"])
                except Exception as e:  # noqa: BLE001 - one point's failure must not hide the others
                    done = {p: {"batch": batch, "context": context, "error": f"{type(e).__name__}: {e}"} for p in llms}
                for provider, p in done.items():
                    report["points"].append(p := {"model": name, "provider": provider, **p})
                    print(f"[peers] {name} {provider:8s} B={batch:<4d} L={context:<6d} " + (p.get("error") or describe(p)), flush=True)
                path.write_text(json.dumps(report, indent=1))
        del llms
        gc.collect()
        torch.cuda.empty_cache()
    report["side_by_side"] = side_by_side(report["points"])
    for row in report["side_by_side"]:
        print(f"[peers] {row['model']} B={row['batch']} L={row['context']}: own / peers: decode step "
              f"{row['own_over_peers_step']:.3f}, prefill time {row['own_over_peers_prefill']:.3f}", flush=True)
    path.write_text(json.dumps(report, indent=1))
    plot(report, args.out)
    return report


def side_by_side(points: list[dict]) -> list[dict]:
    """Per (model, B, L) measured with both: the own kernels' decode step and prefill time over the peers'."""
    done = {(p["model"], p["provider"], p["batch"], p["context"]): p for p in points if "error" not in p}
    rows = []
    for (model, provider, batch, context), p in done.items():
        other = done.get((model, "own", batch, context))
        if provider == "peers" and other:
            rows.append({"model": model, "batch": batch, "context": context,
                         "own_over_peers_step": other["decode_step_s"] / p["decode_step_s"],
                         "own_over_peers_prefill": other["prefill_s"] / p["prefill_s"],
                         "peers_over_floor": p["step_over_floor"], "own_over_floor": other["step_over_floor"]})
    return rows


def plot(report: dict, out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({p["model"] for p in report["points"]})
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for provider, style in (("peers", "o-"), ("own", "s--")):
            for context in sorted({p["context"] for p in report["points"]}):
                pts = [p for p in report["points"] if p["model"] == model and p["provider"] == provider
                       and p["context"] == context and "error" not in p]
                ax.plot([p["batch"] for p in pts], [p["step_over_floor"] for p in pts], style, label=f"{provider} L={context}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(xscale="log", xlabel="batch", ylabel="decode step / HBM floor", title=f"{model}: through LLM.generate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "decode_peers.png", dpi=120)
    plt.close(fig)


def parse_args(doc: str, argv=None, batches: str = "1,8,32,64", contexts: str = "1024,4096", max_tokens: int = 33,
               extra=None):
    """The options of a side-by-side run of ``points`` (this module's, benchmarks/shared_fusion.py's and
    benchmarks/constants_ab.py's); ``extra(parser)`` adds a benchmark's own."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if extra is not None:
        extra(p)
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    p.add_argument("--models", default="v2-lite,v3-slice")
    p.add_argument("--batches", default=batches)
    p.add_argument("--contexts", default=contexts)
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--memory-share", type=float, default=MEMORY_SHARE,
                   help="of the GPU's memory for each of the two LLMs (default %(default)s; two V2-Lite-shaped LLMs, "
                        "31 GB of weights each, fit an 80 GB H100 at 0.46)")
    args = p.parse_args(argv)
    if not 0 < args.memory_share <= 0.5:
        p.error(f"--memory-share must be in (0, 0.5]: the two LLMs are alive together, not {args.memory_share}")
    args.models = args.models.split(",")
    args.batches, args.contexts = ([int(v) for v in s.split(",")] for s in (args.batches, args.contexts))
    return args


def main(argv=None) -> None:
    run(parse_args(__doc__, argv))


if __name__ == "__main__":
    main()
