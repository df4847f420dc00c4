"""The serving tests' server: the embedded default model behind ``build_app``, run by uvicorn on
127.0.0.1 (a free port) in a thread (``server.serve_in_thread``; callers import uvicorn first, or skip)."""

from __future__ import annotations

import contextlib

from deepinfer_core import LLM
from deepinfer_core.serving.async_llm import AsyncLLM
from deepinfer_core.serving.protocol import Limits
from deepinfer_core.serving.server import build_app, serve_in_thread

KEY = "test-key"
MODEL = "default"


@contextlib.contextmanager
def running_server():
    """(base URL, AsyncLLM) of a server wanting API key KEY, serving MODEL with small limits."""
    # batch-invariant: a request's greedy text may not depend on what else the server runs
    llm = LLM(accelerator="cpu", dtype="float32", progress=False, max_num_seqs=8, batch_invariant=True)
    engine = AsyncLLM(llm)
    app = build_app(engine, MODEL, KEY, Limits(max_tokens=64, max_n=4, max_body_bytes=1 << 16))
    try:
        with serve_in_thread(app) as url:
            yield url, engine
    finally:
        engine.shutdown()
