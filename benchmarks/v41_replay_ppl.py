"""The cost of DeepSeek-V4.1's SWA bounded replay on the conformance prompts: teacher-forced
perplexity and greedy agreement, on vs off, on tiny random V4.1 checkpoints.

    python -m benchmarks.v41_replay_ppl --out benchmarks/results/<run>/v41/replay_ppl.json

Teacher forcing goes through the engine's runner, not ``LLM.generate``'s prompt logprobs: a
prompt's logprobs keep every row (bounded replay skips none of them), so they cannot show the
approximation. Here the prompt is prefilled as a normal request is (rows skipped when on), then
the continuation is fed one decode step at a time and each next token's logprob is read. The
prompts are ``specs/workloads/python_snippets.jsonl`` (prompt with BOS, continuation without),
tokenised with the conformance tokenizer the tiny checkpoints carry.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

import torch


def teacher_forced(llm, prompt: list[int], continuation: list[int]) -> list[float]:
    """Logprobs of ``continuation`` after ``prompt``: one prefill, then one decode step per token."""
    from deepinfer_core.engine.scheduler import ScheduledSeq, SchedulerOutput
    from deepinfer_core.engine.sequence import Sequence
    from deepinfer_core.sampling.params import SamplingParams

    engine = llm.engine
    seq = Sequence(10**6, "teacher", 0, list(prompt), SamplingParams(max_tokens=len(continuation)), 0)
    engine.kv.allocate(seq, len(prompt))
    out = engine.runner.run(SchedulerOutput(prefills=[ScheduledSeq(seq, 0, len(prompt), samples=True)]))
    lps = []
    try:
        for i, tok in enumerate(continuation):
            lps.append(float(torch.log_softmax(out.sample_logits[0].float(), dim=-1)[tok]))
            if i == len(continuation) - 1:
                break
            seq.output_token_ids.append(tok)
            pos = seq.num_tokens - 1
            engine.kv.allocate(seq, seq.num_tokens)
            out = engine.runner.run(SchedulerOutput(decodes=[ScheduledSeq(seq, pos, 1, is_decode=True, samples=True)]))
    finally:
        engine.kv.free(seq)
    return lps


def main() -> None:
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.conformance.e2e import workloads_dir
    from tests.v41_checkpoints import write_checkpoint_v41

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()
    samples = [json.loads(line) for line in (workloads_dir() / "python_snippets.jsonl").read_text().splitlines() if line.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="deepinfer-v41-ppl-"))
    results = []
    for name in ("v41-tiny", "v41-sources"):
        path = write_checkpoint_v41(name, tmp / name)
        os.environ["DEEPINFER_SWA_BOUNDED_REPLAY"] = "1"
        llm = LLM(str(path), accelerator=args.accelerator, dtype="float32", progress=False, enable_prefix_caching=False)
        tok = llm.tokenizer
        prompts = [list(tok(s["prompt"]).input_ids) for s in samples]
        conts = [list(tok(s["continuation"], add_special_tokens=False).input_ids) for s in samples]
        row = {"config": name, "tail_tokens": llm.engine.model.tail_tokens, "prompt_tokens": [len(p) for p in prompts], "samples": {}}
        greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        gen = {}
        for on in (True, False):
            llm.engine.model.bounded_replay = on  # read per forward
            gen[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            for s, p, c in zip(samples, prompts, conts):
                lps = teacher_forced(llm, p, c)
                row["samples"].setdefault(s["id"], {})[f"ppl_{'on' if on else 'off'}"] = math.exp(-sum(lps) / len(lps))
        for s, a, b in zip(samples, gen[True], gen[False]):
            row["samples"][s["id"]]["greedy_agreement"] = sum(x == y for x, y in zip(a, b)) / len(b)
        ratios = [v["ppl_on"] / v["ppl_off"] for v in row["samples"].values()]
        row["ppl_ratio_on_over_off"] = {"min": min(ratios), "max": max(ratios), "mean": sum(ratios) / len(ratios)}
        row["greedy_agreement_mean"] = sum(v["greedy_agreement"] for v in row["samples"].values()) / len(samples)
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
