"""The embedded default checkpoint (deepinfer_core/default_model/, built by tools/make_default_model.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers / huggingface_hub are imported

import pytest
import torch
from safetensors import safe_open

DIR = Path(__file__).resolve().parent.parent / "deepinfer_core" / "default_model"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
MTP = 3  # checkpoint layer index of the MTP module = num_hidden_layers

SNIPPETS = [
    "def foo(x):\n    return x",
    "import os\n\n\nclass A(object):\n\tdef __init__(self, *a, **kw) -> None:\n\t\tself.x = {'k': [1, 2.5e-3]}\r\n",
    "    leading spaces, trailing spaces   \n\n\n",
    "Grüße, naïve café — “quotes” ½ ∑ ∞",
    "中文测试：你好，世界！日本語のテキスト。한국어",
    "emoji 🤖🚀👩‍💻 and combining e\u0301 vs \u00e9, zero-width\u200bjoiner, RTL مرحبا",
    "",
    "x",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DIR, local_files_only=True)


@pytest.fixture(scope="module")
def config():
    return json.loads((DIR / "config.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tensors():
    with safe_open(DIR / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        return {k: f.get_tensor(k) for k in f.keys()}


def test_config(config):
    assert config["model_type"] == "deepseek_v3"
    assert config["num_nextn_predict_layers"] == 1
    assert config["num_hidden_layers"] == MTP
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    assert config["rope_parameters"]["rope_type"] == "yarn"
    assert config["tie_word_embeddings"] is False


def test_transformers_loads_and_generates(tokenizer, config):
    from transformers import AutoConfig, DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # model.layers.3.* (MTP) is "unexpected" to transformers by design
    assert AutoConfig.from_pretrained(DIR, local_files_only=True).model_type == "deepseek_v3"
    model = DeepseekV3ForCausalLM.from_pretrained(DIR, local_files_only=True).eval()
    assert len(tokenizer) == config["vocab_size"] == model.config.vocab_size
    x = tokenizer("def foo(x):\n    return x", return_tensors="pt")
    with torch.no_grad():
        logits = model(**x).logits
        assert logits.shape == (1, x["input_ids"].shape[1], config["vocab_size"])
        assert torch.isfinite(logits).all()
        y = model.generate(**x, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert y.shape[1] > x["input_ids"].shape[1]


def test_mtp_weights(tensors, config):
    H = config["hidden_size"]
    src, dst = "model.layers.2.", f"model.layers.{MTP}."
    layer2 = {k[len(src):]: t.shape for k, t in tensors.items() if k.startswith(src)}
    mtp = {k[len(dst):]: t.shape for k, t in tensors.items() if k.startswith(dst)}
    extra = {
        "enorm.weight": (H,),
        "hnorm.weight": (H,),
        "eh_proj.weight": (H, 2 * H),
        "shared_head.norm.weight": (H,),
    }
    assert {k: tuple(v) for k, v in mtp.items()} == {**{k: tuple(v) for k, v in layer2.items()}, **extra}
    # a full MoE decoder layer in DeepSeek's per-expert layout
    for e in range(config["n_routed_experts"]):
        assert dst + f"mlp.experts.{e}.gate_proj.weight" in tensors
    assert dst + "mlp.shared_experts.down_proj.weight" in tensors
    assert dst + "self_attn.kv_a_proj_with_mqa.weight" in tensors
    # embed_tokens / shared_head.head are tied to the main model, not stored
    assert dst + "embed_tokens.weight" not in tensors and dst + "shared_head.head.weight" not in tensors
    assert not any(k.startswith(f"model.layers.{MTP + 1}.") for k in tensors)
    for k in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "input_layernorm.weight"):
        assert torch.equal(tensors[dst + k].float(), torch.ones(H))
    assert tensors[dst + "eh_proj.weight"].float().std() > 0
    for layer in (1, 2, MTP):  # random, non-zero routing bias, fp32 as DeepSeek ships it
        bias = tensors[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and bias.abs().sum() > 0
    assert tensors["lm_head.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("text", SNIPPETS)
def test_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id == 0  # encode adds BOS, like DeepSeek's tokenizer
    assert tokenizer.eos_token_id not in ids  # ... and never EOS
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]


def test_tokenizer_specials(tokenizer):
    assert (tokenizer.bos_token, tokenizer.eos_token) == (BOS, EOS)
    assert tokenizer.convert_tokens_to_ids([BOS, EOS]) == [0, 1]
    assert tokenizer.pad_token_id is not None
    assert tokenizer.decode([0, 1]) == BOS + EOS
    # a trained BPE, not raw bytes: common Python compresses well
    assert len(tokenizer.encode("def __init__(self):\n        return None", add_special_tokens=False)) <= 10


def test_total_size():
    files = [p for p in DIR.iterdir() if p.is_file()]
    names = {p.name for p in files}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in files) < 3 * 2**20  # < 3 MiB
