"""Kernel benchmarks of the NVIDIA backend at DeepSeek-V3 and V2-Lite shapes, against ceilings
measured in the same run.

    python -m benchmarks.kernels --out results/ [--only mla_decode] [--l2 rotate|warm]

Every kernel module of ``deepinfer_nvidia_sm100.kernels`` may have a benchmark module of the same
name in ``benchmarks.kernel_benches`` (kept out of the plugin: the benchmarks call the provider
modules, which import the kernel modules) that defines ``bench(device)``, which returns cases
``{name, shape, ms, bytes, flops}`` (bytes: each input read once and each output written once;
ms: median of triton.testing.do_bench, replaced here by CUDA-graph replays for the decode-path
modules). This script adds achieved GB/s and TFLOP/s and their ratios to the measured copy
bandwidth and matmul rate (the FP8 rate for cases whose name says fp8), and writes kernels.json.

L2 (an H200 has 50 MB): a graph that replays an op on the same inputs lets a working set below
L2 (MLA decode at B=32 L=1k is 38 MB, one FP8 weight of q_a_proj 11 MB) be read from L2 after
the first replay, which overstates its share of the copy bandwidth: a decode step never finds
its weights or latents in L2 (the other layers' reads have evicted them). So every graph-timed
case **rotates** among copies of its inputs: the tensors the timed callable holds (found in its
closure, its defaults, and the functions and partials those hold) are copied, as many times as
one lap over the copies needs to read ``ROTATE_L2_MULTIPLE`` x L2 (210 MB on an H200), and the
graph runs the op on copy 0, 1, ..., n-1, 0, 1, ... in turn (the time is that of the whole
graph over the number of calls). Copies are capped by ``MAX_COPIES`` and by
``MEMORY_FRACTION`` of the free device memory; a working set already at or above the target is
not copied (it is cold by its size).

Why rotation rather than flushing L2 between replays: flushing needs either per-replay events
around each graph launch (which puts the launch latency back into microsecond kernels, the
thing graph replays are here to remove) or subtracting the time of a >L2 flush kernel (~60 us
for 256 MB) from each flush + op pair, which for a 5 us op leaves a result dominated by the
flush's noise; a flush by writing (what triton's do_bench does) also leaves up to L2-size dirty
lines whose write-back the op then pays. Rotation adds no kernel to the timed graph and is what
a decode step does: each layer reads its own copy of the same shapes.

What it cannot do: a callable that reads a few rows of a tensor above the target (the cache
module's gather/write at fixed random slots of a 302 MB cache) is not copied, so those rows can
stay in L2; and working sets of a few KB stay in L2 even at MAX_COPIES. Every case says so: it
records ``l2`` (what was done, in words), ``l2_method`` (rotated / none / flushed / warm),
``working_set_bytes`` (bytes of the distinct storages the callable holds, one copy),
``l2_copies``, ``l2_ring_bytes`` (bytes read between two reads of the same data: copies x
min(working set, the case's bytes)) and ``l2_cold`` (ring >= ``COLD_L2_MULTIPLE`` x L2, or
flushed); graph-timed cases also record ``graph_calls``, the calls unrolled into the timed
graph (whole laps over the copies). The modules timed with plain do_bench (prefill attention,
sampling) keep triton's own flush: it zeroes a 256 MB buffer before every timed call.
``--l2 warm`` times the old way (same inputs every replay), for comparison. The ceilings
(benchmarks.ceilings) are timed eagerly on operands far above L2 (its docstring says why not as
graph replays).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import math
import statistics
import traceback
import types
from pathlib import Path

import torch

from benchmarks.ceilings import measure

# Modules whose ops are all capturable: their cases are timed as CUDA-graph replays, which is how
# the engine runs them in decode steps (no Python launch overhead in the numbers). The others
# (prefill attention, sampling: host reads allowed) are timed with plain do_bench.
GRAPH_TIMED = ("elementwise", "cache", "fp8_linear", "mla_decode", "moe", "hyper", "sparse", "compress")
BENCHES = "benchmarks.kernel_benches"  # bench(device) of kernel module X: BENCHES.X

L2_FALLBACK_BYTES = 50 * 2**20  # an H200's L2, where the device does not report its own
ROTATE_L2_MULTIPLE = 4  # rotate until one lap over the copies reads this many L2s
COLD_L2_MULTIPLE = 2  # a case counts as reading cold data when its ring is at least this many L2s
MAX_COPIES = 4096
MEMORY_FRACTION = 0.5  # at most this share of the free device memory goes to copies
TRITON_FLUSH = "flushed: triton do_bench zeroes a 256 MB buffer before every timed call"


def l2_bytes(device=None) -> int:
    """The device's L2 size (L2_FALLBACK_BYTES where it is not reported)."""
    try:
        return int(torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device()).L2_cache_size) or L2_FALLBACK_BYTES
    except Exception:  # noqa: BLE001 - no CUDA here, or no such property: the H200's size
        return L2_FALLBACK_BYTES


def available_bytes() -> int:
    """Free device memory, counting what the caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info()
    return int(free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())


def choose_copies(working_set: int, available: int, target: int, max_copies: int = MAX_COPIES,
                  memory_fraction: float = MEMORY_FRACTION) -> int:
    """Copies of a ``working_set`` (bytes) to rotate through so that one lap reads ``target``
    bytes: ceil(target / working_set), at least 1 (no copy: the original only), at most
    ``max_copies``, and the extra copies within ``memory_fraction`` of ``available`` bytes."""
    if working_set <= 0:
        return 1
    want = math.ceil(target / working_set)
    fit = 1 + int(memory_fraction * max(available, 0)) // working_set
    return max(1, min(want, max_copies, fit))


# --- The tensors a callable holds, and the same callable over copies of them ---------------------


def _map_held(obj, f, memo: dict):
    """``obj`` with every tensor t it holds replaced by f(t): through closures, defaults and
    keyword defaults of functions, functools.partial, and tuples / lists / dicts. Other objects
    (modules, classes, bound methods, ...) are kept as they are. Unchanged parts are returned
    as the very same objects."""
    if isinstance(obj, torch.Tensor):
        return f(obj)
    key = id(obj)
    if key in memo:
        return memo[key]
    if isinstance(obj, types.FunctionType):
        memo[key] = obj  # a function holding itself keeps the original
        cells = obj.__closure__ or ()
        contents = []
        for cell in cells:
            try:
                contents.append(cell.cell_contents)
            except ValueError:  # an empty cell
                contents.append(cell)
        new_contents = [c if isinstance(c, types.CellType) else _map_held(c, f, memo) for c in contents]
        new_defaults = _map_held(obj.__defaults__, f, memo) if obj.__defaults__ else obj.__defaults__
        new_kw = _map_held(obj.__kwdefaults__, f, memo) if obj.__kwdefaults__ else obj.__kwdefaults__
        if all(a is b for a, b in zip(new_contents, contents)) and new_defaults is obj.__defaults__ and new_kw is obj.__kwdefaults__:
            return obj
        closure = tuple(c if isinstance(c, types.CellType) and c is old else types.CellType(c)
                        for c, old in zip(new_contents, contents)) if cells else None
        new = types.FunctionType(obj.__code__, obj.__globals__, obj.__name__, new_defaults, closure)
        new.__kwdefaults__ = new_kw
        new.__qualname__ = obj.__qualname__
        memo[key] = new
        return new
    if isinstance(obj, functools.partial):
        func = _map_held(obj.func, f, memo)
        args = _map_held(obj.args, f, memo)
        kw = _map_held(obj.keywords, f, memo)
        new = obj if (func is obj.func and args is obj.args and kw is obj.keywords) else functools.partial(func, *args, **kw)
        memo[key] = new
        return new
    if isinstance(obj, (tuple, list)):
        items = [_map_held(x, f, memo) for x in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if isinstance(obj, list):
            return items
        return obj._make(items) if hasattr(obj, "_make") else type(obj)(items)
    if isinstance(obj, dict):
        items = {k: _map_held(v, f, memo) for k, v in obj.items()}
        return obj if all(items[k] is v for k, v in obj.items()) else items
    return obj


def held_tensors(fn) -> list[torch.Tensor]:
    """The distinct tensors ``fn`` holds (see _map_held), in the order found."""
    found: dict[int, torch.Tensor] = {}

    def note(t):
        found.setdefault(id(t), t)
        return t

    _map_held(fn, note, {})
    return list(found.values())


def _storage_key(t: torch.Tensor):
    return t.device, t.untyped_storage().data_ptr()


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (views of one storage count it once)."""
    seen = {}
    for t in tensors:
        seen.setdefault(_storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


def copy_tensors(tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """id(t) -> a copy of t on a fresh storage with t's offset, sizes and strides; tensors that
    shared a storage share the copy's (views stay views of one another)."""
    storages = {}
    out = {}
    for t in tensors:
        key = _storage_key(t)
        if key not in storages:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            storages[key] = whole.clone().untyped_storage()
        out[id(t)] = torch.empty(0, dtype=t.dtype, device=t.device).set_(storages[key], t.storage_offset(), t.size(), t.stride())
    return out


def rebind(fn, mapping: dict[int, torch.Tensor]):
    """``fn`` over other tensors: every tensor t it holds replaced by mapping[id(t)] (if there)."""
    return _map_held(fn, lambda t: mapping.get(id(t), t), {})


def _mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def plan_rotation(fn, rotate: bool = True, available: int | None = None, l2: int | None = None) -> tuple[list, dict]:
    """The callables to run in turn (fn itself first, then fn over each copy) and the record of
    what was done (l2, l2_method, working_set_bytes, l2_copies, l2_rotation_bytes). The copies
    are made here; ``available`` (bytes) defaults to the device's free memory, ``l2`` to its L2."""
    l2 = l2_bytes() if l2 is None else l2
    target = ROTATE_L2_MULTIPLE * l2
    tensors = held_tensors(fn)
    ws = storage_bytes(tensors)
    record = {"working_set_bytes": ws, "l2_copies": 1, "l2_rotation_bytes": ws}
    if not rotate:
        record.update(l2_method="warm", l2="warm: the same inputs every replay (--l2 warm)")
        return [fn], record
    if not tensors:
        record.update(l2_method="none", l2="not rotated: no tensors found in the timed callable")
        return [fn], record
    if ws >= target:
        record.update(l2_method="none", l2=f"not rotated: working set {_mb(ws)} >= target {_mb(target)} (cold by its size where read densely)")
        return [fn], record
    copies = choose_copies(ws, available_bytes() if available is None else available, target)
    fns = [fn] + [rebind(fn, copy_tensors(tensors)) for _ in range(copies - 1)]
    record.update(l2_copies=copies, l2_rotation_bytes=copies * ws, l2_method="rotated" if copies > 1 else "none",
                  l2=f"rotated {copies} copies ({_mb(copies * ws)})" if copies > 1 else "not rotated: no memory for a copy")
    return fns, record


def _summarize(times: list[float], return_mode: str):
    if return_mode == "all":
        return times
    return {"min": min, "max": max, "mean": statistics.fmean, "median": statistics.median}[return_mode](times)


def time_graph(fn, rep: int = 100, return_mode: str = "median", info: dict | None = None, rotate: bool = True) -> float:
    """Milliseconds of one call of ``fn`` replayed in a CUDA graph of n unrolled calls (run once
    first: kernels compile outside the capture), rotating among copies of its inputs so each
    call reads data that is not in L2 (see the module docstring; ``rotate=False``: the same
    inputs every call). ``info``, if given, is filled with the plan_rotation record."""
    # Copies on the caller's stream (where the inputs were made; their blocks go back to its pool).
    fns, record = plan_rotation(fn, rotate)
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        fn()
        torch.cuda.synchronize()
        if len(fns) > 1:
            try:
                for f in fns[1:]:  # eagerly once: a copy that breaks the op fails here, not in the capture
                    f()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - time the original alone, and say why
                fns = [fn]
                record.update(l2_copies=1, l2_rotation_bytes=record["working_set_bytes"], l2_method="none",
                              l2=f"not rotated: the op failed on a copy ({type(e).__name__}: {str(e)[:120]})")
        if info is not None:
            info.update(record)
        copies = len(fns)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(5):
            fns[i % copies]()
        end.record()
        torch.cuda.synchronize()
        estimate_ms = start.elapsed_time(end) / 5
        n = 1000 if estimate_ms == 0 else max(1, int(rep / estimate_ms))
        n = copies * math.ceil(n / copies)  # whole laps over the copies
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n):
                fns[i % copies]()
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / n)
        if info is not None:
            info["graph_calls"] = n
    del graph, fns
    return _summarize(times, return_mode)


@contextlib.contextmanager
def graph_timing(records: list | None = None, rotate: bool = True):
    """Make triton.testing.do_bench time CUDA-graph replays of the benchmarked callable (with L2
    rotation unless ``rotate`` is False); each call's record is appended to ``records``."""
    import triton.testing

    plain = triton.testing.do_bench

    def do_bench(fn, warmup=25, rep=100, return_mode="median", **_):
        info = {}
        try:
            return time_graph(fn, rep=rep, return_mode=return_mode, info=info, rotate=rotate)
        finally:  # appended even when the op raises, so records stay in step with the cases
            if records is not None:
                records.append(info)

    triton.testing.do_bench = do_bench
    try:
        yield
    finally:
        triton.testing.do_bench = plain


@contextlib.contextmanager
def flush_timing(records: list | None = None):
    """Keep triton.testing.do_bench (it flushes L2 itself) and append a record of each call."""
    import triton.testing

    plain = triton.testing.do_bench

    def do_bench(fn, *args, **kwargs):
        ws = storage_bytes(held_tensors(fn))
        if records is not None:
            records.append({"working_set_bytes": ws, "l2_copies": 1, "l2_rotation_bytes": ws,
                            "l2_method": "flushed", "l2": TRITON_FLUSH})
        return plain(fn, *args, **kwargs)

    triton.testing.do_bench = do_bench
    try:
        yield
    finally:
        triton.testing.do_bench = plain


def annotate_l2(cases: list[dict], records: list[dict], l2: int) -> list[dict]:
    """Each case with the record of its do_bench call (the i-th call times the i-th case) and
    l2_ring_bytes / l2_cold; cases and calls that do not pair up are marked unknown."""
    if len(records) != len(cases):
        why = f"unknown: {len(records)} timing calls for {len(cases)} cases"
        unknown = {"l2": why, "l2_method": "unknown", "working_set_bytes": None, "l2_copies": None, "l2_ring_bytes": None, "l2_cold": None}
        return [{**c, **unknown} for c in cases]
    out = []
    for case, rec in zip(cases, records):
        rec = {"working_set_bytes": 0, "l2_copies": 1, "l2_method": "unknown", "l2": "unknown: the timing call failed", **rec}
        touched = min(rec["working_set_bytes"], case.get("bytes") or rec["working_set_bytes"])
        ring = rec["l2_copies"] * touched
        cold = rec["l2_method"] == "flushed" or (rec["l2_method"] != "unknown" and ring >= COLD_L2_MULTIPLE * l2)
        out.append({**case, **rec, "l2_ring_bytes": ring, "l2_cold": cold})
    return out


def run(out_dir: Path, ceilings: dict | None = None, only: list[str] | None = None, rotate: bool = True) -> dict:
    from deepinfer_nvidia_sm100.backend import KERNEL_MODULES

    ceilings = ceilings or measure()
    bw, bf16, fp8 = ceilings["copy_bytes_per_s"], ceilings["bf16_flop_per_s"], ceilings.get("fp8_flop_per_s") or ceilings["bf16_flop_per_s"]
    l2 = l2_bytes()
    report = {
        "ceilings": ceilings,
        "l2": {"l2_bytes": l2, "method": "rotate" if rotate else "warm", "rotation_target_bytes": ROTATE_L2_MULTIPLE * l2,
               "cold_threshold_bytes": COLD_L2_MULTIPLE * l2, "max_copies": MAX_COPIES, "memory_fraction": MEMORY_FRACTION},
        "cases": [], "errors": {},
    }
    for name in KERNEL_MODULES:
        if only and name not in only:
            continue
        try:
            module = importlib.import_module(f"{BENCHES}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{BENCHES}.{name}":  # the module is there, something it imports is not
                raise
            continue  # a kernel module without a benchmark
        bench = getattr(module, "bench", None)
        if bench is None:
            continue
        records: list[dict] = []
        try:
            with graph_timing(records, rotate) if name in GRAPH_TIMED else flush_timing(records):
                cases = bench("cuda")
        except Exception:  # one module's failure must not hide the others' numbers
            report["errors"][name] = traceback.format_exc()
            print(f"[kernels] {name}: bench failed\n{report['errors'][name]}", flush=True)
            continue
        for case in annotate_l2(cases, records, l2):
            seconds = case["ms"] * 1e-3
            rate = fp8 if "fp8" in case["name"].lower() else bf16
            case = {"module": name, "timing": "cuda-graph replay" if name in GRAPH_TIMED else "do_bench", **case}
            case["gb_per_s"] = case.get("bytes", 0) / seconds / 1e9
            case["bw_ratio"] = case.get("bytes", 0) / seconds / bw
            case["tflop_per_s"] = case.get("flops", 0) / seconds / 1e12
            case["flop_ratio"] = case.get("flops", 0) / seconds / rate
            report["cases"].append(case)
            print(f"[kernels] {name:12s} {case['name']:40s} {str(case.get('shape')):50s} {case['ms'] * 1e3:9.1f} us "
                  f"{case['gb_per_s']:7.0f} GB/s ({case['bw_ratio']:5.1%} of copy) "
                  f"{case['tflop_per_s']:6.1f} TFLOP/s ({case['flop_ratio']:5.1%}) "
                  f"[L2 {'cold' if case['l2_cold'] else 'MAY BE WARM'}: {case['l2']}]"
                  + "".join(f" {key}={value:.2f}" for key, value in case.items() if key.startswith("vs_")), flush=True)
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description="NVIDIA kernel benchmarks against measured ceilings")
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--only", action="append", help="kernel module(s) to run (default: all)")
    parser.add_argument("--l2", choices=("rotate", "warm"), default="rotate",
                        help="graph-timed cases: rotate among copies of the inputs so they are read cold (default), "
                             "or replay on the same inputs (warm, the old numbers)")
    args = parser.parse_args()
    run(args.out, only=args.only, rotate=args.l2 == "rotate")


if __name__ == "__main__":
    main()
