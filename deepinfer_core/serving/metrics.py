"""The server's Prometheus metrics (``GET /metrics``), through prometheus_client.

Gauges are read from the engine when scraped (queue, running sequences, KV usage and the lower
KV tiers' usage, prefix-cache hit rate, speculative acceptance since start-up; summed over the ranks of a data-parallel LLM);
per-request figures (time to first token, time per output token, end-to-end latency, tokens)
are observed as each request finishes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deepinfer_core.engine.output import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    def __init__(self, gauges):
        """``gauges()``: the engine's figures now (``Engine.gauges``, summed over the ranks of a
        data-parallel LLM), read when scraped."""
        self.registry = registry = CollectorRegistry()
        p = "deepinfer_"

        def gauge(name: str, doc: str, value) -> None:
            Gauge(p + name, doc, registry=registry).set_function(lambda: value(gauges()))

        gauge("num_requests_waiting", "sequences queued for admission", lambda g: g["waiting"])
        gauge("num_requests_running", "sequences in the running batch", lambda g: g["running"])
        gauge("kv_cache_usage_ratio", "share of the KV cache's blocks in use (tightest cache group)",
              lambda g: g["kv_used_blocks"] / max(1, g["kv_blocks"]))
        gauge("prefix_cache_hit_ratio", "prompt tokens found in the prefix cache / prompt tokens looked up",
              lambda g: g["prefix_hit_tokens"] / max(1, g["prefix_queried_tokens"]))
        gauge("kv_host_tier_usage_ratio", "share of the host-memory KV tier's blocks in use (0 without one)",
              lambda g: g["kv_host_used_blocks"] / max(1, g["kv_host_blocks"]))
        gauge("kv_disk_tier_usage_ratio", "share of the disk KV tier's blocks in use (0 without one)",
              lambda g: g["kv_disk_used_blocks"] / max(1, g["kv_disk_blocks"]))
        gauge("kv_transfers_parked", "sequences whose blocks a prefill instance keeps for its decode instances to read",
              lambda g: g["kv_parked"])
        gauge("kv_transfers_receiving", "sequences a decode instance is reading from prefill instances", lambda g: g["kv_receiving"])
        gauge("spec_decode_draft_tokens", "draft tokens verified since start-up", lambda g: g["draft_tokens"])
        gauge("spec_decode_accepted_tokens", "draft tokens accepted since start-up", lambda g: g["accepted_tokens"])
        self.ttft = Histogram(p + "time_to_first_token_seconds", "request arrival to its first output token", buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "(finish - first token) / (output tokens - 1)", buckets=TOKEN_BUCKETS,
                              registry=registry)
        self.e2e = Histogram(p + "request_latency_seconds", "request arrival to its end", buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of finished requests", registry=registry)
        self.cached_tokens = Counter(p + "cached_prompt_tokens", "prompt tokens served from the prefix cache", registry=registry)
        self.cached_tokens_by_tier = Counter(p + "cached_prompt_tokens_by_tier", "prompt tokens served from the prefix cache, by "
                                             "the tier their blocks were found in (gpu: the device's pool; host; disk)", ["tier"],
                                             registry=registry)
        self.transferred_tokens = Counter(p + "transferred_prompt_tokens", "prompt tokens whose KV cache came from a prefill "
                                          "instance (a decode instance of a prefill/decode pair)", registry=registry)
        self.generation_tokens = Counter(p + "generation_tokens", "output tokens of finished requests", registry=registry)
        self.finished = Counter(p + "requests_finished", "requests ended, by finish reason", ["finish_reason"], registry=registry)

    def observe(self, out: RequestOutput) -> None:
        """A request ended (any thread)."""
        m = out.metrics
        tokens = sum(len(c.token_ids) for c in out.outputs)
        if m is not None and m.first_token_time is not None and m.arrival_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            longest = max(len(c.token_ids) for c in out.outputs)
            if m.finished_time is not None and longest > 1:
                self.tpot.observe((m.finished_time - m.first_token_time) / (longest - 1))
        if m is not None and m.finished_time is not None and m.arrival_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.cached_tokens.inc(out.num_cached_tokens or 0)
        self.transferred_tokens.inc(out.num_transferred_tokens)
        for tier, n in (out.num_cached_tokens_by_tier or {}).items():
            self.cached_tokens_by_tier.labels(tier).inc(n)
        self.generation_tokens.inc(tokens)
        for c in out.outputs:
            self.finished.labels(c.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
