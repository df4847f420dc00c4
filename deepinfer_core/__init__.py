"""DeepInfer: a hardware-pluggable inference engine for DeepSeek MoE models.

The public names are imported lazily so that importing a submodule (a backend's probe module
imports ``deepinfer_core.hookspecs``) stays cheap.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "GenerationError"]


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput", "CompletionOutput", "RequestMetrics", "GenerationError"):
        from deepinfer_core import api

        return getattr(api, name)
    if name == "SamplingParams":
        from deepinfer_core.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'deepinfer_core' has no attribute {name!r}")
