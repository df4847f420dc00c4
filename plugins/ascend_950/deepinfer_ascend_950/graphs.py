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

from deepinfer_core.platform import StreamGraphs

LAUNCH_BLOCKING = "ASCEND_LAUNCH_BLOCKING"


class NpuGraphs(StreamGraphs):
    """torch.npu's graphs (torch_npu), captured as ``StreamGraphs`` does."""

    graph_class = "NPUGraph"

    def __init__(self):
        if os.environ.get(LAUNCH_BLOCKING) == "1":  # synchronous launches cannot be captured (vllm-ascend refuses it too)
            raise RuntimeError(f"NPU graphs cannot be captured with {LAUNCH_BLOCKING}=1 (it makes every launch "
                               f"synchronous): unset it, or run eagerly (LLM(enforce_eager=True))")
        super().__init__()

    def module(self):
        return torch.npu
