"""DSpark speculative decoding (DeepSeek-V4.1) against plain decoding, on the CPU in seconds.

    python examples/dspark.py                     # a tiny random V4.1 checkpoint, built here
    python examples/dspark.py --model /path/to/v41_checkpoint --accelerator nvidia --k 3

DSpark drafts ``k`` tokens per step from the target's own hidden states (its ``dspark``
stages) and the target verifies them in one forward. This prints the measured acceptance by
draft position, the mean tokens a verification step emits, and tokens/s with and without it.
Greedy, the tokens are plain decoding's either way (checked here). On the tiny random checkpoint
the drafter was never trained, so acceptance is near zero; on a real V4.1 checkpoint the
drafts are the model's. CPU timings of a tiny model are noisy (other work on the machine counts). Without --model the example needs a checkout of
the repository (it builds the checkpoint with tests/v41_checkpoints.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from deepinfer_core import LLM, SamplingParams


def tiny_checkpoint(out: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's tests/ package
    from tests.v41_checkpoints import write_checkpoint_v41

    return write_checkpoint_v41("v41-dspark", out)


def run(model: str, accelerator: str | None, prompts: list[list[int]], params: SamplingParams, spec: dict | None):
    llm = LLM(model, accelerator=accelerator, dtype="float32", progress=False, max_num_seqs=len(prompts),
              speculative_config=spec)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    stats = None
    for o in outs:
        s = o.metrics.speculative if o.metrics is not None else None
        if s is not None:
            stats = s if stats is None else stats.merge(s)
    return outs, generated / seconds, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a V4.1 checkpoint directory (default: a tiny random one built here)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--k", type=int, default=3, help="draft tokens per step (at most the checkpoint's dspark_block_size)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_checkpoint(Path(tmp) / "v41-dspark"))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 2000, (int(n),), generator=g).tolist() for n in torch.randint(16, 64, (args.prompts,), generator=g)]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        plain, plain_tps, _ = run(model, args.accelerator, prompts, params, None)
        spec, spec_tps, stats = run(model, args.accelerator, prompts, params, {"method": "dspark", "num_speculative_tokens": args.k})

    same = [p.outputs[0].token_ids == s.outputs[0].token_ids for p, s in zip(plain, spec)]
    print(f"plain decoding : {plain_tps:8.1f} tokens/s")
    print(f"DSpark (k={args.k})   : {spec_tps:8.1f} tokens/s ({spec_tps / plain_tps:.2f}x)")
    if stats is not None and stats.num_draft_tokens:
        by_position = ", ".join(f"{i + 1}: {a:.2f}" for i, a in enumerate(stats.acceptance_by_position))
        print(f"acceptance by draft position: {by_position}")
        print(f"acceptance {stats.acceptance_rate:.2f} of {stats.num_draft_tokens} drafts; "
              f"{stats.mean_accepted_length:.2f} tokens per verification step")
    print(f"greedy tokens equal to plain decoding's: {sum(same)}/{len(same)} prompts")
    if not all(same):
        raise SystemExit("DSpark changed greedy tokens")


if __name__ == "__main__":
    main()
