"""A/B of two source trees through LLM.generate, on a GPU: the same timing in each, run in turns.

    python benchmarks/generate_ab.py TREE OUT.json

TREE is a checkout (e.g. `git archive COMMIT | tar -x -C old`) whose deepinfer_core and benchmarks
are imported first; the NVIDIA plugin comes from the installed one. V2-Lite shape, random
weights, greedy, 256-token prompts, 64 output tokens, at B=1 and B=32: the first generate of the
process (graph capture at that batch size) and the median of three repeats. Alternate TREEs over
several rounds: run-to-run spread between processes is 10-20%. Writes OUT.json.
"""
import json
import statistics
import sys
import tempfile
import time

sys.path.insert(0, sys.argv[1])  # the tree under test, before the installed one

import torch  # noqa: E402

import deepinfer_core  # noqa: E402
from benchmarks.models import write_config  # noqa: E402
from deepinfer_core import LLM, SamplingParams  # noqa: E402

d = write_config("v2-lite", tempfile.mkdtemp())
llm = LLM(model=d, load_format="dummy", accelerator="nvidia", max_model_len=4096, max_num_seqs=64, progress=False)
g = torch.Generator().manual_seed(0)
res = {"tree": deepinfer_core.__file__}
for B in (1, 32):
    prompts = [torch.randint(0, 100000, (256,), generator=g).tolist() for _ in range(B)]
    p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    times = []
    for i in range(4):
        torch.cuda.synchronize(); t = time.perf_counter()
        out = llm.generate(prompts, p, use_tqdm=False)
        torch.cuda.synchronize(); times.append(time.perf_counter() - t)
    toks = sum(len(o.outputs[0].token_ids) for o in out)
    res[f"B{B}"] = {"first_s": times[0], "repeat_s_median": statistics.median(times[1:]), "repeats": times[1:],
                    "tokens": toks, "repeat_tok_per_s": toks / statistics.median(times[1:])}
    print(B, res[f"B{B}"], flush=True)
json.dump(res, open(sys.argv[2], "w"), indent=1)
