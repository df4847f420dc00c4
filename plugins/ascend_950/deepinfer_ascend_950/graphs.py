"""NPU graphs for the core's decode steps (the platform's GraphBackend), through
``torch.npu.NPUGraph`` and ``torch.npu.graph`` (torch_npu's mirror of torch's CUDA graph API:
Ascend/pytorch ``torch_npu/npu/graphs.py``; vllm-ascend's ACLGraphWrapper captures the same way).

The platform offers it (``Platform.graphs``) but does not turn capture on (``graph_capture=False``):
the decode path still runs reference ops that read lengths on the host (``mla_decode_attention``,
``sample_tokens``: op_plan.LEFT_OUT), which no graph can hold. The ``npu`` tests capture and replay
the backend's own ops through it. Never run on an Ascend chip yet.
"""

from __future__ import annotations

import os

import torch

LAUNCH_BLOCKING = "ASCEND_LAUNCH_BLOCKING"


class NpuGraphs:
    """Captures on a side stream after one warm-up run (operators pick their tiling outside the
    capture); every graph shares the memory pool of the first."""

    def __init__(self):
        if os.environ.get(LAUNCH_BLOCKING) == "1":  # synchronous launches cannot be captured (vllm-ascend refuses it too)
            raise RuntimeError(f"NPU graphs cannot be captured with {LAUNCH_BLOCKING}=1 (it makes every launch "
                               f"synchronous): unset it, or run eagerly (LLM(enforce_eager=True))")
        self.pool = None

    def capture(self, fn):
        npu = torch.npu
        stream = npu.Stream()
        stream.wait_stream(npu.current_stream())
        with npu.stream(stream):
            fn()
        npu.current_stream().wait_stream(stream)
        graph = npu.NPUGraph()
        with npu.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def replay(self, graph) -> None:
        graph.replay()
