"""Offline inference: a few prompts through DeepInfer, completions printed.

    python examples/offline_inference.py                      # embedded default model
    python examples/offline_inference.py --model /path/to/hf_checkpoint_dir
    DEEPINFER_HF_MODEL_DIR=/path/to/dir DEEPINFER_ACCELERATOR=cpu python examples/offline_inference.py

The embedded default model is a tiny DeepSeek-V3 trained on the Python standard library
(deepinfer_core/default_model/MODEL_CARD.md): its completions look like Python, nothing more.
Point --model at a real DeepSeek V2/V3 checkpoint for real text.
"""

import argparse

from deepinfer_core import LLM, SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
    "# Sort a list of numbers in place\n",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint dir or repo id (default: DEEPINFER_HF_MODEL_DIR or the embedded model)")
    parser.add_argument("--accelerator", default=None, help="backend: cpu, nvidia, ascend, ... (default: DEEPINFER_ACCELERATOR or auto)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0, help="engine seed: each sequence draws its own stream from it")
    args = parser.parse_args()

    llm = LLM(model=args.model, accelerator=args.accelerator, seed=args.seed)
    engine = llm.engine
    print(f"model: {llm.model_dir}  backend: {engine.backend.name} ({engine.platform.name})  dtype: {engine.dtype}")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    for out in llm.generate(PROMPTS, params):
        completion = out.outputs[0]
        print("=" * 72)
        print(f"prompt ({len(out.prompt_token_ids)} tokens): {out.prompt!r}")
        print(f"completion ({len(completion.token_ids)} tokens, {completion.finish_reason}): {completion.text!r}")


if __name__ == "__main__":
    main()
