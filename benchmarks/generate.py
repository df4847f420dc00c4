"""What users get through ``LLM.generate``: first call vs repeated call, GPU busy share, prefill
budget, prefix caching. Random weights (load_format="dummy"), real DeepSeek shapes.

    python -m benchmarks.generate --model v2-lite --layers 27 --out DIR [--batches 1,8,32,64,128] [--context 1024]
    python -m benchmarks.generate --quick --accelerator cpu --dtype float32 --out /tmp/g   # a CPU smoke run

Every time is the wall clock around one ``generate`` call, the device synchronised before and after.

decode: one fresh LLM per batch size B (its construction is ``startup_s``: weights, KV cache, graph
capture). B distinct prompts of L random token ids, greedy, ignore_eos, M output tokens. The first
call at B, made before any other call on that LLM, is ``first_s`` (what a user sees); then the
same prompts with max_tokens=1 give the prefill time, then the M-token call again gives
``repeat_s`` (each the min of --repeats). Decode step = (generate time - prefill time) / (M - 1):
the first token comes from the prefill, the other M - 1 from decode steps. ``decode_cadence_s``
(min over the repeats) is the mean time between the ends of consecutive decode-only steps of a
repeated call at its full batch (not the smaller steps after some sequences finished), from the engine's step observer (``StepClock``): no prefill in it, so it does not
move with the prefill's spread between calls as the step figure does where the prefill is most of
the call. The first call's step
uses the warm prefill time, so it carries all of the first call's extra cost (compilation, lazy
graph capture, allocator growth). The first LLM of the process also pays one-time costs (kernel
JIT caches), marked ``first_in_process``. Prefix caching is off in these runs (where the engine
has the switch) so that repeating the same prompts does not turn the prefill into cache hits.

gpu_busy (CUDA only), at every decode batch B: after a warm-up, one call of B prompts with --profile-tokens
outputs under torch.profiler (CPU + CUDA). Each engine step runs in a record_function range; a
step is a decode step when every unfinished sequence has its first output token already. The
decode part runs from the first decode step's start to the end of the call. Busy share = length
of the union of kernel intervals (overlap across streams counted once) in a window / the window;
memcpy/memset are left out of it (``call_device_busy_share`` counts them), and so are the GPU
copies of record_function ranges. The profiler slows the host, so the share is also given
against the decode time of a same-shaped unprofiled call. ``top_kernels``: device time by name
over the whole profiled call.

prefill: --prefill-batch prompts of --prefill-len tokens, max_tokens=1, one LLM per
max_num_batched_tokens in --budgets, a warm-up call then a timed one (other prompts).

prefix_caching: N requests sharing a P-token prefix plus distinct S-token suffixes, greedy, on an
LLM with enable_prefix_caching=False and one with True (a warm-up call with another prefix
first): wall times, speed-up, hit rate sum(num_cached_tokens) / sum(prompt lengths) (None where
RequestOutput has no num_cached_tokens), whether the output token ids are identical. An engine
without the switch is recorded as "unsupported".

Writes DIR/generate_<model>.json after every part, and generate_<model>.png if matplotlib is there.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import importlib
import json
import operator
import platform
import random
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.models import MODELS

TINY = {**copy.deepcopy(MODELS["v2-lite"]), "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,  # v2-lite, toy widths
        "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 8,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1}
CONFIGS = {**MODELS, "tiny": TINY}
FULL = {"model": "v2-lite", "layers": None, "batches": "1,8,32,64,128", "context": 1024, "max_tokens": 64, "repeats": 2,
        "prefill_batch": 128, "prefill_len": 1024, "budgets": "2048,4096,8192,16384", "prefix_requests": 64,
        "prefix_len": 896, "suffix_len": 128, "prefix_tokens": 16, "profile_batch": 32, "profile_tokens": 32}
QUICK = {"model": "tiny", "layers": 2, "batches": "1,4", "context": 64, "max_tokens": 8, "repeats": 2, "prefill_batch": 4,
         "prefill_len": 64, "budgets": "64,256", "prefix_requests": 4, "prefix_len": 48, "suffix_len": 16, "prefix_tokens": 4,
         "profile_batch": 4, "profile_tokens": 8}
NOT_KERNELS = ("Memcpy", "Memset")


class Unsupported(Exception):
    """The engine has no enable_prefix_caching switch."""


def write_model(name: str, layers: int | None, directory: Path) -> Path:
    """A config-only checkpoint directory of ``name``, with ``layers`` decoder layers if given."""
    config = {**copy.deepcopy(CONFIGS[name]), **({"num_hidden_layers": layers} if layers else {})}
    path = Path(directory) / f"{name}-{config['num_hidden_layers']}L"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def model_with_tokenizer(name: str, layers: int | None = None, tokenizer_vocab: bool = False) -> str | None:
    """None for ``name == "default"`` (the embedded default model); else a config-only checkpoint
    of ``name`` (random weights: load_format="dummy") holding the default model's tokenizer files,
    for benchmarks that send text. ``tokenizer_vocab``: the model's vocabulary cut to the
    tokenizer's, so that every sampled token has text (a stream's chunks carry text)."""
    if name == "default":
        return None
    import shutil
    import tempfile

    from deepinfer_core.api import resolve_model_dir

    path = write_model(name, layers, Path(tempfile.mkdtemp(prefix="bench-")))
    for f in resolve_model_dir(None).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    if tokenizer_vocab:
        from deepinfer_core.engine.startup import load_tokenizer

        tokenizer, config = load_tokenizer(path), json.loads((path / "config.json").read_text())
        config.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        (path / "config.json").write_text(json.dumps(config, indent=1))
    return str(path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize()


def build(args, caching: bool = False, **kwargs):
    """(LLM, seconds its construction took); enable_prefix_caching=caching where the LLM takes it."""
    from deepinfer_core import LLM

    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    kwargs.update(model=str(args.model_dir), accelerator=args.accelerator, dtype=args.dtype, load_format="dummy",
                  max_model_len=args.max_model_len, enforce_eager=args.enforce_eager, progress=False)
    t0 = time.perf_counter()
    try:
        llm = LLM(**kwargs, enable_prefix_caching=caching)
    except TypeError as e:
        if "enable_prefix_caching" not in str(e):
            raise
        if caching:
            raise Unsupported(str(e)) from e
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
    sync(llm.engine.device)
    return llm, time.perf_counter() - t0


def engine_info(llm) -> dict:
    """What the engine made of the arguments (None for what it no longer exposes under these names)."""
    names = {"backend": "backend.name", "platform": "platform.name", "device": "device", "dtype": "dtype",
             "max_num_batched_tokens": "max_num_batched_tokens", "max_num_seqs": "max_num_seqs",
             "max_model_len": "max_model_len", "kv_blocks": "kv.num_blocks", "async_scheduling": "async_scheduling",
             "graph_capture_s": "runner.graphs.capture_seconds", "prefix_hit_rate": "prefix_hit_rate"}
    info = {}
    for key, name in names.items():
        try:
            value = operator.attrgetter(name)(llm.engine)
        except AttributeError:
            value = None
        info[key] = value if value is None or isinstance(value, (int, float, str)) else str(value)
    return info


def params(max_tokens: int):
    from deepinfer_core import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)


def prompts(rng: random.Random, vocab: int, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def timed(llm, batch, sampling) -> tuple[float, list]:
    sync(llm.engine.device)
    t0 = time.perf_counter()
    outputs = llm.generate(batch, sampling, use_tqdm=False)
    sync(llm.engine.device)
    return time.perf_counter() - t0, outputs


def decode_step(call_s: float, prefill_s: float, max_tokens: int) -> float:
    """The decode step of a max_tokens call: (call - prefill) / (max_tokens - 1); the first token
    comes from the prefill. Where the prefill is most of the call (large batches, few tokens),
    its spread between calls moves this figure: ``StepClock.decode_cadence`` has no prefill in it."""
    return (call_s - prefill_s) / (max_tokens - 1)


class StepClock:
    """Inside ``with``: the perf_counter time at which each engine step's tokens reached the host,
    with the step's StepStats (through the engine's step observer, chained before any plugin's;
    it builds one StepStats a step where no plugin observes)."""

    def __init__(self, engine):
        self.engine, self.marks = engine, []

    def _observe(self, stats) -> None:
        self.marks.append((time.perf_counter(), stats))
        if self._before is not None:
            self._before(stats)

    def __enter__(self):
        self._before, self.engine.observer = self.engine.observer, self._observe
        return self

    def __exit__(self, *exc):
        self.engine.observer = self._before

    def decode_cadence(self) -> float | None:
        """Mean seconds between the ends of consecutive steps that took no prompt tokens and
        decoded the call's full batch (the most decode tokens any step had): the step period of
        steady decoding, with no prefill in it and none of the smaller steps left when sequences
        finish in waves (None: fewer than two such steps in a row)."""
        decoding = [(t, s) for t, s in self.marks if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
        full = max((s.num_decode_tokens for _, s in decoding), default=0)
        steps = [(t, s.step) for t, s in decoding if s.num_decode_tokens == full]
        gaps = [t1 - t0 for (t0, a), (t1, b) in zip(steps, steps[1:]) if b == a + 1]
        return sum(gaps) / len(gaps) if gaps else None


def timed_decode(llm, batch, sampling) -> tuple[float, list, float | None]:
    """``timed``, and the call's decode cadence (``StepClock.decode_cadence``)."""
    with StepClock(llm.engine) as clock:
        seconds, outputs = timed(llm, batch, sampling)
    return seconds, outputs, clock.decode_cadence()


def guarded(fn, *a) -> dict:
    """fn(*a), or the error it raised (the other parts still run); memory released after."""
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001 - a benchmark records what failed and goes on
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def decode_point(args, batch: int) -> dict:
    llm, startup = build(args, max_num_seqs=max(args.batches), max_num_batched_tokens=args.max_num_batched_tokens)
    group = prompts(random.Random(batch), args.vocab, batch, args.context)
    first, outputs = timed(llm, group, params(args.max_tokens))  # before any other call on this LLM
    prefills = [timed(llm, group, params(1))[0] for _ in range(args.repeats)]
    runs = [timed_decode(llm, group, params(args.max_tokens)) for _ in range(args.repeats)]
    repeats, cadences = [r[0] for r in runs], [r[2] for r in runs if r[2] is not None]
    prefill, repeat = min(prefills), min(repeats)
    step_first, step = (decode_step(t, prefill, args.max_tokens) for t in (first, repeat))
    point = {"context": args.context, "max_tokens": args.max_tokens, "startup_s": startup, "first_s": first,
             "prefill_s": prefill, "repeat_s": repeat, "prefill_runs_s": prefills, "repeat_runs_s": repeats,
             "first_over_repeat": first / repeat,
             "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
             "decode_step_first_s": step_first, "decode_step_s": step,
             "decode_cadence_s": min(cadences, default=None), "decode_cadence_runs_s": cadences,
             "step_first_over_repeat": step_first / step if step > 0 else None,
             "decode_tokens_per_s": batch / step if step > 0 else None, "engine": engine_info(llm)}
    if args.profile and llm.engine.device.type == "cuda":
        point["gpu_busy"] = guarded(busy_profile, llm, args, False, batch)
    return point


class StepMarks:
    """Inside ``with``: each ``engine.step`` in a record_function range named bench.decode_step or
    bench.prefill_step; counts of both, and the perf_counter time the first decode step began."""

    def __init__(self, engine):
        self.engine, self.first_decode, self.steps = engine, None, {"decode": 0, "prefill": 0}

    def _step(self):
        from torch.profiler import record_function

        live = [s for r in self.engine.requests.values() for s in r.seqs if not s.is_finished]
        kind = "decode" if live and all(s.output_token_ids for s in live) else "prefill"
        self.steps[kind] += 1
        if kind == "decode" and self.first_decode is None:
            self.first_decode = time.perf_counter()
        with record_function(f"bench.{kind}_step"):
            return self._orig()

    def __enter__(self):
        self._orig, self.engine.step = self.engine.step, self._step
        return self

    def __exit__(self, *exc):
        del self.engine.step  # the class's method again


def covered(intervals, lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` (start, end) clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total, end = total + b - a, b
    return total


def busy_profile(llm, args, cpu: bool = False, batch: int | None = None) -> dict:
    """GPU busy share of one warm call of ``batch`` (default --profile-batch) prompts (module
    docstring); ``cpu=True`` runs the bookkeeping on a CPU engine."""
    from torch.profiler import ProfilerActivity, profile, record_function

    device, rng, sampling = llm.engine.device, random.Random(7), params(args.profile_tokens)
    if device.type != "cuda" and not cpu:
        return {"skipped": f"not a CUDA device ({device})"}
    batch = batch or args.profile_batch
    shape = (args.vocab, batch, args.context)
    timed(llm, prompts(rng, *shape), sampling)  # warm-up at this shape
    with StepMarks(llm.engine) as plain:
        plain_wall = timed(llm, prompts(rng, *shape), sampling)[0]
        plain_decode = time.perf_counter() - plain.first_decode if plain.first_decode else None
    group = prompts(rng, *shape)
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
    with profile(activities=activities, acc_events=True) as prof, StepMarks(llm.engine) as marks, record_function("bench.generate"):
        timed(llm, group, sampling)
    events = prof.events()
    call = next(e.time_range for e in events if e.name == "bench.generate")
    lo = min((e.time_range.start for e in events if e.name == "bench.decode_step"), default=call.end)
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA  # not the GPU copies of ranges
                 and not getattr(e, "is_user_annotation", False) and not e.name.startswith("bench.")]
    kernels = [(e.time_range.start, e.time_range.end) for e in on_device if not e.name.startswith(NOT_KERNELS)]
    copies = [(e.time_range.start, e.time_range.end) for e in on_device if e.name.startswith(NOT_KERNELS)]
    call_us, decode_us, busy_us = call.end - call.start, call.end - lo, covered(kernels, lo, call.end)
    by_name: dict[str, list] = {}
    for e in on_device:
        row = by_name.setdefault(e.name[:120], [0.0, 0])
        row[0], row[1] = row[0] + e.time_range.elapsed_us() / 1e3, row[1] + 1
    return {
        "batch": batch, "context": args.context, "max_tokens": args.profile_tokens, "steps": marks.steps,
        "call_wall_s": call_us / 1e6, "decode_wall_s": decode_us / 1e6, "kernel_busy_decode_s": busy_us / 1e6,
        "call_wall_unprofiled_s": plain_wall, "decode_wall_unprofiled_s": plain_decode,
        "decode_busy_share": busy_us / decode_us if decode_us > 0 else None,
        "decode_busy_share_vs_unprofiled": busy_us / 1e6 / plain_decode if plain_decode else None,
        "call_busy_share": covered(kernels, call.start, call.end) / call_us,
        "call_device_busy_share": covered(kernels + copies, call.start, call.end) / call_us,
        "top_kernels": [{"name": k, "total_ms": ms, "count": n} for k, (ms, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]],
    }


def prefill_point(args, budget: int) -> dict:
    llm, startup = build(args, max_num_seqs=args.prefill_batch, max_num_batched_tokens=budget)
    rng, shape = random.Random(budget), (args.vocab, args.prefill_batch, args.prefill_len)
    warm = timed(llm, prompts(rng, *shape), params(1))[0]
    latency = timed(llm, prompts(rng, *shape), params(1))[0]
    return {"batch": args.prefill_batch, "length": args.prefill_len, "startup_s": startup, "warmup_s": warm,
            "latency_s": latency, "tokens_per_s": args.prefill_batch * args.prefill_len / latency,
            "engine_budget": engine_info(llm)["max_num_batched_tokens"]}


def prefix_caching(args) -> dict:
    rng = random.Random(11)

    def workload():
        shared = prompts(rng, args.vocab, 1, args.prefix_len)[0]
        return [shared + s for s in prompts(rng, args.vocab, args.prefix_requests, args.suffix_len)]

    warm, group, sampling = workload(), workload(), params(args.prefix_tokens)
    result: dict = {"requests": args.prefix_requests, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
                    "max_tokens": args.prefix_tokens}
    tokens = {}
    for key, flag in (("off", False), ("on", True)):
        try:
            llm, startup = build(args, caching=flag, max_num_seqs=args.prefix_requests, max_num_batched_tokens=args.max_num_batched_tokens)
        except Unsupported:
            result[key] = "unsupported"
            continue
        timed(llm, warm, sampling)
        wall, outputs = timed(llm, group, sampling)
        cached, total = [getattr(o, "num_cached_tokens", None) for o in outputs], sum(map(len, group))
        tokens[key] = [o.outputs[0].token_ids for o in outputs]
        result[key] = {"startup_s": startup, "wall_s": wall, "prompt_tokens": total,
                       "cached_tokens": None if None in cached else sum(cached),
                       "hit_rate": None if None in cached else sum(cached) / total}
        del llm, outputs
        gc.collect()
    if len(tokens) == 2:
        result["speedup"] = result["off"]["wall_s"] / result["on"]["wall_s"]
        result["identical_tokens"] = tokens["on"] == tokens["off"]
        result["mismatched_requests"] = sum(a != b for a, b in zip(tokens["on"], tokens["off"]))
    return result


def metadata(args) -> dict:
    def git(*cmd):
        try:
            out = subprocess.run(["git", *cmd], check=False, capture_output=True, text=True, timeout=10, cwd=Path(__file__).parent)
            return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    cuda = torch.cuda.is_available() and args.accelerator in (None, "nvidia", "cuda")
    return {"device_name": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "git_commit": git("rev-parse", "HEAD") or None, "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "host": platform.node(), "started": datetime.datetime.now(datetime.UTC).isoformat()}


def plot(report: dict, out: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    dec, pre = ([p for p in report[k] if "error" not in p] for k in ("decode", "prefill"))
    for key, label in (("decode_step_first_s", "first call"), ("decode_step_s", "repeated call")):
        a.plot([p["batch"] for p in dec], [p[key] * 1e3 for p in dec], "o-", label=label)
    a.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode step (ms)", title=f"{report['model']}: decode, L={report['args']['context']}")
    a.legend(fontsize=8)
    b.plot([p["budget"] for p in pre], [p["tokens_per_s"] for p in pre], "o-")
    b.set(xscale="log", xlabel="max_num_batched_tokens", ylabel="prompt tokens/s", title="prefill (max_tokens=1)")
    runs = {k: v for k, v in report["prefix_caching"].items() if k in ("off", "on") and isinstance(v, dict)}
    c.bar([f"prefix caching {k}" for k in runs], [v["wall_s"] for v in runs.values()])
    c.set(ylabel="wall (s)", title="shared-prefix workload")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path := out / f"generate_{report['model']}.png", dpi=120)
    plt.close(fig)
    return path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(CONFIGS), help="default v2-lite (tiny with --quick)")
    p.add_argument("--layers", type=int, help="decoder layers (default: the config's; 2 with --quick)")
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    p.add_argument("--quick", action="store_true", help="tiny shapes: a CPU smoke run in seconds")
    p.add_argument("--accelerator", help="cpu, nvidia, ... (default: auto)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-num-batched-tokens", type=int, help="of the decode and prefix runs (default: the LLM's)")
    p.add_argument("--max-model-len", type=int, help="default: what the longest request needs")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--skip", default="", help="parts to leave out, comma-separated: decode,prefill,prefix")
    for key in set(FULL) - {"model", "layers"}:
        p.add_argument("--" + key.replace("_", "-"), type=str if key in ("batches", "budgets") else int)
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    args.batches, args.budgets = ([int(v) for v in str(x).split(",")] for x in (args.batches, args.budgets))
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2 (one token from the prefill, at least one decode step)")
    args.vocab = CONFIGS[args.model]["vocab_size"]
    need = max(args.context + max(args.max_tokens, args.profile_tokens), args.prefill_len + 1,
               args.prefix_len + args.suffix_len + args.prefix_tokens)
    args.max_model_len = args.max_model_len or -(-(need + 16) // 64) * 64
    return args


def run(args) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    args.model_dir = write_model(args.model, args.layers, Path(tempfile.mkdtemp(prefix="deepinfer-gen-")))
    skip = set(filter(None, args.skip.split(",")))
    report = {"model": args.model, "meta": metadata(args), "config": json.loads((args.model_dir / "config.json").read_text()),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "decode": [], "gpu_busy": {"skipped": "no CUDA device, or --no-profile"}, "prefill": [], "prefill_best_budget": None, "prefix_caching": {}}
    path, tag = args.out / f"generate_{args.model}.json", f"[{args.model} {report['config']['num_hidden_layers']}L]"

    def save() -> None:  # after every part: a run cut short keeps what it measured
        report["meta"]["finished"] = datetime.datetime.now(datetime.UTC).isoformat()
        path.write_text(json.dumps(report, indent=1))

    importlib.import_module("deepinfer_core.api")  # imports and the CUDA context: the process's, not the first LLM's start-up

    if torch.cuda.is_available() and args.accelerator in (None, "nvidia", "cuda"):
        torch.zeros(1, device="cuda").add_(1).cpu()
    for batch in [] if "decode" in skip else args.batches:
        report["decode"].append(point := {"batch": batch, "first_in_process": not report["decode"], **guarded(decode_point, args, batch)})
        print(f"{tag} decode B={batch} L={args.context}: " + (point.get("error") or (
              f"start-up {point['startup_s']:.1f}s, first {point['first_s']:.3f}s, repeat {point['repeat_s']:.3f}s "
              f"({point['first_over_repeat']:.2f}x), prefill {point['prefill_s']:.3f}s, step {point['decode_step_s'] * 1e3:.2f} ms "
              f"(first call {point['decode_step_first_s'] * 1e3:.2f} ms), cadence "
              + ("n/a" if point["decode_cadence_s"] is None else f"{point['decode_cadence_s'] * 1e3:.2f} ms"))), flush=True)
        save()
    busy = [p.pop("gpu_busy") for p in report["decode"] if "gpu_busy" in p]  # one warm call per decode batch
    if busy:
        report["gpu_busy"] = busy
    for g in busy:
        if g.get("decode_busy_share") is not None:
            print(f"{tag} GPU busy B={g['batch']}: decode {g['decode_busy_share']:.1%} ({g['decode_busy_share_vs_unprofiled'] or 0:.1%} "
                  f"of the unprofiled decode time), whole call {g['call_busy_share']:.1%}", flush=True)
    for budget in [] if "prefill" in skip else args.budgets:
        report["prefill"].append(point := {"budget": budget, **guarded(prefill_point, args, budget)})
        print(f"{tag} prefill budget {budget}: " + (point.get("error") or f"{point['tokens_per_s']:.0f} tok/s ({point['latency_s']:.3f}s)"), flush=True)
        done = [p for p in report["prefill"] if "error" not in p]
        report["prefill_best_budget"] = max(done, key=lambda p: p["tokens_per_s"])["budget"] if done else None
        save()
    if "prefix" not in skip:
        report["prefix_caching"] = pc = guarded(prefix_caching, args)
        print(f"{tag} prefix caching: " + json.dumps({k: pc[k] for k in ("off", "on", "speedup", "identical_tokens", "error") if k in pc}), flush=True)
    save()
    figure = plot(report, args.out)
    print(f"wrote {path}" + (f" and {figure}" if figure else " (no plot: matplotlib is not installed)"), flush=True)
    return report


def main(argv=None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
