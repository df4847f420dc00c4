"""The engine: requests in, one scheduler/runner/sampler step at a time, finished outputs out."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer_core.config import ConfigError, EngineConfig, ModelConfig
from deepinfer_core.dtypes import DTYPES
from deepinfer_core.engine.graphs import DecodeGraphs
from deepinfer_core.engine.kv_cache import BlockManager, KVCache
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.engine.scheduler import ScheduledBatch, Scheduler
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.hookspecs import StepStats
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import sample, top_logprobs

log = logging.getLogger("deepinfer")

CPU_KV_MEMORY_FRACTION = 0.25
PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt / TokensPrompt
# Samples of one request beyond max_num_seqs run in waves; this bounds the host memory a single
# request can claim (n=10**9 would build a billion sequences before any runs).
MAX_SAMPLES_PER_REQUEST = 4096


class RequestError(ValueError):
    """A request that cannot be served as given (too long, bad token ids, no tokenizer...)."""


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, supported: tuple[torch.dtype, ...]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        name = (config.torch_dtype or "").replace("torch.", "")
        resolved = DTYPES.get(name, torch.bfloat16)
    elif dtype in DTYPES:
        resolved = DTYPES[dtype]
    else:
        raise ConfigError(f"dtype {dtype!r} is not supported; use 'auto', {', '.join(DTYPES)}")
    if resolved not in supported:
        raise ConfigError(f"dtype {resolved} is not supported by this backend (supported: {supported})")
    return resolved


class Engine:
    def __init__(self, model_dir: Path, engine_config: EngineConfig, backend_name: str | None, dtype: str | torch.dtype, progress: bool = True):
        from deepinfer_core.loader import init_dummy_weights, load_model
        from deepinfer_core.models.registry import get_model_class
        from deepinfer_core.plugins import load_backend

        self.config = engine_config
        self.model_config = ModelConfig.from_dir(model_dir)
        self.plugins, self.backend, self.platform, self.ops, limits = load_backend(backend_name, self.model_config)
        self.device = self.platform.torch_device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # Triton launches and graph captures use the current device
        self.dtype = resolve_dtype(dtype, self.model_config, self.platform.supported_dtypes)
        keep_fp8 = bool(self.platform.fp8_weights and self.model_config.fp8_block)
        if keep_fp8 and self.model_config.n_routed_experts and self.model_config.moe_intermediate_size % self.model_config.fp8_block[0]:
            log.warning(
                "moe_intermediate_size %d is not a multiple of the FP8 block %d: the fused expert scales cannot be "
                "kept, so FP8 weights are dequantised to %s at load", self.model_config.moe_intermediate_size,
                self.model_config.fp8_block[0], self.dtype,
            )
            keep_fp8 = False
        model_cls = get_model_class(self.model_config.model_type)
        self.model = model_cls(self.model_config, self.ops, self.dtype, self.device, keep_fp8=keep_fp8)
        if engine_config.load_format == "dummy":
            init_dummy_weights(self.model, seed=engine_config.seed, progress=progress)
        else:
            load_model(model_dir, self.model_config, self.model, progress=progress)
        self.tokenizer = load_tokenizer(model_dir)
        self.eos_ids = self._eos_ids()

        # A backend's limits cap what the user asked for; they never raise it.
        self.max_num_seqs = min(engine_config.max_num_seqs, (limits and limits.max_num_seqs) or engine_config.max_num_seqs)
        self.max_num_batched_tokens = min(
            engine_config.max_num_batched_tokens,
            (limits and limits.max_num_batched_tokens) or engine_config.max_num_batched_tokens,
        )
        specs = self.model.cache_specs()
        block_size = engine_config.block_size
        num_blocks = engine_config.num_kv_blocks or self._auto_num_blocks(specs, block_size)
        capacity = num_blocks * block_size
        max_len = engine_config.max_model_len or min(self.model_config.max_position_embeddings, capacity)
        if max_len > self.model_config.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                f"{self.model_config.max_position_embeddings}; lower max_model_len"
            )
        if max_len > capacity:
            raise ConfigError(
                f"max_model_len={max_len} needs {math.ceil(max_len / block_size)} KV blocks but the cache has "
                f"{num_blocks} (block_size {block_size}); raise num_kv_blocks or lower max_model_len"
            )
        self.max_model_len = max_len
        self.kv_cache = KVCache(specs, num_blocks, block_size, self.device)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, self.max_num_seqs, self.max_num_batched_tokens)
        graphs = None
        sizes = tuple(b for b in ((limits and limits.graph_batch_sizes) or ()) if b <= self.max_num_seqs)
        if self.platform.graph_capture and sizes and not engine_config.enforce_eager and self.device.type == "cuda":
            graphs = DecodeGraphs(self.model, self.kv_cache.tensors, sizes, math.ceil(max_len / block_size), self.device)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_manager, self.device, graphs)
        self.observer = self.plugins.step_observer()
        self.requests: dict[str, Request] = {}
        self.next_seq_id = 0  # sequence ids seed unseeded samples (see _seed)
        self.next_request_id = 0
        self._step = 0
        self.num_preemptions = 0  # total, for tests and metrics
        log.info(
            "engine ready: backend %s (%s), dtype %s, %d KV blocks x %d tokens, max_model_len %d, decode graphs %s",
            self.backend.name, self.platform.name, self.dtype, num_blocks, block_size, max_len,
            f"for batch sizes up to {graphs.max_batch}" if graphs else "off",
        )

    # ---- set-up helpers ----------------------------------------------------------------------
    def _auto_num_blocks(self, specs, block_size: int) -> int:
        """Enough blocks for max_num_seqs sequences of the longest allowed length, capped by memory:
        a quarter of free host memory on the CPU, gpu_memory_utilization of the device otherwise."""
        per_block = KVCache.bytes_per_block(specs, block_size)
        max_len = self.config.max_model_len or self.model_config.max_position_embeddings
        wanted = math.ceil(self.max_num_seqs * max_len / block_size)
        if self.device.type == "cuda":  # blocks the allocator cached while loading are free for the cache
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        free, total = self.platform.memory_info()
        if self.device.type == "cpu":
            budget = free * CPU_KV_MEMORY_FRACTION
        else:
            budget = total * self.config.gpu_memory_utilization - (total - free) - self._activation_bytes(specs, block_size, max_len)
        if budget < per_block:
            raise ConfigError(
                f"no memory left for the KV cache ({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB after "
                f"loading weights); raise gpu_memory_utilization, set num_kv_blocks, or use a smaller model"
            )
        return min(int(budget // per_block), wanted)

    def _activation_bytes(self, specs, block_size: int, max_len: int) -> int:
        """Memory the steps need beside weights and cache: the measured peak of a prefill of
        max_num_batched_tokens tokens over a throw-away cache, plus what a last prompt chunk at
        max_len context adds analytically (prefill expands K and V of the whole context, one layer
        at a time), the logits of max_num_seqs rows and their sampling, and a margin for the
        decode graphs' pool."""
        if self.device.type != "cuda":
            return 0
        from deepinfer_core.engine.sequence import Sequence

        tokens = min(self.max_num_batched_tokens, self.model_config.max_position_embeddings)
        blocks = -(-tokens // block_size)
        cache = KVCache(specs, blocks, block_size, self.device)
        manager = BlockManager(blocks, block_size)
        seq = Sequence(-1, "profile", 0, [0] * tokens, SamplingParams(max_tokens=1), 0)
        manager.allocate(seq, tokens)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        ModelRunner(self.model, cache, manager, self.device).run(ScheduledBatch([(seq, tokens)], []))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del cache
        torch.cuda.empty_cache()
        c = self.model_config
        per_context_token = (c.latent_dim + c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim + c.qk_head_dim)) * self.dtype.itemsize
        long_context = max(0, max_len - tokens) * per_context_token
        logits = self.max_num_seqs * c.vocab_size * 4 * 3  # logits, sampler temporaries
        return int(peak + long_context + logits + 256 * 2**20)

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int] | dict, label: str = "prompt") -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt: a string, a list of token ids, or vLLM's dict forms
        ``{"prompt": text}`` and ``{"prompt_token_ids": ids}``."""
        if isinstance(prompt, dict):
            unknown = sorted(map(str, set(prompt) - set(PROMPT_KEYS)))
            if unknown or len(prompt) != 1:
                raise RequestError(
                    f"{label} is a dict with keys {sorted(map(str, prompt))}; a dict prompt has exactly one of the keys "
                    f"{' or '.join(map(repr, PROMPT_KEYS))}" + (f" (unknown: {unknown})" if unknown else "")
                )
            (key, prompt), = prompt.items()
            if key == "prompt" and not isinstance(prompt, str):
                raise RequestError(f"{label}: 'prompt' must be a string, got {type(prompt).__name__}")
            if key == "prompt_token_ids" and isinstance(prompt, str):
                raise RequestError(f"{label}: 'prompt_token_ids' must be a list of token ids, got a string")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(
                    "this model directory has no tokenizer files, so text prompts cannot be encoded; pass token "
                    "ids (a list of ints) instead, or add tokenizer.json / tokenizer_config.json to the directory"
                )
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(
                    f"{label} is not valid Unicode text: {e.reason} {prompt[e.start:e.end]!r} at character {e.start} "
                    f"(lone surrogates cannot be tokenised); fix the text or pass token ids"
                ) from None
            return prompt, list(self.tokenizer(prompt).input_ids)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError(
                f"{label} must be a string, a list of token ids (ints) or a dict with 'prompt' or 'prompt_token_ids', "
                f"got {_describe(prompt)}"
            )
        return None, list(prompt)

    def check(self, prompt_token_ids: list[int], params: SamplingParams, label: str = "prompt") -> None:
        """Raise RequestError if the request cannot run; nothing has been queued yet."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError(f"{label} is empty; give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{label} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if n >= self.max_model_len:
            raise RequestError(
                f"{label} is too long: {n} tokens, but max_model_len is {self.max_model_len} (the prompt plus at "
                f"least one generated token must fit); shorten it or raise max_model_len"
            )
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, and this model directory has none; use stop_token_ids")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise RequestError(f"stop_token_ids {bad_stop} are outside the vocabulary [0, {vocab})")
        if params.logprobs is not None and params.logprobs > vocab or params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
            raise RequestError(f"logprobs / prompt_logprobs exceed the vocabulary size {vocab}")
        if params.n > MAX_SAMPLES_PER_REQUEST:
            raise RequestError(
                f"n={params.n} samples exceed {MAX_SAMPLES_PER_REQUEST}, the most one request may ask for (each sample "
                f"holds its own copy of the prompt in host memory from the start); split it into several requests"
            )

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str | None = None,
                    label: str = "prompt") -> str:
        text, ids = self.encode(prompt, label)
        self.check(ids, params, label)
        rid = request_id if request_id is not None else str(self.next_request_id)
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        req = Request(rid, text, ids, params)
        first = self.next_seq_id
        for i in range(params.n):
            req.seqs.append(Sequence(first + i, rid, i, list(ids), params, self._seed(params, i, first + i)))
        self.requests[rid] = req  # known before queued: a withdraw always finds what was queued
        for seq in req.seqs:  # queued only once every sequence could be built
            self.scheduler.add(seq)
        self.next_seq_id += params.n
        if request_id is None:
            self.next_request_id += 1
        return rid

    def _seed(self, params: SamplingParams, index: int, seq_id: int) -> int:
        """Seeded requests: seed + sample index. Others: derived from the engine seed and the
        sequence id, so a run is reproducible for the same engine seed and request order."""
        seed = params.seed + index if params.seed is not None else self.config.seed * 1_000_003 + seq_id
        return seed % 2**63

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> Request:
        """Stop a request (unfinished samples get finish_reason "abort" and the text of the tokens
        they produced), free its blocks, return it."""
        req = self.requests.pop(request_id)
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
                seq.text = self.detokenize(seq)
        return req

    def abort_all(self) -> list[Request]:
        aborted = [self.abort(rid) for rid in list(self.requests)]
        self.scheduler.reset()  # nothing is left: whatever a failed step left half-done is gone too
        return aborted

    def withdraw(self, request_ids: list[str], ids_before: tuple[int, int]) -> None:
        """Take back requests whose caller will never see them (an interrupted ``generate``). When
        no other request remains, the engine is left as new: queues and block pool rebuilt (an
        interrupt may have landed between two bookkeeping steps) and the id counters where they
        were before the requests came (``ids_before``: next_seq_id, next_request_id), so a rerun
        samples exactly what the interrupted call would have."""
        for rid in request_ids:
            if rid in self.requests:
                self.abort(rid)
        if not self.requests:
            self.scheduler.reset()
            self.next_seq_id, self.next_request_id = ids_before

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one batch; return the requests that finished in it (removed from the engine)."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler could not schedule any work; KV cache too small for the waiting requests")
            return []
        self.num_preemptions += batch.num_preempted
        out = self.runner.run(batch)
        for seq, first, logits in out.prompt_logits:
            self._record_prompt_logprobs(seq, first, logits)
        results = sample(self.ops, out.sample_logits, out.sample_seqs, self.eos_ids) if out.sample_seqs else []
        # Tokens first, then the computed counts: a step cut short in between leaves sequences that
        # know a token more than they computed (the next step recomputes it), never the reverse.
        for seq, (token, logprob, top) in zip(out.sample_seqs, results):
            self._append(seq, token, logprob, top)
        self.scheduler.commit(batch)
        finished = [r for r in self.requests.values() if r.finished]
        for req in finished:
            del self.requests[req.request_id]
        self._step += 1
        if self.observer is not None:
            self.observer(StepStats(
                step=self._step,
                num_prefill_tokens=sum(n for _, n in batch.prefills),
                num_decode_tokens=len(batch.decodes),
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                num_preempted=batch.num_preempted,
                free_kv_blocks=self.block_manager.num_free,
                seconds=time.perf_counter() - t0,
            ))
        return finished

    def _record_prompt_logprobs(self, seq: Sequence, first: int, logits: torch.Tensor) -> None:
        """Rows of ``logits`` predict prompt positions first, first+1, ...; positions already
        recorded (a recompute after preemption, maybe chunked differently) are skipped."""
        have = len(seq.prompt_logprobs)
        if not first <= have < first + logits.shape[0]:
            return
        lps = torch.log_softmax(logits[have - first :].float(), dim=-1)
        k = seq.params.prompt_logprobs
        for i in range(lps.shape[0]):
            seq.prompt_logprobs.append(top_logprobs(lps[i], k, seq.prompt_token_ids[have + i]))

    def _append(self, seq: Sequence, token: int, logprob: float | None, top: dict[int, float] | None) -> None:
        seq.output_token_ids.append(token)
        if seq.output_logprobs is not None:
            seq.cumulative_logprob += logprob
            seq.output_logprobs.append(top)
        p = seq.params
        reason, stop = None, None
        if not p.ignore_eos and token in self.eos_ids:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, stop = "stop", token
        elif p.stop:
            hit = self._stop_string(seq)
            if hit is not None:
                reason, stop = "stop", hit
        if reason is None and (len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop
            if not isinstance(stop, str):  # a stop string already trimmed seq.text
                seq.text = self.detokenize(seq)
            self.scheduler.finish(seq)

    def _stop_string(self, seq: Sequence) -> str | None:
        """The stop string that the latest token completed, if any (text before min_tokens outputs
        is scanned but cannot stop the sequence); trims seq.text at it."""
        text = self.detokenize(seq)
        start = max(0, seq.stop_scanned_chars - max(len(s) for s in seq.params.stop) + 1)
        seq.stop_scanned_chars = len(text)
        if len(seq.output_token_ids) < seq.params.min_tokens:
            return None
        earliest = None
        for s in seq.params.stop:
            idx = text.find(s, start)
            if idx >= 0 and (earliest is None or idx < earliest[0]):
                earliest = (idx, s)
        if earliest is None:
            return None
        idx, s = earliest
        seq.text = text[: idx + len(s)] if seq.params.include_stop_str_in_output else text[:idx]
        return s

    def detokenize(self, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)


def _describe(value) -> str:
    """A short description of a bad prompt for an error message."""
    if isinstance(value, (list, tuple)):
        bad = next((t for t in value if not isinstance(t, int) or isinstance(t, bool)), None)
        return f"a {type(value).__name__} holding {type(bad).__name__} {bad!r:.40}"
    return type(value).__name__


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, or None when the directory has no tokenizer files."""
    if not any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except Exception as e:
        raise ConfigError(f"{model_dir}: the tokenizer files could not be loaded: {e}") from e
