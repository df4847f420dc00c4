#!/usr/bin/env python
"""Train DeepInfer's embedded default model: deepinfer_core/default_model/.

A tiny DeepSeek-V3-architecture model (MLA with q/kv LoRA, YaRN rope, one dense first layer, then
MoE layers with group-limited sigmoid routing and a shared expert) with ONE multi-token-prediction
module in DeepSeek's layout (enorm, hnorm, eh_proj, a MoE decoder layer, shared_head.norm; the
embedding and output head shared with the main model), trained with the next-token loss plus
MTP_WEIGHT x the next-next-token loss, on the running interpreter's standard-library sources.
Whole files are held out: a validation set (picks the checkpoint kept) and a test set (reported).

    python tools/train_default_model.py [--out DIR] [--steps N] [--max-minutes M] [--device cuda]

Needs one GPU for the real run (about 4 minutes of training on an H200); ``--steps 2
--device cpu`` checks the whole pipeline on a CPU. Reproducible for a given interpreter (the
corpus is its stdlib), seed, device and library versions. Writes config.json,
model.safetensors, the tokenizer files, generation_config.json and training.json (the measured
numbers) and MODEL_CARD.md (written from them) into --out.

Tokenizer: byte-level BPE (``tokenizers``; ByteLevel pre-tokenizer and decoder, no normalizer,
so any text round-trips), VOCAB_SIZE tokens, trained on the training files only. Special tokens
as DeepSeek spells them: BOS 0, EOS 1, PAD 2; ``encode`` adds BOS, never EOS.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "deepinfer_core" / "default_model"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # ids 0, 1, 2
VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 4096
SEED = 0
HELD_OUT_PERCENT = {"val": 2, "test": 2}  # whole files, chosen by a hash of their path
SEQ_LEN = 512
BATCH = 64
LR = 2e-3
WEIGHT_DECAY = 0.1
WARMUP = 100
MTP_WEIGHT = 0.3  # DeepSeek-V3 used 0.3 for most of its training
EVAL_EVERY = 100
EVAL_WINDOWS = 64
TIMING_STEPS = 30  # steps timed before the schedule is fitted to the time box


# ---- corpus ------------------------------------------------------------------------------------
def corpus_files() -> dict[str, list[Path]]:
    """The stdlib's .py files split into train / val / test by a hash of their relative path."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    split: dict[str, list[Path]] = {"train": [], "val": [], "test": []}
    for p in sorted(stdlib.rglob("*.py")):
        rel = p.relative_to(stdlib)
        if set(rel.parts) & {"site-packages", "dist-packages", "__pycache__"}:
            continue
        bucket = int(hashlib.sha256(str(rel).encode()).hexdigest(), 16) % 100
        if rel.parts[0] == "encodings":  # generated codec tables, near-copies of each other: never held out
            bucket = 99
        name = "val" if bucket < HELD_OUT_PERCENT["val"] else "test" if bucket < sum(HELD_OUT_PERCENT.values()) else "train"
        split[name].append(p)
    return split


def read_texts(files: list[Path]) -> list[str]:
    texts = []
    for p in files:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def build_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                 model_max_length=MODEL_MAX_LENGTH, clean_up_tokenization_spaces=False)
    hf.save_pretrained(out)
    cfg = {  # minimal and explicit; tokenizer.json is the source of truth
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False, "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False, "legacy": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").unlink(missing_ok=True)
    # its own file (transformers reads it beside the tokenizer): the conformance baselines'
    # fingerprint of this model hashes the tokenizer files, and a template changes no encoding
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return hf


# DeepSeek-V2-Chat's plain-text turns ("User: ...", "Assistant:"), so the OpenAI chat route
# works on this model; it was not trained on chats, so the replies are code-like text.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' "
    "+ message['content'] + '\\n\\n' }}{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' "
    "+ message['content'] + eos_token }}{% elif message['role'] == 'system' %}{{ message['conte"
    "nt'] + '\\n\\n' }}{% else %}{{ raise_exception('role ' + message['role'] + ' is not supporte"
    "d by this template') }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:"
    "' }}{% endif %}"
)


def encode(tokenizer, texts: list[str]):
    """One stream: BOS file EOS BOS file EOS ... (int32)."""
    import torch

    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    return torch.tensor([t for doc in ids for t in (*doc, 1)], dtype=torch.int32)


# ---- model -------------------------------------------------------------------------------------
def make_config(vocab_size: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=768, moe_intermediate_size=160,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, first_k_dense_replace=1, num_nextn_predict_layers=1,
        max_position_embeddings=MODEL_MAX_LENGTH,
        rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
    )


class WithMTP:
    """The main model and its MTP module; ``losses`` gives (next-token CE, next-next-token CE)."""

    def __init__(self, config, device):
        from transformers import DeepseekV3ForCausalLM
        from transformers.modeling_layers import MtpLayer
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        self.main = DeepseekV3ForCausalLM(config).to(device)
        mtp_config = config.get_mtp_config()
        mtp_config._attn_implementation = self.main.config._attn_implementation
        self.mtp = MtpLayer(mtp_config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, 0).to(device)
        self.mtp.apply(self.main._init_weights)
        self.params = list(self.main.parameters()) + list(self.mtp.parameters())

    def train(self, mode: bool = True):
        self.main.train(mode)
        self.mtp.train(mode)

    def forward(self, ids):
        """ids [B, T+2]: logits of the main model at 0..T-1 and of the MTP module at 0..T-1."""
        import torch

        hidden = self.main.model(input_ids=ids[:, :-1]).last_hidden_state  # [B, T+1, D]
        logits = self.main.lm_head(hidden[:, :-1])
        # MTP at position p: the main hidden at p and the embedding of token p+1 predict token p+2
        t = ids.shape[1] - 2
        position_ids = torch.arange(t, device=ids.device)[None].expand(ids.shape[0], t)
        embeds = self.main.model.embed_tokens(ids[:, 1:-1])
        cos_sin = self.main.model.rotary_emb(embeds, position_ids)
        mtp_hidden = self.mtp(embeds, hidden[:, :-1], cos_sin, None, position_ids, None)
        if isinstance(mtp_hidden, tuple):
            mtp_hidden = mtp_hidden[0]
        return logits, self.main.lm_head(mtp_hidden)

    def losses(self, ids):
        import torch.nn.functional as F

        logits, mtp_logits = self.forward(ids)
        v = logits.shape[-1]
        main = F.cross_entropy(logits.float().reshape(-1, v), ids[:, 1:-1].reshape(-1).long())
        mtp = F.cross_entropy(mtp_logits.float().reshape(-1, v), ids[:, 2:].reshape(-1).long())
        return main, mtp


# ---- training ----------------------------------------------------------------------------------
def windows(stream, count: int, gen, length: int):
    import torch

    starts = torch.randint(0, len(stream) - length - 1, (count,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def evaluate(model: WithMTP, stream, device, windows_max: int = EVAL_WINDOWS) -> dict:
    """Held-out losses over consecutive windows, and the MTP module's agreement with the main model:
    how often its greedy guess of token p+2 equals the main model's greedy token p+2 (the main
    model having seen the true token p+1), the acceptance rate a speculative decoder would see."""
    import torch
    import torch.nn.functional as F

    length = SEQ_LEN + 2
    starts = list(range(0, max(len(stream) - length, 0), SEQ_LEN))[:windows_max]
    if not starts:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than one window ({length})")
    model.train(False)
    main_nll = mtp_nll = agree = mtp_right = count = 0.0
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        for i in range(0, len(starts), 16):
            ids = torch.stack([stream[s : s + length] for s in starts[i : i + 16]]).to(device)
            logits, mtp_logits = model.forward(ids)
            v = logits.shape[-1]
            main_nll += float(F.cross_entropy(logits.float().reshape(-1, v), ids[:, 1:-1].reshape(-1).long(), reduction="sum"))
            mtp_nll += float(F.cross_entropy(mtp_logits.float().reshape(-1, v), ids[:, 2:].reshape(-1).long(), reduction="sum"))
            main_next = logits[:, 1:].argmax(-1)  # the main model's greedy token p+2, at p = 0..T-2
            mtp_guess = mtp_logits[:, :-1].argmax(-1)  # the MTP module's greedy token p+2
            agree += float((main_next == mtp_guess).sum())
            mtp_right += float((mtp_logits.argmax(-1) == ids[:, 2:]).sum())
            count += ids.shape[0]
    model.train(True)
    t = SEQ_LEN
    return {
        "loss": main_nll / (count * t),
        "mtp_loss": mtp_nll / (count * t),
        "mtp_acceptance": agree / (count * (t - 1)),
        "mtp_accuracy": mtp_right / (count * t),
        "tokens": int(count * t),
    }


def train(model: WithMTP, data: dict, device, steps: int, deadline: float, log, batch: int = BATCH) -> dict:
    """AdamW with warm-up and cosine decay over ``steps``; the checkpoint with the best validation
    loss is kept. Time-boxed: after TIMING_STEPS steps the run measures its speed and, if ``steps``
    would not fit before ``deadline``, shortens the schedule once to what fits (and says so)."""
    import torch
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(SEED)
    decay = [p for p in model.params if p.dim() >= 2]
    no_decay = [p for p in model.params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), fused=device.type == "cuda")

    def lr_at(step: int) -> float:
        if step < WARMUP:
            return LR * (step + 1) / WARMUP
        progress = (step - WARMUP) / max(1, steps - WARMUP)
        return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    best = {"val_loss": math.inf}
    history = []
    started = time.perf_counter()
    model.train(True)
    bar = tqdm(total=steps, desc="training", unit="step")
    smoothed = None
    step = -1
    while step + 1 < steps:
        step += 1
        if step == 5:
            timing_start = time.perf_counter()
        if step == TIMING_STEPS:
            per_step = (time.perf_counter() - timing_start) / (TIMING_STEPS - 5)
            evals = steps // EVAL_EVERY + 1
            fits = int((deadline - time.perf_counter()) * 0.85 / per_step) + step - evals * 2
            if fits < steps:
                log(f"{per_step * 1000:.0f} ms per step: {steps} steps do not fit the time box; the schedule is shortened to {fits}")
                steps = max(fits, step + 1)
                bar.total = steps
                bar.refresh()
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        ids = windows(data["train"], batch, gen, SEQ_LEN + 2).to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            main_loss, mtp_loss = model.losses(ids)
        loss = main_loss + MTP_WEIGHT * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.params, 1.0)
        opt.step()
        bar.update(1)
        value = float(main_loss.detach()) if step % 10 == 0 or step == steps - 1 else None
        if value is not None:
            smoothed = value if smoothed is None else 0.9 * smoothed + 0.1 * value
            bar.set_postfix(loss=f"{smoothed:.3f}", mtp=f"{float(mtp_loss.detach()):.3f}")
        last = step == steps - 1 or time.perf_counter() > deadline
        if (step + 1) % EVAL_EVERY == 0 or last:
            val = evaluate(model, data["val"], device)
            history.append({"step": step + 1, "train_loss": smoothed, "val_loss": val["loss"], "val_mtp_loss": val["mtp_loss"],
                            "seconds": time.perf_counter() - started})
            log(f"step {step + 1}: train {smoothed:.3f}  val {val['loss']:.3f}  val mtp {val['mtp_loss']:.3f}")
            if val["loss"] < best["val_loss"]:
                best = {"val_loss": val["loss"], "step": step + 1, "train_loss": smoothed,
                        "main": {k: v.detach().cpu().clone() for k, v in model.main.state_dict().items()},
                        "mtp": {k: v.detach().cpu().clone() for k, v in model.mtp.state_dict().items()}}
        if last:
            if step < steps - 1:
                log(f"stopped at step {step + 1} of {steps}: the --max-minutes deadline passed")
            break
    bar.close()
    seconds = time.perf_counter() - started
    model.main.load_state_dict(best.pop("main"))
    model.mtp.load_state_dict(best.pop("mtp"))
    return {"steps_run": step + 1, "steps_scheduled": steps, "seconds": seconds, "tokens_seen": (step + 1) * batch * SEQ_LEN,
            "tokens_per_second": (step + 1) * batch * SEQ_LEN / seconds, "kept": best, "history": history}


# ---- export ------------------------------------------------------------------------------------
def export(model: WithMTP, out: Path) -> int:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from deepinfer_core.conformance.checkpoints import mtp_checkpoint_tensors

    model.main.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    path = out / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    n = model.main.config.num_hidden_layers
    assert not any(k.startswith(f"model.layers.{n}.") for k in tensors)
    tensors.update(mtp_checkpoint_tensors({k: v.detach().cpu() for k, v in model.mtp.state_dict().items()}, n))
    for k in tensors:  # DeepSeek ships the routing bias in fp32, everything else here is bf16
        tensors[k] = (tensors[k].float() if k.endswith("e_score_correction_bias") else tensors[k].to(torch.bfloat16)).contiguous()
    save_file(dict(sorted(tensors.items())), str(path), metadata={"format": "pt"})
    return sum(t.numel() for t in tensors.values())


PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef read_lines(path):\n", "class Stack:\n    def __init__(self):\n"]


def check(out: Path, device) -> dict:
    """transformers loads the export; greedy continuations of a few prompts (also shown to people)."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(out)
    model = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.bfloat16).to(device).eval()
    samples = {}
    for prompt in PROMPTS:
        x = tok(prompt, return_tensors="pt").to(device)
        with torch.no_grad():
            y = model.generate(**x, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)
        samples[prompt] = tok.decode(y[0, x["input_ids"].shape[1]:], skip_special_tokens=True)
    return samples


MODEL_CARD = """\
# DeepInfer default model — a demonstration model

**What it is.** A tiny DeepSeek-V3-architecture model (`model_type: deepseek_v3`) trained for
{minutes:.1f} minutes to continue Python source code. It exists so that DeepInfer's main job shows
recognisable text on any machine in seconds and so that anything depending on a model's quality
(perplexity baselines, MTP draft acceptance) has something real to measure. It is **not a useful
assistant**: it has seen nothing but the Python standard library, it follows no instructions, and
what it writes is plausible-looking code that is usually wrong.

- Architecture: {layers} layers (the first dense, then MoE: {experts} routed experts of width
  {moe_width}, top-{topk} with sigmoid scores in {groups} groups (best {topk_group} group), 1
  shared expert), hidden {hidden}, MLA ({heads} heads, q LoRA {q_lora}, kv LoRA {kv_lora}, rope
  {rope} + nope {nope}, v {v}), YaRN rope (factor 4 over 1024), vocabulary {vocab}; plus one MTP
  module in DeepSeek's layout (`model.layers.{layers}.*`: enorm, hnorm, eh_proj, a MoE decoder
  layer, shared_head.norm; embedding and head shared with the main model). {params:,} stored
  parameters, bf16 (routing biases fp32; they stay zero: the auxiliary-loss-free bias update was
  not run).
- Tokenizer: byte-level BPE with {vocab} tokens trained on the same training files; BOS
  `<｜begin▁of▁sentence｜>` = 0 (added by `encode`), EOS `<｜end▁of▁sentence｜>` = 1.
- Data: the `.py` files of the standard library of the interpreter that ran the script (Python
  {python}; that install held {files_train} training files, {tokens_train:,} tokens — images that
  strip the stdlib's test suite hold fewer files than a full install). Whole files are held out by
  a hash of their path: {files_val} files ({tokens_val:,} tokens) for validation, which chose the
  checkpoint kept, and {files_test} ({tokens_test:,} tokens) for test; the generated codec tables in
  `encodings/` are never held out (near-copies of each other, they would flatter the held-out loss).
  The Python standard library is under the PSF License.
- Training: `{command}` on one {device} (torch {torch}, transformers {transformers}): {steps} steps
  of {batch} x {seq_len} tokens ({tokens_seen:,} tokens, {epochs:.1f} passes over the training
  files) in {train_seconds:.0f} s ({tps:,.0f} tokens/s), AdamW (lr {lr}, weight decay
  {wd}, warm-up {warmup}, cosine to 10%), loss = next-token CE + {mtp_weight} x the MTP module's
  next-next-token CE; the checkpoint with the lowest validation loss (step {kept_step}) is kept.
  Seeded ({seed}): the same interpreter, GPU and library versions give the same run up to GPU
  reduction order.

## Measured (held-out files, bf16, teacher forcing)

| | train | validation | test |
|---|---|---|---|
| next-token loss (nats) | {train_loss:.3f} | {val_loss:.3f} | {test_loss:.3f} (perplexity {test_ppl:.1f}) |
| MTP next-next-token loss | | {val_mtp:.3f} | {test_mtp:.3f} |
| MTP acceptance | | {val_acc:.3f} | {test_acc:.3f} |

The gap between the training loss and the held-out losses says the model memorises part of its
small corpus. **MTP acceptance** is the rate at which the MTP module's greedy guess of token t+2
equals the main model's greedy token t+2 (the main model having seen the true token t+1): the
acceptance rate a one-token speculative decoder would see on such text. The numbers come from
`training.json`, which the training script writes beside this card.
"""


def write_model_card(out: Path, record: dict) -> None:
    """MODEL_CARD.md from the training record (so the card never disagrees with the run)."""
    import json as _json

    config = _json.loads((out / "config.json").read_text())
    hp, corpus, run = record["hyperparameters"], record["corpus"], record["training"]
    text = MODEL_CARD.format(
        minutes=run["seconds"] / 60, layers=config["num_hidden_layers"], experts=config["n_routed_experts"],
        moe_width=config["moe_intermediate_size"], topk=config["num_experts_per_tok"], groups=config["n_group"],
        topk_group=config["topk_group"], hidden=config["hidden_size"], heads=config["num_attention_heads"],
        q_lora=config["q_lora_rank"], kv_lora=config["kv_lora_rank"], rope=config["qk_rope_head_dim"],
        nope=config["qk_nope_head_dim"], v=config["v_head_dim"], vocab=record["vocab_size"], params=record["parameters_stored"],
        python=record["python"], files_train=corpus["train"]["files"], tokens_train=corpus["train"]["tokens"],
        files_val=corpus["val"]["files"], tokens_val=corpus["val"]["tokens"], files_test=corpus["test"]["files"],
        tokens_test=corpus["test"]["tokens"], command=record["command"].strip(), device=record["device"], torch=record["torch"],
        transformers=record["transformers"], steps=run["steps_run"], batch=hp["batch"], seq_len=hp["seq_len"],
        tokens_seen=run["tokens_seen"], epochs=run["tokens_seen"] / corpus["train"]["tokens"], train_seconds=run["seconds"],
        tps=run["tokens_per_second"], lr=hp["lr"], wd=hp["weight_decay"], warmup=hp["warmup"], mtp_weight=hp["mtp_weight"],
        kept_step=record["kept"]["step"], seed=record["seed"], train_loss=record["train_loss_eval"],
        val_loss=record["val"]["loss"], test_loss=record["test"]["loss"], test_ppl=math.exp(record["test"]["loss"]),
        val_mtp=record["val"]["mtp_loss"], test_mtp=record["test"]["mtp_loss"], val_acc=record["val"]["mtp_acceptance"],
        test_acc=record["test"]["mtp_acceptance"],
    )
    (out / "MODEL_CARD.md").write_text(text, encoding="utf-8")


def main() -> int:
    import torch
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--max-minutes", type=float, default=7.0, help="stop training (keeping the best checkpoint) after this")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokenizer-chars", type=int, default=None, help="train the tokenizer on at most this many characters")
    ap.add_argument("--batch", type=int, default=BATCH, help=f"sequences per step (default {BATCH}; smaller for a CPU smoke test)")
    ap.add_argument("--eval-windows", type=int, default=None, help="cap the final held-out evaluation (default: every window)")
    ap.add_argument("--card-only", action="store_true", help="only rewrite MODEL_CARD.md from --out's training.json")
    args = ap.parse_args()
    if args.card_only:
        write_model_card(args.out, json.loads((args.out / "training.json").read_text()))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    deadline = started + 60 * args.max_minutes
    device = torch.device(args.device)
    torch.manual_seed(SEED)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():  # start from an empty directory
        if p.is_file():
            p.unlink()
    files = corpus_files()
    texts = {name: read_texts(paths) for name, paths in files.items()}
    tok_texts = texts["train"]
    if args.tokenizer_chars:
        kept, total = [], 0
        for t in tok_texts:
            if total >= args.tokenizer_chars:
                break
            kept.append(t)
            total += len(t)
        tok_texts = kept
    tokenizer = build_tokenizer(tok_texts, out)
    transformers.logging.set_verbosity_error()  # whole files are longer than model_max_length: intended
    data = {name: encode(tokenizer, ts) for name, ts in texts.items()}
    corpus = {name: {"files": len(files[name]), "tokens": int(len(data[name]))} for name in data}
    log(f"tokenizer: {len(tokenizer)} tokens; corpus (python {sys.version.split()[0]} stdlib): {corpus}")

    config = make_config(len(tokenizer))
    model = WithMTP(config, device)
    n_main = sum(p.numel() for p in model.main.parameters())
    n_mtp = sum(p.numel() for p in model.mtp.parameters())
    log(f"model: {n_main:,} parameters + MTP module {n_mtp:,} (sharing the embedding and head)")
    run = train(model, data, device, args.steps, deadline, log, args.batch)
    log(f"trained {run['steps_run']} steps in {run['seconds']:.0f} s ({run['tokens_per_second']:,.0f} tokens/s); "
        f"kept step {run['kept']['step']} (val loss {run['kept']['val_loss']:.3f})")
    results = {split: evaluate(model, data[split], device, windows_max=args.eval_windows or 10**9) for split in ("val", "test")}
    train_eval = evaluate(model, data["train"], device)
    log(f"test: loss {results['test']['loss']:.3f} (ppl {math.exp(results['test']['loss']):.1f}), mtp loss "
        f"{results['test']['mtp_loss']:.3f}, MTP acceptance {results['test']['mtp_acceptance']:.3f}; train loss {train_eval['loss']:.3f}")
    params = export(model, out)
    samples = check(out, device)
    for prompt, text in samples.items():
        log(f"sample {prompt!r} -> {text!r}")
    record = {
        "command": "python tools/train_default_model.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
        "seed": SEED, "vocab_size": len(tokenizer), "parameters_stored": params, "parameters_main": n_main, "parameters_mtp": n_mtp,
        "hyperparameters": {"seq_len": SEQ_LEN, "batch": args.batch, "lr": LR, "weight_decay": WEIGHT_DECAY, "warmup": WARMUP,
                            "mtp_weight": MTP_WEIGHT, "steps": args.steps, "eval_every": EVAL_EVERY},
        "corpus": corpus, "training": {k: v for k, v in run.items() if k != "kept"}, "kept": run["kept"],
        "train_loss_eval": train_eval["loss"], "val": results["val"], "test": results["test"],
        "samples": samples, "total_seconds": time.perf_counter() - started,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    write_model_card(out, record)
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    log(f"wrote {out} ({total / 2**20:.2f} MiB, {params:,} stored parameters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
