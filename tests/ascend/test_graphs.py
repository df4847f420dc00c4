"""NpuGraphs' glue on the CPU, through a recording stand-in of torch.npu's graph API (NPUGraph,
torch.npu.graph, streams: torch_npu/npu/graphs.py, which mirrors torch.cuda's). It checks the
order of the calls and the shared pool, not capture itself (the ``npu`` tests replay real graphs)."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from deepinfer_ascend_950 import graphs


class FakeNpu:
    def __init__(self):
        self.log: list[str] = []
        self.current = "main"

    def Stream(self):  # noqa: N802 (torch's name)
        name = f"side{sum(e.startswith('new stream') for e in self.log)}"
        self.log.append(f"new stream {name}")
        fake = self

        class Stream:
            def wait_stream(self, other):
                fake.log.append(f"{name} waits for {other}")

            def __repr__(self):
                return name
        return Stream()

    def current_stream(self):
        fake = self

        class Current:
            def wait_stream(self, other):
                fake.log.append(f"{fake.current} waits for {other!r}")

            def __repr__(self):
                return fake.current
        return Current()

    @contextlib.contextmanager
    def stream(self, s):
        before, self.current = self.current, repr(s)
        yield
        self.current = before

    def NPUGraph(self):  # noqa: N802
        fake, index = self, sum(e.startswith("new graph") for e in self.log)
        self.log.append(f"new graph {index}")
        return types.SimpleNamespace(pool=lambda: f"pool of graph {index}", replay=lambda: fake.log.append(f"replay {index}"))

    @contextlib.contextmanager
    def graph(self, g, pool=None):
        self.log.append(f"capture begin (pool={pool})")
        before, self.current = self.current, "capture"
        yield
        self.current = before
        self.log.append("capture end")


@pytest.fixture
def npu(monkeypatch):
    fake = FakeNpu()
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    monkeypatch.delenv(graphs.LAUNCH_BLOCKING, raising=False)
    return fake


def test_capture_warms_up_on_a_side_stream_then_records_into_one_shared_pool(npu):
    g = graphs.NpuGraphs()
    ran = []
    fn = lambda: ran.append(npu.current) or torch.ones(2)  # noqa: E731
    graph0, out = g.capture(fn)
    assert torch.equal(out, torch.ones(2)) and ran == ["side0", "capture"]
    g.capture(fn)
    assert npu.log == [
        "new stream side0", "side0 waits for main", "main waits for side0", "new graph 0", "capture begin (pool=None)",
        "capture end",
        "new stream side1", "side1 waits for main", "main waits for side1", "new graph 1",
        "capture begin (pool=pool of graph 0)", "capture end",
    ]
    g.replay(graph0)
    assert npu.log[-1] == "replay 0"


def test_launch_blocking_is_refused_with_the_fix(npu, monkeypatch):
    monkeypatch.setenv(graphs.LAUNCH_BLOCKING, "1")
    with pytest.raises(RuntimeError, match="ASCEND_LAUNCH_BLOCKING=1.*unset it, or run eagerly"):
        graphs.NpuGraphs()
