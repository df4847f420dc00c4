"""config.json validation, dtype choice and DEEPINFER_* settings."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer_core.config import DEFAULT_MODEL_DIR, ConfigError, settings
from deepinfer_core.models.registry import read_config
from deepinfer_core.engine.startup import resolve_dtype


def write_config(tmp_path, **changes):
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_default_config_reads():
    config = read_config(DEFAULT_MODEL_DIR)
    assert config.model_type == "deepseek_v3" and config.num_nextn_predict_layers == 1
    assert config.latent_dim == config.kv_lora_rank + config.qk_rope_head_dim
    assert config.rope_parameters["rope_type"] == "yarn" and config.fp8_block is None


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "llama"}, "model_type 'llama' is not supported; supported model types: deepseek_v3, deepseek_v2"),
        ({"n_routed_experts": 7}, "not divisible by n_group"),
        ({"topk_group": 5}, "topk_group=5 exceeds n_group"),
        ({"num_experts_per_tok": 99}, "exceeds n_routed_experts"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "only DeepSeek's block FP8"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, changes, message):
    with pytest.raises(ConfigError, match="config.json") as info:
        read_config(write_config(tmp_path, **changes))
    assert message in str(info.value)


def test_missing_and_broken_config(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_config(tmp_path)


@pytest.mark.parametrize("block", [(128, 128), (64, 128)])
def test_fp8_block_is_read(tmp_path, block):
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    assert read_config(write_config(tmp_path, quantization_config=quant)).fp8_block == block  # (bn, bk), in order


@pytest.mark.parametrize("norm", [False, True])
def test_norm_topk_prob_is_read(tmp_path, norm):
    assert read_config(write_config(tmp_path, norm_topk_prob=norm)).norm_topk_prob is norm


def test_dtype_resolution():
    config = read_config(DEFAULT_MODEL_DIR)
    every = (torch.float32, torch.bfloat16, torch.float16)
    assert resolve_dtype("auto", config, every) == torch.bfloat16  # the checkpoint's own dtype
    assert resolve_dtype("float32", config, every) == torch.float32
    with pytest.raises(ConfigError, match="dtype 'int8' is not supported"):
        resolve_dtype("int8", config, every)
    with pytest.raises(ConfigError, match="not supported by this backend"):
        resolve_dtype("float16", config, (torch.float32,))


def test_auto_dtype_is_float32_on_the_cpu():
    """The reference backend is the numeric ground truth: a bf16 checkpoint runs in float32 on the
    CPU unless a dtype is named; elsewhere, or where the backend has no float32, the checkpoint's."""
    config = read_config(DEFAULT_MODEL_DIR)
    every = (torch.float32, torch.bfloat16, torch.float16)
    assert resolve_dtype("auto", config, every, "cpu") == torch.float32
    assert resolve_dtype("bfloat16", config, every, "cpu") == torch.bfloat16
    assert resolve_dtype("auto", config, every, "cuda") == torch.bfloat16
    assert resolve_dtype("auto", config, (torch.bfloat16,), "cpu") == torch.bfloat16


def test_dtype_takes_vllms_spellings():
    config = read_config(DEFAULT_MODEL_DIR)
    every = (torch.float32, torch.bfloat16, torch.float16)
    assert resolve_dtype("half", config, every) == torch.float16 and resolve_dtype("float", config, every) == torch.float32
    assert resolve_dtype("bf16", config, every) == torch.bfloat16


def test_settings_read_the_environment(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", "/models/x")
    s = settings()
    assert s.accelerator == "nvidia" and s.hf_model_dir == "/models/x" and s.log_level == "INFO"


def _v4_dir(tmp_path, **changes):
    from benchmarks.models import V4_FLASH

    raw = {k: v for k, v in {**V4_FLASH, **changes}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_v4_flash_config_reads_its_layer_kinds(tmp_path):
    config = read_config(_v4_dir(tmp_path))
    assert config.model_type == "deepseek_v4" and config.num_hidden_layers == 43
    assert config.compress_ratios == tuple([0, 0] + [4, 128] * 20 + [4])  # the MTP tail entry dropped
    assert (config.csa_ratio, config.hca_ratio, config.num_hash_layers, config.expert_dtype) == (4, 128, 3, "fp4")
    assert config.fp8_block == (128, 128)


@pytest.mark.parametrize("changes,needle", [
    (dict(compress_ratios=[0, 8] * 22), "transformers reads only 0, 4 and 128"),
    (dict(compress_ratios=None), "needs compress_ratios"),
])
def test_v4_layer_kinds_must_be_given_as_transformers_reads_them(tmp_path, changes, needle):
    with pytest.raises(ConfigError, match=needle):
        read_config(_v4_dir(tmp_path, **changes))
