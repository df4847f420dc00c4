"""Run by test_data_parallel under torchrun: every rank creates the LLM (data_parallel_size from
WORLD_SIZE, experts sharded), calls generate with the same prompts, and writes the token ids it
got to OUT/rank{RANK}.json. Arguments: CHECKPOINT OUT PROMPTS_JSON."""

import json
import os
import sys
from pathlib import Path

from deepinfer_core import LLM, SamplingParams

if __name__ == "__main__":
    checkpoint, out, prompts = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM(checkpoint, accelerator="cpu", dtype="float32", progress=False, expert_parallel=True,
              max_num_batched_tokens=16, max_num_seqs=4)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps([o.outputs[0].token_ids for o in outputs]))
    llm.close()
