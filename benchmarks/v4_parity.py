"""DeepSeek-V4 on the NVIDIA backend against the CPU reference and transformers, on tiny random
checkpoints (tests/hf_checkpoints_v4.py): greedy tokens and logprobs, nvidia in float32 and in
bf16, beside transformers' own bf16-vs-float32 drift. Run from the repository root on a GPU:

    OUT=results/ python -m benchmarks.v4_parity
"""
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from deepinfer_core import LLM, SamplingParams
from tests.hf_checkpoints_v4 import hf_greedy_goldens, hf_logprobs, load_golden_v4, write_checkpoint_v4


def main() -> None:
    out = Path(os.environ.get("OUT", "/tmp/out")); out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, quant in [("v4_flash_like", None), ("v4_pro_like", None), ("v4_flash_like", "fp8+fp4")]:
        d = Path(tempfile.mkdtemp()) / name
        golden = write_checkpoint_v4(name, d, quant=quant, block=(32, 32))
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(2, 160, (n,), generator=g).tolist() for n in (150, 61, 9)]
        params = SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True)
        teacher = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        runs = {}
        for acc, dtype in [("cpu", "float32"), ("nvidia", "float32"), ("nvidia", "bfloat16")]:
            t0 = time.perf_counter()
            llm = LLM(str(d), accelerator=acc, dtype=dtype, max_num_seqs=4, progress=False)
            o = llm.generate(prompts, params, use_tqdm=False)
            pl = llm.generate([prompts[0]], teacher, use_tqdm=False)[0].prompt_logprobs
            runs[f"{acc}-{dtype}"] = {"tokens": [x.outputs[0].token_ids for x in o],
                                      "logprobs": [[lp[t] for lp, t in zip(x.outputs[0].logprobs, x.outputs[0].token_ids)] for x in o],
                                      "teacher": [pl[i][prompts[0][i]] for i in range(1, len(prompts[0]))],
                                      "seconds": time.perf_counter() - t0, "fp8_kept": llm.engine.model.keep_fp8}
            del llm
        hf = [hf_greedy_goldens(golden, p, 24)[0] for p in prompts]
        idx = torch.arange(len(prompts[0]) - 1), torch.tensor(prompts[0][1:])
        hf32 = hf_logprobs(golden, prompts[0])[idx]
        hf16 = hf_logprobs(load_golden_v4(d, dtype=torch.bfloat16), prompts[0])[idx]
        hf16_tokens = [hf_greedy_goldens(load_golden_v4(d, dtype=torch.bfloat16), p, 24)[0] for p in prompts]
        ref = runs["cpu-float32"]
        row = {"config": name, "quant": quant, "hf_fp32_tokens_equal_cpu": [list(a) == list(b) for a, b in zip(hf, ref["tokens"])],
               "hf_bf16_tokens_equal_hf_fp32": [list(a) == list(b) for a, b in zip(hf16_tokens, hf)],
               "hf_bf16_vs_hf_fp32_teacher_logprob_diff": {"max": float((hf16 - hf32).abs().max()), "mean": float((hf16 - hf32).abs().mean())}}
        for k, r in runs.items():
            t = torch.tensor(r["teacher"]) - torch.tensor(ref["teacher"])
            row[k] = {"tokens_equal_cpu": [a == b for a, b in zip(r["tokens"], ref["tokens"])],
                      "max_greedy_logprob_diff_vs_cpu": max(abs(a - b) for la, lb in zip(r["logprobs"], ref["logprobs"]) for a, b in zip(la, lb)),
                      "teacher_logprob_diff_vs_cpu": {"max": float(t.abs().max()), "mean": float(t.abs().mean())},
                      "fp8_kept": r["fp8_kept"], "seconds": r["seconds"]}
        print(json.dumps(row), flush=True)
        results.append(row)
    (out / "v4_parity.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
