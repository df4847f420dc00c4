"""The Ascend backend's glue to torch_npu (``deepinfer_ascend_950.npu_ops``), on the CPU.

These test OUR GLUE, NOT THE CHIP: ``torch_npu`` here is ``tests/ascend/fake_torch_npu.py``, a
test-only model of each operator's documented semantics (its docstring names the documents it
follows), injected as ``sys.modules["torch_npu"]`` inside each test only. A pass shows that the
arguments npu_ops builds are the ones the documentation asks for (the model refuses what the
documentation refuses) and that, if each operator does what its documentation says, the op meets
its contract: the conformance kit judges it against the reference with the spec's tolerances. The
chip's own rounding, tie order and speed are for the ``npu``-marked tests (test_hardware.py).
"""

from __future__ import annotations

import sys

import pytest
import torch

from deepinfer_ascend_950 import npu_ops
from deepinfer_core.conformance.ops_suite import ReplayCase, replay_case, run_op
from deepinfer_core.conformance.spec import dtype_name

from . import fake_torch_npu as fake

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
MAX_ELEMENTS = 1 << 20  # the declared shapes up to this size (the real-model ones above it stay for the chip)
# The ops whose stock operator takes float32 too (the others hand float32 to the reference).
FP32_MAPPED = ("rms_norm", "add_rms_norm", "silu_and_mul", "moe_route", "moe_experts", "rms_norm_f32", "rms_normalize",
               "moe_experts_clamped")
KIT_RUNS = [(op, BF16) for op in npu_ops.OPS] + [(op, FP32) for op in FP32_MAPPED] + [("rotary_embedding", FP16)]


@pytest.fixture
def fake_npu(monkeypatch):
    """The operator model as torch_npu, for this test only; its call counts start at zero."""
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    fake.CALLS.clear()
    return fake


@pytest.mark.parametrize("op, dtype", KIT_RUNS, ids=[f"{op}-{dtype_name(d)}" for op, d in KIT_RUNS])
def test_the_kit_passes_each_mapped_op_through_its_operator_model(fake_npu, op, dtype):
    """The conformance kit's declared shapes (up to MAX_ELEMENTS values), through the glue and the
    operator model; at least one of them takes the stock operator, not the fallback."""
    report = run_op(op, npu_ops.OPS[op], dtype, "cpu", examples=0, max_elements=MAX_ELEMENTS)
    assert report.result == "PASS", f"{op} ({report.dtype}): {report.detail()}"
    assert sum(fake_npu.CALLS.values()) > 0, f"{op} in {dtype_name(dtype)} never reached a torch_npu operator"


# Cases beyond the declared shapes that fit here: several tokens per expert and experts left empty
# (the routing's permutation), cached prefixes of several sequences, 6 and 8 streams, V2's and V3's
# grouped gates at small sizes. Each must take the stock operator(s) named and pass the kit's judgement.
WIDER = [
    ("moe_experts", {"tokens": 37, "hidden": 64, "intermediate": 32, "experts": 8, "top_k": 3, "fp8_block": []},
     {"npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_swiglu"}),
    ("moe_experts_clamped", {"tokens": 29, "hidden": 64, "intermediate": 48, "experts": 6, "top_k": 4, "fp8_block": [],
                             "limit": 1.0, "gate_up_std": 2.0}, {"npu_moe_init_routing_v2", "npu_grouped_matmul"}),
    ("mla_prefill_attention", {"seq_lens_q": [5, 1, 17], "seq_lens_k": [5, 9, 30], "heads": 4, "qk_dim": 192,
                               "v_dim": 128, "scale": "default"}, {"npu_fused_infer_attention_score"}),
    ("mla_prefill_attention", {"seq_lens_q": [3, 8], "seq_lens_k": [40, 8], "heads": 2, "qk_dim": 128, "v_dim": 128,
                               "scale": "default"}, {"npu_fused_infer_attention_score"}),
    ("rotary_embedding", {"tokens": 9, "heads": 3, "rope_dim": 64, "interleaved": True, "max_positions": 256,
                          "rope": "v3_yarn"}, {"npu_interleave_rope"}),
    ("moe_route", {"tokens": 19, "hidden": 64, "experts": 16, "top_k": 4, "n_group": 4, "topk_group": 2,
                   "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
                   "routed_scaling_factor": 2.5}, {"npu_moe_gating_top_k"}),
    ("moe_route", {"tokens": 11, "hidden": 32, "experts": 24, "top_k": 3, "n_group": 4, "topk_group": 2,
                   "scoring_func": "softmax", "topk_method": "group_limited_greedy", "norm_topk_prob": False,
                   "routed_scaling_factor": 16.0}, {"npu_moe_gating_top_k"}),
    ("mhc_pre", {"tokens": 13, "hc": 6, "hidden": 32, "sinkhorn_iters": 5}, {"npu_mhc_pre", "npu_mhc_sinkhorn"}),
    ("mhc_pre_delayed", {"tokens": 6, "hc": 8, "hidden": 16, "sinkhorn_iters": 20, "one_hot_tokens": 2},
     {"npu_mhc_pre", "npu_mhc_sinkhorn"}),
    ("mhc_post", {"tokens": 13, "hc": 8, "hidden": 48}, {"npu_mhc_post"}),
    ("mhc_head", {"tokens": 13, "hc": 6, "hidden": 32}, {"npu_mhc_pre"}),
]


@pytest.mark.parametrize("op, dims, operators", WIDER, ids=[f"{op}-{i}" for i, (op, _, _) in enumerate(WIDER)])
def test_wider_cases_take_the_stock_operators(fake_npu, op, dims, operators):
    for seed in (0, 1):
        report = replay_case(ReplayCase(op, "bfloat16", dims, seed), npu_ops.OPS[op], "cpu")
        assert report.result == "PASS", f"{op} {dims} seed {seed}: {report.detail()}"
    assert operators <= set(fake_npu.CALLS), f"{op}: called {dict(fake_npu.CALLS)}, expected {sorted(operators)}"


# What the operators do not take goes to the reference, never to a guess: the model is not called.
FALLBACKS = [
    ("mla_prefill_attention", "float16", {"seq_lens_q": [19], "seq_lens_k": [19], "heads": 16, "qk_dim": 192, "v_dim": 128,
                                          "scale": "v2lite_yarn"}),  # a bf16 cast would miss fp16's tolerance
    ("mla_prefill_attention", "bfloat16", {"seq_lens_q": [5, 1], "seq_lens_k": [5, 9], "heads": 4, "qk_dim": 24, "v_dim": 16,
                                           "scale": "default"}),  # head dims TND does not take
    ("mla_prefill_attention", "bfloat16", {"seq_lens_q": [0, 4], "seq_lens_k": [3, 4], "heads": 2, "qk_dim": 192,
                                           "v_dim": 128, "scale": "default"}),  # an empty sequence
    ("moe_route", "bfloat16", {"tokens": 19, "hidden": 64, "experts": 16, "top_k": 4, "n_group": 4, "topk_group": 2,
                               "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": False,
                               "routed_scaling_factor": 1.0}),  # sigmoid always renormalises there
    ("moe_experts", "bfloat16", {"tokens": 5, "hidden": 64, "intermediate": 32, "experts": 16, "top_k": 4,
                                 "fp8_block": [32, 32]}),  # block FP8
    ("moe_experts_clamped", "bfloat16", {"tokens": 9, "hidden": 96, "intermediate": 48, "experts": 8, "top_k": 3,
                                         "fp8_block": [], "limit": 1.0, "gate_up_std": 2.0, "mxfp4": True}),  # MXFP4
    ("mhc_pre", "bfloat16", {"tokens": 7, "hc": 3, "hidden": 100, "sinkhorn_iters": 2}),  # 3 streams, D not 16-aligned
    ("rotary_embedding", "bfloat16", {"tokens": 5, "heads": 4, "rope_dim": 8, "interleaved": False, "max_positions": 256,
                                      "rope": "v3_yarn"}),  # NeoX pairs, rope_dim 8
    ("rotary_embedding", "float32", {"tokens": 1, "heads": 1, "rope_dim": 64, "interleaved": True, "max_positions": 4096,
                                     "rope": "default"}),  # float32
]


@pytest.mark.parametrize("op, dtype, dims", FALLBACKS, ids=[f"{op}-{i}" for i, (op, _, _) in enumerate(FALLBACKS)])
def test_what_the_operators_do_not_take_runs_the_reference(fake_npu, op, dtype, dims):
    report = replay_case(ReplayCase(op, dtype, dims, 0), npu_ops.OPS[op], "cpu")
    assert report.result == "PASS", report.detail()
    assert not fake_npu.CALLS, f"{op}: expected the reference, but called {dict(fake_npu.CALLS)}"


def test_the_model_refuses_what_the_documents_refuse(fake_npu):
    """A permissive model would let wrong glue pass: these are the documented refusals the glue must avoid."""
    x = torch.randn(2, 3, 1, 64, dtype=BF16)
    cos = torch.randn(2, 1, 1, 64, dtype=BF16)
    with pytest.raises(fake.DocumentedConstraint, match="64"):
        fake.npu_interleave_rope(torch.randn(2, 3, 1, 32, dtype=BF16), cos[..., :32], cos[..., :32])
    with pytest.raises(fake.DocumentedConstraint, match="non-contiguous"):
        fake.npu_interleave_rope(x.transpose(0, 1).contiguous().transpose(0, 1), cos, cos)
    with pytest.raises(fake.DocumentedConstraint, match="bfloat16"):
        fake.npu_fused_infer_attention_score(torch.randn(4, 2, 192, dtype=FP16), torch.randn(4, 2, 192, dtype=FP16),
                                             torch.randn(4, 2, 128, dtype=FP16), input_layout="TND",
                                             actual_seq_lengths=[4], actual_seq_lengths_kv=[4], num_heads=2, sparse_mode=3)
    with pytest.raises(fake.DocumentedConstraint, match="cumulative"):
        q = torch.randn(4, 2, 192, dtype=BF16)
        fake.npu_fused_infer_attention_score(q, q, torch.randn(4, 2, 128, dtype=BF16), input_layout="TND",
                                             actual_seq_lengths=[3, 1], actual_seq_lengths_kv=[3, 4], num_heads=2,
                                             sparse_mode=3, atten_mask=torch.ones(2048, 2048, dtype=torch.int8).triu(1))
    with pytest.raises(fake.DocumentedConstraint, match="renorm|group_count"):
        fake.npu_moe_gating_top_k(torch.randn(3, 16), 2, group_count=8, k_group=2)  # 2 experts a group
    with pytest.raises(fake.DocumentedConstraint, match="length 1"):
        fake.npu_grouped_matmul([torch.randn(3, 4)], [torch.randn(1, 4, 5)], group_list=torch.tensor([3]),
                                group_list_type=1, group_type=0, split_item=2)
    with pytest.raises(fake.DocumentedConstraint, match="n 3"):
        fake.npu_mhc_post(torch.randn(2, 3, 16, dtype=BF16), None, torch.randn(2, 16, dtype=BF16), torch.rand(2, 3))


def test_interleave_rope_glue_undoes_the_operators_storage_order(fake_npu):
    """npu_interleave_rope leaves the pairs de-interleaved (its formula); the op's contract keeps them
    interleaved. Exact in float32 arithmetic on bf16-representable inputs: the same products either way."""
    from deepinfer_core.ops.rope import rotary_embedding, rope_cos_sin_table

    table = rope_cos_sin_table(64, 10000.0, None, 32).to(BF16).float()  # cos / sin exact in bf16
    q, k = torch.randn(5, 2, 64, dtype=BF16), torch.randn(5, 64, dtype=BF16)
    positions = torch.tensor([0, 3, 31, 7, 7])
    got_q, got_k = npu_ops.rotary_embedding(q, k, positions, table, True)
    want_q, want_k = rotary_embedding(q.float(), k.float(), positions, table, True)
    torch.testing.assert_close(got_q.float(), want_q, atol=2e-2, rtol=1e-2)  # one bf16 rounding
    torch.testing.assert_close(got_k.float(), want_k, atol=2e-2, rtol=1e-2)
    assert fake_npu.CALLS["npu_interleave_rope"] == 2


def test_every_callable_keeps_its_reference_signature_and_names_what_runs():
    from deepinfer_ascend_950.op_plan import PROVIDES
    from deepinfer_core.hook_checks import signature_problem
    from deepinfer_core.ops import REFERENCE_OPS

    assert set(npu_ops.OPS) == set(PROVIDES)
    for name, fn in npu_ops.OPS.items():
        assert signature_problem(fn, REFERENCE_OPS[name]) is None, name
        assert fn.impl == PROVIDES[name] and fn.impl.startswith(("torch_npu.", "as moe_experts"))
    assert "torch_npu" not in sys.modules or sys.modules["torch_npu"] is fake  # importing npu_ops imported none


def test_the_model_covers_exactly_the_operators_the_glue_calls():
    import ast
    import inspect

    called = {node.attr for node in ast.walk(ast.parse(inspect.getsource(npu_ops)))
              if isinstance(node, ast.Attribute) and node.attr.startswith("npu_")}
    assert called == set(npu_ops.OPERATORS)
    assert all(callable(getattr(fake, name, None)) for name in npu_ops.OPERATORS)
