"""CUDA graphs for the core's decode steps (the platform's GraphBackend)."""

from __future__ import annotations

import torch

from deepinfer_core.platform import StreamGraphs


class CudaGraphs(StreamGraphs):
    """torch.cuda's graphs, captured as ``StreamGraphs`` does."""

    graph_class = "CUDAGraph"

    def module(self):
        return torch.cuda
