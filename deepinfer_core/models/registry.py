"""The DeepSeek generations DeepInfer serves: one record each, and the one place that reads
config.json's ``model_type``.

A generation is one folder under ``models/`` (its config, checkpoint format and model) plus one
record here. Everything the rest of the engine needs to know about a generation is on its record
or on its model class, whose members ``models/contract.py`` states (and checks at load): the
checkpoint format (``checkpoint_format``) and the capabilities (``supports_graphs``,
``supports_batch_invariance``, ``supports_context_parallel``, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from deepinfer_core.config import ConfigError
from deepinfer_core.models.v3 import config as v3_config
from deepinfer_core.models.v3.model import DeepseekV3ForCausalLM
from deepinfer_core.models.v4.config import V4ModelConfig
from deepinfer_core.models.v4.model import DeepseekV4ForCausalLM
from deepinfer_core.models.v41.config import V41ModelConfig
from deepinfer_core.models.v41.model import DeepseekV41ForCausalLM


@dataclass(frozen=True)
class Generation:
    """One DeepSeek generation: the ``model_type`` values it serves, its config class (read by
    ``config.from_config_json(raw, model_dir)``), its model class, and its chat protocol: the
    deepseek-recipe (ModelVersion, encoding class, DeepSeek's API name of the model) that
    ``recipe.py`` drives, or None for the tokenizer's own chat template."""

    name: str
    model_types: tuple[str, ...]
    config: type
    model: type
    chat: tuple[str, str, str] | None = None

    @property
    def checkpoint_format(self):
        """How its checkpoints name their tensors (``loader.load_model`` reads it off the model)."""
        return self.model.checkpoint_format


GENERATIONS = (
    Generation("DeepSeek-V2 / V3 / R1", v3_config.MODEL_TYPES, v3_config.V3ModelConfig, DeepseekV3ForCausalLM),
    Generation("DeepSeek-V4", ("deepseek_v4",), V4ModelConfig, DeepseekV4ForCausalLM,
               chat=("DeepseekV4Pro", "DeepseekV4Encoding", "DeepSeek-V4-Pro")),
    Generation("DeepSeek-V4.1", ("deepseek_v41",), V41ModelConfig, DeepseekV41ForCausalLM,
               chat=("DeepseekV41Flash", "DeepseekV41Encoding", "DeepSeek-V4.1-Flash")),
)
BY_MODEL_TYPE = {t: g for g in GENERATIONS for t in g.model_types}
SUPPORTED_MODEL_TYPES = tuple(BY_MODEL_TYPE)


def generation(model_type: str) -> Generation:
    """The generation that serves ``model_type``; ConfigError listing the supported types otherwise."""
    try:
        return BY_MODEL_TYPE[model_type]
    except KeyError:
        raise ConfigError(
            f"model_type {model_type!r} is not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        ) from None


def generation_for(config) -> Generation:
    """The generation of a config ``read_config`` returned."""
    return generation(config.model_type)


def describe(g: Generation) -> str:
    """How error messages name a generation: its name and config.json's values for it."""
    return f"{g.name} ({', '.join(map(repr, g.model_types))})"


def drafting(method: str) -> tuple[str, ...]:
    """The model types whose checkpoints' draft layers are ``method`` (the model's ``draft_method``)."""
    return tuple(t for g in GENERATIONS if g.model.draft_method == method for t in g.model_types)


def get_model_class(model_type: str) -> type:
    """The class that serves ``model_type``; ConfigError listing the supported types otherwise."""
    return generation(model_type).model


def read_config(model_dir: str | Path):
    """Read and validate ``model_dir/config.json`` with its generation's config class (V2/V3 and
    V4 through transformers' config classes; V4.1, which transformers lacks, directly)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: a model directory must hold an HF config.json")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} holds a JSON {type(raw).__name__}, not an object: an HF config.json is one object of settings")
    try:
        return generation(raw.get("model_type")).config.from_config_json(raw, model_dir)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
