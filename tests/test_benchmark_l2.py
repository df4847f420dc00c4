"""benchmarks/kernels.py's L2 handling without a GPU: how many copies of a working set are
rotated through, the copies themselves (CPU tensors: the callable over a copy computes the same
thing on other storage, views stay views), and the l2 fields every case of kernels.json gets
(run() with fake kernel modules and a fake graph timer). The CUDA-graph timing itself needs a GPU."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
import types

import pytest
import torch

from benchmarks import ceilings, kernels

MB = 10**6
H200_L2 = 50 * 2**20


def test_copies_reach_the_target_within_memory():
    target = kernels.ROTATE_L2_MULTIPLE * H200_L2  # 200 MiB
    mla_b32_l1k = 32 * 1024 * 576 * 2  # MLA decode latents at B=32, L=1k: 37.7 MB, below L2
    assert kernels.choose_copies(mla_b32_l1k, 100 * 2**30, target) == 6  # 6 x 37.7 MB = 226 MB >= 210 MB
    assert kernels.choose_copies(11 * MB, 100 * 2**30, target) == 20  # one FP8 q_a_proj weight
    assert kernels.choose_copies(target, 100 * 2**30, target) == 1
    assert kernels.choose_copies(10 * target, 100 * 2**30, target) == 1
    assert kernels.choose_copies(0, 100 * 2**30, target) == 1
    # capped by memory: the extra copies take at most MEMORY_FRACTION of what is free
    assert kernels.choose_copies(40 * MB, 100 * MB, target) == 1 + int(kernels.MEMORY_FRACTION * 100 * MB) // (40 * MB) == 2
    assert kernels.choose_copies(40 * MB, 0, target) == 1
    assert kernels.choose_copies(100, 100 * 2**30, target) == kernels.MAX_COPIES


def test_the_copy_ceiling_is_far_above_l2():
    assert ceilings.copy_buffer_bytes(2**32, 100 * 2**30, H200_L2) == 2**32  # 4 GiB: 80 L2s
    assert ceilings.copy_buffer_bytes(2**32, 4 * 2**30, H200_L2) == 2**30  # short of memory: a quarter of it
    assert ceilings.copy_buffer_bytes(2**32, 0, H200_L2) == ceilings.MIN_COPY_L2_MULTIPLE * H200_L2
    assert ceilings.MIN_COPY_L2_MULTIPLE >= 2 * kernels.ROTATE_L2_MULTIPLE


def _storages(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_rotated_callables_compute_the_same_on_other_storage():
    base = torch.randn(6, 4, 3)
    q = base[..., 1:]  # a strided view, as rotary_embedding's q_pe
    k = base[:, 0, :]  # another view of the same storage
    w = torch.randn(2)
    table = torch.arange(5.0)
    scale = 0.5

    def helper(z):  # a nested function holding a tensor of its own
        return z * table.sum()

    part = functools.partial(torch.add, alpha=2.0)

    def fn(extra=(w,)):
        return helper((q * extra[0]).sum() + k.sum() * scale) + part(w, w).sum()

    tensors = kernels.held_tensors(fn)
    assert {id(t) for t in tensors} == {id(q), id(k), id(w), id(table)}
    assert kernels.storage_bytes(tensors) == (base.numel() + w.numel() + table.numel()) * 4  # q, k: one storage

    ws = kernels.storage_bytes(tensors)
    l2 = ws  # a pretend L2 as large as the working set: target 4 x ws, so 4 copies
    fns, record = kernels.plan_rotation(fn, available=10**9, l2=l2)
    assert record["l2_method"] == "rotated" and record["l2_copies"] == len(fns) == kernels.ROTATE_L2_MULTIPLE
    assert record["working_set_bytes"] == ws and record["l2_rotation_bytes"] == 4 * ws
    assert record["l2"].startswith("rotated 4 copies")
    assert fns[0] is fn
    want = fn()
    seen = set()
    for f in fns[1:]:
        held = kernels.held_tensors(f)
        assert len(held) == 4
        assert not _storages(held) & _storages(tensors)  # all on fresh storage
        assert not _storages(held) & seen  # and not shared between copies
        seen |= _storages(held)
        assert torch.equal(f(), want)
    # views keep their offsets / strides and share one copied storage
    copies = kernels.copy_tensors(tensors)
    q2, k2 = copies[id(q)], copies[id(k)]
    assert (q2.stride(), q2.storage_offset(), q2.shape) == (q.stride(), q.storage_offset(), q.shape)
    assert (k2.stride(), k2.storage_offset()) == (k.stride(), k.storage_offset())
    assert q2.untyped_storage().data_ptr() == k2.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
    assert torch.equal(q2, q) and torch.equal(k2, k)


def test_in_place_ops_write_their_own_copy():
    cache = torch.zeros(8, 3)
    rows = torch.tensor([1, 5])
    new = torch.ones(2, 3)

    def write():
        cache.index_copy_(0, rows, new)

    fns, record = kernels.plan_rotation(write, available=10**9, l2=kernels.storage_bytes(kernels.held_tensors(write)))
    assert record["l2_copies"] == 4
    fns[1]()
    assert cache.sum() == 0  # the original is untouched
    written = next(t for t in kernels.held_tensors(fns[1]) if t.shape == cache.shape)
    assert written[[1, 5]].sum() == 6 and written.sum() == 6


def test_what_is_not_rotated_says_why():
    x = torch.randn(1000)
    fns, record = kernels.plan_rotation(lambda: x.sum(), available=10**9, l2=10)  # 4 kB >= target 40 B
    assert len(fns) == 1 and record["l2_method"] == "none" and "not rotated: working set" in record["l2"]
    fns, record = kernels.plan_rotation(lambda: x.sum(), rotate=False, available=10**9, l2=10**9)
    assert len(fns) == 1 and record["l2_method"] == "warm"
    fns, record = kernels.plan_rotation(lambda: torch.ones(3).sum(), available=10**9, l2=10**9)
    assert len(fns) == 1 and record["l2_method"] == "none" and "no tensors" in record["l2"]
    fns, record = kernels.plan_rotation(lambda: x.sum(), available=0, l2=10**9)
    assert len(fns) == 1 and record["l2"] == "not rotated: no memory for a copy"


def test_late_bound_loop_lambdas_are_copied_as_they_are_at_the_call():
    """The plugin's bench() functions time ``lambda: op(x, ...)`` inside loops that rebind x:
    the copies must be made when do_bench is called, from the values of that moment."""
    sizes = []
    for n in (3, 7):
        x = torch.randn(n)
        fns, _ = kernels.plan_rotation(lambda: x * 2, available=10**9, l2=n * 4)  # noqa: B023 - on purpose
        sizes.append({f().numel() for f in fns})
    assert sizes == [{3}, {7}]


def test_annotate_pairs_records_with_cases_and_flags_warm_ones():
    l2 = H200_L2
    cases = [{"name": "a", "bytes": 38 * MB}, {"name": "b", "bytes": 9 * MB}, {"name": "c", "bytes": 1000 * MB}, {"name": "d"}]
    records = [
        {"working_set_bytes": 38 * MB, "l2_copies": 6, "l2_method": "rotated", "l2": "rotated 6 copies (228 MB)"},
        {"working_set_bytes": 302 * MB, "l2_copies": 1, "l2_method": "none", "l2": "not rotated"},  # sparse reads of a big tensor
        {"working_set_bytes": 1000 * MB, "l2_copies": 1, "l2_method": "none", "l2": "not rotated"},
        {"working_set_bytes": 5 * MB, "l2_copies": 1, "l2_method": "flushed", "l2": kernels.TRITON_FLUSH},
    ]
    out = kernels.annotate_l2(cases, records, l2)
    assert [c["l2_ring_bytes"] for c in out] == [6 * 38 * MB, 9 * MB, 1000 * MB, 5 * MB]
    assert [c["l2_cold"] for c in out] == [True, False, True, True]
    assert out[0]["l2"] == "rotated 6 copies (228 MB)" and out[0]["name"] == "a" and out[0]["bytes"] == 38 * MB
    bad = kernels.annotate_l2(cases, records[:3], l2)
    assert all(c["l2_method"] == "unknown" and c["l2_cold"] is None and "3 timing calls for 4 cases" in c["l2"] for c in bad)
    assert all(c["working_set_bytes"] is c["l2_copies"] is c["l2_ring_bytes"] is None for c in bad)


def _fake_module(name: str, sizes: list[int], fail_at: int | None = None):
    def bench(device):
        import triton.testing

        results = []
        for i, n in enumerate(sizes):
            x = torch.randn(n)
            w = torch.randn(n)
            def op():  # late-bound loop variables, as in the plugin's bench() functions
                if i == fail_at:  # noqa: B023
                    raise RuntimeError("no backend for this shape")  # as mla_prefill's SDPA: do_bench raises
                return (x * w).sum()  # noqa: B023

            try:
                ms = triton.testing.do_bench(op, return_mode="median")
            except RuntimeError:
                ms = float("nan")
            results.append({"name": f"op/{n}", "shape": {"n": n}, "ms": 1.0 if math.isnan(ms) else ms, "bytes": 2 * n * 4, "flops": n})
        return results

    module = types.ModuleType(f"benchmarks.kernel_benches.{name}")
    module.bench = bench
    return module


def test_run_writes_the_l2_fields(tmp_path, monkeypatch):
    triton_testing = pytest.importorskip("triton.testing")
    backend = pytest.importorskip("deepinfer_nvidia_sm100.backend")

    calls = []

    def fake_time_graph(fn, rep=100, return_mode="median", info=None, rotate=True):
        fns, record = kernels.plan_rotation(fn, rotate, available=10**9, l2=4000)  # a pretend 4 kB L2
        for f in fns:
            f()
        info.update(record)
        calls.append(len(fns))
        return 0.01

    def fake_plain_do_bench(fn, warmup=25, rep=100, return_mode="median", **_):
        fn()
        return 0.02

    monkeypatch.setattr(kernels, "time_graph", fake_time_graph)
    monkeypatch.setattr(kernels, "l2_bytes", lambda device=None: 4000)
    monkeypatch.setattr(triton_testing, "do_bench", fake_plain_do_bench)
    monkeypatch.setattr(backend, "KERNEL_MODULES", ("fake_graph", "fake_plain"))
    monkeypatch.setattr(kernels, "GRAPH_TIMED", ("fake_graph",))
    monkeypatch.setitem(sys.modules, "benchmarks.kernel_benches.fake_graph", _fake_module("fake_graph", [10, 100, 10_000]))
    monkeypatch.setitem(sys.modules, "benchmarks.kernel_benches.fake_plain", _fake_module("fake_plain", [10, 20], fail_at=1))
    ceil = {"copy_bytes_per_s": 4e12, "bf16_flop_per_s": 7e14, "fp8_flop_per_s": 1.3e15}

    kernels.run(tmp_path, ceilings=ceil)
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert report["l2"]["l2_bytes"] == 4000 and report["l2"]["rotation_target_bytes"] == 16000
    assert report["l2"]["method"] == "rotate" and not report["errors"]
    graph = [c for c in report["cases"] if c["module"] == "fake_graph"]
    plain = [c for c in report["cases"] if c["module"] == "fake_plain"]
    for c in report["cases"]:
        assert {"l2", "l2_method", "working_set_bytes", "l2_copies", "l2_ring_bytes", "l2_cold"} <= set(c)
    # 2 x 10 floats = 80 B: 200 copies for a 16 kB lap; 800 B: 20 copies; 80 kB: above the target
    assert [(c["working_set_bytes"], c["l2_copies"], c["l2_method"]) for c in graph] == [
        (80, 200, "rotated"), (800, 20, "rotated"), (80_000, 1, "none")]
    assert calls == [200, 20, 1]
    assert [c["l2_cold"] for c in graph] == [True, True, True]
    assert graph[0]["l2"] == "rotated 200 copies (16.0 kB)"
    assert [c["l2_method"] for c in plain] == ["flushed", "flushed"]  # the raising call still has its record
    assert all(c["l2"] == kernels.TRITON_FLUSH and c["timing"] == "do_bench" for c in plain)

    kernels.run(tmp_path, ceilings=ceil, only=["fake_graph"], rotate=False)
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert report["l2"]["method"] == "warm"
    assert [(c["l2_method"], c["l2_copies"], c["l2_cold"]) for c in report["cases"]] == [
        ("warm", 1, False), ("warm", 1, False), ("warm", 1, True)]  # 80 kB is cold by its size (>= 2 L2s)


def test_the_cli_keeps_its_flags(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(kernels, "run", lambda out, only=None, rotate=True: seen.update(out=out, only=only, rotate=rotate))
    monkeypatch.setattr(sys, "argv", ["kernels", "--out", str(tmp_path), "--only", "moe"])
    kernels.main()
    assert seen == {"out": tmp_path, "only": ["moe"], "rotate": True}
    monkeypatch.setattr(sys, "argv", ["kernels", "--l2", "warm"])
    kernels.main()
    assert seen["rotate"] is False and str(seen["out"]) == "bench_results"


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int32, torch.bfloat16])
def test_copies_keep_the_dtype_and_bytes(dtype):
    t = torch.arange(24).reshape(4, 6).to(dtype)[:, 2:]
    c = kernels.copy_tensors([t])[id(t)]
    assert c.dtype == dtype and c.shape == t.shape and c.stride() == t.stride()
    assert torch.equal(c.view(torch.uint8) if dtype.itemsize == 1 else c.float(), t.view(torch.uint8) if dtype.itemsize == 1 else t.float())


class _FakeCuda:
    """Just enough of torch.cuda for time_graph's control flow on the CPU: every call of the op
    is one unit of "device time" (0.01 ms); a graph replays the calls made while it captured."""

    def __init__(self):
        self.calls = 0
        self.capturing = None

    def install(self, monkeypatch):
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = fake.calls

            def elapsed_time(self, end):
                return (end.at - self.at) * 0.01

        class Graph:
            def __init__(self):
                self.n = 0

            def replay(self):
                fake.calls += self.n

        @contextlib.contextmanager
        def graph(g):
            start = fake.calls
            fake.capturing = g
            yield
            fake.capturing = None
            g.n = fake.calls - start

        for name, value in {"Event": Event, "CUDAGraph": Graph, "graph": graph, "Stream": lambda: None,
                            "stream": lambda s: contextlib.nullcontext(), "synchronize": lambda *a: None,
                            "mem_get_info": lambda *a: (10**9, 10**10), "memory_reserved": lambda *a: 0,
                            "memory_allocated": lambda *a: 0}.items():
            monkeypatch.setattr(torch.cuda, name, value, raising=False)


def test_time_graph_captures_whole_laps_over_the_copies(monkeypatch):
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    monkeypatch.setattr(kernels, "l2_bytes", lambda device=None: 1000)  # target 4000 B
    x = torch.randn(100)  # 400 B: 10 copies
    seen = []

    def op():
        cuda.calls += 1
        if cuda.capturing is not None:
            seen.append(x.untyped_storage().data_ptr())
        return x * 2

    info = {}
    ms = kernels.time_graph(op, rep=1, info=info)
    assert ms == pytest.approx(0.01)
    assert info["l2_copies"] == 10 and info["l2_method"] == "rotated" and info["working_set_bytes"] == 400
    # rep 1 ms / 0.01 ms = 100 calls: 10 whole laps, each over the original and its 9 copies in turn
    assert info["graph_calls"] == len(seen) == 100
    assert len(set(seen[:10])) == 10 and seen[:10] * 10 == seen
    assert seen[0] == x.untyped_storage().data_ptr()

    info = {}
    kernels.time_graph(op, rep=1, info=info, rotate=False)
    assert info["l2_method"] == "warm" and info["l2_copies"] == 1
