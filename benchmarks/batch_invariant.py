"""Batch-invariant inference measured through ``LLM.generate``: what it costs, and whether it holds.

    python -m benchmarks.batch_invariant --out DIR [--model v2-lite] [--check-model v2-lite --check-layers 4]
    python -m benchmarks.batch_invariant --accelerator cpu --dtype float32 --model default --check-model default \\
        --batches 1,4 --max-tokens 8 --context 32 --out /tmp/bi      # a CPU smoke run

Parts (``--parts``, comma-separated):

* ``invariance`` (``--check-model``, random weights, bf16): in the normal mode and in the
  batch-invariant mode, one greedy target request (``--context`` random tokens, ``--max-tokens``
  outputs, logprobs) alone, then beside random neighbours at every size of ``--neighbours``
  (other lengths, some sharing its prefix): how many sizes changed its tokens or any logprob bit,
  and the largest logprob difference. Then ``--preempt-prompts`` prompts in a cache of
  ``--tight-blocks`` blocks (preempted and recomputed) against a large cache: how many outputs
  differ. The normal mode is expected to differ; the batch-invariant mode must not.
* ``speed`` (``--model``): one LLM per mode, B prompts of ``--context`` random tokens for every B
  in ``--batches``, greedy, ignore_eos. The first call at B, then max_tokens=1 calls (prefill) and
  max_tokens=M calls (each the best of ``--repeats``). Decode step = (M-token call - prefill call)
  / (M - 1); tokens/s count the tokens the outputs hold. ``step_over_normal``: the invariant
  mode's decode step over the normal mode's at the same B.

Writes DIR/batch_invariant.json after every part (and batch_invariant.png with matplotlib).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import tempfile
import time
from pathlib import Path

from benchmarks.generate import decode_step, guarded, metadata, prompts, sync, timed, write_model

MODES = {"normal": False, "invariant": True}


def _model_dir(name: str, layers: int | None) -> str | None:
    """None for the embedded default model, else a config-only checkpoint in a temporary directory."""
    return None if name == "default" else str(write_model(name, layers, Path(tempfile.mkdtemp(prefix="bi-"))))


def _llm(args, model: str, layers: int | None, batch_invariant: bool, **kw):
    from deepinfer_core import LLM

    path = _model_dir(model, layers)
    t0 = time.perf_counter()
    llm = LLM(model=path, accelerator=args.accelerator, dtype=args.dtype, load_format="dummy" if path else "safetensors",
              batch_invariant=batch_invariant, enable_prefix_caching=False, progress=False, **kw)
    sync(llm.engine.device)
    return llm, time.perf_counter() - t0


def _bits(out) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted(d.items())) for d in c.logprobs)


def _logprob_gap(a, b) -> float:
    """Largest |logprob difference| of the tokens both outputs share, position by position."""
    gap = 0.0
    for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        for t in la.keys() & lb.keys():
            gap = max(gap, abs(la[t] - lb[t]))
    return gap


def invariance(args) -> dict:
    from deepinfer_core import SamplingParams

    result = {}
    for mode, flag in MODES.items():
        llm, startup = _llm(args, args.check_model, args.check_layers, flag, max_num_seqs=max(args.neighbours))
        vocab = llm.engine.model_config.vocab_size
        rng = random.Random(0)
        target = prompts(rng, vocab, 1, args.context)[0]
        greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=1)
        alone = llm.generate([target], greedy, use_tqdm=False)[0]
        sizes = []
        for size in args.neighbours:
            others = [target[: rng.randint(0, args.context // 2)] + prompts(rng, vocab, 1, rng.randint(1, args.context))[0]
                      for _ in range(size - 1)]
            where = rng.randrange(size)
            got = llm.generate(others[:where] + [target] + others[where:], greedy, use_tqdm=False)[where]
            sizes.append({"batch": size, "same_bits": _bits(got) == _bits(alone), "same_tokens": _bits(got)[0] == _bits(alone)[0],
                          "max_logprob_diff": _logprob_gap(got, alone)})
        batch = prompts(random.Random(1), vocab, args.preempt_prompts, args.context // 2)
        big = llm.generate(batch, greedy, use_tqdm=False)
        del llm
        tight, _ = _llm(args, args.check_model, args.check_layers, flag, num_kv_blocks=args.tight_blocks,
                        max_model_len=args.context + args.max_tokens)
        small = tight.generate(batch, greedy, use_tqdm=False)
        result[mode] = {
            "startup_s": startup,
            "neighbours": sizes,
            "sizes_differing": sum(not s["same_bits"] for s in sizes),
            "preempted": {"prompts": len(batch), "preemptions": tight.engine.num_preemptions,
                          "outputs_differing_bits": sum(_bits(a) != _bits(b) for a, b in zip(big, small)),
                          "outputs_differing_tokens": sum(_bits(a)[0] != _bits(b)[0] for a, b in zip(big, small)),
                          "max_logprob_diff": max(_logprob_gap(a, b) for a, b in zip(big, small))},
        }
        r = result[mode]
        print(f"[invariance] {mode}: {r['sizes_differing']} of {len(sizes)} batch sizes changed the target's bits "
              f"(max logprob diff {max(s['max_logprob_diff'] for s in sizes):.2e}); preempted run: "
              f"{r['preempted']['outputs_differing_bits']} of {len(batch)} outputs differ "
              f"({r['preempted']['preemptions']} preemptions)", flush=True)
        del tight
    return result


def speed(args) -> dict:
    from deepinfer_core import SamplingParams

    result = {}
    for mode, flag in MODES.items():
        llm, startup = _llm(args, args.model, args.layers, flag, max_num_seqs=max(args.batches))
        points = []
        for batch in args.batches:
            group = prompts(random.Random(batch), llm.engine.model_config.vocab_size, batch, args.context)
            decode = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
            first, outputs = timed(llm, group, decode)
            prefill = min(timed(llm, group, decode.model_copy(update={"max_tokens": 1}))[0] for _ in range(args.repeats))
            repeat = min(timed(llm, group, decode)[0] for _ in range(args.repeats))
            emitted = sum(len(o.outputs[0].token_ids) for o in outputs)
            step = decode_step(repeat, prefill, args.max_tokens)
            points.append({"batch": batch, "first_s": first, "prefill_s": prefill, "repeat_s": repeat, "emitted_tokens": emitted,
                           "tokens_per_s": emitted / repeat, "tokens_per_s_first": emitted / first,
                           "prefill_tokens_per_s": batch * args.context / prefill,
                           "decode_step_s": step, "decode_tokens_per_s": batch / step if step > 0 else None})
            print(f"[speed] {mode} B={batch}: decode step {1e3 * step:.2f} ms, {emitted / repeat:.0f} tok/s repeated "
                  f"({emitted / first:.0f} first call), prefill {batch * args.context / prefill:.0f} tok/s", flush=True)
        result[mode] = {"startup_s": startup, "graphs": llm.engine.runner.graphs is not None, "points": points}
        del llm
    normal = {p["batch"]: p for p in result["normal"]["points"]}
    for p in result["invariant"]["points"]:
        base = normal[p["batch"]]
        p["step_over_normal"] = p["decode_step_s"] / base["decode_step_s"] if base["decode_step_s"] > 0 else None
        p["prefill_over_normal"] = p["prefill_s"] / base["prefill_s"]
    return result


def plot(report: dict, out: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    part = report.get("speed", {})
    if "normal" not in part or "invariant" not in part:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in MODES:
        pts = part[mode]["points"]
        a.plot([p["batch"] for p in pts], [p["decode_tokens_per_s"] for p in pts], marker="o", label=mode)
    a.set(xscale="log", xlabel="batch", ylabel="decode tokens/s", title=f"{report['args']['model']} ({report['args']['dtype']})")
    a.legend()
    pts = part["invariant"]["points"]
    b.bar([str(p["batch"]) for p in pts], [p["step_over_normal"] for p in pts])
    b.axhline(1.15, color="red", linestyle="--", label="target 1.15")
    b.set(xlabel="batch", ylabel="decode step, invariant / normal", title="cost of batch invariance")
    b.legend()
    fig.tight_layout()
    path = out / "batch_invariant.png"
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="invariance,speed")
    p.add_argument("--model", default="v2-lite", help="speed: a benchmarks.models name, or 'default' (the embedded model)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--check-model", default="v2-lite")
    p.add_argument("--check-layers", type=int, default=4)
    p.add_argument("--accelerator", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--neighbours", default="2,4,8,16,32,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--preempt-prompts", type=int, default=48)
    p.add_argument("--tight-blocks", type=int, default=48)
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    args = p.parse_args(argv)
    args.batches = [int(v) for v in args.batches.split(",")]
    args.neighbours = [int(v) for v in args.neighbours.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"meta": metadata(args), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    path = args.out / "batch_invariant.json"
    for part, fn in (("invariance", invariance), ("speed", speed)):
        if part in args.parts.split(","):
            report[part] = guarded(fn, args)
            report["meta"]["finished"] = datetime.datetime.now(datetime.UTC).isoformat()
            path.write_text(json.dumps(report, indent=1))
    plot(report, args.out)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
