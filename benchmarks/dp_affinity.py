"""Data-parallel request placement on a multi-turn chat workload: round robin, least queued work,
and least queued work with prefix affinity (``DEEPINFER_DP_POLICY``), through
``LLM(data_parallel_size=N)``.

    python -m benchmarks.dp_affinity --out DIR [--accelerator cpu] [--conversations 16] [--turns 6]

The workload: ``--conversations`` chats, each opening with the same ``--system-tokens`` system
prompt and its own first user turn. Each round sends every conversation's whole history plus a
new user turn (``--turn-tokens`` random token ids, varying by up to half), all rounds' requests
in one ``generate`` call each, in a shuffled order (requests arrive interleaved, not in
conversation order); greedy replies of ``--reply-tokens`` tokens are appended to the histories.
Token ids are random (no tokenizer); the model is the tiny default one unless ``--model``.

Reported per policy: prefix-cache hit tokens (``RequestOutput.num_cached_tokens`` summed), prompt
tokens computed (prompt tokens minus hits), every rank's share of the requests and of their cost
(prompt + max_tokens, as rank 0 weighs them), the reusable tokens (the full blocks of each
request's own conversation history already computed somewhere: the most a placement could hit,
not counting the system prompt shared across conversations), and the wall time of the rounds (LLM start-up not
counted). Writes dp_affinity.json under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from benchmarks.generate import metadata

POLICIES = ("round_robin", "least_load", "affinity")


def workload(args) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and every conversation's user turns (token ids)."""
    rng = random.Random(args.seed)
    draw = lambda n: [rng.randrange(3, args.vocab) for _ in range(n)]  # ids past the special ones
    turns = [[draw(rng.randint(args.turn_tokens // 2, args.turn_tokens)) for _ in range(args.turns)]
             for _ in range(args.conversations)]
    return draw(args.system_tokens), turns


def run_policy(policy: str, args, system: list[int], turns: list[list[list[int]]]) -> dict:
    from deepinfer_core import LLM, SamplingParams

    os.environ["DEEPINFER_DP_POLICY"] = policy  # read by rank 0's Router when the group starts
    llm = LLM(args.model, accelerator=args.accelerator, dtype=args.dtype, data_parallel_size=args.dp, progress=False,
              **({"num_kv_blocks": args.kv_blocks} if args.kv_blocks else {}))
    try:
        router = llm.parallel.router
        assert router.policy == policy, (router.policy, policy)
        placed: list[tuple[int, int]] = []  # (rank, cost) of every request
        route = router.route

        def recording(work, loads, free):
            route(work, loads, free)
            placed.extend((w.rank, w.cost) for w in work)

        router.route = recording
        params = SamplingParams(temperature=0, max_tokens=args.reply_tokens, ignore_eos=True)
        rng = random.Random(args.seed + 1)  # the same arrival orders for every policy
        history = [list(system) for _ in turns]
        computed = [0] * len(turns)  # tokens of each conversation's history some rank computed (its last token never is)
        bs = llm.engine.kv.block_size
        prompt_tokens = cached = reusable = 0
        per_round = []
        start = time.perf_counter()
        for t in range(args.turns):
            order = list(range(len(turns)))
            rng.shuffle(order)
            prompts = [history[c] + turns[c][t] for c in order]
            outs = llm.generate(prompts, params, use_tqdm=False)
            hit = sum(o.num_cached_tokens or 0 for o in outs)
            total = sum(len(p) for p in prompts)
            # the most any placement could reuse: the full blocks of the conversation's own history
            best = sum(min(computed[c] // bs, (len(p) - 1) // bs) * bs for c, p in zip(order, prompts))
            per_round.append({"round": t, "prompt_tokens": total, "cached_tokens": hit, "reusable_tokens": best})
            prompt_tokens, cached, reusable = prompt_tokens + total, cached + hit, reusable + best
            for c, prompt, out in zip(order, prompts, outs):
                history[c] = prompt + list(out.outputs[0].token_ids)
                computed[c] = len(history[c]) - 1
        wall = time.perf_counter() - start
        ranks = range(args.dp)
        return {"policy": policy, "wall_s": round(wall, 3), "prompt_tokens": prompt_tokens, "cached_tokens": cached,
                "prefill_tokens_computed": prompt_tokens - cached, "reusable_tokens": reusable,
                "hit_rate": round(cached / prompt_tokens, 4) if prompt_tokens else 0.0,
                "requests_per_rank": [sum(1 for r, _ in placed if r == k) for k in ranks],
                "cost_per_rank": [sum(c for r, c in placed if r == k) for k in ranks],
                "rounds": per_round}
    finally:
        llm.close()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the tiny default model)")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--dp", type=int, default=2, help="data_parallel_size")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=64)
    p.add_argument("--turn-tokens", type=int, default=64)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per rank (default: the engine's sizing)")
    p.add_argument("--vocab", type=int, default=4096, help="token ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    system, turns = workload(args)
    results = []
    for policy in args.policies.split(","):
        r = run_policy(policy, args, system, turns)
        results.append(r)
        print(f"{policy:>12}: cached {r['cached_tokens']:>6} of {r['prompt_tokens']} prompt tokens ({r['hit_rate']:.1%}; "
              f"{r['reusable_tokens']} reusable), "
              f"prefill computed {r['prefill_tokens_computed']:>6}, requests per rank {r['requests_per_rank']}, "
              f"cost per rank {r['cost_per_rank']}, wall {r['wall_s']:.2f} s", flush=True)
    report = {"meta": metadata(args), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "dp_affinity.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
