"""eval/run.py end to end: ``deepinfer serve`` on the default model (CPU, float32,
batch-invariant), lm-eval's local-completions on the local python_snippets tasks, no network.
The metrics come back as numbers in range; the generation task's outputs are ``LLM.generate``'s
greedy outputs for the same prompts, and the loglikelihoods lm-eval recorded are sums of the
engine's own prompt logprobs (float32) over the continuation's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is the eval extra (pip install -e .[eval]; ./build.sh installs it)")
for _module in ("aiohttp", "tenacity"):  # local-completions' own needs (lm-eval[api])
    pytest.importorskip(_module, reason="lm-eval's API models need lm-eval[api] (pip install -e .[eval])")

from deepinfer_core import LLM, SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LIMIT = 12  # every item of each task (a dozen each)
MAX_GEN_TOKS = 16  # the generation task's own bound too
CHECKED_ITEMS = 3  # multiple-choice items (4 choices each) scored again offline: prompt logprobs cost CPU time


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "results.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",  # the local task needs no network
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, str(REPO / "eval" / "run.py"), "--tasks", "python_snippets", "--accelerator", "cpu",
           "--dtype", "float32", "--serve-arg=--batch-invariant", "--limit", str(LIMIT), "--max-gen-toks", str(MAX_GEN_TOKS),
           "--log-samples", "--output", str(out), "--startup-timeout", "180"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "python_snippets_mc" in proc.stdout and "|" in proc.stdout  # lm-eval's table was printed
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def offline():
    """The engine offline as eval/run.py serves it (float32, batch-invariant)."""
    return LLM(accelerator="cpu", dtype="float32", progress=False, max_num_seqs=8, batch_invariant=True)


def test_the_metrics_are_numbers_in_range(results):
    want = {"python_snippets_mc": ("acc", "acc_norm"), "python_snippets_gen": ("exact_match", "prefix_match")}
    for task, metrics in want.items():
        got = results["results"][task]
        for m in metrics:
            value = got[f"{m},none"]
            assert isinstance(value, float) and 0.0 <= value <= 1.0, (task, m, value)
        assert results["n-samples"][task]["effective"] == LIMIT
    assert results["results"]["python_snippets_mc"]["acc,none"] > 0.25  # better than chance on held-out Python


def test_the_generation_tasks_outputs_are_llm_generates_greedy_outputs(results, offline):
    samples = sorted(results["samples"]["python_snippets_gen"], key=lambda s: s["doc_id"])
    prompts = [s["arguments"][0][0] for s in samples]
    assert all(s["arguments"][0][1]["until"] == ["\n"] for s in samples)
    ref = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_GEN_TOKS, stop=["\n"]), use_tqdm=False)
    got = [s["resps"][0][0] for s in samples]
    assert got == [r.outputs[0].text for r in ref]
    assert sum(bool(g) for g in got) >= len(got) // 2  # not a comparison of empty strings


def test_lm_evals_loglikelihoods_are_the_engines_prompt_logprobs(results, offline):
    samples = sorted(results["samples"]["python_snippets_mc"], key=lambda s: s["doc_id"])[:CHECKED_ITEMS]
    pairs = [tuple(arg) for s in samples for arg in s["arguments"]]  # (context, continuation) per choice
    recorded = [resp[0] for s in samples for resp in s["resps"]]  # [loglikelihood, is_greedy] per choice
    tok = offline.get_tokenizer()
    assert all(c == c.rstrip() for c, _ in pairs)  # lm-eval moves a context's trailing spaces; none here
    # lm-eval's encoding for a causal model: the whole text and the context, each with BOS (add_bos_token)
    ctx = [tok.encode(c, add_special_tokens=True) for c, _ in pairs]
    whole = [tok.encode(c + cont, add_special_tokens=True) for c, cont in pairs]
    assert all(w[:len(c)] == c for c, w in zip(ctx, whole)), "a choice merges with its context into one token: move the split"
    ref = offline.generate([{"prompt_token_ids": w} for w in whole],
                           SamplingParams(prompt_logprobs=1, max_tokens=1, temperature=0), use_tqdm=False)
    for (ll, greedy), c, w, r in zip(recorded, ctx, whole, ref, strict=True):
        want = [r.prompt_logprobs[i][w[i]] for i in range(len(c), len(w))]
        assert ll == sum(want)  # the same float32 values, summed in the same order
        assert greedy == all(lp.rank == 1 for lp in want)
    assert len({ll for ll, _ in recorded}) > len(recorded) // 2  # distinct scores: the check can tell them apart
