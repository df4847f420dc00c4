"""The embedded default checkpoint (deepinfer_core/default_model/, trained by tools/train_default_model.py)."""

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
MTP = 4  # checkpoint layer index of the MTP module = num_hidden_layers

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
    src, dst = f"model.layers.{MTP - 1}.", f"model.layers.{MTP}."
    last = {k[len(src):]: t.shape for k, t in tensors.items() if k.startswith(src)}
    mtp = {k[len(dst):]: t.shape for k, t in tensors.items() if k.startswith(dst)}
    extra = {
        "enorm.weight": (H,),
        "hnorm.weight": (H,),
        "eh_proj.weight": (H, 2 * H),
        "shared_head.norm.weight": (H,),
    }
    # a full MoE decoder layer (the last main layer's shapes) plus DeepSeek's MTP parts
    assert {k: tuple(v) for k, v in mtp.items()} == {**{k: tuple(v) for k, v in last.items()}, **extra}
    for e in range(config["n_routed_experts"]):
        assert dst + f"mlp.experts.{e}.gate_proj.weight" in tensors
    assert dst + "mlp.shared_experts.down_proj.weight" in tensors
    # embed_tokens / shared_head.head are the main model's, not stored again
    assert dst + "embed_tokens.weight" not in tensors and dst + "shared_head.head.weight" not in tensors
    assert not any(k.startswith(f"model.layers.{MTP + 1}.") for k in tensors)
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):  # trained, not initial values
        t = tensors[dst + k].float()
        assert torch.isfinite(t).all() and not torch.equal(t, torch.ones_like(t)) and t.std() > 0, k
    for layer in range(config["first_k_dense_replace"], MTP + 1):  # routing bias in fp32, as DeepSeek ships it
        assert tensors[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert all(t.dtype == torch.bfloat16 for k, t in tensors.items() if not k.endswith("e_score_correction_bias"))


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


def test_files_and_size():
    files = [p for p in DIR.iterdir() if p.is_file()]
    names = {p.name for p in files}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md", "training.json"} <= names
    assert sum(p.stat().st_size for p in files) <= 20 * 2**20  # the budget for an embedded model


def test_model_card_quotes_the_training_record():
    """MODEL_CARD.md's numbers are training.json's (written by the training script), not typed in."""
    record = json.loads((DIR / "training.json").read_text())
    card = (DIR / "MODEL_CARD.md").read_text(encoding="utf-8")
    assert f"{record['test']['loss']:.3f}" in card and f"{record['val']['loss']:.3f}" in card
    assert f"{record['test']['mtp_acceptance']:.3f}" in card and f"{record['train_loss_eval']:.3f}" in card
    assert record["device"] in card and "demonstration" in card


def test_engine_matches_transformers_on_the_default_model():
    """Greedy tokens and their logprobs, and teacher-forced prompt logprobs, in float32: the
    reference backend against transformers' eager DeepseekV3 on the embedded checkpoint."""
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    from deepinfer_core import LLM, SamplingParams

    hf_logging.set_verbosity_error()
    hf = DeepseekV3ForCausalLM.from_pretrained(DIR, local_files_only=True, dtype=torch.float32,
                                               attn_implementation="eager", experts_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(DIR, local_files_only=True)
    llm = LLM(accelerator="cpu", dtype="float32", progress=False)
    prompts = ["def fibonacci(n):\n", "import os\n\n\ndef read_lines(path):\n", "class Stack:\n    def __init__(self):\n"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            golden = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id,
                                 eos_token_id=None, output_logits=True, return_dict_in_generate=True)
        tokens = golden.sequences[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == tokens, prompt
        hf_logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(golden.logits, tokens)]
        ours = [lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens)]
        assert ours == pytest.approx(hf_logprobs, abs=2e-3), prompt
    text = prompts[0] + "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    out = llm.generate(text, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        golden = torch.log_softmax(hf(ids).logits[0].float(), -1)
    for pos in range(1, ids.shape[1]):
        token = out.prompt_token_ids[pos]
        assert out.prompt_logprobs[pos][token] == pytest.approx(golden[pos - 1, token].item(), abs=2e-3), pos


def test_mtp_module_matches_transformers_mtp_layer(tensors):
    """The checkpoint's MTP module was trained as transformers' MtpLayer (tools/train_default_model.py):
    our forward_mtp on its weights gives MtpLayer's hidden states and next-next-token logits, in
    float32, on a real prompt, and its greedy guesses agree with MtpLayer's."""
    from transformers import DeepseekV3ForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    from deepinfer_core.models.registry import read_config
    from deepinfer_core.loader import load_model
    from deepinfer_core.models.v3.checkpoint import split_expert_key
    from deepinfer_core.models.registry import get_model_class
    from deepinfer_core.ops import OpTable
    from tests.hf_checkpoints import build_mtp_layer, causal_mask
    from tests.test_model_parity import Seq, block_pool, make_batch, new_caches, new_seq

    hf_logging.set_verbosity_error()
    hf = DeepseekV3ForCausalLM.from_pretrained(DIR, local_files_only=True, dtype=torch.float32,
                                               attn_implementation="eager", experts_implementation="eager").eval()
    layer = build_mtp_layer(hf.config)
    prefix = f"model.layers.{MTP}."
    state = {}
    for key, t in layer.state_dict().items():  # MtpLayer keys <- the checkpoint's (experts one by one)
        name = "shared_head.norm.weight" if key == "post_norm.weight" else key.removeprefix("mtp_block.")
        split = split_expert_key(key, tuple(t.shape)) if key.startswith("mtp_block.") else None
        state[key] = torch.empty_like(t)
        for expert_key, slot in (split or {name: None}).items():
            target = slot.view(state[key]) if slot else state[key]
            target.copy_(tensors[prefix + expert_key.removeprefix("mtp_block.")].float())
    layer.load_state_dict(state)

    config = read_config(DIR)
    ours = get_model_class(config.model_type)(config, OpTable.reference(), torch.float32, torch.device("cpu"))
    load_model(DIR, config, ours, progress=False)
    assert ours.num_mtp_layers == 1
    tok = PreTrainedTokenizerFast.from_pretrained(DIR, local_files_only=True)
    tokens = tok("import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return f.read()").input_ids
    t = len(tokens) - 1
    with torch.no_grad():
        main = hf.model(torch.tensor([tokens])).last_hidden_state
        position_ids = torch.arange(t)[None]
        embeds = hf.model.embed_tokens(torch.tensor([tokens[1:]]))
        golden = layer(embeds, main[:, :t], hf.model.rotary_emb(embeds, position_ids), causal_mask(t), position_ids, None)
        golden = (golden[0] if isinstance(golden, tuple) else golden)[0]
        seq = new_seq(tokens, block_pool(2))
        caches = new_caches(ours)
        hidden = ours(*make_batch([(seq, 0, len(tokens))]), caches)
        ids, pos, batch = make_batch([(Seq(tokens[1:], seq.blocks, seq.block_size), 0, t)])  # position p carries t_{p+1}
        got = ours.forward_mtp(0, ids, pos, hidden[:t], batch, caches)
    torch.testing.assert_close(hidden, main[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(got, golden, atol=1e-4, rtol=0)
    ours_logits, hf_logits = ours.compute_logits(got), hf.lm_head(golden).float()
    torch.testing.assert_close(ours_logits.log_softmax(-1), hf_logits.log_softmax(-1), atol=1e-4, rtol=0)
    assert torch.equal(ours_logits.argmax(-1), hf_logits.argmax(-1))
