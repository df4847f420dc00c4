"""Tiny random DeepSeek-V4 checkpoints and transformers goldens, for tests.

``write_checkpoint_v4(name, dir)`` builds the tiny config ``name`` (see CONFIGS_V4), gives it the
weights of ``randomize_v4`` and writes it out; it returns the HF golden model (float32, eager
attention, eager experts) holding exactly the values the checkpoint holds:

* ``quant=None``: ``save_pretrained`` (float32; transformers' own "hybrid" key names: a
  ``model.`` prefix and ``model.embed_tokens`` / ``model.hc_head.hc_*`` / ``model.norm`` kept, the
  rest DeepSeek-style, with the attention ``kv_norm`` written back as ``attn.norm``); the golden
  is the reload.
* ``quant="fp8"`` / ``"fp8+fp4"``: DeepSeek's original naming (``embed.weight``,
  ``layers.L.attn.wq_a.weight`` + ``.scale``, ``layers.L.ffn.experts.E.w1.weight``, ...; no
  ``model.`` prefix), written here. Linears DeepSeek ships in FP8 are float8_e4m3fn with
  float8_e8m0fnu (power-of-two) block scales; routed experts are FP8 too (``"fp8"``) or MXFP4
  (``"fp8+fp4"``: int8 [out, in/2], low nibble = even input, one e8m0 scale per 32 inputs).
  The other tensors carry the real checkpoints' dtypes: bf16 for embed/head/norms/router
  weight/compressor and indexer projections, fp32 for mHC, sinks, ape and the router bias,
  int64 for tid2eid. The golden holds the dequantised (and bf16-rounded) values, so it matches
  the checkpoint exactly. config.json is transformers' (explicit ``layer_types``,
  ``compress_rates``, ``mlp_layer_types``) plus DeepSeek's own keys (``compress_ratios`` with the
  real ratios and the MTP tail, ``num_hash_layers``, ``expert_dtype``, ``quantization_config``).

``with_mtp=True`` adds one random ``mtp.0.*`` MTP block (original naming, FP8 where DeepSeek's
is) and returns ``(golden, mtp_tensors)``; transformers has no V4 MTP, ``hf_mtp_logits`` composes
one from transformers' V4 modules (§3.8 of the architecture notes).

``hf_greedy_goldens`` / ``hf_logprobs`` produce goldens with full, uncached forwards.

transformers quirks (5.24): ``compress_ratios`` values are only type tags (0/4/128, anything
else is a KeyError), the actual rate comes from ``compress_rates`` -- so a config with a small HCA
rate gives ``layer_types`` explicitly. ``max_position_embeddings`` = factor x
original_max_position_embeddings, or transformers warns about an implicit YaRN factor.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer_core.models.v4.checkpoint import normalize_v4_key, rename_v4_state
from deepinfer_core.conformance.checkpoints import quantize_fp8_block_e8m0, quantize_mxfp4
from deepinfer_core.loader import dequantize_mxfp4, e8m0_to_float
from deepinfer_core.ops.linear import dequantize_fp8_block

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

YARN_V4 = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}

BASE_V4 = dict(
    vocab_size=160,
    hidden_size=64,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    qk_rope_head_dim=8,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    # 16 indexer heads: a score sum_h w_h relu(q_h . k) is exactly 0 only when every head's dot product
    # is <= 0; with few heads such exact ties are common and top-k breaks them by tensor length
    # (a cached decode and a full forward then select differently).
    index_n_heads=16,
    index_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=1.5,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rms_norm_eps=1e-6,
    swiglu_limit=10.0,
    sliding_window=8,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_scaling=YARN_V4,
    max_position_embeddings=1024,  # = factor x original_max_position_embeddings, as in the real config
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)

# name -> DeepseekV4Config kwargs (over BASE_V4). A prompt of ~80 tokens spans several blocks of
# every compressed layer (except v4_legacy_ratios, whose HCA rate is the real 128: use >= 256).
CONFIGS_V4: dict[str, dict] = {
    # DeepSeek compress_ratios [0, 4, 8, 4, 0]: SWA, CSA, HCA(8), CSA; 1 hash layer; index_topk 4
    # is well below the 20 CSA entries of an 80-token prompt, so the indexer really selects.
    "v4_flash_like": dict(
        BASE_V4,
        num_hidden_layers=4,
        layer_types=[SWA, CSA, HCA, CSA],
        compress_rates={CSA: 4, HCA: 8},
        num_hash_layers=1,
        index_topk=4,
    ),
    # V4-Pro's bootstrap: compress_ratios [16, 16, 4, 16, 0]; hc_mult 2, 2 hash layers, window 16,
    # head_dim 64 / rope 16, 8 experts; index_topk 32 is larger than the CSA entries of an
    # 80-token prompt (every visible entry is selected).
    "v4_pro_like": dict(
        BASE_V4,
        num_hidden_layers=4,
        layer_types=[HCA, HCA, CSA, HCA],
        compress_rates={CSA: 4, HCA: 16},
        num_hash_layers=2,
        hc_mult=2,
        sliding_window=16,
        head_dim=64,
        qk_rope_head_dim=16,
        q_lora_rank=48,
        o_lora_rank=32,
        index_head_dim=32,
        index_topk=32,
        n_routed_experts=8,
    ),
    # compress_ratios [4, 0, 4, 0]: no HCA, no hash layer (every layer has gate.bias), plain
    # (non-YaRN) compress rope, head_dim 48, a SwiGLU limit low enough to clamp, index_topk 2.
    "v4_swa_nohash": dict(
        {k: v for k, v in BASE_V4.items() if k != "rope_scaling"},
        num_hidden_layers=3,
        layer_types=[CSA, SWA, CSA],
        compress_rates={CSA: 4, HCA: 128},
        num_hash_layers=0,
        hc_mult=2,
        sliding_window=16,
        head_dim=48,
        qk_rope_head_dim=16,
        index_topk=2,
        n_routed_experts=6,
        swiglu_limit=1.0,
    ),
    # Given the legacy way, as DeepSeek's config.json does: compress_ratios with the MTP tail entry,
    # the real rates 4 / 128 (transformers folds it into layer_types and drops the tail).
    "v4_legacy_ratios": dict(
        BASE_V4,
        num_hidden_layers=4,
        compress_ratios=[0, 4, 128, 4, 0],
        num_hash_layers=1,
        index_topk=8,
    ),
}

# Prompt length each config needs to span several blocks of every compressed layer.
PROMPT_LEN_V4 = {"v4_flash_like": 80, "v4_pro_like": 80, "v4_swa_nohash": 80, "v4_legacy_ratios": 300}

FP8_BLOCK = (16, 16)  # every dimension of CONFIGS_V4 is a multiple of 16 (transformers' dequantiser needs that)
QUANTS = (None, "fp8", "fp8+fp4")


# --------------------------------------------------------------------------------------------
# config and model


def hf_config_v4(name: str, **overrides):
    from transformers import DeepseekV4Config

    kwargs = copy.deepcopy({**CONFIGS_V4[name], **overrides})
    return DeepseekV4Config(**kwargs, attn_implementation="eager", experts_implementation="eager")


def compress_ratios(config) -> list[int]:
    """DeepSeek's ``compress_ratios`` for an HF V4 config: the real rate per layer, MTP tail entries 0."""
    rate = {SWA: 0, CSA: config.compress_rates[CSA], HCA: config.compress_rates[HCA]}
    return [rate[t] for t in config.layer_types] + [0] * config.num_nextn_predict_layers


def _eager(model):
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    return model.float().eval()


def build_model_v4(name: str, seed: int = 0, **overrides):
    """The randomised float32 ``DeepseekV4ForCausalLM`` of ``name`` (in memory, nothing written)."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config_v4(name, **overrides))
    randomize_v4(model, seed)
    return _eager(model)


# --------------------------------------------------------------------------------------------
# weights


def _randomize_tensor(name: str, t: torch.Tensor, gen: torch.Generator, num_experts: int) -> torch.Tensor:
    shape = t.shape

    def randn(*s):
        return torch.randn(s or shape, generator=gen)

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":  # distinct valid experts per token
        return torch.stack([torch.randperm(num_experts, generator=gen)[: shape[1]] for _ in range(shape[0])])
    if leaf == "e_score_correction_bias":
        return 0.1 * randn()
    if leaf == "sinks":
        return randn()
    if leaf == "position_bias":  # ape: added to the compressor gate logits, which are ~N(0, 1)
        return 0.5 * randn()
    if leaf in ("fn", "hc_fn"):  # mHC mixes from the unit-RMS flattened streams: small
        return 0.5 * randn() / math.sqrt(shape[-1])
    if leaf in ("base", "hc_base"):
        return 0.1 * randn()
    if leaf in ("scale", "hc_scale"):
        return 1.0 + 0.1 * randn()
    if "norm" in name:
        return 1.0 + 0.1 * randn()
    if "embed_tokens" in name or name in ("embed.weight",):
        return randn()
    # a matrix [out, in] (experts [E, out, in]): unit-variance outputs for unit-RMS inputs; the router
    # spread wider (clear-cut expert choices), the head wider (peaked, non-uniform next-token distributions)
    gain = 2.0 if name.endswith("gate.weight") and ".mlp." in name else 2.5 if "lm_head" in name else 1.0
    return gain * randn() / math.sqrt(shape[-1])


def randomize_v4(model: torch.nn.Module, seed: int) -> None:
    """Non-degenerate random weights for a transformers V4 model or sub-module (in place).

    Matrices N(0,1)/sqrt(fan_in) (router x2, head x2.5), embeddings N(0,1), norm weights
    1 + 0.1 N, sinks N(0,1), ape 0.5 N, mHC fn 0.5 N/sqrt(fan_in) / base 0.1 N / scale 1 + 0.1 N
    (hc_head likewise), router bias 0.1 N, tid2eid distinct random experts per token."""
    gen = torch.Generator().manual_seed(seed)
    experts = getattr(getattr(model, "config", None), "n_routed_experts", None) or _num_experts_from(model)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            t.copy_(_randomize_tensor(name, t, gen, experts).to(t.dtype))


def _num_experts_from(module) -> int:
    for m in module.modules():
        if hasattr(m, "num_experts"):
            return m.num_experts
    return 1


# --------------------------------------------------------------------------------------------
# HF names <-> DeepSeek's original names (deepinfer_core.models.v4.checkpoint: rename_v4_state one way)


def load_original_v4(module: torch.nn.Module, tensors: dict[str, torch.Tensor], param=lambda target: target) -> None:
    """Copy V4 checkpoint tensors (any naming, routed experts one by one) into ``module``'s
    parameters, experts into their fused tensors; ``param`` maps a V4 parameter name
    (``normalize_v4_key(key).target``) to the module's. Every parameter must be given."""
    state = module.state_dict()
    filled = set()
    with torch.no_grad():
        for key, t in tensors.items():
            p = normalize_v4_key(key)
            if p is None or p.scale:
                raise KeyError(f"{key!r} is no V4 weight")
            name = param(p.target)
            dst = state[name] if p.expert is None else state[name][p.expert]
            if p.half is not None:
                rows = dst.shape[0] // 2
                dst = dst[p.half * rows : (p.half + 1) * rows]
            if dst.shape != t.shape:
                raise ValueError(f"{key}: shape {list(t.shape)}, {name} needs {list(dst.shape)}")
            dst.copy_(t)
            filled.add(name)
    if missing := sorted(set(state) - filled):
        raise KeyError(f"no tensors for {missing[:5]}")


# Original-name suffixes of the linears DeepSeek ships in block FP8 (routed experts: FP8 or FP4).
FP8_LINEARS_V4 = (
    "attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
    "attn.indexer.wq_b.weight", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
    "ffn.shared_experts.w3.weight", "e_proj.weight", "h_proj.weight",
)
# Stored float32 in DeepSeek's checkpoints (the rest of the unquantised tensors are bf16).
_FP32_LEAVES = ("attn_sink", "ape", "gate.bias", "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn",
                "hc_ffn_base", "hc_ffn_scale", "hc_head_fn", "hc_head_base", "hc_head_scale")


def is_fp8_linear_v4(key: str) -> bool:
    return key.endswith(FP8_LINEARS_V4)


def is_routed_expert(key: str) -> bool:
    return ".ffn.experts." in key and key.endswith(".weight")


def stored_dtype(key: str) -> torch.dtype:
    """The dtype DeepSeek stores an unquantised V4 tensor in."""
    if key.endswith("tid2eid"):
        return torch.int64
    if key.rsplit(".", 1)[-1] in _FP32_LEAVES or key.endswith(_FP32_LEAVES):
        return torch.float32
    return torch.bfloat16


def quantize_original(
    tensors: dict[str, torch.Tensor], quant: str, block: tuple[int, int], *, fp8=quantize_fp8_block_e8m0, cast: bool = True
):
    """Original-named float tensors -> (checkpoint tensors, the float32 values they hold). FP8
    linears (and routed experts with ``"fp8"``) through ``fp8`` (e8m0 block scales by default),
    routed experts MXFP4 with ``"fp8+fp4"``; ``cast``: the rest in DeepSeek's dtypes (else unchanged)."""
    if quant not in ("fp8", "fp8+fp4"):
        raise ValueError(f"quant must be None, 'fp8' or 'fp8+fp4', got {quant!r}")
    stored: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        base = key[: -len(".weight")]
        if is_routed_expert(key) and quant == "fp8+fp4":
            q, s = quantize_mxfp4(t)
            stored[key], stored[base + ".scale"] = q, s
            values[key] = dequantize_mxfp4(q, s, torch.float32)
        elif is_routed_expert(key) or is_fp8_linear_v4(key):
            q, s = fp8(t, block)
            stored[key], stored[base + ".scale"] = q, s
            values[key] = dequantize_fp8_block(q, e8m0_to_float(s), block, torch.float32)
        else:
            stored[key] = t.to(stored_dtype(key)) if cast else t
            values[key] = stored[key].float() if stored[key].is_floating_point() else stored[key]
    return stored, values


def quant_config_v4(quant: str, block: tuple[int, int] = FP8_BLOCK) -> dict:
    """config.json's ``expert_dtype`` and ``quantization_config`` of a ``quant`` checkpoint, as DeepSeek writes them."""
    return {
        "expert_dtype": "fp4" if quant == "fp8+fp4" else "fp8",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": list(block),
            "activation_scheme": "dynamic",
        },
    }


# --------------------------------------------------------------------------------------------
# MTP block


def mtp_config(config):
    """The config of V4's MTP block: one sliding-only, non-hash layer."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    cfg.layer_types = [SWA]
    cfg.mlp_layer_types = ["moe"]
    return cfg


class _MtpBlockV4(torch.nn.Module):
    """transformers' V4 modules arranged as DeepSeek's MTP block (keys = original ``mtp.0.`` names less the prefix)."""

    def __init__(self, config):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4DecoderLayer,
            DeepseekV4HyperHead,
            DeepseekV4RMSNorm,
        )

        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.block = DeepseekV4DecoderLayer(mtp_config(config), 0)
        self.enorm = DeepseekV4RMSNorm(d, eps)
        self.hnorm = DeepseekV4RMSNorm(d, eps)
        self.e_proj = torch.nn.Linear(d, d, bias=False)
        self.h_proj = torch.nn.Linear(d, d, bias=False)
        self.norm = DeepseekV4RMSNorm(d, eps)
        self.hc_head = DeepseekV4HyperHead(config)

    def params(self) -> dict[str, torch.Tensor]:
        """The block's tensors under the V4 model's parameter names (``mtp.layers.0.*``)."""
        return {"mtp.layers.0." + k.removeprefix("block."): v for k, v in self.state_dict().items()}

    def original_state(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix("mtp.0."): v for k, v in rename_v4_state(self.params()).items()}

    def load_original(self, tensors: dict[str, torch.Tensor]) -> None:
        own = self.state_dict()

        def param(target: str) -> str:
            rest = target.removeprefix("mtp.layers.0.")
            return rest if rest in own else "block." + rest

        load_original_v4(self, {"mtp.0." + k: v for k, v in tensors.items()}, param)


def mtp_params_v4(config) -> dict[str, torch.Tensor]:
    """An (uninitialised) V4 MTP block of ``config``: its tensors under the model's names (``mtp.layers.0.*``)."""
    return _MtpBlockV4(config).params()


def random_mtp_tensors(config, seed: int = 1) -> dict[str, torch.Tensor]:
    """One random V4 MTP block, float32, keyed by DeepSeek's names without the ``mtp.0.`` prefix."""
    mtp = _MtpBlockV4(config).float()
    randomize_v4(mtp, seed)
    return mtp.original_state()


def hf_mtp_block(config, mtp_tensors: dict[str, torch.Tensor]):
    """The MTP block holding ``mtp_tensors`` (keys with or without ``mtp.0.``), built from transformers' V4 modules."""
    mtp = _MtpBlockV4(config).float().eval()
    mtp.block.self_attn.config._attn_implementation = "eager"
    mtp.load_original({k.removeprefix("mtp.0."): v for k, v in mtp_tensors.items()})
    return mtp


@torch.no_grad()
def hf_mtp_logits(model, mtp_tensors: dict[str, torch.Tensor], ids) -> torch.Tensor:
    """Teacher-forced MTP logits [T-1, vocab] over ``ids`` (§3.8): row p predicts ids[p+2] from the
    main model's streams at p (after the last layer, before hc_head) and the token ids[p+1]; the
    block attends over positions 0..T-2 (sliding window, main rope). The embedding is not zeroed
    at position 0 (vLLM does that; the reference does not)."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    ids = torch.as_tensor(ids, dtype=torch.long).view(1, -1)
    streams = {}
    hook = model.model.hc_head.register_forward_pre_hook(lambda m, args: streams.setdefault("x", args[0]))
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        hook.remove()
    h = streams["x"][:, :-1]  # [1, T-1, hc, D]
    nxt = ids[:, 1:]
    mtp = hf_mtp_block(model.config, mtp_tensors)
    e = mtp.enorm(model.model.embed_tokens(nxt))
    x = mtp.e_proj(e).unsqueeze(2) + mtp.h_proj(mtp.hnorm(h))
    pos = torch.arange(nxt.shape[1]).view(1, -1)
    emb = model.model.embed_tokens(nxt)
    mask = create_sliding_window_causal_mask(config=model.config, inputs_embeds=emb, attention_mask=None, cache=None, position_ids=pos)
    rope = {t: model.model.rotary_emb(emb, position_ids=pos, layer_type=t) for t in ("main", "compress")}
    x = mtp.block(x, position_embeddings=rope, position_ids=pos, attention_mask=mask, input_ids=nxt, cache=None)
    return model.lm_head(mtp.norm(mtp.hc_head(x)))[0]


# --------------------------------------------------------------------------------------------
# writing


def _config_json(model, quant: str | None, block: tuple[int, int], with_mtp: bool) -> dict:
    """transformers' config.json (what save_pretrained writes: explicit layer_types, compress_rates,
    mlp_layer_types, nested rope_parameters) plus DeepSeek's own keys, which transformers ignores
    when the explicit ones are there."""
    cfg = copy.deepcopy(model.config)
    cfg.architectures = [type(model).__name__]
    cfg.num_nextn_predict_layers = 1 if with_mtp else 0
    out = json.loads(cfg.to_json_string())
    out["compress_ratios"] = compress_ratios(cfg)
    out["num_hash_layers"] = sum(t == "hash_moe" for t in cfg.mlp_layer_types)
    compress_rope = cfg.rope_parameters["compress"]
    if compress_rope["rope_type"] == "yarn":
        keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
        out["rope_scaling"] = {"type": "yarn", **{k: compress_rope[k] for k in keys}}
    if quant is not None:
        out["dtype"] = "bfloat16"
        out.update(quant_config_v4(quant, block))
    return out


def write_checkpoint_v4(
    name: str,
    path,
    *,
    seed: int = 0,
    quant: str | None = None,
    with_mtp: bool = False,
    block: tuple[int, int] = FP8_BLOCK,
    mtp_seed: int = 1,
    **overrides,
):
    """Write tiny V4 config ``name`` into ``path``; return the HF golden (float32, eager), or
    ``(golden, mtp_tensors)`` with ``with_mtp`` (``mtp.0.``-prefixed float32 values as stored).

    ``overrides`` are DeepseekV4Config kwargs over CONFIGS_V4[name]."""
    from transformers import DeepseekV4ForCausalLM

    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    path = Path(path)
    model = build_model_v4(name, seed, **overrides)
    mtp = {"mtp.0." + k: v for k, v in random_mtp_tensors(model.config, mtp_seed).items()} if with_mtp else {}

    if quant is None:
        model.config.num_nextn_predict_layers = 1 if with_mtp else 0
        model.save_pretrained(str(path))
        if with_mtp:
            file = path / "model.safetensors"
            with safe_open(str(file), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            save_file({**tensors, **mtp}, str(file), metadata={"format": "pt"})
        golden = _eager(DeepseekV4ForCausalLM.from_pretrained(str(path), attn_implementation="eager", experts_implementation="eager"))
        return (golden, mtp) if with_mtp else golden

    original = rename_v4_state(model.state_dict())
    stored, values = quantize_original({**original, **mtp}, quant, block)
    path.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(stored.items())), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(_config_json(model, quant, block, with_mtp), indent=2, sort_keys=True) + "\n")
    main = {k: v for k, v in values.items() if not k.startswith("mtp.")}
    load_original_v4(model, main)
    if with_mtp:
        return model, {k: v for k, v in values.items() if k.startswith("mtp.")}
    return model


def load_golden_v4(path, dtype: torch.dtype = torch.float32):
    """transformers' own load of a checkpoint written by write_checkpoint_v4 (FP8 / FP4 dequantised
    by ``FineGrainedFP8Config(dequantize=True)``), eager. With ``dtype=torch.bfloat16`` it is the
    bf16 HF model: transformers keeps norms, mHC, sinks, ape and the router bias in float32
    (``_keep_in_fp32_modules_strict``); dequantised FP8 / FP4 values are exact in bf16, so for
    quantised checkpoints it holds the checkpoint's values exactly (``golden.to(bf16)`` would not
    keep the float32 modules)."""
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    path = Path(path)
    kwargs = {}
    if "quantization_config" in json.loads((path / "config.json").read_text()):
        kwargs["quantization_config"] = FineGrainedFP8Config(dequantize=True)
    model = DeepseekV4ForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation="eager", experts_implementation="eager", **kwargs
    )
    return model.eval()


def read_checkpoint_dequantised(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, float32 tensors) of an original-naming checkpoint written by write_checkpoint_v4,
    FP8 / MXFP4 weights dequantised (FP8 blocks from quantization_config; int tensors unchanged)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    block = tuple(config["quantization_config"]["weight_block_size"])
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        raw = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for key, t in raw.items():
        if key.endswith(".scale"):
            continue
        scale = raw.get(key[: -len(".weight")] + ".scale") if key.endswith(".weight") else None
        if scale is None:
            out[key] = t.float() if t.is_floating_point() else t
        elif t.dtype == torch.int8:
            out[key] = dequantize_mxfp4(t, scale, torch.float32)
        else:
            out[key] = dequantize_fp8_block(t, e8m0_to_float(scale), block, torch.float32)
    return config, out


# --------------------------------------------------------------------------------------------
# goldens


@torch.no_grad()
def hf_logprobs(model, ids) -> torch.Tensor:
    """Teacher-forced float32 log-probabilities [len(ids), vocab]: row t is the distribution of token t+1."""
    ids = torch.as_tensor(ids, dtype=torch.long).view(1, -1)
    logits = model(input_ids=ids, use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@torch.no_grad()
def hf_greedy_goldens(model, prompt_ids, max_new_tokens: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Greedy continuation by full uncached forwards over prompt + generated-so-far.

    No EOS stop. Returns (new tokens, float32 [n] log-prob of each chosen token, float32 [n, vocab] log-probs)."""
    ids = [int(t) for t in torch.as_tensor(prompt_ids).view(-1).tolist()]
    tokens, rows = [], []
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids + tokens]), use_cache=False).logits[0, -1]
        row = torch.log_softmax(logits.float(), dim=-1)
        tokens.append(int(row.argmax()))
        rows.append(row)
    full = torch.stack(rows) if rows else torch.empty(0, model.config.vocab_size)
    chosen = full.gather(1, torch.tensor(tokens, dtype=torch.long).view(-1, 1)).view(-1)
    return tokens, chosen, full


@torch.no_grad()
def hf_cached_greedy(model, prompt_ids, max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' own cached greedy ``generate`` (no EOS stop): (new tokens, float32 [n, vocab] log-probs)."""
    from transformers import GenerationConfig

    ids = torch.as_tensor(prompt_ids, dtype=torch.long).view(1, -1)
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None, pad_token_id=0,
        use_cache=True, return_dict_in_generate=True, output_logits=True,
    )
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # else generate() falls back to it and stops at EOS
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    finally:
        model.generation_config.eos_token_id = saved
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    return tokens, torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)


def random_prompt(length: int, vocab: int = 160, seed: int = 0) -> list[int]:
    """Token ids in [2, vocab) (no BOS / EOS)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(2, vocab, (length,), generator=gen).tolist()


# DeepSeek's special tokens besides BOS / EOS (the conformance tokenizer's ids 0 and 1), as
# deepseek-recipe spells them: what its V4 / V4.1 chat encoding writes into prompts.
CHAT_SPECIAL_TOKENS = ["<think>", "</think>", "<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>",
                       "｜DSML｜", "<｜image｜>", "<｜ref｜>", "<｜/ref｜>", "<｜box｜>", "<｜/box｜>", "<｜point｜>",
                       "<｜/point｜>", "<｜polygon｜>", "<｜/polygon｜>"]


def write_chat_tokenizer(path) -> int:
    """The conformance tokenizer with DeepSeek's chat special tokens added (ids 2048...), written
    to ``path``; returns its size (a checkpoint's vocab_size)."""
    from tokenizers import AddedToken, Tokenizer

    source = Path(__file__).parent.parent / "deepinfer_core" / "conformance" / "tokenizer"
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIAL_TOKENS])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text((source / "tokenizer_config.json").read_text())
    return tokenizer.get_vocab_size(with_added_tokens=True)


def write_chat_checkpoint_v4(path, name: str = "v4_flash_like", seed: int = 0) -> Path:
    """A tiny random V4 checkpoint (original naming, FP8) whose tokenizer carries DeepSeek's chat tokens."""
    path = Path(path)
    vocab = write_chat_tokenizer(path)
    write_checkpoint_v4(name, path, seed=seed, quant="fp8", vocab_size=vocab, bos_token_id=0, eos_token_id=1)
    return path
