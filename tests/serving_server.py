"""The serving tests' server: the embedded default model behind ``build_app``, run by uvicorn on
127.0.0.1 (a free port) in a thread (callers import uvicorn first, or skip)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from deepinfer_core import LLM
from deepinfer_core.serving.async_llm import AsyncLLM
from deepinfer_core.serving.protocol import Limits
from deepinfer_core.serving.server import build_app

KEY = "test-key"
MODEL = "default"


@contextlib.contextmanager
def running_server():
    """(base URL, AsyncLLM) of a server wanting API key KEY, serving MODEL with small limits."""
    # batch-invariant: a request's greedy text may not depend on what else the server runs
    llm = LLM(accelerator="cpu", dtype="float32", progress=False, max_num_seqs=8, batch_invariant=True)
    engine = AsyncLLM(llm)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = build_app(engine, MODEL, KEY, Limits(max_tokens=64, max_n=4, max_body_bytes=1 << 16))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()
