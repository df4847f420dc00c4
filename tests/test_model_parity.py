"""Our DeepSeek V2/V3 model on the reference ops against transformers, on tiny random checkpoints.

Every forward here builds its BatchMeta by hand: ``Seq`` owns a list of (deliberately
non-contiguous) cache blocks, ``make_batch`` packs prefill chunks first, then decode tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

from deepinfer_core.models.v3.config import V3ModelConfig
from deepinfer_core.models.registry import read_config
from deepinfer_core.loader import load_model
from deepinfer_core.models.registry import get_model_class
from deepinfer_core.models.batch import BatchMeta, GroupMeta
from deepinfer_core.models.v3.model import CACHE_GROUP
from deepinfer_core.ops import OpTable
from tests.hf_checkpoints import CONFIGS, add_mtp_weights, causal_mask, hf_config, hf_mtp_layer, write_checkpoint

ATOL = 1e-4
NUM_BLOCKS = 64


class Seq:
    """One sequence's tokens and its cache blocks (block ids taken from a shared shuffled pool)."""

    def __init__(self, tokens: list[int], blocks: list[int], block_size: int):
        self.tokens, self.blocks, self.block_size = tokens, blocks, block_size

    def slot(self, pos: int) -> int:
        return self.blocks[pos // self.block_size] * self.block_size + pos % self.block_size


def make_batch(steps: list[tuple[Seq, int, int]], num_decodes: int | None = None) -> tuple[torch.Tensor, torch.Tensor, BatchMeta]:
    """steps: (seq, start, n) = compute tokens [start, start + n) of seq with [0, start) cached.

    The last ``num_decodes`` steps are decode rows (1 + k tokens over the paged cache); by
    default the trailing single-token steps with a cached prefix; everything before is prefill."""
    if num_decodes is None:
        num_decodes = _num_decodes(steps)
    prefills, decodes = steps[: len(steps) - num_decodes], steps[len(steps) - num_decodes :]
    ids, pos, slots = [], [], []
    cu_q, cu_k, ctx = [0], [0], []
    for seq, start, n in prefills:
        ids += seq.tokens[start : start + n]
        pos += list(range(start, start + n))
        slots += [seq.slot(p) for p in range(start, start + n)]
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + start + n)
        ctx += [seq.slot(p) for p in range(start + n)]
    max_blocks = max([len(s.blocks) for s, _, _ in decodes] + [1])
    tables, lens, qstart = [], [], [0]
    for seq, start, n in decodes:
        ids += seq.tokens[start : start + n]
        pos += list(range(start, start + n))
        slots += [seq.slot(p) for p in range(start, start + n)]
        tables.append(seq.blocks + [0] * (max_blocks - len(seq.blocks)))
        lens.append(start + n)
        qstart.append(qstart[-1] + n)
    cache = GroupMeta(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32).view(len(decodes), max_blocks),
        context_slots=torch.tensor(ctx, dtype=torch.int64),
    )
    batch = BatchMeta(
        num_prefill_tokens=cu_q[-1],
        prefill_cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
        prefill_cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
        decode_seq_lens=torch.tensor(lens, dtype=torch.int32),
        decode_query_start_loc=torch.tensor(qstart, dtype=torch.int32),
        groups={CACHE_GROUP: cache},
    )
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), batch


def _num_decodes(steps):
    n = 0
    for seq, start, count in reversed(steps):
        if count == 1 and start > 0:
            n += 1
        else:
            break
    return n


def new_caches(model) -> dict[str, torch.Tensor]:
    (group,) = model.cache_groups(with_mtp=True)
    return {layer: torch.zeros(NUM_BLOCKS, 4, group.entry_dim, dtype=group.dtype) for layer in group.layers}


def new_seq(tokens: list[int], pool: list[int], block_size: int = 4) -> Seq:
    n = -(-len(tokens) // block_size)
    blocks = [pool.pop() for _ in range(n)]
    return Seq(tokens, blocks, block_size)


def block_pool(seed: int = 0) -> list[int]:
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()


def build_ours(path, keep_fp8: bool = False):
    config = read_config(path)
    model = get_model_class(config.model_type)(config, OpTable.reference(), torch.float32, torch.device("cpu"), keep_fp8=keep_fp8)
    load_model(path, config, model, progress=False)
    return model


def prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    hf = write_checkpoint(request.param, path)
    return request.param, path, hf, build_ours(path)


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    seq = new_seq(tokens, block_pool(1))
    ids, pos, batch = make_batch([(seq, 0, len(tokens))])
    return model.compute_logits(model(ids, pos, batch, new_caches(model)))


def test_prefill_matches_transformers(pair):
    name, _, hf, ours = pair
    tokens = prompt(hf.config.vocab_size, 17)
    with torch.no_grad():
        golden = hf(torch.tensor([tokens])).logits[0].float()
    got = full_logits(ours, tokens)
    assert golden.std() > 1.0, "degenerate test logits"
    torch.testing.assert_close(got.log_softmax(-1), golden.log_softmax(-1), atol=ATOL, rtol=0)
    assert torch.equal(got.argmax(-1), golden.argmax(-1))


def test_configs_hold_the_cases_the_parity_tests_rely_on():
    """The pair tests catch a swapped mscale / mscale_all_dim, an ignored norm_topk_prob and a
    reversed FP8 block only through these configs: they must stay asymmetric / False / non-square."""
    from deepinfer_core.models.v3.model import softmax_scale
    from deepinfer_core.ops.rope import rope_inv_freq

    hf = hf_config("v3_yarn_mscale")
    rope = hf.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["mscale"] != rope["mscale_all_dim"]
    config = V3ModelConfig.from_hf(hf)
    assert rope_inv_freq(config.qk_rope_head_dim, config.rope_theta, config.rope_parameters)[1] != pytest.approx(1.0, abs=1e-3)
    as_if_mscale = V3ModelConfig.from_hf(hf_config("v3_yarn_mscale", rope_parameters=dict(rope, mscale_all_dim=rope["mscale"])))
    assert softmax_scale(config) != pytest.approx(softmax_scale(as_if_mscale), rel=1e-2)
    assert hf_config("v3_unnormed_topk").norm_topk_prob is False
    bn, bk = CONFIGS["v3_fp8_nonsquare"][2]
    assert bn != bk


@pytest.mark.parametrize("name", ["v3_fp8", "v3_fp8_nonsquare"])
def test_fp8_kept_matches_dequantised(tmp_path_factory, name):
    path = tmp_path_factory.mktemp("fp8_keep") / "ckpt"
    hf = write_checkpoint(name, path)
    ours = build_ours(path, keep_fp8=True)
    assert ours.model.layers[0].self_attn.o_proj.block == CONFIGS[name][2]
    assert ours.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.float8_e4m3fn
    assert ours.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    tokens = prompt(hf.config.vocab_size, 13)
    with torch.no_grad():
        golden = hf(torch.tensor([tokens])).logits[0].float()
    got = full_logits(ours, tokens)
    torch.testing.assert_close(got.log_softmax(-1), golden.log_softmax(-1), atol=ATOL, rtol=0)
    assert torch.equal(got.argmax(-1), golden.argmax(-1))


def test_decode_matches_full_forward(pair):
    _, _, hf, ours = pair
    tokens = prompt(hf.config.vocab_size, 15, seed=2)
    full = full_logits(ours, tokens)
    seq = new_seq(tokens, block_pool(3))
    caches = new_caches(ours)
    k = 5
    ids, pos, batch = make_batch([(seq, 0, k)])
    rows = [ours.compute_logits(ours(ids, pos, batch, caches))]
    for p in range(k, len(tokens)):
        ids, pos, batch = make_batch([(seq, p, 1)])
        assert batch.num_prefill_tokens == 0
        rows.append(ours.compute_logits(ours(ids, pos, batch, caches)))
    torch.testing.assert_close(torch.cat(rows), full, atol=ATOL, rtol=0)


def test_multi_token_decode_rows_match_full_forward(pair):
    """Decode rows of 1 + k tokens (speculative verification), causal within the row, in one batch
    with single-token rows and a prefill: every row's logits are the full forward's."""
    _, _, hf, ours = pair
    a_tokens, b_tokens, c_tokens = (prompt(hf.config.vocab_size, n, seed=s) for n, s in ((16, 21), (11, 22), (9, 23)))
    pool = block_pool(24)
    a, b, c = new_seq(a_tokens, pool), new_seq(b_tokens, pool), new_seq(c_tokens, pool)
    caches = new_caches(ours)
    ids, pos, batch = make_batch([(a, 0, 10), (b, 0, 7)])
    ours(ids, pos, batch, caches)
    # c prefills whole; a verifies a row of 4 (10..13), b a row of 1 (7), then a row of 3 (8..10)
    ids, pos, batch = make_batch([(c, 0, 9), (a, 10, 4), (b, 7, 1)], num_decodes=2)
    assert batch.num_prefill_tokens == 9 and batch.num_decodes == 2
    got = ours.compute_logits(ours(ids, pos, batch, caches))
    ids, pos, batch = make_batch([(b, 8, 3), (a, 14, 2)], num_decodes=2)
    got2 = ours.compute_logits(ours(ids, pos, batch, caches))
    fa, fb, fc = full_logits(ours, a_tokens), full_logits(ours, b_tokens), full_logits(ours, c_tokens)
    torch.testing.assert_close(got, torch.cat([fc, fa[10:14], fb[7:8]]), atol=ATOL, rtol=0)
    torch.testing.assert_close(got2, torch.cat([fb[8:11], fa[14:16]]), atol=ATOL, rtol=0)


def test_chunked_prefill_matches_full_forward(pair):
    _, _, hf, ours = pair
    tokens = prompt(hf.config.vocab_size, 16, seed=4)
    full = full_logits(ours, tokens)
    seq = new_seq(tokens, block_pool(5))
    caches = new_caches(ours)
    rows = []
    for start, n in [(0, 6), (6, 3), (9, 7)]:
        ids, pos, batch = make_batch([(seq, start, n)])
        rows.append(ours.compute_logits(ours(ids, pos, batch, caches)))
    torch.testing.assert_close(torch.cat(rows), full, atol=ATOL, rtol=0)


def _run_alone(model, steps_per_seq):
    """Run each sequence's steps on its own; return per-sequence list of logits per step."""
    out = []
    for seq, steps in steps_per_seq:
        caches = new_caches(model)
        logits = []
        for start, n in steps:
            ids, pos, batch = make_batch([(seq, start, n)])
            logits.append(model.compute_logits(model(ids, pos, batch, caches)))
        out.append(logits)
    return out


def test_mixed_batch_matches_sequences_alone(pair):
    _, _, hf, ours = pair
    pool = block_pool(6)
    a = new_seq(prompt(hf.config.vocab_size, 9, seed=7), pool)
    b = new_seq(prompt(hf.config.vocab_size, 14, seed=8), pool)
    c = new_seq(prompt(hf.config.vocab_size, 7, seed=9), pool)
    # Step 1: all three prefill a first chunk. Step 2: a decodes, b prefills its rest, c decodes.
    plan = {id(a): [(0, 8), (8, 1)], id(b): [(0, 5), (5, 9)], id(c): [(0, 6), (6, 1)]}
    alone = _run_alone(ours, [(s, plan[id(s)]) for s in (a, b, c)])
    caches = new_caches(ours)
    ids, pos, batch = make_batch([(a, 0, 8), (b, 0, 5), (c, 0, 6)])
    first = ours.compute_logits(ours(ids, pos, batch, caches))
    ids, pos, batch = make_batch([(b, 5, 9), (a, 8, 1), (c, 6, 1)])
    assert batch.num_prefill_tokens == 9 and batch.num_decodes == 2
    second = ours.compute_logits(ours(ids, pos, batch, caches))
    tol = dict(atol=1e-5, rtol=0)
    torch.testing.assert_close(first[:8], alone[0][0], **tol)
    torch.testing.assert_close(first[8:13], alone[1][0], **tol)
    torch.testing.assert_close(first[13:], alone[2][0], **tol)
    torch.testing.assert_close(second[:9], alone[1][1], **tol)
    torch.testing.assert_close(second[9:10], alone[0][1], **tol)
    torch.testing.assert_close(second[10:], alone[2][1], **tol)


@pytest.fixture(scope="module")
def mtp_pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp") / "ckpt"
    hf = write_checkpoint("v3_yarn", path)
    tensors = add_mtp_weights(path, hf)
    return hf, hf_mtp_layer(hf, tensors), build_ours(path)


def test_mtp_matches_transformers_mtp_layer(mtp_pair):
    hf, hf_mtp, ours = mtp_pair
    assert ours.num_mtp_layers == 1
    (group,) = ours.cache_groups(with_mtp=True)
    assert len(group.layers) == hf.config.num_hidden_layers + 1 and group.layers[-1] == "mtp.layers.0.self_attn"
    assert "mtp.layers.0.self_attn" not in ours.cache_groups()[0].layers  # a cache only when something runs it
    tokens = prompt(hf.config.vocab_size, 14, seed=11)
    t = len(tokens) - 1
    with torch.no_grad():
        main = hf.model(torch.tensor([tokens])).last_hidden_state
        position_ids = torch.arange(t)[None]
        embeds = hf.model.embed_tokens(torch.tensor([tokens[1:]]))
        cos_sin = hf.model.rotary_emb(embeds, position_ids)
        golden = hf_mtp(embeds, main[:, :t], cos_sin, causal_mask(t), position_ids, None)[0]

    seq = new_seq(tokens, block_pool(12))
    caches = new_caches(ours)
    ids, pos, batch = make_batch([(seq, 0, len(tokens))])
    hidden = ours(ids, pos, batch, caches)
    torch.testing.assert_close(hidden, main[0], atol=ATOL, rtol=0)
    shifted = Seq(tokens[1:], seq.blocks, seq.block_size)
    ids, pos, batch = make_batch([(shifted, 0, t)])
    got = ours.forward_mtp(0, ids, pos, hidden[:t], batch, caches)
    torch.testing.assert_close(got, golden, atol=ATOL, rtol=0)
    torch.testing.assert_close(
        ours.compute_logits(got).log_softmax(-1), hf.lm_head(golden).float().log_softmax(-1), atol=ATOL, rtol=0
    )

    # Decode through the MTP layer's own cache gives the same rows as its prefill.
    caches2 = new_caches(ours)
    ids, pos, batch = make_batch([(seq, 0, len(tokens))])
    ours(ids, pos, batch, caches2)
    ids, pos, batch = make_batch([(shifted, 0, 8)])
    rows = [ours.forward_mtp(0, ids, pos, hidden[:8], batch, caches2)]
    for p in range(8, t):
        ids, pos, batch = make_batch([(shifted, p, 1)])
        rows.append(ours.forward_mtp(0, ids, pos, hidden[p : p + 1], batch, caches2))
    torch.testing.assert_close(torch.cat(rows), golden, atol=ATOL, rtol=0)


def test_checkpoint_without_mtp_drops_mtp_layers(pair):
    name, path, hf, ours = pair
    if CONFIGS[name][0] == "v3":
        assert hf.config.num_nextn_predict_layers >= 1  # announced by the config, absent from the file
    assert ours.num_mtp_layers == 0
    assert len(ours.cache_groups(with_mtp=True)[0].layers) == hf.config.num_hidden_layers
    with pytest.raises(ValueError, match="MTP"):
        ours.forward_mtp(0, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.zeros(1, 64), None, {})


def test_derived_tensors_are_not_in_state_dict(pair):
    _, _, _, ours = pair
    keys = set(ours.state_dict())
    assert not any("w_uk" in k or "w_uv" in k or "cos_sin" in k for k in keys)
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys
    assert ours.model.layers[1].mlp.gate.weight.dtype == torch.float32


@pytest.mark.parametrize("name,keep_fp8", [("v3_yarn", False), ("v3_fp8", True)])
def test_bfloat16_prefill_and_decode(tmp_path, name, keep_fp8):
    path = tmp_path / "ckpt"
    hf = write_checkpoint(name, path)
    config = read_config(path)
    ours = get_model_class(config.model_type)(config, OpTable.reference(), torch.bfloat16, torch.device("cpu"), keep_fp8=keep_fp8)
    load_model(path, config, ours, progress=False)
    assert ours.model.layers[0].self_attn.w_uk_t.dtype == torch.bfloat16
    tokens = prompt(hf.config.vocab_size, 12, seed=13)
    with torch.no_grad():
        golden = hf(torch.tensor([tokens])).logits[0].float()
    seq = new_seq(tokens, block_pool(14))
    caches = new_caches(ours)
    assert next(iter(caches.values())).dtype == torch.bfloat16
    ids, pos, batch = make_batch([(seq, 0, 6)])
    rows = [ours.compute_logits(ours(ids, pos, batch, caches))]
    for p in range(6, len(tokens)):
        ids, pos, batch = make_batch([(seq, p, 1)])
        rows.append(ours.compute_logits(ours(ids, pos, batch, caches)))
    got = torch.cat(rows)
    assert got.dtype == torch.float32
    # bf16 rounding in the absorbed decode path: close to the bf16 full forward...
    full = full_logits(ours, tokens)
    assert (got.log_softmax(-1) - full.log_softmax(-1)).abs().max() < 0.15
    # ...and as close to the float32 golden as transformers' own bf16 forward is, on typical rows (a
    # rare bf16 top-k flip in routing moves a row, in either). Measured median ours / transformers'
    # 0.85-1.14 over 3 checkpoints x 2 prompts (here 0.130 / 0.114 nats v3_yarn, 0.108 / 0.114 v3_fp8).
    with torch.no_grad():
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)(torch.tensor([tokens])).logits[0].float()
    ours_err = (got.log_softmax(-1) - golden.log_softmax(-1)).abs().amax(-1).median()
    hf_err = (hf_bf16.log_softmax(-1) - golden.log_softmax(-1)).abs().amax(-1).median()
    assert ours_err < 1.5 * hf_err, (float(ours_err), float(hf_err))
