"""FlashMLA as the provider of mla_decode_attention (deepinfer_nvidia_sm100/flashmla.py).

CPU: a stand-in ``flash_mla`` module that computes what FlashMLA's dense decode computes (each
batch entry one query over its first cache_seqlens entries through its block table, its
metadata object filled on first use) checks the provider's own work: one FlashMLA sequence per
query row, rows with no entries zeroed, one plan and one scheduler metadata per step shared by
the layers, the fallback for what FlashMLA does not take, and the backend's choices (the op
table, the 64-token block). GPU (``gpu``, skipped where flash_mla does not import): the real
kernel against the reference at the spec's FlashMLA shapes, padding rows, CUDA-graph replay.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from deepinfer_core.conformance.inputs import ATTENTION_SCALES, make_case
from deepinfer_core.ops import attention as ref_ops
from deepinfer_nvidia_sm100 import backend as nvidia
from deepinfer_nvidia_sm100 import flashmla
from tests.op_spec import assert_close


def _inputs(seq_lens, query_lens, heads=2, dtype=torch.bfloat16, device="cpu", seed=0, d_c=512, d_r=64, block=64):
    dims = dict(seq_lens=list(seq_lens), query_lens=list(query_lens), heads=heads, kv_lora_rank=d_c, rope_dim=d_r,
                block_size=block, scale="default")
    return list(make_case("mla_decode_attention", dims, dtype, device, seed).args[:6])


class _StandIn(types.ModuleType):
    """What flash_mla's dense decode computes, in torch (float32 softmax), with call counts."""

    def __init__(self):
        super().__init__("flash_mla")
        self.metadata_made = self.decode_calls = 0

    def has_legacy(self):
        return True

    def get_mla_metadata(self, *args, **kwargs):
        return types.SimpleNamespace(tile_scheduler_metadata=None), None

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, meta, softmax_scale=None,
                               causal=False, use_legacy=False):
        assert use_legacy and not causal and q.shape[1] == 1 and k_cache.shape[2] == 1
        assert block_table.dtype == cache_seqlens.dtype == torch.int32
        self.decode_calls += 1
        if meta.tile_scheduler_metadata is None:
            meta.tile_scheduler_metadata = self.metadata_made = self.metadata_made + 1
        b, _, h, d = q.shape
        starts = torch.arange(b + 1, dtype=torch.int32)
        out = ref_ops.mla_decode_attention(q[:, 0, :, :head_dim_v], q[:, 0, :, head_dim_v:], k_cache[:, :, 0],
                                           block_table, cache_seqlens, starts, softmax_scale)
        return out.unsqueeze(1), torch.zeros(b, h, 1)


@pytest.fixture
def stand_in(monkeypatch):
    fake = _StandIn()
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    monkeypatch.setattr(flashmla, "DEVICE_TYPES", ("cpu", "cuda"))  # the plan kernel runs interpreted on the CPU
    monkeypatch.setattr(flashmla, "version", lambda: "stand-in 0")
    monkeypatch.setattr(flashmla, "MIN_ROWS_X_HEADS", 1)  # the small cases here take FlashMLA's path too
    return fake


def _reference(args, scale):
    return ref_ops.mla_decode_attention(*args, scale)


@pytest.mark.parametrize("seq_lens,query_lens", [([5, 70, 1], [1, 1, 1]), ([7, 1, 130], [4, 1, 3]),
                                                 ([3, 6, 4], [3, 0, 4]), ([65], [2])])
def test_rows_are_flashmla_sequences(stand_in, seq_lens, query_lens, device):
    args = _inputs(seq_lens, query_lens, device=device)
    op = flashmla.provide({"mla_decode_attention": lambda *a: pytest.fail("the fallback ran")})["mla_decode_attention"]
    got = op(*args, 0.1)
    assert stand_in.decode_calls == 1
    assert torch.equal(got, _reference(args, 0.1))


def test_padding_rows_are_zeros(stand_in, device):
    """Graph padding (seq_lens 0, one row) gives zeros; FlashMLA itself is asked for one entry."""
    args = _inputs([9, 3], [1, 1], device=device)
    args[4] = torch.tensor([9, 0], dtype=torch.int32, device=device)
    got = flashmla.FlashMLADecode(None)(*args, 0.1)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.equal(got, _reference(args, 0.1))


def test_one_plan_and_metadata_per_step(stand_in, device):
    """Layers of one step share the plan and FlashMLA's scheduler metadata; a new step's tensors, or
    the same tensors written in place, get new ones; inference tensors (no write counter) too."""
    args = _inputs([40, 90], [1, 1], device=device)
    op = flashmla.FlashMLADecode(None)
    first = op(*args, 0.1)
    for _ in range(3):  # three more layers
        assert torch.equal(op(*args, 0.1), first)
    assert stand_in.metadata_made == 1 and stand_in.decode_calls == 4
    args[4].copy_(torch.tensor([2, 90], dtype=torch.int32))  # written in place: a new step
    assert torch.equal(op(*args, 0.1), _reference(args, 0.1))
    assert stand_in.metadata_made == 2
    step = _inputs([40, 90], [1, 1], seed=1, device=device)  # new tensors
    assert torch.equal(op(*step, 0.1), _reference(step, 0.1))
    assert stand_in.metadata_made == 3
    with torch.inference_mode():  # how the engine runs its steps
        step = [t.clone() for t in step]
        for _ in range(2):
            assert torch.equal(op(*step, 0.1), _reference(step, 0.1))
    assert stand_in.metadata_made == 4 and stand_in.decode_calls == 8


@pytest.mark.parametrize("change", ["float32", "block16", "narrow_rows", "few_rows_x_heads"])
def test_other_shapes_go_to_the_fallback(stand_in, change, device, monkeypatch):
    if change == "few_rows_x_heads":
        monkeypatch.setattr(flashmla, "MIN_ROWS_X_HEADS", 2 * 2 + 1)  # 2 rows x 2 heads: one short
    kw = {"float32": dict(dtype=torch.float32), "block16": dict(block=16), "narrow_rows": dict(d_c=32, d_r=8),
          "few_rows_x_heads": {}}[change]
    args = _inputs([5, 20], [1, 1], device=device, **kw)
    calls = []
    op = flashmla.FlashMLADecode(lambda *a: calls.append(a) or "fallback")
    assert op(*args, 0.1) == "fallback" and len(calls) == 1
    assert stand_in.decode_calls == 0


def test_the_backend_table_and_block_size(stand_in, monkeypatch):
    ops = nvidia.deepinfer_ops(platform=None, model_config=None, batch_invariant=False)
    assert isinstance(ops["mla_decode_attention"], flashmla.FlashMLADecode)
    assert ops["mla_decode_attention"].impl.startswith("flashmla (stand-in 0")
    invariant = nvidia.deepinfer_ops(platform=None, model_config=None, batch_invariant=True)
    assert not isinstance(invariant["mla_decode_attention"], flashmla.FlashMLADecode)

    config = types.SimpleNamespace(model_type="deepseek_v2", kv_lora_rank=512, qk_rope_head_dim=64)
    assert nvidia.deepinfer_scheduler_limits(platform=None, model_config=config).block_size == 64
    for other in (dict(kv_lora_rank=32, qk_rope_head_dim=8), dict(model_type="deepseek_v4")):
        changed = types.SimpleNamespace(**{**vars(config), **other})
        assert nvidia.deepinfer_scheduler_limits(platform=None, model_config=changed).block_size is None

    monkeypatch.setenv("DEEPINFER_EXTERNAL_KERNELS", "0")
    ops = nvidia.deepinfer_ops(platform=None, model_config=None, batch_invariant=False)
    assert not isinstance(ops["mla_decode_attention"], flashmla.FlashMLADecode)
    assert nvidia.deepinfer_scheduler_limits(platform=None, model_config=config).block_size is None


def test_without_flash_mla_nothing_changes(monkeypatch):
    monkeypatch.setattr(flashmla, "version", lambda: None)
    ops = {"mla_decode_attention": object()}
    assert flashmla.provide(ops) is ops


# ------------------------------------------------------------------------------------------------
# the real kernel


def _real_flash_mla(monkeypatch):
    monkeypatch.setattr(flashmla, "MIN_ROWS_X_HEADS", 1)  # FlashMLA for these small batches too
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if flashmla.version() is None:
        pytest.skip("flash_mla does not import (pip install 'deepinfer-nvidia-sm100[flashmla]')")


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("seq_lens,query_lens", [([1, 17, 300], [1, 1, 1]), ([129, 64, 4000], [4, 0, 2]),
                                                 ([2048] * 8, [1] * 8)])
def test_flashmla_against_the_reference(heads, seq_lens, query_lens, monkeypatch):
    _real_flash_mla(monkeypatch)
    args = _inputs(seq_lens, query_lens, heads=heads, device="cuda", seed=3)
    scale = ATTENTION_SCALES["v3_yarn"]
    op = flashmla.FlashMLADecode(lambda *a: pytest.fail("the fallback ran"))
    assert_close(op(*args, scale), _reference(args, scale), "mla_decode_attention", torch.bfloat16)


@pytest.mark.gpu
def test_flashmla_padding_rows_and_cuda_graph(monkeypatch):
    """Captured once, replayed: the same bits as eager; new lengths, rows and tables are honoured;
    padding rows are zeros."""
    _real_flash_mla(monkeypatch)
    args = _inputs([700, 1, 64, 333], [4, 1, 2, 3], heads=16, device="cuda", seed=4)
    q_latent, q_pe, kv_cache, tables, lens, starts = args
    scale = ATTENTION_SCALES["v2lite_yarn"]
    op = flashmla.FlashMLADecode(None)

    eager = op(*args, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the same tensors as the eager call: the capture makes its own plan
        captured = op(*args, scale)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    lens.copy_(torch.tensor([5, 720, 0, 100], dtype=torch.int32, device="cuda"))  # the third: padding
    starts.copy_(torch.tensor([0, 2, 7, 8, 10], dtype=torch.int32, device="cuda"))
    tables.copy_(tables.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[7], torch.zeros_like(captured[7]))
    assert_close(captured, _reference(args, scale), "mla_decode_attention", torch.bfloat16)


@pytest.mark.gpu
def test_flashmla_passes_the_kit(monkeypatch):
    """The conformance kit on the provider with FlashMLA taking every call it fits (the op table's
    threshold would leave the kit's small batches to the Triton kernel, judged on its own)."""
    _real_flash_mla(monkeypatch)
    from deepinfer_core.conformance.ops_suite import run_op
    from deepinfer_nvidia_sm100.kernels import mla_decode

    report = run_op("mla_decode_attention", flashmla.FlashMLADecode(mla_decode.mla_decode_attention), torch.bfloat16, "cuda")
    assert report.result == "PASS", report.detail()
