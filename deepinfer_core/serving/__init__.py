"""Serving: the asyncio front end (``AsyncLLM``) and the OpenAI-compatible HTTP server
(``server.build_app``, started by ``deepinfer serve``)."""

from deepinfer_core.serving.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]
