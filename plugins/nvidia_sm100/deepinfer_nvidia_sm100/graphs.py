"""CUDA graphs for the core's decode steps (the platform's GraphBackend)."""

from __future__ import annotations

import torch


class CudaGraphs:
    """Captures on a side stream after one warm-up run (kernels compile and autotune outside the
    capture); every graph shares the memory pool of the first."""

    def __init__(self):
        self.pool = None

    def capture(self, fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def replay(self, graph) -> None:
        graph.replay()
