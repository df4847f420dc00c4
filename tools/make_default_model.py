#!/usr/bin/env python
"""Build DeepInfer's embedded default checkpoint: deepinfer_core/default_model/.

A tiny DeepSeek-V3-architecture model with RANDOM weights (seeded) in Hugging Face
format, plus a real byte-level BPE tokenizer, small enough to commit. The engine
runs on it when the user gives no model. Its output text is noise.

    python tools/make_default_model.py [--out DIR]

Tokenizer
    Byte-level BPE (``tokenizers``: ByteLevel pre-tokenizer + ByteLevel decoder, no
    normalizer, so any text round-trips exactly), vocab 2048, trained on the running
    interpreter's standard-library ``*.py`` sources (sorted file list, first
    ``CORPUS_CAP_BYTES`` of text). Special tokens, as DeepSeek spells them:
    ``<｜begin▁of▁sentence｜>`` = 0 (BOS), ``<｜end▁of▁sentence｜>`` = 1 (EOS),
    ``<｜▁pad▁｜>`` = 2 (PAD). Like DeepSeek's tokenizer, ``encode`` ADDS BOS (a
    TemplateProcessing post-processor, ``add_special_tokens=False`` turns it off) and
    never adds EOS. The merges depend on the stdlib text, so a different Python
    version can give a different (equally valid) tokenizer; for one interpreter the
    output is byte-identical run to run.

Model
    ``DeepseekV3ForCausalLM`` (3 layers: 1 dense + 2 MoE, hidden 128, MLA with q/kv
    LoRA, 8 routed experts top-2 in 2 groups, 1 shared expert, YaRN rope), seeded with
    ``torch.manual_seed(0)``, bf16 except ``e_score_correction_bias`` (fp32, as in
    DeepSeek's release; non-zero random). One MTP module is appended in DeepSeek's
    checkpoint layout under ``model.layers.3.`` (enorm, hnorm, eh_proj,
    shared_head.norm + a full MoE decoder layer); its embed_tokens / shared_head.head
    are not stored (the engine ties them to the main model's). Transformers ignores
    these keys when loading.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "deepinfer_core" / "default_model"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # ids 0, 1, 2
VOCAB_SIZE = 2048
CORPUS_CAP_BYTES = 4 * 1024 * 1024
MODEL_MAX_LENGTH = 4096
SEED = 0

README = """\
# DeepInfer default model (RANDOM weights)

- Tiny DeepSeek-V3 architecture (`model_type: deepseek_v3`): 3 layers (1 dense + 2 MoE with 8 routed experts top-2 and 1 shared), hidden 128, MLA attention, YaRN rope, plus 1 MTP layer stored as `model.layers.3.*`; {params:,} parameters, bf16 (routing bias `e_score_correction_bias` fp32).
- Tokenizer: byte-level BPE, {vocab} tokens, trained on the Python standard library sources; `encode` adds BOS `<｜begin▁of▁sentence｜>` (id 0), EOS is `<｜end▁of▁sentence｜>` (id 1).
- Weights are random (seeded `torch.manual_seed(0)`), NOT trained: the engine runs on it when no model is given, and its output text is noise until a trained default lands.
- Produced by `python tools/make_default_model.py` (reproducible; do not edit these files by hand).
"""


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(stdlib.rglob("*.py")):
        parts = set(p.relative_to(stdlib).parts)
        if parts & {"site-packages", "dist-packages", "__pycache__"}:
            continue
        files.append(p)
    return files


def corpus_iter(cap: int = CORPUS_CAP_BYTES):
    used = 0
    for p in corpus_files():
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        n = len(text.encode("utf-8"))
        if used + n > cap:
            break
        used += n
        yield text


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_iter(), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, 0)],
    )

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(out)
    # Keep tokenizer_config.json minimal and explicit; tokenizer.json is the source of truth.
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "legacy": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    for extra in ("special_tokens_map.json", "chat_template.jinja"):
        (out / extra).unlink(missing_ok=True)
    return tok.get_vocab_size()


def make_config(vocab_size: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        num_nextn_predict_layers=1,
        max_position_embeddings=4096,
        rope_scaling={
            "type": "yarn",
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )


def build_model(out: Path, vocab_size: int):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    torch.manual_seed(SEED)
    config = make_config(vocab_size)
    model = DeepseekV3ForCausalLM(config)
    model.eval()
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_((torch.rand(buf.shape, generator=gen) - 0.5) * 0.1)
    model.to(torch.bfloat16)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            assert buf.abs().sum() > 0
    model.save_pretrained(out, safe_serialization=True)

    # ---- append the MTP module (DeepSeek layout, layer index = num_hidden_layers) ----
    st_path = out / "model.safetensors"
    with safe_open(st_path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    n = config.num_hidden_layers
    src, dst = f"model.layers.{n - 1}.", f"model.layers.{n}."
    assert not any(k.startswith(dst) for k in tensors)
    H = config.hidden_size
    mtp: dict[str, torch.Tensor] = {}
    for k in sorted(tensors):
        if not k.startswith(src):
            continue
        ref = tensors[k]
        name = dst + k[len(src):]
        if k.endswith("norm.weight"):  # input/post_attention/q_a/kv_a layernorms
            t = torch.ones(ref.shape, dtype=ref.dtype)
        elif k.endswith("e_score_correction_bias"):
            t = (torch.rand(ref.shape, generator=gen) - 0.5) * 0.1
        else:
            t = torch.randn(ref.shape, generator=gen) * config.initializer_range
        mtp[name] = t.to(ref.dtype).contiguous()
    bf16 = torch.bfloat16
    mtp[dst + "enorm.weight"] = torch.ones(H, dtype=bf16)
    mtp[dst + "hnorm.weight"] = torch.ones(H, dtype=bf16)
    mtp[dst + "eh_proj.weight"] = (torch.randn(H, 2 * H, generator=gen) * config.initializer_range).to(bf16)
    mtp[dst + "shared_head.norm.weight"] = torch.ones(H, dtype=bf16)
    tensors.update(mtp)
    for k in tensors:  # DeepSeek ships the routing bias in fp32; everything else is bf16
        tensors[k] = tensors[k].float() if k.endswith("e_score_correction_bias") else tensors[k].to(bf16)
    save_file(dict(sorted(tensors.items())), st_path, metadata={"format": "pt"})
    return model, sum(t.numel() for t in tensors.values())


def check(out: Path, ref_model) -> None:
    import torch
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the MTP keys (model.layers.3.*) are "unexpected" by design
    hf_logging.disable_progress_bar()

    tok = AutoTokenizer.from_pretrained(out)
    s = "def foo(x):\n    return x"
    ids = tok.encode(s)
    assert ids[0] == 0, ids
    assert tok.decode(ids, skip_special_tokens=True) == s
    model = DeepseekV3ForCausalLM.from_pretrained(out)
    model.eval()
    # the saved (per-expert, DeepSeek-layout) checkpoint must reload to exactly the built weights
    ref = ref_model.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v.float(), ref[k].float()), k
    x = tok(s, return_tensors="pt")
    with torch.no_grad():
        y = model.generate(**x, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert y.shape[1] == x["input_ids"].shape[1] + 5 or int(y[0, -1]) == 1, y.shape
    print("transformers generate ok:", repr(tok.decode(y[0, x["input_ids"].shape[1]:])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--no-check", action="store_true", help="skip the transformers load/generate check")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():  # overwrite: start from an empty directory
        if p.is_file():
            p.unlink()

    vocab = build_tokenizer(out)
    model, params = build_model(out, vocab)
    (out / "README.md").write_text(README.format(params=params, vocab=vocab), encoding="utf-8")
    if not args.no_check:
        check(out, model)

    total = 0
    for p in sorted(out.iterdir()):
        size = p.stat().st_size
        total += size
        print(f"{size:>10,}  {p.relative_to(REPO) if p.is_relative_to(REPO) else p}")
    print(f"{total:>10,}  total ({total / 2**20:.2f} MiB)")
    print(f"params: {params:,} (incl. MTP layer)   tokenizer vocab: {vocab}   python {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
