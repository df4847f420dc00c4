"""SWA bounded replay (DeepSeek-V4.1, section 4.4 of the architecture notes) on and off: a long
prompt prefilled both ways, on the CPU in seconds.

    python examples/swa_replay.py                     # a tiny random V4.1 checkpoint, built here
    python examples/swa_replay.py --model /path/to/v41_checkpoint --accelerator nvidia --prompt-tokens 32768

With bounded replay on (the default; ``DEEPINFER_SWA_BOUNDED_REPLAY=0`` turns it off), a
prefill runs the layers from the last KV source on only over each sequence's newest
``sliding_window`` tokens: faster on long prompts, and approximate. This prints the prefill time
each way and the outputs' difference: greedy tokens that agree, and the largest difference of
their logprobs. Prefix caching is off, so both runs prefill the whole prompt. Without --model the
example needs a checkout of the repository (it builds the checkpoint with tests/v41_checkpoints.py).
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

    return write_checkpoint_v41("v41-tiny", out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a V4.1 checkpoint directory (default: a tiny random one built here)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_checkpoint(Path(tmp) / "v41-tiny"))
        llm = LLM(model, accelerator=args.accelerator, dtype="float32", progress=False, enable_prefix_caching=False)
    prompt = torch.randint(3, 2000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    prefill = SamplingParams(max_tokens=1, temperature=0)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    llm.generate([prompt[:64]], prefill, use_tqdm=False)  # warm-up
    results = {}
    for on in (True, False):
        llm.engine.model.bounded_replay = on  # read at each forward
        seconds = []
        for _ in range(2):  # the first call of a shape may compile kernels: the faster of two
            start = time.perf_counter()
            llm.generate([prompt], prefill, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
        seconds = min(seconds)
        (c,) = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs
        results[on] = (seconds, c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids)])
    print(f"prompt of {len(prompt)} tokens, sliding window {llm.engine.model_config.sliding_window}")
    for on in (True, False):
        print(f"bounded replay {'on ' if on else 'off'}: prefill {results[on][0] * 1000:8.1f} ms")
    (_, on_ids, on_lps), (_, off_ids, off_lps) = results[True], results[False]
    agree = sum(a == b for a, b in zip(on_ids, off_ids))
    first = next((i for i, (a, b) in enumerate(zip(on_ids, off_ids)) if a != b), None)
    # logprobs compare while the two runs' tokens still agree (after that they score different tokens)
    diff = max((abs(a - b) for a, b in zip(on_lps[:first], off_lps[:first])), default=0.0)
    print(f"speed-up {results[False][0] / results[True][0]:.2f}x; greedy tokens agreeing: {agree}/{len(off_ids)}"
          f"{'' if first is None else f' (first difference at token {first})'}; "
          f"largest |logprob| difference before it: {diff:.3g}")


if __name__ == "__main__":
    main()
