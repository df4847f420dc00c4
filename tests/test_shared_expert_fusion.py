"""The shared experts run as extra experts of the routed grouped pass (``MoE.fuse_shared``) when
the backend's ``moe_experts`` asks for it, and the two attention input projections as one GEMM
(``Attention.qkv_a_proj``): the same logits as the model computed the plain way.

The op table here is the reference's, with a ``moe_experts`` that carries the hint and records
the expert count it is called with, so the test sees which path each forward took.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.models.registry import read_config
from deepinfer_core.loader import load_model
from deepinfer_core.models.registry import get_model_class
from deepinfer_core.ops import REFERENCE_OPS, OpTable, reference_ops
from tests.hf_checkpoints import add_mtp_weights, write_checkpoint
from tests.test_model_parity import full_logits, prompt

MAX_TOKENS = 4


def hinted_table(calls: list[int], dtypes=(torch.float32, torch.float8_e4m3fn), routed: list[int] | None = None) -> OpTable:
    """The reference table with a hinted moe_experts; with ``routed``, also a moe_route that
    appends the shared slots itself (``appends_shared_experts``) and records how many it was asked for."""
    def moe_experts(x, w13, *args):
        calls.append(w13.shape[0])
        return REFERENCE_OPS["moe_experts"](x, w13, *args)

    def moe_route(x, gate_weight, *args, shared_experts=0, **kwargs):
        routed.append(shared_experts)
        weights, ids = REFERENCE_OPS["moe_route"](x, gate_weight, *args, **kwargs)
        e, t = gate_weight.shape[0], x.shape[0]
        return (torch.cat([weights, weights.new_ones(t, shared_experts)], dim=1),
                torch.cat([ids, torch.arange(e, e + shared_experts).repeat(t, 1)], dim=1))

    moe_experts.shared_expert_max_tokens = dict.fromkeys(dtypes, MAX_TOKENS)
    moe_route.appends_shared_experts = True
    own = {"moe_experts": moe_experts, **({"moe_route": moe_route} if routed is not None else {})}
    return OpTable({**reference_ops(), **own}, dict.fromkeys(REFERENCE_OPS, "reference"))


def build(path, ops: OpTable, keep_fp8: bool = False, expert_slots=None):
    config = read_config(path)
    model = get_model_class(config.model_type)(config, ops, torch.float32, torch.device("cpu"), keep_fp8=keep_fp8,
                                                expert_slots=expert_slots)
    model.built_at = {name: p.data_ptr() for name, p in model.named_parameters() if ".mlp.experts." in name}
    load_model(path, config, model, progress=False)
    return model


@pytest.mark.parametrize("name,keep_fp8,in_route", [("v3_shared2", False, False), ("v2_greedy", False, False), ("v3_fp8", True, False),
                                                    ("v3_no_q_lora", False, False), ("v3_shared2", False, True), ("v3_fp8", True, True)])
def test_fused_shared_experts_give_the_plain_logits(tmp_path, name, keep_fp8, in_route):
    """``in_route``: the routing appends the shared slots (no concatenation in the model)."""
    path = tmp_path / "ckpt"
    hf = write_checkpoint(name, path)
    plain = build(path, OpTable.reference(), keep_fp8)
    calls: list[int] = []
    routed: list[int] | None = [] if in_route else None
    fused = build(path, hinted_table(calls, routed=routed), keep_fp8)
    config = fused.config
    e, n = config.n_routed_experts, config.n_shared_experts
    moe = next(layer.mlp for layer in fused.model.layers if hasattr(layer.mlp, "with_shared"))
    assert moe.with_shared is not None and moe.with_shared.w13.shape[0] == e + n
    # The routed parameters are views of the larger tensors, under their old keys and shapes, and
    # were loaded there: the storage they were built with (rows kept free for the shared experts).
    ex = moe.experts
    assert ex.gate_up_proj.data_ptr() == moe.with_shared.w13.data_ptr() and ex.gate_up_proj.shape[0] == e
    assert ex.down_proj.data_ptr() == moe.with_shared.w2.data_ptr()
    moved = [name for name, p in fused.named_parameters() if name in fused.built_at and p.data_ptr() != fused.built_at[name]]
    assert not moved, f"routed experts copied after loading: {moved}"
    assert set(fused.state_dict()) == set(plain.state_dict())  # both stack q | kv_a: the fusion adds no key
    # Both attention input projections are one stacked GEMM (it needs no hint), unless the q rows
    # end inside an FP8 block (v3_fp8: q_lora_rank 48 in 32-row blocks).
    attn = fused.model.layers[0].self_attn
    q_rows = config.q_lora_rank or config.num_attention_heads * config.qk_head_dim
    straddles = keep_fp8 and q_rows % config.fp8_block[0] != 0
    assert (attn.qkv_a_proj is None) == straddles
    assert straddles or attn.kv_a_proj_with_mqa.weight.numel() == 0
    for length, path_taken in ((MAX_TOKENS, e + n), (MAX_TOKENS + 5, e)):
        tokens = prompt(hf.config.vocab_size, length, seed=length)
        calls.clear()
        if routed is not None:
            routed.clear()
        got, want = full_logits(fused, tokens), full_logits(plain, tokens)
        assert calls and set(calls) == {path_taken}, (length, calls)
        assert routed is None or set(routed) == {path_taken - e}, (length, routed)  # asked for n slots only when fused
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_not_fused_without_the_hint_for_the_dtype_or_under_expert_parallelism(tmp_path):
    path = tmp_path / "ckpt"
    add_mtp_weights(path, write_checkpoint("v3_shared2", path))
    config = read_config(path)
    plain = build(path, OpTable.reference())
    moe = [layer.mlp for layer in plain.model.layers if hasattr(layer.mlp, "with_shared")]
    assert moe and all(m.with_shared is None for m in moe)
    invariant = hinted_table([])
    invariant.batch_invariant = True
    assert all(layer.mlp.with_shared is None for layer in build(path, invariant).model.layers if hasattr(layer.mlp, "with_shared"))
    fp8 = tmp_path / "fp8"
    write_checkpoint("v3_fp8", fp8)
    kept = build(fp8, hinted_table([], dtypes=(torch.float32,)), keep_fp8=True)  # the hint does not name FP8
    assert kept.keep_fp8 and all(getattr(layer.mlp, "with_shared", None) is None for layer in kept.model.layers)
    sharded = build(path, hinted_table([]), expert_slots=tuple(range(0, config.n_routed_experts, 2)))
    assert all(getattr(layer.mlp, "with_shared", None) is None for layer in sharded.model.layers)
    # MTP layers hold every expert, also under expert parallelism: they take the fused path.
    assert sharded.num_mtp_layers and all(layer.mlp.with_shared is not None for layer in sharded.mtp.layers)


def test_a_route_that_says_it_appends_but_takes_no_keyword_is_refused_at_load(tmp_path):
    path = tmp_path / "ckpt"
    write_checkpoint("v3_shared2", path)
    ops = hinted_table([])

    def moe_route(*args, **kwargs):  # no shared_experts keyword
        return REFERENCE_OPS["moe_route"](*args, **kwargs)

    moe_route.appends_shared_experts = True
    ops.moe_route = moe_route
    with pytest.raises(TypeError, match="takes no 'shared_experts' keyword"):
        build(path, ops)


def test_a_hint_that_is_not_a_dict_is_refused_by_name(tmp_path):
    path = tmp_path / "ckpt"
    write_checkpoint("v3_shared2", path)
    ops = hinted_table([])
    ops.moe_experts.shared_expert_max_tokens = 16
    with pytest.raises(TypeError, match="shared_expert_max_tokens must be a dict"):
        build(path, ops)


def test_the_nvidia_tables_hint():
    """The NVIDIA plugin's moe_experts asks for the fusion up to SHARED_EXPERT_MAX_TOKENS; its
    batch-invariant form must not (a row's path would follow the batch size)."""
    kmoe = pytest.importorskip("deepinfer_nvidia_sm100.kernels.moe")
    assert kmoe.OPS["moe_experts"].shared_expert_max_tokens == kmoe.SHARED_EXPERT_MAX_TOKENS
    assert kmoe.SHARED_EXPERT_MAX_TOKENS[torch.bfloat16] > 0 and torch.float8_e4m3fn not in kmoe.SHARED_EXPERT_MAX_TOKENS
    assert not hasattr(kmoe.INVARIANT_OPS["moe_experts"], "shared_expert_max_tokens")


@pytest.mark.parametrize("name", ["v3_yarn", "v3_no_q_lora"])
def test_the_transformers_peer_gets_the_checkpoints_weights_back(tmp_path, name):
    """benchmarks.e2e.hf_state_dict hands transformers our weights under its names, the stacked
    input projections and fused gate/up split back: exactly the checkpoint's tensors."""
    from benchmarks.e2e import hf_state_dict

    path = tmp_path / "ckpt"
    want = write_checkpoint(name, path).state_dict()
    got = hf_state_dict(build(path, hinted_table([])))
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key].float(), want[key].float(), atol=0, rtol=0, msg=key)


def test_a_replaced_expert_parameter_is_refused_not_appended_to(tmp_path):
    """The shared experts go into rows allocated behind the routed parameters; a parameter replaced
    after construction (not loaded in place) no longer has them, and fuse_shared says so."""
    path = tmp_path / "ckpt"
    write_checkpoint("v3_shared2", path)
    config = read_config(path)
    model = get_model_class(config.model_type)(config, hinted_table([]), torch.float32, torch.device("cpu"))
    moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "with_shared"))
    moe.experts.down_proj.data = moe.experts.down_proj.data.clone()
    with pytest.raises(RuntimeError, match="experts.down_proj no longer lies in the rows"):
        moe.fuse_shared()
