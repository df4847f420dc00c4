"""``deepinfer conformance --e2e --check-structured-output``: structured outputs on a backend.

The embedded default model runs on the backend under each kind of constraint (a JSON schema, a
regular expression, an EBNF grammar, a list of choices, any JSON object), greedy and seeded
sampling, in one batch with an unconstrained request. Each output is then checked by code that
knows nothing of xgrammar (``json``, ``re`` and a hand-written check of the schema), so a
backend whose ``apply_token_bitmask`` or sampling lets a forbidden token through fails here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"v[0-9]\.[0-9]{1,2}\.[0-9]{1,2}"
GRAMMAR = 'root ::= call ("; " call)?\ncall ::= name "(" [0-9] ")"\nname ::= "f" | "g" | "print"'
GRAMMAR_AS_REGEX = r"(?:f|g|print)\([0-9]\)(?:; (?:f|g|print)\([0-9]\))?"
CHOICES = ["positive", "negative", "neutral"]
PROMPTS = ["Describe a programmer as JSON:\n", "Version:", "Code:", "Sentiment:", "data = json.loads("]


def _person(text: str) -> bool:
    value = json.loads(text, strict=False)  # xgrammar's strings may hold raw control characters (README)
    return (isinstance(value, dict) and set(value) == {"name", "age"} and isinstance(value["name"], str)
            and len(value["name"]) <= 12 and type(value["age"]) is int and 0 <= value["age"] <= 120)


def _json_object(text: str) -> bool:
    return isinstance(json.loads(text, strict=False), dict)


# name -> (so_args, whether an output is valid)
CHECKS: dict[str, tuple[dict, Callable[[str], bool]]] = {
    "json schema": ({"json": PERSON}, _person),
    "regex": ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text) is not None),
    "grammar": ({"grammar": GRAMMAR}, lambda text: re.fullmatch(GRAMMAR_AS_REGEX, text) is not None),
    "choice": ({"choice": CHOICES}, lambda text: text in CHOICES),
    "json object": ({"json_object": True}, _json_object),
}


@dataclass
class Outcome:
    check: str
    sampling: str
    text: str
    finish_reason: str
    valid: bool


def run(backend: str | None) -> list[Outcome]:
    """Every check, greedy and with seeded sampling, on the backend (one batch each)."""
    from deepinfer_core import LLM, SamplingParams

    llm = LLM(accelerator=backend, progress=False)
    outcomes = []
    for sampling, temperature in (("greedy", 0.0), ("sampled", 0.8)):
        # any JSON object is unbounded: greedy only, so that this small model closes it within max_tokens
        checks = {name: check for name, check in CHECKS.items() if temperature == 0 or name != "json object"}
        params = [SamplingParams(temperature=temperature, seed=i, max_tokens=96, so_args=so) for i, (so, _) in enumerate(checks.values())]
        free = SamplingParams(temperature=temperature, seed=99, max_tokens=16)
        outs = llm.generate(PROMPTS[: len(checks)] + ["free"], params + [free], use_tqdm=False)
        for (name, (_, valid)), out in zip(checks.items(), outs):
            c = out.outputs[0]
            try:
                ok = c.finish_reason == "stop" and valid(c.text)
            except ValueError:  # not JSON
                ok = False
            outcomes.append(Outcome(name, sampling, c.text, c.finish_reason, ok))
    return outcomes


def report(backend: str | None) -> int:
    """Print the checks' results; 0 when every output is valid, 1 otherwise."""
    outcomes = run(backend)
    print(f"\nstructured outputs on backend {backend or 'auto'} (the embedded default model; outputs checked without xgrammar):")
    for o in outcomes:
        print(f"  {o.check:<12} {o.sampling:<8} {'PASS' if o.valid else 'FAIL'}  [{o.finish_reason}] {o.text[:70]!r}")
    failed = [o for o in outcomes if not o.valid]
    print(f"{len(outcomes) - len(failed)}/{len(outcomes)} constrained outputs valid: {'FAIL' if failed else 'PASS'}")
    return 1 if failed else 0
