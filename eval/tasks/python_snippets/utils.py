"""The python_snippets tasks' data (local JSONL files beside this one: nothing is downloaded)
and the generation task's metrics."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _load(name: str) -> datasets.DatasetDict:
    with open(HERE / name, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_mc(**kwargs) -> datasets.DatasetDict:
    return _load("mc.jsonl")


def load_gen(**kwargs) -> datasets.DatasetDict:
    return _load("gen.jsonl")


def process_gen(doc: dict, results: list[str]) -> dict[str, float]:
    """exact_match: the completion up to the line's end is the target; prefix_match: the share of
    the target's characters the completion gets right before it first differs (partial credit)."""
    pred, target = results[0].rstrip(), doc["target"].rstrip()
    common = 0
    for a, b in zip(pred, target):
        if a != b:
            break
        common += 1
    return {"exact_match": float(pred == target), "prefix_match": common / len(target)}
