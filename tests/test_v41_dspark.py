"""DeepSeek-V4.1's DSpark stages (§4.6): loaded from mtp.{0,1,2}.*, the context each stage's
window receives from the target's taps, and one block draft, checked against the spec."""

from __future__ import annotations

import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.kv_cache import KVCache, KVCacheManager
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.engine.scheduler import ScheduledSeq, SchedulerOutput
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.ops.sparse import key_pool
from tests.v41_checkpoints import write_checkpoint_v41


def _rms(x, w, eps=1e-20):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def test_dspark_context_and_block_draft_follow_the_spec(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_SWA_BOUNDED_REPLAY", "0")
    path = write_checkpoint_v41("v41-dspark", tmp_path / "d")
    llm = LLM(str(path), accelerator="cpu", dtype="float32", progress=False, max_num_seqs=2)
    model, ops, cpu = llm.engine.model, llm.engine.ops, torch.device("cpu")
    c = model.config
    assert model.num_mtp_layers == 3
    n, w = c.dspark_block_size, c.sliding_window
    ids = torch.randint(3, 2000, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    t = 29  # the target has processed positions 0..28; the anchor y = ids[29] is at P = 29
    groups = model.cache_groups(with_mtp=True)
    window = next(g for g in groups if g.name == "window")
    assert "mtp.layers.2.self_attn.window" in window.layers
    bs = llm.engine.kv.block_size
    blocks = -(-(t + n) // bs) + 2
    cache = KVCache(groups, blocks, bs, 1, 0, cpu)
    kv = KVCacheManager(groups, blocks, bs, 1, prefix_caching=False)
    seq = Sequence(0, "d", 0, ids[:t], SamplingParams(max_tokens=1), 0)
    kv.allocate(seq, t)
    runner = ModelRunner(model, cache, kv, cpu)

    taps = {}
    for layer in c.dspark_target_layer_ids:  # the residual entering each target layer, averaged over streams
        model.model.layers[layer].register_forward_pre_hook(lambda mod, args, layer=layer: taps.__setitem__(layer, args[0].float().mean(1)))
    ids_t, positions, meta = runner._meta(runner.prepare(SchedulerOutput(prefills=[ScheduledSeq(seq, 0, t, samples=True)])))
    model.forward(ids_t, positions, meta, cache.tensors)

    # context: RoPE(kv_norm_s(wkv_s(main_norm(main_proj([taps])))), p) in stage s's ring, at p
    first = model.mtp.layers[0]
    main_x = _rms(torch.cat([taps[L] for L in c.dspark_target_layer_ids], dim=-1) @ first.main_proj.weight.float().T, first.main_norm.weight)
    rb, table = KVCache.ring_block(window, bs), seq.block_tables["window"]
    ring_slot = [table[(p // rb) % len(table)] * rb + p % rb for p in range(t)]
    contexts = []
    for s, stage in enumerate(model.mtp.layers):
        a = stage.self_attn
        k = _rms(main_x @ a.kv_proj.weight.float().T, a.kv_norm.weight)
        r = c.qk_rope_head_dim
        k_pe = ops.rotary_embedding(k[:, None, -r:], k[:, -r:], positions, model.tables["main"][0], True)[1]
        want = torch.cat([k[:, :-r], k_pe], dim=-1)
        ring = cache.tensors[f"mtp.layers.{s}.self_attn.window"].view(-1, c.head_dim)
        held = [p for p in range(t) if p >= t - w]
        assert torch.allclose(ring[[ring_slot[p] for p in held]], want[held], atol=1e-5)
        contexts.append(ring[[ring_slot[p] for p in range(t - w, t)]].clone())

    # the block: rows [y, noise, noise] at P..P+2, each reading its stage's context P-W..P-1 and every block row
    seq.draft_token_ids = [ids[t]] + [c.dspark_noise_token_id] * (n - 1)
    kv.allocate(seq, t + n)
    calls = []
    inner = ops.sparse_attention

    def record(q, pool, index, *args):
        calls.append((key_pool(pool).clone(), index.clone()))  # one tensor or several pools
        return inner(q, pool, index, *args)

    ops.sparse_attention = record
    _, positions, meta = runner._meta(runner.prepare(SchedulerOutput(decodes=[ScheduledSeq(seq, t, n, num_drafts=n - 1, is_decode=True)])))
    assert positions.tolist() == list(range(t, t + n))
    before = {k: v.clone() for k, v in cache.tensors.items()}
    draft = model.forward_dspark(torch.tensor([ids[t]]), positions, meta, cache.tensors)
    assert all(torch.equal(before[k], v) for k, v in cache.tensors.items())  # nothing written
    assert len(calls) == 3
    for s, (pool, index) in enumerate(calls):
        assert index.shape == (n, w + n)
        for row in range(n):
            assert torch.equal(pool[index[row, :w]], contexts[s])  # context P-W..P-1, oldest first
            assert index[row, w:].tolist() == list(range(n))  # all block rows: not causal inside the block

    # heads: base = head(norm(x)); Markov bias from the previous token (the anchor for row 0); greedy; confidence
    last = model.mtp.layers[2]
    base = model.compute_logits(_rms(draft.hidden[0], last.norm.weight))
    assert torch.allclose(draft.base_logits[0], base, atol=1e-4)
    m1, m2, wc = last.markov_head.embed.weight, last.markov_head.head.weight, last.confidence_head.proj.weight
    prev = ids[t]
    for i in range(n):
        e = m1[prev].float()
        logits = base[i] + m2.float() @ e
        assert torch.allclose(draft.logits[0, i], logits, atol=1e-4)
        assert int(draft.tokens[0, i]) == int(logits.argmax())
        conf = torch.sigmoid(torch.cat([draft.hidden[0, i].float(), e]) @ wc.float()[0])
        assert torch.allclose(draft.confidence[0, i], conf, atol=1e-5)
        prev = int(draft.tokens[0, i])


def test_a_checkpoint_without_the_dspark_stages_loads_without_them(tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_checkpoint_v41("v41-dspark", tmp_path / "d")
    tensors = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if not k.startswith("mtp.")}
    save_file(tensors, str(path / "model.safetensors"))
    llm = LLM(str(path), accelerator="cpu", dtype="float32", progress=False, max_num_seqs=2)
    assert llm.engine.model.num_mtp_layers == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
