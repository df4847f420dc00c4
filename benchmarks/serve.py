"""Serving benchmark: the HTTP server under a request-rate sweep, measured as clients see it.

    python -m benchmarks.serve [--model default|v2-lite] [--rates 1,2,4,8] [--requests 64] [--max-tokens 64] --out results/

Starts ``deepinfer serve``'s app in this process (on 127.0.0.1, a free port; or ``--url`` for a
server already running) and, per rate, sends ``--requests`` streamed completions with Poisson
arrivals. Every prompt is one shared system prompt (``--system-tokens`` long) plus a question of
its own, the workload where prefix caching pays. Per rate: time to first token and time per
output token (p50 / p99, from the stream's chunks and the final usage), end-to-end latency,
output tokens/s over the rate's wall time, and the prefix-cache hit rate of that rate's
requests (the server's /metrics, read before and after); for a local server also the engine
thread's steps (mean step time, share of the time it was stepping). The clients run in a
process of their own; ``--warmup`` requests go first, timed apart (a fresh server compiles
kernels on its first prompts). Writes serve.json and serve.png.
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
              load_format="dummy" if path else "safetensors")
    engine = AsyncLLM(llm)
    try:
        with serve_in_thread(build_app(engine, "bench")) as url:
            yield url, llm.tokenizer, _StepClock(llm.engine)
    finally:
        engine.shutdown()


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
    first, tokens = None, 0
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
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    first = first if first is not None else end
    return {"ttft_s": first - start, "e2e_s": end - start, "tokens": tokens,
            "tpot_s": (end - first) / (tokens - 1) if tokens > 1 else None}


def _pct(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


async def _rate(url: str, prompts: list[str], rate: float, max_tokens: int, seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    t, delays = 0.0, []
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(rate)
    async with httpx.AsyncClient(timeout=600) as client:
        before = (await client.get(url + "/metrics")).text
        start = time.perf_counter()
        rows = await asyncio.gather(*(_one(client, url, p, max_tokens, d) for p, d in zip(prompts, delays)))
        wall = time.perf_counter() - start
        after = (await client.get(url + "/metrics")).text
    ok = [r for r in rows if "error" not in r]
    prompt_tokens = _counter(after, "deepinfer_prompt_tokens_total") - _counter(before, "deepinfer_prompt_tokens_total")
    cached = _counter(after, "deepinfer_cached_prompt_tokens_total") - _counter(before, "deepinfer_cached_prompt_tokens_total")
    point = {"rate": rate, "requests": len(rows), "errors": [r["error"] for r in rows if "error" in r][:5],
             "num_errors": len(rows) - len(ok), "wall_s": wall, "output_tokens": sum(r["tokens"] for r in ok),
             "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall, "prefix_hit_rate": cached / prompt_tokens if prompt_tokens else None}
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        point[key] = {"p50": _pct([r[key] for r in ok], 0.5), "p99": _pct([r[key] for r in ok], 0.99)}
    return point


def _rate_in_process(url: str, prompts: list[str], rate: float, max_tokens: int, seed: int) -> dict:
    return asyncio.run(_rate(url, prompts, rate, max_tokens, seed))


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
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    report = {"meta": metadata(args), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "points": []}
    args.out.mkdir(parents=True, exist_ok=True)
    server = contextlib.nullcontext((args.url, None, None)) if args.url else _local_server(args)
    # the clients run in a process of their own: in the server's they would share its interpreter lock
    clients = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    with server as (url, tokenizer, clock), clients:
        if tokenizer is None and args.url is None:
            raise SystemExit("the model has no tokenizer: the benchmark sends text prompts")
        if args.warmup:  # the first prompts of a fresh server compile kernels: timed apart
            start = time.perf_counter()
            warm = clients.submit(_rate_in_process, url, _prompts(tokenizer, args.warmup, args.system_tokens, args.seed - 1),
                                  1e9, args.max_tokens, args.seed).result()
            report["warmup"] = {"requests": args.warmup, "wall_s": time.perf_counter() - start, "ttft_s": warm["ttft_s"],
                                "num_errors": warm["num_errors"]}
            print(f"[serve] warm-up: {args.warmup} requests at once in {report['warmup']['wall_s']:.1f} s", flush=True)
        for i, rate in enumerate(rates):
            prompts = _prompts(tokenizer, args.requests, args.system_tokens, args.seed + i)
            if clock is not None:
                clock.reset()
            point = clients.submit(_rate_in_process, url, prompts, rate, args.max_tokens, args.seed + i).result()
            if clock is not None:
                point["engine"] = clock.summary()
            report["points"].append(point)
            print(f"[serve] {rate:g} req/s: {point['output_tokens_per_s']:.0f} output tok/s, TTFT p50 "
                  f"{(point['ttft_s']['p50'] or 0) * 1e3:.0f} ms p99 {(point['ttft_s']['p99'] or 0) * 1e3:.0f} ms, TPOT p50 "
                  f"{(point['tpot_s']['p50'] or 0) * 1e3:.1f} ms p99 {(point['tpot_s']['p99'] or 0) * 1e3:.1f} ms, prefix hits "
                  f"{point['prefix_hit_rate'] or 0:.0%}, errors {point['num_errors']}" + (
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
