"""Serving benchmark: the HTTP server under a request-rate sweep, measured as clients see it.

    python -m benchmarks.serve [--model default|v2-lite] [--rates 1,2,4,8] [--requests 64] [--max-tokens 64] --out results/
    python -m benchmarks.serve --workload chat --num-kv-blocks 48 [--kv-offload-gb 1]   # multi-turn, a cache that evicts
    python -m benchmarks.serve --launch pd     # deepinfer serve --role prefill + --role decode behind vllm-router
    python -m benchmarks.serve --launch one    # one deepinfer serve behind vllm-router: the same path without the split
    python -m benchmarks.serve --launch one --replicas 2 --router-policy cache_aware --workload chat   # replicas' balancing

Starts ``deepinfer serve``'s app in this process (on 127.0.0.1, a free port), or with
``--launch`` ``deepinfer serve`` processes behind ``vllm-router`` (``one``: one server; ``pd``: a
prefill and a decode server, the KV cache moving through NIXL), or ``--url`` for a server
already running. Per rate it sends ``--requests`` streamed completions with Poisson arrivals.
``--workload shared``: every prompt is one shared system prompt (``--system-tokens`` long) plus a
question of its own, the workload where prefix caching pays. ``--workload chat``: ``--requests``
conversations of ``--turns`` turns start at the rate; each turn re-sends the conversation so far
(the previous answer and a new question appended) once the previous turn is answered, so the
conversations outnumber what a small cache (``--num-kv-blocks``) holds and a host tier
(``--kv-offload-gb``) can give their prefixes back. Per rate: time to first token and time per
output token (p50 / p99, from the stream's chunks and the final usage), end-to-end latency,
output tokens/s over the rate's wall time, and from the servers' /metrics (read before and
after) the prompt tokens and those the prefix cache spared (by tier), hence the prompt tokens
computed; for a local server also the engine thread's steps (mean step time, share of the time
it was stepping). The clients run in a process of their own; ``--warmup`` requests go first,
timed apart (a fresh server compiles kernels on its first prompts). Writes serve.json and serve.png.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime
import json
import multiprocessing
import random
import time
from pathlib import Path

from benchmarks.generate import metadata, model_with_tokenizer

TIERS = ("gpu", "host", "disk")  # deepinfer_cached_prompt_tokens_by_tier's labels

SYSTEM = "You are a careful Python reviewer. Answer with code only, no prose. Follow PEP 8. "


class _StepClock:
    """Times the engine's steps (local server only): how long its thread spends stepping, and
    how much of the wall time between the first and the last step that is (the rest: the
    front end's work on that thread, and waiting for requests). A slow step is listed with the
    Triton kernels compiled during it and the StepStats reported during it (with overlapped
    scheduling those describe the step launched one call earlier)."""

    SLOW_S = 0.1  # a step this long is listed with what it ran (and the kernels compiled meanwhile)

    def __init__(self, engine):
        self._step, engine.step = engine.step, self
        self._observer, engine.observer = engine.observer, self._observe
        self.compiles: list[tuple[float, str]] = []
        try:  # Triton's compile hook (called before each compilation): JIT compiles during the run
            from triton import knobs

            knobs.runtime.jit_cache_hook = self._compiling
        except (ImportError, AttributeError):
            pass
        self.reset()

    def reset(self) -> None:
        self.steps, self.busy, self.first, self.last, self.durations, self.stats, self.compiles = 0, 0.0, None, None, [], [], []

    def _compiling(self, fn=None, **_) -> bool:
        self.compiles.append((time.perf_counter(), getattr(fn, "name", str(fn))))
        return False  # compile it

    def _observe(self, stats) -> None:
        self.stats.append(stats)
        if self._observer is not None:
            self._observer(stats)

    def __call__(self):
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.last = time.perf_counter()
            self.first = self.first or start
            self.steps += 1
            self.busy += self.last - start
            self.durations.append((start, self.last))

    def summary(self) -> dict:
        if not self.steps:
            return {"steps": 0}
        span = self.last - self.first
        ms = sorted((b - a) * 1e3 for a, b in self.durations)
        slow = sorted(((b - a, a, b, s) for (a, b), s in zip(self.durations, self.stats + [None] * len(self.durations))
                       if b - a > self.SLOW_S), reverse=True)[:8]
        return {"steps": self.steps, "step_ms_mean": self.busy / self.steps * 1e3, "stepping_share": self.busy / span if span else None,
                "step_ms_p50": ms[len(ms) // 2], "step_ms_p90": ms[int(0.9 * len(ms))], "step_ms_max": ms[-1],
                "slow_steps": sum(1 for v in ms if v > self.SLOW_S * 1e3), "slow_steps_ms": sum(v for v in ms if v > self.SLOW_S * 1e3),
                "compiles": len(self.compiles),
                "slowest": [{"ms": d * 1e3, "prefill_tokens": getattr(st, "num_prefill_tokens", None),
                             "decode_tokens": getattr(st, "num_decode_tokens", None),
                             "compiled": sorted({n for t, n in self.compiles if a <= t <= b})} for d, a, b, st in slow]}


@contextlib.contextmanager
def _local_server(args):
    from deepinfer_core import LLM
    from deepinfer_core.serving.async_llm import AsyncLLM
    from deepinfer_core.serving.server import build_app, serve_in_thread

    # a random-weight model's vocabulary is cut to the tokenizer's: every token then streams text
    path = model_with_tokenizer(args.model, args.layers, tokenizer_vocab=True)
    llm = LLM(model=path, accelerator=args.accelerator, dtype=args.dtype, max_num_seqs=args.max_num_seqs, progress=False,
              load_format="dummy" if path else "safetensors", num_kv_blocks=args.num_kv_blocks, kv_offload_gb=args.kv_offload_gb)
    engine = AsyncLLM(llm)
    try:
        with serve_in_thread(build_app(engine, "bench")) as url:
            yield url, [url], llm.tokenizer, _StepClock(llm.engine)
    finally:
        engine.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, procs: list, timeout: float = 300) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a server exited before {url} answered: see the logs in --out")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} did not answer /health within {timeout:.0f} s")


@contextlib.contextmanager
def _launched(args):
    """``deepinfer serve`` processes behind ``vllm-router`` (``args.launch``: one server, or a
    prefill and a decode server); yields (the router's URL, the servers' URLs, tokenizer, None)."""
    import shutil
    import subprocess
    import sys

    from deepinfer_core.api import resolve_model_dir
    from deepinfer_core.engine.startup import load_tokenizer

    router = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not Path(router).exists():
        raise SystemExit("--launch needs vllm-router (pip install 'deepinfer[pd]')")
    path = model_with_tokenizer(args.model, args.layers, tokenizer_vocab=True)
    serve = [sys.executable, "-m", "deepinfer_core.cli", "serve", *([path, "--load-format", "dummy"] if path else []),
             "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs), "--kv-offload-gb", str(args.kv_offload_gb)]
    serve += ["--accelerator", args.accelerator] if args.accelerator else []
    serve += ["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks else []
    roles = ["prefill", "decode"] if args.launch == "pd" else [None] * args.replicas
    # a pair on one GPU shares its memory; on the CPU the fraction is not read
    serve += ["--gpu-memory-utilization", str(args.gpu_memory_utilization or round(0.9 / len(roles), 3))]
    procs, urls = [], []
    try:
        for role in roles:
            port = _free_port()
            log = open(args.out / f"server-{role or len(procs)}.log", "w")
            procs.append(subprocess.Popen(serve + ["--port", str(port)] + (["--role", role] if role else []),
                                          stdout=log, stderr=subprocess.STDOUT))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            _wait(url, procs)
        port = _free_port()
        if args.launch == "pd":
            how = ["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", urls[0], "--decode", urls[1]]
        else:
            how = ["--worker-urls", *urls, "--policy", args.router_policy]
        procs.append(subprocess.Popen([router, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(_free_port()),
                                       *how], stdout=open(args.out / "router.log", "w"), stderr=subprocess.STDOUT))
        _wait(f"http://127.0.0.1:{port}", procs, timeout=60)
        yield f"http://127.0.0.1:{port}", urls, load_tokenizer(Path(path) if path else resolve_model_dir(None)), None
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _prompts(tokenizer, n: int, system_tokens: int, seed: int) -> list[str]:
    system = SYSTEM
    while tokenizer is not None and len(tokenizer.encode(system, add_special_tokens=False)) < system_tokens:
        system += SYSTEM
    rng = random.Random(seed)
    names = ["parse", "merge", "render", "fetch", "sort", "hash", "split", "encode"]
    return [f"{system}\n# task {i}: write {rng.choice(names)}_{rng.choice(names)}({rng.randint(1, 9)} args)\ndef " for i in range(n)]


def _counter(page: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(name + " "))


async def _one(client, url: str, prompt: str, max_tokens: int, delay: float) -> dict:
    import httpx

    await asyncio.sleep(delay)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # the last chunk: the usage (tokens)
    start = time.perf_counter()
    first, tokens, text = None, 0, []
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return {"error": event["error"]["message"]}
                if first is None and any(c["text"] for c in event["choices"]):
                    first = time.perf_counter()
                text += [c["text"] for c in event["choices"]]
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    first = first if first is not None else end
    return {"ttft_s": first - start, "e2e_s": end - start, "tokens": tokens,
            "tpot_s": (end - first) / (tokens - 1) if tokens > 1 else None, "text": "".join(text)}


async def _conversation(client, url: str, opening: str, turns: int, max_tokens: int, delay: float) -> list[dict]:
    """One chat: each turn re-sends the conversation so far once the previous turn is answered."""
    rows, prompt = [], opening
    for turn in range(turns):
        row = await _one(client, url, prompt, max_tokens, delay if turn == 0 else 0.0)
        rows.append(row)
        if "error" in row:
            break
        prompt += row.pop("text") + f"\n# follow-up {turn + 1}: now make it faster\ndef "
    return rows


def _pct(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


async def _metrics(client, urls: list[str]) -> dict[str, float]:
    """The servers' prompt-token counters, added up."""
    pages = [(await client.get(url + "/metrics")).text for url in urls]
    out = {"prompt": sum(_counter(p, "deepinfer_prompt_tokens_total") for p in pages),
           "cached": sum(_counter(p, "deepinfer_cached_prompt_tokens_total") for p in pages),
           "transferred": sum(_counter(p, "deepinfer_transferred_prompt_tokens_total") for p in pages)}
    for tier in TIERS:
        out[tier] = sum(_counter(p, f'deepinfer_cached_prompt_tokens_by_tier_total{{tier="{tier}"}}') for p in pages)
    return out


async def _rate(url: str, metrics: list[str], prompts: list[str], rate: float, max_tokens: int, seed: int, turns: int = 0) -> dict:
    """One rate: ``prompts`` sent with Poisson arrivals (``turns`` > 0: each opens a conversation
    of that many turns, the later turns sent as the earlier ones are answered)."""
    import httpx

    rng = random.Random(seed)
    t, delays = 0.0, []
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(rate)
    async with httpx.AsyncClient(timeout=600) as client:
        before = await _metrics(client, metrics)
        start = time.perf_counter()
        if turns:
            chats = await asyncio.gather(*(_conversation(client, url, p, turns, max_tokens, d) for p, d in zip(prompts, delays)))
            rows = [r for chat in chats for r in chat]
        else:
            rows = await asyncio.gather(*(_one(client, url, p, max_tokens, d) for p, d in zip(prompts, delays)))
        wall = time.perf_counter() - start
        after = await _metrics(client, metrics)
    ok = [r for r in rows if "error" not in r]
    counted = {k: after[k] - before[k] for k in after}
    # a prefill/decode pair: the prefill's prompt is the request's but its last token, the decode's
    # the whole prompt less what it received: each prompt token is counted once
    prompt_tokens, cached = counted["prompt"] - counted["transferred"], counted["cached"]
    point = {"rate": rate, "requests": len(rows), "errors": [r["error"] for r in rows if "error" in r][:5],
             "num_errors": len(rows) - len(ok), "wall_s": wall, "output_tokens": sum(r["tokens"] for r in ok),
             "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall, "prefix_hit_rate": cached / prompt_tokens if prompt_tokens else None,
             "prompt_tokens": prompt_tokens, "prompt_tokens_computed": prompt_tokens - cached,
             "cached_prompt_tokens_by_tier": {tier: counted[tier] for tier in TIERS}}
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        point[key] = {"p50": _pct([r[key] for r in ok], 0.5), "p99": _pct([r[key] for r in ok], 0.99)}
    return point


def _rate_in_process(url: str, metrics: list[str], prompts: list[str], rate: float, max_tokens: int, seed: int, turns: int = 0) -> dict:
    return asyncio.run(_rate(url, metrics, prompts, rate, max_tokens, seed, turns))


def _plot(points: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rates = [p["rate"] for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for key, ax in zip(("ttft_s", "tpot_s"), axes):
        for q in ("p50", "p99"):
            ax.plot(rates, [(p[key][q] or 0) * 1e3 for p in points], marker="o", label=q)
        ax.set(xlabel="requests/s offered", ylabel=f"{key[:-2].upper()} (ms)", xscale="log")
        ax.legend()
    axes[2].plot(rates, [p["output_tokens_per_s"] for p in points], marker="o")
    axes[2].set(xlabel="requests/s offered", ylabel="output tokens/s", xscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="'default' (the embedded model) or a benchmarks.models name (random "
                   "weights, the default model's tokenizer)")
    p.add_argument("--layers", type=int, default=None, help="with a benchmarks.models name: that many decoder layers")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--url", default=None, help="benchmark this running server instead (its /metrics must be open)")
    p.add_argument("--accelerator", default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--rates", default="1,2,4,8,16")
    p.add_argument("--requests", type=int, default=64, help="requests per rate")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=200, help="length of the shared system prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=8, help="requests sent at once before the sweep, reported apart (0: none)")
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    p.add_argument("--workload", choices=["shared", "chat"], default="shared",
                   help="shared: a shared system prompt and a question each; chat: --requests conversations of --turns turns")
    p.add_argument("--turns", type=int, default=4, help="with --workload chat: turns per conversation")
    p.add_argument("--replicas", type=int, default=1, help="with --launch one: that many servers behind the router")
    p.add_argument("--router-policy", default="round_robin",
                   help="with --launch one: vllm-router's --policy across the replicas (round_robin, cache_aware, power_of_two, ...)")
    p.add_argument("--launch", choices=["one", "pd"], default=None,
                   help="deepinfer serve processes behind vllm-router: one server, or a prefill and a decode server")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="the servers' KV cache in blocks (a small one evicts)")
    p.add_argument("--kv-offload-gb", type=float, default=0, help="the servers' host tier (GiB; 0: none)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="with --launch: each server's share of the GPU's memory (default 0.9, split between a pair)")
    args = p.parse_args(argv)
    if args.url and args.launch:
        raise SystemExit("--url and --launch: give one")
    rates = [float(r) for r in args.rates.split(",")]
    report = {"meta": metadata(args), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "points": []}
    args.out.mkdir(parents=True, exist_ok=True)
    server = (contextlib.nullcontext((args.url, [args.url], None, None)) if args.url else
              _launched(args) if args.launch else _local_server(args))
    turns = args.turns if args.workload == "chat" else 0
    # the clients run in a process of their own: in the server's they would share its interpreter lock
    clients = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    with server as (url, metrics, tokenizer, clock), clients:
        if tokenizer is None and args.url is None:
            raise SystemExit("the model has no tokenizer: the benchmark sends text prompts")
        if args.warmup:  # the first prompts of a fresh server compile kernels: timed apart
            start = time.perf_counter()
            warm = clients.submit(_rate_in_process, url, metrics, _prompts(tokenizer, args.warmup, args.system_tokens, args.seed - 1),
                                  1e9, args.max_tokens, args.seed).result()
            report["warmup"] = {"requests": args.warmup, "wall_s": time.perf_counter() - start, "ttft_s": warm["ttft_s"],
                                "num_errors": warm["num_errors"]}
            print(f"[serve] warm-up: {args.warmup} requests at once in {report['warmup']['wall_s']:.1f} s", flush=True)
        for i, rate in enumerate(rates):
            prompts = _prompts(tokenizer, args.requests, args.system_tokens, args.seed + i)
            if turns:  # conversations share nothing: each its own first block, so only its own turns reuse its prefix
                prompts = [f"# session {args.seed + i}.{k}\n{p}" for k, p in enumerate(prompts)]
            if clock is not None:
                clock.reset()
            point = clients.submit(_rate_in_process, url, metrics, prompts, rate, args.max_tokens, args.seed + i, turns).result()
            if clock is not None:
                point["engine"] = clock.summary()
            report["points"].append(point)
            print(f"[serve] {rate:g} req/s: {point['output_tokens_per_s']:.0f} output tok/s, TTFT p50 "
                  f"{(point['ttft_s']['p50'] or 0) * 1e3:.0f} ms p99 {(point['ttft_s']['p99'] or 0) * 1e3:.0f} ms, TPOT p50 "
                  f"{(point['tpot_s']['p50'] or 0) * 1e3:.1f} ms p99 {(point['tpot_s']['p99'] or 0) * 1e3:.1f} ms, prefix hits "
                  f"{point['prefix_hit_rate'] or 0:.0%} (host tier {point['cached_prompt_tokens_by_tier']['host']:.0f} tokens), prompt "
                  f"tokens computed {point['prompt_tokens_computed']:.0f} of {point['prompt_tokens']:.0f}, errors {point['num_errors']}" + (
                      f"; engine: {point['engine']['steps']} steps, mean {point['engine']['step_ms_mean']:.1f} ms, p50 "
                      f"{point['engine']['step_ms_p50']:.1f} ms, {point['engine']['slow_steps']} over 100 ms, "
                      f"{point['engine']['compiles']} kernel compiles, stepping {point['engine']['stepping_share']:.0%} of the time"
                      if point.get("engine", {}).get("steps") else ""), flush=True)
            for slow in point.get("engine", {}).get("slowest", [])[:3]:
                print(f"[serve]   slow step {slow['ms']:.0f} ms: {slow['prefill_tokens']} prefill + {slow['decode_tokens']} decode "
                      f"tokens, compiled {', '.join(slow['compiled'][:6]) or 'nothing'}", flush=True)
            report["meta"]["finished"] = datetime.datetime.now(datetime.UTC).isoformat()
            (args.out / "serve.json").write_text(json.dumps(report, indent=1))
    _plot(report["points"], args.out / "serve.png")
    print(f"wrote {args.out / 'serve.json'}", flush=True)


if __name__ == "__main__":
    main()
