"""Which proposer drafts, from ``SpeculativeConfig`` (or DeepSeek's environment switches), and
whether the checkpoint can serve it: the engine's one entry into speculative decoding."""

from __future__ import annotations

from deepinfer_core.config import ConfigError, SpeculativeConfig, settings
from deepinfer_core.models.registry import drafting
from deepinfer_core.engine.spec_decode.dspark import DSparkProposer
from deepinfer_core.engine.spec_decode.mtp import MTPProposer
from deepinfer_core.engine.spec_decode.ngram import NgramProposer

DRAFT_MODELS = {"mtp": MTPProposer, "dspark": DSparkProposer}  # methods whose drafter is part of the checkpoint
DEFAULT_NEXTN = 5  # DeepSeek's default DEEPINFER_USE_NEXTN_DECODE


def resolve(config: SpeculativeConfig | None, model_cls: type) -> SpeculativeConfig | None:
    """The user's config, else DeepSeek's switches: DEEPINFER_USE_NEXTN_DECODE=K drafts K tokens
    with the model's own drafter (DSpark on V4.1, MTP otherwise); DEEPINFER_ENABLE_MTP_VARLEN=1
    is DSpark with adaptive verification (K defaults to 5)."""
    if config is not None:
        return config
    env = settings()
    k, varlen = env.use_nextn_decode, bool(env.enable_mtp_varlen)
    if not k and not (varlen and k is None):
        return None
    method = model_cls.draft_method
    return SpeculativeConfig(method=method, num_speculative_tokens=k or DEFAULT_NEXTN, adaptive=varlen and method == "dspark")


def check(sc: SpeculativeConfig | None, model, model_config, model_dir) -> bool:
    """Raise ConfigError if the checkpoint cannot draft as ``sc`` asks; whether its drafter's
    caches are needed (cache_groups(with_mtp=True))."""
    if sc is None or sc.method not in DRAFT_MODELS:
        return False
    if model.draft_method != sc.method:
        raise ConfigError(
            f"speculative_config method {sc.method!r} drafts for {', '.join(drafting(sc.method))}, not this checkpoint "
            f"(its draft layers are {model.draft_method!r}); use {model.draft_method!r} or 'ngram'"
        )
    if not model.num_mtp_layers:
        raise ConfigError(
            f"speculative_config method {sc.method!r} needs the checkpoint's draft layers, and {model_dir} has none "
            f"(config.json num_nextn_predict_layers={model_config.num_nextn_predict_layers}, after loading: 0 "
            "layers); use method 'ngram' or a checkpoint with them"
        )
    if sc.method == "dspark" and sc.num_speculative_tokens > model_config.dspark_block_size:
        raise ConfigError(
            f"num_speculative_tokens={sc.num_speculative_tokens} exceeds DSpark's block of dspark_block_size="
            f"{model_config.dspark_block_size} drafts; ask for at most that many"
        )
    return True


def build(sc: SpeculativeConfig | None, model, runner, ops, eos_ids, max_model_len: int, copy_to_host, step_tokens: int):
    """The proposer for ``sc`` (None: no speculation)."""
    if sc is None:
        return None
    k = sc.num_speculative_tokens
    if sc.method == "mtp":
        return MTPProposer(model, runner, k, ops, eos_ids, max_model_len, copy_to_host, sc.acceptance)
    if sc.method == "dspark":
        return DSparkProposer(model, runner, k, ops, eos_ids, max_model_len, copy_to_host, sc.acceptance, sc.adaptive, step_tokens)
    return NgramProposer(k, sc.prompt_lookup_max, sc.prompt_lookup_min, max_model_len)
