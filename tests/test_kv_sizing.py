"""How many KV blocks the engine sizes on a device (``startup.auto_num_blocks`` and
``activation_bytes``), on the CPU.

CI has no GPU, so the engine of a tiny checkpoint is built on the CPU and then told it runs on
``cuda:0``: the platform's device says so, the engine's device is a CPU device whose ``type``
reads "cuda", torch.cuda's memory query and torch.accelerator's allocator statistics are faked
(the measured peak grows with the tokens the profiling forward ran). Every number is counted by
hand from the tiny config:

* paged bytes per block: 3 layers x (kv_lora_rank 32 + qk_rope_head_dim 8) x 4 bytes (float32)
  = 480 per token, x block_size 4 = 1920;
* activation bytes: the profiled prefill of max_num_batched_tokens = 16 tokens (faked peak
  16 x 62_500 = 1_000_000), plus (max_model_len 64 - 16) x (latent 40 + 4 heads x (16 + 16 + 24))
  x 4 = 48 x 1056 = 50_688 for the long context, plus the logits of max_num_seqs 2 rows
  2 x 160 x 4 x 3 = 3_840, plus the 256 MiB margin: 269_489_984 in all;
* budget: the smaller of this engine's share, total x gpu_memory_utilization 0.5 - what the
  allocator holds (the weights) - ring/state bytes - activations, and the device's free memory -
  ring/state bytes - activations; blocks = budget // 1920, at most ceil(2 x 64 / 4) = 32
  (max_num_seqs sequences of max_model_len).
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_core.engine.runner as runner_module
from deepinfer_core.engine.startup import activation_bytes, auto_num_blocks
from deepinfer_core import LLM
from deepinfer_core.config import ConfigError
from deepinfer_core.engine import startup as engine_module
from deepinfer_core.models.batch import CacheGroup
from tests.hf_checkpoints import write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

TOTAL = 2**30
ALLOCATED = 5_000_000  # what the allocator holds before the profiling forward (weights)
PEAK_PER_TOKEN = 62_500
PER_BLOCK = 1920
ACTIVATION = 16 * PEAK_PER_TOKEN + 50_688 + 3_840 + 256 * 2**20
assert ACTIVATION == 269_489_984
USABLE = TOTAL // 2  # gpu_memory_utilization 0.5


def free_for(budget: int) -> int:
    """The free memory that leaves ``budget`` bytes for the paged blocks (the share is larger)."""
    return ACTIVATION + budget


def held_for(budget: int) -> int:
    """What the allocator may hold so that this engine's share leaves ``budget`` bytes."""
    return USABLE - ACTIVATION - budget


class CudaLike(str):
    """A device torch takes for the CPU ("cpu") but the engine's checks read as a GPU."""

    type = "cuda"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("sizing") / "ckpt"
    write_checkpoint("v3_grouped", path)
    return LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False, block_size=4, num_kv_blocks=16,
               max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, gpu_memory_utilization=0.5)


@pytest.fixture
def gpu(llm, monkeypatch):
    """The engine on a fake cuda:0; returns the fake's state: set ``free``; ``calls`` logs the
    memory calls in order, ``forwards`` the prefill tokens of each forward since the last reset."""
    engine = llm.engine
    state = {"free": TOTAL, "held": ALLOCATED, "calls": [], "forwards": []}
    monkeypatch.setattr(engine, "device", CudaLike("cpu"))
    monkeypatch.setattr(engine.platform, "device", "cuda:0")
    monkeypatch.setattr(runner_module, "to_device", lambda t, device: t)  # no pinned memory without a GPU

    def mem_get_info(dev):
        state["calls"].append(("mem_get_info", str(dev)))
        return state["free"], TOTAL

    def reset_peak(dev):
        state["calls"].append(("reset_peak", str(dev)))
        state["forwards"] = []

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: None)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: state["calls"].append(("empty_cache",)))
    monkeypatch.setattr(torch.accelerator, "reset_peak_memory_stats", reset_peak)
    monkeypatch.setattr(torch.accelerator, "memory_allocated", lambda dev: ALLOCATED)
    monkeypatch.setattr(torch.accelerator, "memory_reserved", lambda dev: state["held"])
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated",
                        lambda dev: ALLOCATED + PEAK_PER_TOKEN * sum(state["forwards"]))
    forward = engine.model.forward

    def spy(ids, positions, meta, caches):
        state["forwards"].append(meta.num_prefill_tokens)
        return forward(ids, positions, meta, caches)

    monkeypatch.setattr(engine.model, "forward", spy)
    return state


def auto_blocks(llm, groups=None) -> int:
    engine = llm.engine
    return auto_num_blocks(engine, groups or engine.cache_groups, 4, 0)


def test_activation_bytes_are_the_profiled_prefill_plus_the_hand_count(llm, gpu):
    assert activation_bytes(llm.engine, llm.engine.cache_groups, 4, 64) == ACTIVATION
    assert gpu["forwards"] == [16], "one profiling forward: a prefill of max_num_batched_tokens tokens"
    assert activation_bytes(llm.engine, llm.engine.cache_groups, 4, 16) == ACTIVATION - 50_688  # no longer context


def test_blocks_are_what_the_memory_left_holds(llm, gpu):
    gpu["free"] = free_for(10 * PER_BLOCK + 1000)
    assert auto_blocks(llm) == 10
    # the allocator's cache is handed back before free memory is read; the profile comes after
    assert gpu["calls"][:2] == [("empty_cache",), ("mem_get_info", "cuda:0")]
    assert ("reset_peak", "cuda:0") in gpu["calls"][2:]
    gpu["free"] = free_for(PER_BLOCK)  # exactly one block
    assert auto_blocks(llm) == 1


def test_blocks_are_capped_by_what_max_num_seqs_sequences_of_max_model_len_need(llm, gpu):
    gpu["free"] = TOTAL  # budget 267_380_928 bytes: 139_260 blocks, but 32 are all that can be used
    assert auto_blocks(llm) == 32


def test_ring_and_state_groups_take_their_bytes_per_sequence_first(llm, gpu):
    # a state group of 1 layer: 3 rows x 16 x 4 bytes = 192 bytes per sequence, x max_num_seqs 2 = 384
    extra = CacheGroup("st", "state", ("extra.state",), 16, torch.float32, state_rows=3)
    gpu["free"] = free_for(10 * PER_BLOCK + 200)
    assert auto_blocks(llm) == 10
    assert auto_blocks(llm, llm.engine.cache_groups + [extra]) == 9  # 19_400 - 384 bytes left


def test_memory_that_cannot_hold_one_block_is_an_error(llm, gpu):
    gpu["free"] = free_for(PER_BLOCK - 1)
    with pytest.raises(ConfigError, match=r"no memory left for the KV cache: the device has .*other processes hold"):
        auto_blocks(llm)
    gpu["free"], gpu["held"] = TOTAL, USABLE  # the weights alone fill gpu_memory_utilization of the device
    with pytest.raises(ConfigError, match=r"no memory left for the KV cache: this engine's share .*raise gpu_memory_utilization, set num_kv_blocks"):
        auto_blocks(llm)


def test_the_share_is_this_engines_not_the_devices(llm, gpu):
    """vLLM's meaning of gpu_memory_utilization: another process's memory does not come out of this
    engine's share (two instances at 0.45 share one GPU), only out of what is free."""
    gpu["free"], gpu["held"] = TOTAL // 2, held_for(10 * PER_BLOCK + 1000)  # another process holds half the device
    assert auto_blocks(llm) == 10
    gpu["free"] = free_for(3 * PER_BLOCK)  # it holds nearly all: what is free decides
    assert auto_blocks(llm) == 3


def test_the_cpu_takes_a_quarter_of_free_host_memory_and_profiles_nothing(llm, monkeypatch):
    engine = llm.engine
    free = 10 * PER_BLOCK * 4 + 100
    monkeypatch.setattr(engine.platform, "memory_info", lambda: (free, 2 * free))
    assert engine_module.CPU_KV_MEMORY_FRACTION == 0.25
    assert activation_bytes(engine, engine.cache_groups, 4, 64) == 0
    assert auto_blocks(llm) == 10
