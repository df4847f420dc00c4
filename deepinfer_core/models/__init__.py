"""Model definitions (pure math on the OpTable) and the model_type registry."""

from deepinfer_core.models.registry import get_model_class

__all__ = ["get_model_class"]
