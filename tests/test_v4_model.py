"""DeepSeek-V4 through LLM.generate on the reference backend against transformers'
DeepseekV4ForCausalLM, on tiny random checkpoints it wrote (tests/hf_checkpoints_v4.py), float32.

Goldens are transformers' full, uncached forwards; ours run the engine: chunked prefill over a
sliding-window ring and compressed paged groups, then incremental decode.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.kv_cache import KVCache, KVCacheManager
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.engine.scheduler import ScheduledSeq, SchedulerOutput
from deepinfer_core.engine.sequence import Sequence
from tests.hf_checkpoints_v4 import PROMPT_LEN_V4, hf_greedy_goldens, hf_logprobs, hf_mtp_logits, random_prompt, write_checkpoint_v4

ATOL = 1e-4
NEW_TOKENS = 10
CASES = [("v4_flash_like", None), ("v4_pro_like", None), ("v4_swa_nohash", None), ("v4_legacy_ratios", None),
         ("v4_flash_like", "fp8"), ("v4_flash_like", "fp8+fp4")]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (path, HF golden), written once per module."""
    made = {}

    def get(name: str, quant: str | None = None):
        key = (name, quant)
        if key not in made:
            path = tmp_path_factory.mktemp(f"{name}-{quant or 'fp32'}".replace("+", "-"))
            made[key] = (path, write_checkpoint_v4(name, path, quant=quant))
        return made[key]

    return get


def _prompts(name: str) -> list[list[int]]:
    long = PROMPT_LEN_V4[name]
    return [random_prompt(long, seed=1), random_prompt(long // 2 + 3, seed=2), random_prompt(5, seed=3)]


def _llm(path, **kwargs) -> LLM:
    return LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False, **{"max_num_seqs": 4, **kwargs})


def _chosen_logprobs(completion) -> list[float]:
    return [lp[t] for lp, t in zip(completion.logprobs, completion.token_ids)]


@pytest.mark.parametrize("name,quant", CASES)
def test_greedy_tokens_and_logprobs_match_transformers(checkpoints, name, quant):
    path, golden = checkpoints(name, quant)
    prompts = _prompts(name)
    outs = _llm(path).generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens, chosen, _ = hf_greedy_goldens(golden, prompt, NEW_TOKENS)
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        assert torch.allclose(torch.tensor(_chosen_logprobs(completion)), chosen, atol=ATOL)
        assert len(set(tokens)) > 2  # the goldens are not degenerate


@pytest.mark.parametrize("chunk", [None, 7, 13, 20])
def test_chunked_prefill_splitting_windows_and_blocks_equals_transformers(checkpoints, chunk):
    """Prompt logprobs of one long prompt computed in chunks that split compression blocks (4 and
    8 tokens) and windows (8 tokens) equal transformers' teacher-forced ones at every position."""
    path, golden = checkpoints("v4_flash_like")
    prompt = random_prompt(PROMPT_LEN_V4["v4_flash_like"], seed=4)
    kwargs = {} if chunk is None else {"max_num_batched_tokens": chunk}
    out = _llm(path, **kwargs).generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))])
    ref = hf_logprobs(golden, prompt)
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(ours, want, atol=ATOL)


def test_preemption_and_prefix_caching_change_nothing(checkpoints):
    path, golden = checkpoints("v4_flash_like")
    shared = random_prompt(70, seed=5)
    prompts = [shared + random_prompt(k, seed=10 + k) for k in (3, 9, 17)] + [random_prompt(30, seed=6)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    want = [hf_greedy_goldens(golden, p, NEW_TOKENS)[0] for p in prompts]

    llm = _llm(path)  # block size 16: 64 tokens of the shared prefix are cached blocks
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts, params, use_tqdm=False)
    assert first[0].outputs[0].token_ids == want[0]
    assert [o.outputs[0].token_ids for o in rest] == want
    replay = llm.engine.model.replay_tokens()  # 4 layers x (window 8 - 1): recomputed to rebuild the rings
    assert replay == 28
    assert [o.num_cached_tokens for o in rest][:3] == [64 - replay] * 3

    tight = _llm(path, num_kv_blocks=9, max_num_batched_tokens=24, enable_prefix_caching=False)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want


def test_window_groups_stay_bounded_as_the_context_grows(checkpoints):
    """The ring groups (window keys, compressor windows) hold the same blocks at every context
    length; only the compressed paged groups grow, one entry per 4 or 8 tokens."""
    path, _ = checkpoints("v4_flash_like")
    llm = _llm(path, max_model_len=200)
    engine = llm.engine
    rings = {g.name: g for g in engine.cache_groups if g.kind == "ring"}
    assert set(rings) == {"window", "csa_state", "hca_state"}
    engine.add_request(random_prompt(20, seed=7), SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    seen = {}
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            n = seq.num_computed_tokens
            seen[n] = {name: len(table) for name, table in seq.block_tables.items()}
    assert max(seen) > 160  # ten blocks of 16, 20 windows of 8
    for n, counts in seen.items():
        for name, g in rings.items():
            assert counts[name] == KVCache.ring_blocks(g, engine.kv.block_size, 0), (n, name)
        assert -(-n // engine.kv.block_size) <= counts["csa_kv"] <= -(-n // engine.kv.block_size) + 1, (n, counts)
    assert seen[max(seen)]["csa_kv"] > seen[min(seen)]["csa_kv"]
    ring_rows = {name: engine.kv_cache.tensors[g.layers[0]].shape for name, g in rings.items()}
    small = _llm(path, max_model_len=64)
    assert {name: small.engine.kv_cache.tensors[g.layers[0]].shape for name, g in rings.items()} == ring_rows


def test_mtp_block_matches_an_implementation_of_the_spec(tmp_path):
    """forward_mtp on a checkpoint with DeepSeek's mtp.0.* block (FP8 e_proj/h_proj) against
    tests/hf_checkpoints_v4.hf_mtp_logits (§3.8 composed from transformers' V4 modules)."""
    golden, mtp = write_checkpoint_v4("v4_flash_like", tmp_path / "mtp", quant="fp8", with_mtp=True)
    llm = _llm(tmp_path / "mtp")
    model = llm.engine.model
    assert model.num_mtp_layers == 1
    ids = random_prompt(40, seed=8)
    t = len(ids) - 1
    groups = model.cache_groups(with_mtp=True)
    assert "mtp.layers.0.self_attn.window" in groups[0].layers
    bs = llm.engine.kv.block_size
    blocks = -(-len(ids) // bs) + 1
    cache = KVCache(groups, blocks, bs, 1, 0, torch.device("cpu"))
    kv = KVCacheManager(groups, blocks, bs, 1, prefix_caching=False)
    seq = Sequence(0, "mtp", 0, ids[:t], SamplingParams(max_tokens=1), 0)
    kv.allocate(seq, t)
    runner = ModelRunner(model, cache, kv, torch.device("cpu"))
    _, positions, meta = runner._meta(runner.prepare(SchedulerOutput(prefills=[ScheduledSeq(seq, 0, t, samples=True)])))
    streams = model.forward_streams(torch.tensor(ids[:t]), positions, meta, cache.tensors)
    hidden, _ = model.forward_mtp(0, torch.tensor(ids[1:]), positions, streams, meta, cache.tensors)
    ours = model.compute_logits(hidden)
    want = hf_mtp_logits(golden, mtp, ids)
    assert torch.allclose(ours, want, atol=ATOL * 10), (ours - want).abs().max()


def test_rejected_drafts_roll_back_rings_and_compressed_entries(checkpoints, monkeypatch):
    """Verification rows of 1 + 3 tokens whose drafts are partly right (the golden continuation
    with one token wrong): the rejected tokens' window keys, compressor rows and compressed
    entries are written and must be rolled back. Output equals transformers' greedy tokens."""
    path, golden = checkpoints("v4_flash_like")
    prompt = random_prompt(45, seed=9)
    want = hf_greedy_goldens(golden, prompt, 16)[0]

    def propose_for(self, seq, max_model_len):
        done = len(seq.output_token_ids)
        drafts = list(want[done : done + 3])
        if len(drafts) == 3 and done % 2:
            drafts[1] = (drafts[1] + 1) % 160  # the second draft is wrong: the third is rejected with it
        room = seq.params.max_tokens - done - 1
        return drafts[: max(room, 0)]

    from deepinfer_core.engine.spec_decode.ngram import NgramProposer

    monkeypatch.setattr(NgramProposer, "propose_for", propose_for)
    llm = _llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    engine = llm.engine
    assert out.outputs[0].token_ids == want
    assert 0 < engine.num_accepted_tokens < engine.num_draft_tokens


def test_sampling_features_run_on_v4_and_seeds_reproduce(checkpoints):
    path, _ = checkpoints("v4_pro_like")
    llm = _llm(path)
    prompts = [random_prompt(40, seed=11), random_prompt(12, seed=12)]
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, repetition_penalty=1.1, n=2, seed=3,
                            max_tokens=8, logprobs=2, stop_token_ids=[5])
    a = llm.generate(prompts, params, use_tqdm=False)
    b = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    assert all(len(c.logprobs) == len(c.token_ids) and all(len(lp) >= 2 for lp in c.logprobs) for o in a for c in o.outputs)


def test_bounded_temporaries_chunk_queries_without_changing_results(checkpoints, monkeypatch):
    """Long contexts: the indexer's candidate index and the reference ops' gathers are built
    in chunks of queries within a byte budget; tiny budgets (a query or two per chunk) give the
    same tokens and logprobs."""
    import deepinfer_core.models.v4.model as v4
    import deepinfer_core.ops.sparse as sparse

    path, golden = checkpoints("v4_flash_like")
    monkeypatch.setattr(v4, "CANDIDATE_BYTES", 64)
    monkeypatch.setattr(sparse, "CHUNK_BYTES", 4096)
    prompt = random_prompt(PROMPT_LEN_V4["v4_flash_like"], seed=13)
    out = _llm(path).generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True), use_tqdm=False)[0]
    tokens, chosen, _ = hf_greedy_goldens(golden, prompt, 6)
    assert out.outputs[0].token_ids == tokens
    assert torch.allclose(torch.tensor(_chosen_logprobs(out.outputs[0])), chosen, atol=ATOL)
