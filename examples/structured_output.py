"""Structured outputs: each kind of ``so_args`` constraint, with the output checked.

    python examples/structured_output.py                  # embedded default model
    python examples/structured_output.py --model /path/to/hf_checkpoint_dir

``SamplingParams(so_args=...)`` (also spelled ``structured_outputs=`` or ``guided_decoding=``,
as in vLLM) holds exactly one of:

* ``{"json": schema}``: a JSON schema, as a dict or as JSON text;
* ``{"regex": "..."}``: a regular expression the whole output matches;
* ``{"grammar": "root ::= ..."}``: an EBNF grammar in xgrammar's GBNF dialect;
* ``{"choice": [...]}``: exactly one of the strings;
* ``{"json_object": True}``: any JSON object.

The embedded default model was trained on Python code and knows no JSON. Its values are nonsense,
but their form is what the constraint allows. An invalid constraint is a ValueError for that call,
and the engine goes on serving.
"""

import argparse
import json
import re

from deepinfer_core import LLM, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "languages": {"type": "array", "items": {"enum": ["python", "c", "rust"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json schema": {"json": PERSON},
    "regex": {"regex": r"v[0-9]\.[0-9]{1,2}\.[0-9]{1,2}"},
    "grammar": {"grammar": 'root ::= call ("; " call)? ("; " call)?\ncall ::= name "(" [0-9] ")"\nname ::= "f" | "g" | "print"'},
    "choice": {"choice": ["positive", "negative", "neutral"]},
    "json object": {"json_object": True},
}


def check(kind: str, so: dict, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(so["regex"], text) is not None
    if kind == "choice":
        return text in so["choice"]
    if kind == "grammar":
        return re.fullmatch(r"(?:f|g|print)\([0-9]\)(?:; (?:f|g|print)\([0-9]\)){0,2}", text) is not None
    try:
        value = json.loads(text, strict=False)  # strict=False: see the README on control characters
    except ValueError:
        return False
    if kind == "json object":
        return isinstance(value, dict)
    return set(value) == {"name", "age", "languages"} and 0 <= value["age"] <= 130


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint dir or repo id (default: the embedded model)")
    parser.add_argument("--accelerator", default=None)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()

    llm = LLM(model=args.model, accelerator=args.accelerator)
    prompts = ["Describe a programmer as JSON:\n", "Version:", "Code:", "Sentiment:", "data = json.loads("]
    # any object is unbounded: greedy, so that this small model closes it
    params = [SamplingParams(temperature=0 if kind == "json object" else args.temperature, seed=i, max_tokens=96, so_args=so)
              for i, (kind, so) in enumerate(CONSTRAINTS.items())]
    # one batch: the constraints run side by side, each sequence with its own grammar state
    for (kind, so), out in zip(CONSTRAINTS.items(), llm.generate(prompts, params, use_tqdm=False)):
        c = out.outputs[0]
        print(f"{kind:>12}: {c.text!r}  [{c.finish_reason}, {'valid' if check(kind, so, c.text) else 'INVALID'}]")
    try:
        llm.generate(["x"], SamplingParams(so_args={"regex": "(unclosed"}), use_tqdm=False)
    except ValueError as e:
        print(f"invalid constraint -> ValueError: {str(e)[:120]}")


if __name__ == "__main__":
    main()
