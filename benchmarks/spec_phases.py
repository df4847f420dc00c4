"""Where a speculative decode step's time goes, through ``LLM.generate``: the engine's phases
(target launch, token wait, MTP catch-up and chain, their prepares and graph replays, the
scheduler) timed by wrapping the methods, with MTP off and on.

Two passes per point: ``host`` times each phase as the host sees it (launches return early;
a phase that waits for the GPU shows the wait), ``synced`` synchronizes the device around each
phase so that it includes its own GPU work. Phases nest (``step`` holds the rest), so the
columns do not add up. Prints a table per point and writes ``spec_phases.json`` under ``--out``.

    python -m benchmarks.spec_phases --accelerator nvidia --k 0,1,3 --batches 1,32 --out results/
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.generate import metadata, sync
from benchmarks.spec_decode import _spec, snippet_prompts

# label -> (attribute path from the engine, method name); the class-level entry is SampledBatch.resolve
PHASES = {
    "step": ("", "step"),
    "launch": ("", "_launch"),
    "target run": ("runner", "run"),
    "prepare (all)": ("runner", "prepare"),
    "token wait": (None, "resolve"),
    "resolve": ("", "_resolve"),
    "scheduler.schedule": ("scheduler", "schedule"),
    "scheduler.update": ("scheduler", "update"),
    "mtp observe": ("proposer", "observe"),
    "mtp propose": ("proposer", "propose"),
    "mtp forward": ("proposer", "_forward"),
    "mtp sample": ("proposer", "_sample"),
    "target replay": ("runner.graphs", "replay"),
    "mtp replay": ("proposer.graphs", "replay"),
}


def _owner(engine, path: str | None):
    if path is None:
        from deepinfer_core.sampling.sampler import SampledBatch
        return SampledBatch
    obj = engine
    for name in filter(None, path.split(".")):
        obj = getattr(obj, name, None)
    return obj


def timed_phases(engine, synced: bool):
    """Wrap the phases' methods; return (totals, counts, undo)."""
    totals, counts, undo = defaultdict(float), defaultdict(int), []
    device = engine.device
    for label, (path, name) in PHASES.items():
        owner = _owner(engine, path)
        if owner is None or not hasattr(owner, name):
            continue
        original = getattr(owner, name)

        def wrapper(*a, _original=original, _label=label, **kw):
            if synced:
                sync(device)
            t = time.perf_counter()
            try:
                return _original(*a, **kw)
            finally:
                if synced:
                    sync(device)
                totals[_label] += time.perf_counter() - t
                counts[_label] += 1

        setattr(owner, name, wrapper)
        undo.append((owner, name, original, path is None))
    return totals, counts, undo


def restore(undo) -> None:
    for owner, name, original, is_class in reversed(undo):
        if is_class:
            setattr(owner, name, original)
        else:
            delattr(owner, name)  # the instance attribute shadowed the bound method


def run(args) -> list[dict]:
    from deepinfer_core import LLM, SamplingParams

    prompts = snippet_prompts()
    out = []
    for k in args.k:
        llm = LLM(accelerator=args.accelerator, dtype=args.dtype, progress=False, max_num_seqs=max(args.batches),
                  speculative_config=_spec(k) if k else None)
        engine = llm.engine
        for batch in args.batches:
            group = [prompts[i % len(prompts)] for i in range(batch)]
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
            llm.generate(group, params, use_tqdm=False)  # warm: graphs of this size
            for mode in args.modes:
                totals, counts, undo = timed_phases(engine, synced=mode == "synced")
                sync(engine.device)
                t = time.perf_counter()
                try:
                    outputs = llm.generate(group, params, use_tqdm=False)
                finally:
                    sync(engine.device)
                    wall = time.perf_counter() - t
                    restore(undo)
                tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
                steps = max(counts["step"], 1)
                point = {"k": k, "batch": batch, "mode": mode, "wall_s": wall, "emitted_tokens": tokens, "steps": counts["step"],
                         "ms_per_step": {p: 1e3 * v / steps for p, v in totals.items()},
                         "calls_per_step": {p: c / steps for p, c in counts.items()}}
                out.append(point)
                print(f"[phases] k={k} B={batch} {mode}: {tokens / wall:.0f} tok/s, {counts['step']} steps, "
                      f"{1e3 * wall / steps:.2f} ms/step", flush=True)
                for p in PHASES:
                    if p in totals:
                        print(f"    {p:<20} {point['ms_per_step'][p]:8.3f} ms/step  x{point['calls_per_step'][p]:.2f}", flush=True)
        del llm, engine
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--accelerator")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--k", default="0,1,3", help="MTP draft lengths (0: off)")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--modes", default="host,synced", help="passes per point, in order: host, synced")
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    args.k = [int(v) for v in args.k.split(",")]
    args.batches = [int(v) for v in args.batches.split(",")]
    args.model, args.layers = "default", None
    report = {"meta": metadata(args), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "phases": run(args)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "spec_phases.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
