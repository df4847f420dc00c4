"""DeepSeek-V4 with its MXFP4 routed experts kept packed (``Platform.fp4_experts``, the model's
``keep_fp4``): a tiny checkpoint written as DeepSeek ships V4-Flash (block-FP8 linears, MXFP4
experts) loaded on the CPU reference with the flag on holds its experts as uint8 codes and UE8M0
scale bytes, byte for byte as stored, and generates the same greedy tokens as with the flag off
(experts dequantised at load): the reference op dequantises the same values exactly."""

from __future__ import annotations

import pytest
import torch

import deepinfer_core.plugins
from safetensors.torch import save_file

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.loader import CheckpointError, _open
from deepinfer_core.models.layers import Experts
from deepinfer_core.parallel.expert_parallel import ExpertParallel
from tests.hf_checkpoints_v4 import random_prompt, write_checkpoint_v4
from tests.v41_checkpoints import write_checkpoint_v41

pytestmark = pytest.mark.usefixtures("one_thread")
NAME = "v4_flash_like"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4-fp8-fp4")
    write_checkpoint_v4(NAME, path, quant="fp8+fp4", with_mtp=True)
    return path


@pytest.fixture
def fp4_platform(monkeypatch):
    """The reference backend's platform with ``fp4_experts`` on (what the NVIDIA plugin sets)."""
    load_backend = deepinfer_core.plugins.load_backend

    def with_fp4(*args, **kwargs):
        plugins, backend, platform, ops, limits = load_backend(*args, **kwargs)
        platform.fp4_experts = True
        return plugins, backend, platform, ops, limits

    monkeypatch.setattr(deepinfer_core.plugins, "load_backend", with_fp4)


def _llm(path) -> LLM:
    return LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False, max_num_seqs=4)


def _greedy(llm: LLM) -> list[list[int]]:
    prompts = [random_prompt(40, seed=1), random_prompt(9, seed=2)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def _expert_bytes(model) -> tuple[int, set[torch.dtype]]:
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    params = [p for m in experts for p in m.parameters()]
    return sum(p.numel() * p.element_size() for p in params), {p.dtype for p in params}


def test_kept_mxfp4_experts_are_the_stored_bytes_and_generate_the_same_tokens(checkpoint, fp4_platform, monkeypatch):
    packed = _llm(checkpoint)
    model = packed.engine.model
    assert model.keep_fp4
    size, dtypes = _expert_bytes(model)
    assert dtypes == {torch.uint8}
    config = model.config
    e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    layers = len(model.model.layers) + model.num_mtp_layers
    per_expert = 3 * d * i // 2 + 3 * d * i // 32  # codes + one scale byte per 32 inputs: 0.53 bytes a weight
    assert size == layers * e * per_expert
    # byte for byte what the checkpoint stores (w3: the up rows, second half of gate_up_proj)
    f = _open(checkpoint / "model.safetensors")
    ex = model.model.layers[1].mlp.experts
    assert torch.equal(ex.gate_up_proj[2, i:], f.get_tensor("layers.1.ffn.experts.2.w3.weight").view(torch.uint8))
    assert torch.equal(ex.down_proj_scale_inv[2], f.get_tensor("layers.1.ffn.experts.2.w2.scale").view(torch.uint8))
    tokens = _greedy(packed)

    monkeypatch.undo()  # the flag off: experts dequantised at load, float32
    plain = _llm(checkpoint)
    plain_size, plain_dtypes = _expert_bytes(plain.engine.model)
    assert plain_dtypes == {torch.float32} and plain_size == layers * e * 3 * d * i * 4
    assert _greedy(plain) == tokens
    assert len({t for row in tokens for t in row}) > 2  # not degenerate


def test_v41_with_dspark_stages_keeps_its_experts_packed(tmp_path, monkeypatch, fp4_platform):
    """V4.1 reuses V4's MoE: its decoder and its DSpark stages (their own expert count) keep uint8
    experts and generate the flag-off tokens."""
    write_checkpoint_v41("v41-dspark", tmp_path)
    packed = _llm(tmp_path)
    assert _expert_bytes(packed.engine.model)[1] == {torch.uint8}
    assert packed.engine.model.num_mtp_layers == 3
    tokens = _greedy(packed)
    monkeypatch.undo()
    assert _greedy(_llm(tmp_path)) == tokens


@pytest.mark.parametrize("key,value,says", [
    ("layers.1.ffn.experts.0.w1.weight", lambda t: torch.zeros(t.shape[0], 2 * t.shape[1], dtype=torch.bfloat16), "keep_fp4"),
    ("layers.1.ffn.experts.0.w1.scale", lambda t: torch.ones(t.shape, dtype=torch.float32), "e8m0"),
])
def test_a_checkpoint_the_packed_experts_cannot_take_is_refused(checkpoint, tmp_path, fp4_platform, key, value, says):
    f = _open(checkpoint / "model.safetensors")
    tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[key] = value(tensors[key])
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (checkpoint / name).is_file():
            (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    with pytest.raises(CheckpointError, match=f"{key}.*{says}"):
        _llm(tmp_path)


class _Solo:
    """A one-rank communicator: all_to_all hands the rows back."""

    rank, size = 0, 1

    def __init__(self):
        self.widths: list[int] = []  # of the model-dtype rows exchanged

    def all_to_all(self, t, send_counts, recv_counts):
        if t.dtype == torch.float32 and t.dim() == 2:
            self.widths.append(t.shape[1])
        return t.clone(), None

    def all_reduce(self, t):
        return t


def test_expert_parallel_runs_kept_mxfp4_experts(checkpoint, fp4_platform):
    """ExpertParallel's shard takes the packed weights and their scales, and its idle pass sends
    rows of the hidden size (not the packed width)."""
    llm = _llm(checkpoint)
    model = llm.engine.model
    want = _greedy(llm)
    model.expert_slots = tuple(range(model.config.n_routed_experts))
    comm = _Solo()
    ep = ExpertParallel(model, comm, model.config.n_routed_experts, extra=0)
    shard = ep.layers[0].ep.shard
    assert shard.w13.dtype == torch.uint8 and shard.w13_scale.dtype == torch.uint8 and shard.block is None
    ep.idle()
    assert set(comm.widths) == {model.config.hidden_size}
    assert _greedy(llm) == want
