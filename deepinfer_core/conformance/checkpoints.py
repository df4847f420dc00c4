"""The fixed checkpoints the end-to-end conformance workloads run on.

``default`` is the embedded default model (``deepinfer_core/default_model/``). The others are
generated: a config dict and a seed in this file, written out by ``materialize(name)`` as an HF
checkpoint directory (config.json, model.safetensors with DeepSeek's key names, and the
tokenizer in ``conformance/tokenizer/``: a byte-level BPE of 2048 tokens, the first embedded
default model's, kept here so these checkpoints and their baselines do not change when the
default model does) and cached by name and fingerprint, so every run after the first
reads it from disk.

Every platform must get bit-identical weights, so values are drawn on the CPU from one seeded
``torch.Generator`` per tensor (seeded from the checkpoint seed and the tensor's key, so no
tensor depends on the others or on their order) as float64 uniforms scaled to unit variance:
``torch.rand`` turns generator bits into floats exactly, and the scaling is plain IEEE arithmetic.
``torch.randn`` would not do: its vectorised Box-Muller uses log/cos, whose last bits differ
between CPU instruction sets and libm versions. Scales keep activations O(1) through the layers
(matrices 1/sqrt(fan_in), norms ~1, small router bias) and spread the router scores twice as
wide (so that expert choices are not near-ties that flip on rounding). The logits come out about
N(0, 1): the perplexity of unrelated text is a few thousand, a little above the vocabulary size.

Block-FP8 checkpoints store the linear weights DeepSeek stores in FP8 (``FP8_LINEARS``) as
float8_e4m3fn with float32 ``weight_scale_inv`` on a ceil(N/bn) x ceil(K/bk) grid (partial edge
blocks included), each block's scale amax/448, as in DeepSeek's V3 release.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_core.config import DEFAULT_MODEL_DIR
from deepinfer_core.models.v3.checkpoint import split_expert_key

DEFAULT = "default"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"  # the generated checkpoints' tokenizer
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
# Linear weights DeepSeek ships in block FP8 (everything but embeddings, head, norms, router, eh_proj).
FP8_LINEARS = (
    "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)

_COMMON = dict(
    vocab_size=2048,  # TOKENIZER_DIR's tokenizer
    hidden_size=128,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
    torch_dtype="bfloat16",
)
_YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=16.0, original_max_position_embeddings=256, beta_fast=32, beta_slow=1
)


class CheckpointMismatch(RuntimeError):
    """This platform generated different weights than the ones the baselines were recorded on."""


@dataclass(frozen=True)
class GeneratedCheckpoint:
    """A tiny checkpoint written by ``materialize``: its HF config.json (less the quantization
    section) and seed; ``fp8_block`` (bn, bk) makes it a DeepSeek block-FP8 checkpoint.
    ``weights_digest`` is ``tensors_digest`` of the weights as first generated: a platform that
    draws anything else is told so instead of being compared on other weights."""

    name: str
    description: str
    config: dict
    seed: int
    weights_digest: str
    fp8_block: tuple[int, int] | None = None

    def config_json(self) -> dict:
        config = dict(self.config)
        if self.fp8_block:
            config["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": list(self.fp8_block),
            }
        return config

    def fingerprint(self) -> str:
        """16 hex digits naming this exact content: config, seed, weights, tokenizer."""
        h = hashlib.sha256()
        h.update(json.dumps({"config": self.config_json(), "seed": self.seed, "weights": self.weights_digest}, sort_keys=True).encode())
        for name in TOKENIZER_FILES:
            h.update((TOKENIZER_DIR / name).read_bytes())
        return h.hexdigest()[:16]


GENERATED: dict[str, GeneratedCheckpoint] = {
    c.name: c
    for c in (
        GeneratedCheckpoint(
            name="tiny-v2-lite",
            description=(
                "DeepSeek-V2-Lite shape: no q LoRA, 16 routed experts top-6 with softmax greedy routing and no "
                "renormalisation, 2 shared experts, V2 YaRN (mscale 0.707); bf16"
            ),
            config=dict(
                _COMMON,
                architectures=["DeepseekV2ForCausalLM"],
                model_type="deepseek_v2",
                intermediate_size=256,
                moe_intermediate_size=32,
                q_lora_rank=None,
                n_routed_experts=16,
                num_experts_per_tok=6,
                n_shared_experts=2,
                topk_method="greedy",
                scoring_func="softmax",
                n_group=1,
                topk_group=1,
                norm_topk_prob=False,
                routed_scaling_factor=1.0,
                moe_layer_freq=1,
                rope_parameters=dict(_YARN, mscale=0.707, mscale_all_dim=0.707),
            ),
            seed=2,
            weights_digest="12c6430205bbe4a7",
        ),
        GeneratedCheckpoint(
            name="tiny-v3-fp8",
            description=(
                "DeepSeek-V3 shape in block FP8 (32x32 blocks, partial edge blocks in kv_a_proj_with_mqa and the dense "
                "MLP), q LoRA, 16 routed experts top-4 in 4 groups (2 chosen), sigmoid scores with a routing bias"
            ),
            config=dict(
                _COMMON,
                architectures=["DeepseekV3ForCausalLM"],
                model_type="deepseek_v3",
                intermediate_size=176,
                moe_intermediate_size=64,
                q_lora_rank=64,
                n_routed_experts=16,
                num_experts_per_tok=4,
                n_shared_experts=1,
                n_group=4,
                topk_group=2,
                norm_topk_prob=True,
                routed_scaling_factor=2.5,
                rope_interleave=True,
                num_nextn_predict_layers=0,
                rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=1.0),
            ),
            seed=3,
            weights_digest="5b30bfe3c6e87c34",
            fp8_block=(32, 32),
        ),
    )
}


def checkpoint_names() -> list[str]:
    return [DEFAULT, *GENERATED]


def fingerprint(name: str) -> str:
    """What a recorded baseline was measured on: the generated checkpoint's fingerprint, or for
    ``default`` a hash of its config and weights."""
    if name == DEFAULT:
        h = hashlib.sha256()
        for file in ("config.json", "model.safetensors", *TOKENIZER_FILES):
            h.update((DEFAULT_MODEL_DIR / file).read_bytes())
        return h.hexdigest()[:16]
    return _generated(name).fingerprint()


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "deepinfer" / "conformance"


def materialize(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The checkpoint directory of ``name``: the embedded default model's, or a generated one
    written under ``cache_dir`` (default ``~/.cache/deepinfer/conformance``; a temporary
    directory when that is not writable) as ``<name>-<fingerprint>`` and reused from then on."""
    if name == DEFAULT:
        return DEFAULT_MODEL_DIR
    spec = _generated(name)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        if cache_dir is not None:
            raise
        root = Path(tempfile.gettempdir()) / "deepinfer-conformance"
        root.mkdir(parents=True, exist_ok=True)
    target = root / f"{name}-{spec.fingerprint()}"
    if (target / "model.safetensors").is_file():
        return target
    # Written aside and renamed into place, so a concurrent or interrupted run never sees half a checkpoint.
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        write_checkpoint(spec, staging)
        staging.chmod(0o755)  # mkdtemp's 0700 would keep a shared cache from other users
        try:
            staging.rename(target)
        except OSError:  # another process got there first; its copy is identical
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_checkpoint(spec: GeneratedCheckpoint, out: Path) -> None:
    """config.json, model.safetensors and the tokenizer files of ``spec`` into ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = generate_tensors(spec)
    digest = tensors_digest(tensors)
    if digest != spec.weights_digest:
        raise CheckpointMismatch(
            f"conformance checkpoint {spec.name}: this platform (torch {torch.__version__}) generates weights with digest "
            f"{digest}, not the {spec.weights_digest} the baselines were recorded on, so a comparison would mean nothing. "
            "If the generator or the config was changed on purpose, update weights_digest in "
            "deepinfer_core/conformance/checkpoints.py and refresh every platform's baseline; otherwise report it"
        )
    save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(spec.config_json(), indent=2, sort_keys=True) + "\n")
    for file in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / file, out / file)


def checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape for an HF DeepSeek V2/V3 config dict, routed experts per expert
    (DeepSeek's layout), taken from transformers' model built on the meta device."""
    from transformers import AutoConfig, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    model_cls = {"deepseek_v3": DeepseekV3ForCausalLM, "deepseek_v2": DeepseekV2ForCausalLM}[config["model_type"]]
    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = model_cls(hf_config)
    shapes: dict[str, tuple[int, ...]] = {}
    for key, tensor in model.state_dict().items():
        split = split_expert_key(key, tensor.shape)
        if split is None:
            shapes[key] = tuple(tensor.shape)
        else:  # routed experts: one key per expert, as DeepSeek ships them
            shapes.update({k: tuple(slot.view(tensor).shape) for k, slot in split.items()})
    return shapes


def mtp_checkpoint_tensors(mtp_state: dict, layer: int) -> dict[str, torch.Tensor]:
    """transformers' MtpLayer state dict -> DeepSeek's checkpoint keys under model.layers.{layer}:
    enorm, hnorm, eh_proj, shared_head.norm and the decoder layer, routed experts one by one. The
    embedding and output head are the main model's and not included."""
    out = {}
    prefix = f"model.layers.{layer}."
    for key, t in mtp_state.items():
        if key == "post_norm.weight":
            out[prefix + "shared_head.norm.weight"] = t
        elif key.startswith("mtp_block.") and (split := split_expert_key(key, t.shape)) is not None:
            for expert_key, slot in split.items():  # routed experts one by one
                out[prefix + expert_key[len("mtp_block."):]] = slot.view(t).clone()
        elif key.startswith("mtp_block."):
            out[prefix + key[len("mtp_block."):]] = t
        else:
            out[prefix + key] = t
    return out


def generate_tensors(spec: GeneratedCheckpoint) -> dict[str, torch.Tensor]:
    """Every tensor of ``spec``'s checkpoint, bit-identical on every platform."""
    tensors: dict[str, torch.Tensor] = {}
    for key, shape in sorted(checkpoint_shapes(spec.config).items()):
        value = _value(key, shape, spec.seed)
        if key.endswith("e_score_correction_bias"):
            tensors[key] = value  # float32, as DeepSeek ships it
        elif spec.fp8_block and is_fp8_linear(key):
            tensors[key], tensors[key + "_scale_inv"] = quantize_fp8_block(value, spec.fp8_block)
        else:
            tensors[key] = value.to(torch.bfloat16)
    return tensors


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """16 hex digits over every tensor's name, dtype, shape and bytes (independent of the file format)."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _value(key: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Unit-variance uniform values for ``key``, scaled by the kind of tensor; float32."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    unit = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2.0 - 1.0) * math.sqrt(3.0)
    if key.endswith("e_score_correction_bias"):
        value = unit * 0.1
    elif "norm" in key:
        value = unit * 0.2 + 1.0
    elif "embed_tokens" in key:
        value = unit
    else:  # a matrix [out, in]; router scores spread wider, so that expert choices are clear-cut
        gain = 2.0 if key.endswith("mlp.gate.weight") else 1.0
        value = unit * (gain / math.sqrt(shape[-1]))
    return value.to(torch.float32)


def is_fp8_linear(key: str) -> bool:
    parts = key.split(".")
    return key.endswith(".weight") and len(parts) >= 2 and parts[-2] in FP8_LINEARS


def _fp8_blocks(w: torch.Tensor, block: tuple[int, int], scale_of) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8_e4m3fn [N, K], scales [ceil(N/bn), ceil(K/bk)]): ``scale_of`` maps
    each block's amax (float32 [gn, gk]) to its scale; partial blocks are zero-padded."""
    bn, bk = block
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.view(gn, bn, gk, bk)
    scale = scale_of(blocks.abs().amax(dim=(1, 3)))
    q = (blocks / scale.float()[:, None, :, None]).view(gn * bn, gk * bk)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8_e4m3fn [N, K], float32 scales [ceil(N/bn), ceil(K/bk)]), amax/448 per block, on w's device."""
    return _fp8_blocks(w, block, lambda amax: (amax / FP8_MAX).clamp(min=1e-12))


def e8m0_from_exponent(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents e -> float8_e8m0fnu 2^e (byte e + 127), clamped to the finite range 2^-127 .. 2^127."""
    return (exponent.to(torch.int32) + 127).clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def _pow2_exponent(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest e with amax / 2^e <= top (all-zero blocks: the smallest scale)."""
    e = torch.ceil(torch.log2(amax.double() / top))
    return torch.where(amax > 0, e, torch.full_like(e, -127)).clamp(-127, 127)


def quantize_fp8_block_e8m0(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8_e4m3fn [N, K], float8_e8m0fnu scales [ceil(N/bn), ceil(K/bk)]) with
    power-of-two block scales 2^ceil(log2(amax/448)), as DeepSeek-V4 stores its FP8 linears."""
    return _fp8_blocks(w, block, lambda amax: e8m0_from_exponent(_pow2_exponent(amax, FP8_MAX)))


E2M1_MAX = 6.0
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float (K a multiple of 32) -> MXFP4 as DeepSeek-V4 stores routed experts:
    (int8 [..., N, K/2], element 2k in the low nibble of byte k and 2k+1 in the high nibble;
    float8_e8m0fnu scales [..., N, K/32], 2^ceil(log2(amax/6)) per 32 inputs). Each value is
    rounded to the nearest E2M1 value (ties to the larger magnitude); ``deepinfer_core.loader.
    dequantize_mxfp4`` inverts it."""
    *lead, n, k = w.shape
    if k % 32:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of 32, got {k}")
    groups = w.float().reshape(*lead, n, k // 32, 32)
    scale = e8m0_from_exponent(_pow2_exponent(groups.abs().amax(dim=-1), E2M1_MAX))
    x = (groups / scale.float()[..., None]).reshape(*lead, n, k)
    grid = torch.tensor(_E2M1_GRID, device=w.device)
    mid = (grid[1:] + grid[:-1]) / 2
    code = torch.bucketize(x.abs().clamp(max=E2M1_MAX), mid, right=True).to(torch.uint8)
    code |= (x < 0).to(torch.uint8) << 3
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.view(torch.int8).contiguous(), scale


def _generated(name: str) -> GeneratedCheckpoint:
    try:
        return GENERATED[name]
    except KeyError:
        raise KeyError(f"unknown conformance checkpoint {name!r}; known: {', '.join(checkpoint_names())}") from None
