"""Speculative decoding, measured through ``LLM.generate``: MTP acceptance, what verifying 1 + k
tokens costs against 1, and decode tokens/s with MTP on and off.

Parts (``--parts``, comma-separated):

* ``acceptance``: the embedded default model over ``specs/workloads/python_snippets.jsonl``
  prompts, greedy and sampled (T=0.6, seeded: coupled acceptance; unseeded: rejection
  sampling), at draft lengths 1..5: acceptance by draft position and mean tokens per
  verification step, counted from the verifications that ran (``engine.spec_stats``).
* ``verify`` (GPU): V3-slice and V2-Lite shapes with random weights, graph-captured decode steps
  of rows of 1 token against rows of 1 + k tokens (k fixed drafts per step, all of them verified:
  the drafts come from a stub proposer, so only the target's cost is measured), at B = 1..64:
  per-step time from ``generate`` runs of two lengths (prefill cancels out).
* ``e2e``: the default model, decode tokens/s at B = 1, 8, 32 with MTP (k = 1..3) and without,
  first call and repeated call, counting only the tokens the outputs hold.

A projection of the speed-up at V3 shapes combines measured acceptance with measured verify cost
and an assumed draft cost (one MTP layer ~ 1/61 of a V3 step per draft); it is labelled as such.
Writes ``spec_decode.json`` (and prints every point) under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.generate import guarded, metadata, sync, write_model

SNIPPETS = Path(__file__).resolve().parents[1] / "specs" / "workloads" / "python_snippets.jsonl"
V3_LAYERS = 61  # layers of a DeepSeek-V3 step, for the projection's draft cost


def snippet_prompts() -> list[str]:
    return [json.loads(line)["prompt"] for line in SNIPPETS.read_text().splitlines() if line.strip()]


def _spec(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def acceptance(args) -> list[dict]:
    from deepinfer_core import LLM, SamplingParams

    prompts = snippet_prompts()
    modes = {"greedy": SamplingParams(temperature=0, max_tokens=args.max_tokens),
             "sampled_seeded": SamplingParams(temperature=0.6, max_tokens=args.max_tokens, seed=0, n=4),
             "sampled_unseeded": SamplingParams(temperature=0.6, max_tokens=args.max_tokens, n=4)}
    out = []
    for k in range(1, 6):
        llm = LLM(accelerator=args.accelerator, dtype=args.dtype, progress=False, speculative_config=_spec(k))
        for mode, params in modes.items():
            before = llm.engine.spec_stats
            outputs = llm.generate(prompts, params, use_tqdm=False)
            stats = outputs[0].metrics.speculative
            for o in outputs[1:]:
                stats = stats.merge(o.metrics.speculative)
            point = {"k": k, "mode": mode, "acceptance": "coupled" if mode != "sampled_unseeded" else "rejection",
                     "first_draft_acceptance": stats.acceptance_by_position[0] if stats.proposed else None,
                     "acceptance_by_position": stats.acceptance_by_position, "mean_accepted_length": stats.mean_accepted_length,
                     "drafts": stats.num_draft_tokens, "accepted": stats.num_accepted_tokens, "verify_steps": stats.num_verify_steps,
                     "emitted_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs)}
            assert llm.engine.spec_stats.num_draft_tokens - before.num_draft_tokens == stats.num_draft_tokens
            out.append(point)
            print(f"[acceptance] k={k} {mode}: first draft {point['first_draft_acceptance']:.3f}, by position "
                  f"{[round(a, 3) for a in point['acceptance_by_position']]}, mean accepted length {point['mean_accepted_length']:.3f}", flush=True)
        del llm
    return out


class FixedDrafts:
    """A stub proposer for the verify-cost part: k drafts (token 0) for every decoding sequence."""

    def __init__(self, k: int, max_model_len: int):
        self.k, self.max_model_len = k, max_model_len

    def observe(self, out, step, accepted) -> None:
        pass

    def propose(self, running) -> None:
        for seq in running:
            room = min(self.k, seq.params.max_tokens - len(seq.output_token_ids) - 1, self.max_model_len - seq.num_tokens - 1)
            seq.draft_token_ids = [0] * room if seq.num_computed_tokens == seq.num_tokens - 1 and room > 0 else []


def _step_time(llm, batch: int, context: int, steps: int, repeats: int) -> float:
    """Seconds per decode step: (generate of 1 + steps tokens - generate of 1 token) / steps, best of repeats."""
    from deepinfer_core import SamplingParams

    g = torch.Generator().manual_seed(batch)
    vocab = llm.engine.model_config.vocab_size
    prompts = [torch.randint(1, vocab, (context,), generator=g).tolist() for _ in range(batch)]

    def timed(n: int) -> float:
        sync(llm.engine.device)
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        sync(llm.engine.device)
        return time.perf_counter() - t0

    timed(1 + steps)  # warm
    full = min(timed(1 + steps) for _ in range(repeats))
    prefill = min(timed(1) for _ in range(repeats))
    return (full - prefill) / steps


def verify_cost(args) -> list[dict]:
    from deepinfer_core import LLM

    out = []
    for name, layers in (("v3-slice", None), ("v2-lite", 4)):
        model_dir = write_model(name, layers, Path(tempfile.mkdtemp(prefix="deepinfer-spec-")))
        for k in (0, *args.verify_k):
            spec = {"method": "ngram", "num_speculative_tokens": k} if k else None
            llm = LLM(model=str(model_dir), accelerator=args.accelerator, dtype="bfloat16", load_format="dummy", progress=False,
                      max_model_len=args.context + 64, max_num_seqs=max(args.batches), speculative_config=spec)
            if k:
                llm.engine.proposer = FixedDrafts(k, llm.engine.max_model_len)
            for batch in args.batches:
                t = _step_time(llm, batch, args.context, args.steps, args.repeats)
                point = {"model": name, "layers": llm.engine.model_config.num_hidden_layers, "k": k, "batch": batch,
                         "context": args.context, "step_s": t, "graphs": llm.engine.runner.graphs is not None}
                out.append(point)
                print(f"[verify] {name} k={k} B={batch}: {t * 1e3:.3f} ms per step", flush=True)
            del llm
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    base = {(p["model"], p["batch"]): p["step_s"] for p in out if p["k"] == 0}
    for p in out:
        p["over_plain"] = p["step_s"] / base[(p["model"], p["batch"])]
    return out


def e2e(args) -> list[dict]:
    from deepinfer_core import LLM, SamplingParams

    prompts = snippet_prompts()
    out = []
    for k in (0, *args.e2e_k):
        t0 = time.perf_counter()
        llm = LLM(accelerator=args.accelerator, dtype=args.dtype, progress=False, max_num_seqs=max(args.e2e_batches),
                  speculative_config=_spec(k) if k else None)
        startup = time.perf_counter() - t0
        for batch in args.e2e_batches:
            group = [prompts[i % len(prompts)] for i in range(batch)]
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
            runs = []
            for _ in range(1 + args.repeats):
                sync(llm.engine.device)
                t = time.perf_counter()
                outputs = llm.generate(group, params, use_tqdm=False)
                sync(llm.engine.device)
                runs.append((time.perf_counter() - t, sum(len(c.token_ids) for o in outputs for c in o.outputs)))
            (first_s, tokens), best = runs[0], min(r[0] for r in runs[1:])
            stats = llm.engine.spec_stats
            point = {"k": k, "batch": batch, "startup_s": startup, "first_s": first_s, "repeat_s": best, "emitted_tokens": tokens,
                     "tokens_per_s_first": tokens / first_s, "tokens_per_s": tokens / best,
                     "mean_accepted_length": stats.mean_accepted_length, "graphs": llm.engine.runner.graphs is not None}
            out.append(point)
            print(f"[e2e] k={k} B={batch}: {point['tokens_per_s']:.0f} tok/s repeated ({point['tokens_per_s_first']:.0f} first call)", flush=True)
        del llm
    base = {p["batch"]: p["tokens_per_s"] for p in out if p["k"] == 0}
    for p in out:
        p["speedup"] = p["tokens_per_s"] / base[p["batch"]]
    return out


def projection(report: dict) -> list[dict]:
    """PROJECTION, not a measurement: V3 speed-up = mean accepted length (default model, greedy)
    / (measured v3-slice verify cost ratio at 1 + k + k drafts of an assumed 1/61 step each)."""
    acc = {p["k"]: p["mean_accepted_length"] for p in report.get("acceptance", []) if isinstance(p, dict) and p.get("mode") == "greedy"}
    out = []
    for p in report.get("verify", []):
        if not isinstance(p, dict) or p.get("model") != "v3-slice" or not p.get("k") or p["k"] not in acc:
            continue
        cost = p["over_plain"] + p["k"] / V3_LAYERS
        out.append({"label": "projection", "k": p["k"], "batch": p["batch"], "mean_accepted_length": acc[p["k"]],
                    "verify_over_plain": p["over_plain"], "assumed_draft_cost": p["k"] / V3_LAYERS,
                    "projected_speedup": acc[p["k"]] / cost})
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="acceptance,verify,e2e")
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    p.add_argument("--accelerator")
    p.add_argument("--dtype", default="float32", help="of the default-model parts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--context", type=int, default=512, help="verify part: prompt length")
    p.add_argument("--steps", type=int, default=32, help="verify part: decode steps timed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--verify-k", default="1,2,3,5")
    p.add_argument("--e2e-batches", default="1,8,32")
    p.add_argument("--e2e-k", default="1,2,3")
    p.add_argument("--acceptance-from", type=Path, help="a spec_decode.json whose acceptance part the projection uses "
                   "(when this run leaves that part out; acceptance does not depend on the device in float32)")
    args = p.parse_args(argv)
    for key in ("batches", "verify_k", "e2e_batches", "e2e_k"):
        setattr(args, key, [int(v) for v in getattr(args, key).split(",")])
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.model, args.layers = "default", None
    report = {"meta": metadata(args), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    path = args.out / "spec_decode.json"
    if args.acceptance_from:
        report["acceptance"] = json.loads(args.acceptance_from.read_text())["acceptance"]
        report["acceptance_source"] = str(args.acceptance_from)
    for part, fn in (("acceptance", acceptance), ("verify", verify_cost), ("e2e", e2e)):
        if part in args.parts.split(","):
            report[part] = guarded(fn, args)
            report["projection_v3"] = projection(report)
            report["meta"]["finished"] = datetime.datetime.now(datetime.UTC).isoformat()
            path.write_text(json.dumps(report, indent=1))
    for p in report.get("projection_v3", []):
        print(f"[PROJECTION v3] k={p['k']} B={p['batch']}: {p['projected_speedup']:.2f}x", flush=True)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
