"""DeepSeek-V4.1-Flash on a GPU: parity with the CPU reference, the slice through LLM.generate,
a decode-step profile, and SWA bounded replay's gain (prefill time) and cost (outputs).

    python -m benchmarks.v41_slice --out benchmarks/results/<run>/v41

1. ``parity``: tiny random checkpoints (tests/v41_checkpoints.py, original layout, FP8 32x32 +
   MXFP4): greedy tokens and logprobs of nvidia float32 / bf16 against the CPU reference in
   float32, bounded replay off (exact) and on.
2. ``generate`` / ``profile``: benchmarks.models' ``v41-flash-slice`` (dummy weights, bf16) as
   benchmarks.v4_slice measures V4 (first call and repeat; op-by-op decode step).
3. ``replay``: one prompt of 4k / 32k tokens prefilled (max_tokens=1, no prefix caching) with
   bounded replay on and off, first call and repeat; and, on the tiny checkpoints, the cost:
   greedy agreement, |logprob| differences and the perplexity of each run's own greedy
   continuation, on vs off.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.models import write_config
from benchmarks.v4_slice import _sync, build, generate_points, profile_decode


def _chosen(out) -> list[float]:
    c = out.outputs[0]
    return [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]


def _prompts(n_list, vocab=2000, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in n_list]


def _llm(path, acc, dtype, replay: bool, **kw):
    import os

    from deepinfer_core import LLM

    os.environ["DEEPINFER_SWA_BOUNDED_REPLAY"] = "1" if replay else "0"
    return LLM(str(path), accelerator=acc, dtype=dtype, progress=False, **{"max_num_seqs": 4, **kw})


def parity(tmp: Path) -> list[dict]:
    from deepinfer_core import SamplingParams
    from tests.v41_checkpoints import write_checkpoint_v41

    rows = []
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True)
    for name in ("v41-tiny", "v41-sources"):
        path = write_checkpoint_v41(name, tmp / name)
        prompts = _prompts((150, 61, 9))
        for replay in (False, True):
            runs = {}
            for acc, dtype in (("cpu", "float32"), ("nvidia", "float32"), ("nvidia", "bfloat16")):
                o = _llm(path, acc, dtype, replay, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
                runs[f"{acc}-{dtype}"] = o
            ref = runs["cpu-float32"]
            row = {"config": name, "bounded_replay": replay}
            for k, o in runs.items():
                row[k] = {"tokens_equal_cpu": [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(o, ref)],
                          "max_logprob_diff_vs_cpu": max(abs(x - y) for a, b in zip(o, ref) for x, y in zip(_chosen(a), _chosen(b)))}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def replay_cost(tmp: Path, acc: str) -> list[dict]:
    from deepinfer_core import SamplingParams

    from tests.v41_checkpoints import write_checkpoint_v41

    rows = []
    greedy = SamplingParams(temperature=0, max_tokens=32, logprobs=0, ignore_eos=True)
    for name in ("v41-tiny", "v41-sources"):
        path = tmp / name
        if not path.exists():
            write_checkpoint_v41(name, path)
        prompts = _prompts((300, 120, 40, 12), seed=7)
        outs = {r: _llm(path, acc, "float32", r, enable_prefix_caching=False).generate(prompts, greedy, use_tqdm=False) for r in (False, True)}
        same = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs[True], outs[False])]
        agree = [sum(x == y for x, y in zip(a.outputs[0].token_ids, b.outputs[0].token_ids)) / 32 for a, b in zip(outs[True], outs[False])]
        first = [abs(_chosen(a)[0] - _chosen(b)[0]) for a, b in zip(outs[True], outs[False])]
        # perplexity of each run's own greedy continuation (no teacher forcing through LLM.generate:
        # prompt logprobs keep every row, so they would not see the approximation)
        ppl = {r: [math.exp(-sum(_chosen(o)) / len(_chosen(o))) for o in outs[r]] for r in (False, True)}
        mean_diff = [sum(abs(x - y) for x, y in zip(_chosen(a), _chosen(b))) / 32 for a, b in zip(outs[True], outs[False])]
        row = {"config": name, "device": acc, "prompt_lens": [len(p) for p in prompts], "greedy_equal": same,
               "greedy_token_agreement": agree, "first_token_logprob_abs_diff": first,
               "mean_logprob_abs_diff": mean_diff, "own_greedy_perplexity_off": ppl[False], "own_greedy_perplexity_on": ppl[True]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def prefill_gain(llm, lengths) -> list[dict]:
    from deepinfer_core import SamplingParams

    model = llm.engine.model
    vocab = 2000
    rows = []
    for n in lengths:
        prompt = _prompts((n,), vocab=vocab, seed=n)[0]
        for replay in (True, False):
            model.bounded_replay = replay  # read per forward (prefix caching is off here)
            for call in ("first", "repeat"):
                _sync()
                t0 = time.perf_counter()
                llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
                _sync()
                dt = time.perf_counter() - t0
                rows.append({"prompt_len": n, "bounded_replay": replay, "call": call, "seconds": dt, "prefill_tok_per_s": n / dt})
                print(f"prefill {n} tokens, bounded replay {'on' if replay else 'off'}, {call}: {dt:.2f} s ({n / dt:.0f} tok/s)", flush=True)
    model.bounded_replay = True
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", default="nvidia")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip", action="append", default=[], help="parity / generate / profile / replay")
    parser.add_argument("--lengths", default="4096,32768")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="deepinfer-v41-"))
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}

    def save():
        (args.out / "v41.json").write_text(json.dumps(result, indent=1))

    if "parity" not in args.skip:
        result["parity"] = parity(tmp)
        save()
    if "replay" not in args.skip:
        result["replay_cost"] = replay_cost(tmp, args.accelerator)
        save()
    lengths = [int(x) for x in args.lengths.split(",")]
    if not {"generate", "profile", "prefill"} <= set(args.skip):
        # no prefix caching: a repeated prompt is computed again (the prefill timing's repeat call)
        llm, load_s = build(32, max(lengths) + 256, args.accelerator, write_config("v41-flash-slice", tmp), enable_prefix_caching=False)
        result["load_seconds"] = load_s
        if "prefill" not in args.skip:
            result["prefill"] = prefill_gain(llm, lengths)
            save()
        if "generate" not in args.skip:
            result["generate"] = generate_points(llm, [1, 8, 32], 1024, 32)
            save()
        if "profile" not in args.skip:
            result["profile"] = [profile_decode(llm, b, c, 8) for b, c in ((1, 2048), (8, 2048), (32, 2048))]
            save()
    save()


if __name__ == "__main__":
    main()
