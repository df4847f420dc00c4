"""model_type (from config.json) -> model class."""

from __future__ import annotations

from deepinfer_core.config import MLA_MODEL_TYPES, SUPPORTED_MODEL_TYPES, ConfigError
from deepinfer_core.models.deepseek_v3 import DeepseekV3ForCausalLM
from deepinfer_core.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer_core.models.deepseek_v41 import DeepseekV41ForCausalLM

MODEL_CLASSES: dict[str, type] = {
    **dict.fromkeys(MLA_MODEL_TYPES, DeepseekV3ForCausalLM),
    "deepseek_v4": DeepseekV4ForCausalLM,
    "deepseek_v41": DeepseekV41ForCausalLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_MODEL_TYPES)


def get_model_class(model_type: str) -> type:
    """The class that serves ``model_type``; ConfigError listing the supported types otherwise."""
    try:
        return MODEL_CLASSES[model_type]
    except KeyError:
        raise ConfigError(
            f"model_type {model_type!r} is not supported; supported model types: {', '.join(MODEL_CLASSES)}"
        ) from None
