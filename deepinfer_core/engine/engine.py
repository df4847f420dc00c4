"""The engine: requests in, one scheduler/runner/sampler step at a time, finished outputs out.

A step: ``Scheduler.schedule()`` -> ``ModelRunner.run()`` -> ``sampler.launch()`` (tokens stay on
the device) -> ``resolve`` (the host copy) -> ``Scheduler.update()`` (append / roll back) ->
``OutputProcessor.process()`` (stops, logprobs, text). In overlapped mode the next step is
scheduled and launched before the previous one is resolved: its decode rows read their newest
token from the device, and stop checks run one step behind (a sequence that finished computed at
most one extra token, which is dropped).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from deepinfer_core.config import ConfigError, EngineConfig, settings
from deepinfer_core.models.registry import read_config
from deepinfer_core.models.v3.config import V3ModelConfig
from deepinfer_core.dtypes import DTYPES
from deepinfer_core.engine.graphs import DecodeGraphs, max_blocks_per_group
from deepinfer_core.engine.kv_cache import KVCache, KVCacheManager
from deepinfer_core.engine.output import OutputProcessor
from deepinfer_core.engine.runner import ModelRunner, PrevTokens, StepOutput
from deepinfer_core.engine.scheduler import Scheduler, SchedulerOutput
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.hookspecs import StepStats
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import SampledBatch, SampleRow, launch, needs_history, probabilities, top_logprobs, verify
from deepinfer_core.sampling import structured
from deepinfer_core.engine.spec_decode import proposers, rejection
from deepinfer_core.engine.spec_decode.stats import AcceptanceStats

log = logging.getLogger("deepinfer")

CPU_KV_MEMORY_FRACTION = 0.25
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # tokens per step where neither the user nor the backend chose
PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt / TokensPrompt
# Samples of one request beyond max_num_seqs run in waves; this bounds the host memory a single
# request can claim (n=10**9 would build a billion sequences before any runs).
MAX_SAMPLES_PER_REQUEST = 4096


@dataclass
class InFlight:
    """A launched step whose sampled tokens have not reached the host yet."""

    output: SchedulerOutput
    step: StepOutput
    sampled: SampledBatch | None
    t0: float
    prev_finished: list | None = None  # the previous step, resolved during this launch (grammar masks): what it finished


class RequestError(ValueError):
    """A request that cannot be served as given (too long, bad token ids, no tokenizer...)."""


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    # wall-clock times (time.time()): added; its first output token reached the host; it ended
    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def resolve_dtype(dtype: str | torch.dtype, config: V3ModelConfig, supported: tuple[torch.dtype, ...]) -> torch.dtype:
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
    def __init__(self, model_dir: Path, engine_config: EngineConfig, backend_name: str | None, dtype: str | torch.dtype, progress: bool = True,
                 expert_parallel: tuple[int, int] | None = None):
        """``expert_parallel``: (this rank, EP size) when the MoE layers are sharded over a group
        (``parallel.expert_parallel``): the model is built with, and loads, only this rank's expert
        slots, so its memory (and the KV cache sized from what is left) is that of one shard."""
        from deepinfer_core.models.dummy_weights import init_dummy_weights
        from deepinfer_core.loader import load_model
        from deepinfer_core.models.contract import check_model, check_model_class
        from deepinfer_core.models.registry import describe, generation_for
        from deepinfer_core.plugins import load_backend

        self.config = engine_config
        self.model_config = read_config(model_dir)
        self.generation = generation_for(self.model_config)
        model_cls = self.generation.model
        check_model_class(model_cls)
        if engine_config.batch_invariant and not model_cls.supports_batch_invariance:
            raise ConfigError(
                f"batch_invariant=True is supported for the MLA models (DeepSeek-V2/V3/R1 and the embedded default), not for "
                f"{describe(self.generation)} yet (its prompt and decode tokens read their attention context "
                f"along different paths); run it without batch_invariant / DEEPINFER_BATCH_INVARIANT"
            )
        self.plugins, self.backend, self.platform, self.ops, limits = load_backend(backend_name, self.model_config,
                                                                                   engine_config.batch_invariant)
        self.device = self.platform.torch_device
        self.platform.activate()  # kernel launches and graph captures use the current device
        self.dtype = resolve_dtype(dtype, self.model_config, self.platform.supported_dtypes)
        keep_fp8 = bool(self.platform.fp8_weights and self.model_config.fp8_block)
        if keep_fp8 and self.model_config.n_routed_experts and self.model_config.moe_intermediate_size % self.model_config.fp8_block[0]:
            log.warning(
                "moe_intermediate_size %d is not a multiple of the FP8 block %d: the fused expert scales cannot be "
                "kept, so FP8 weights are dequantised to %s at load", self.model_config.moe_intermediate_size,
                self.model_config.fp8_block[0], self.dtype,
            )
            keep_fp8 = False
        slots = None
        if expert_parallel is not None:
            from deepinfer_core.parallel.expert_parallel import initial_slots

            c = self.model_config
            slots = initial_slots(c.n_routed_experts, *expert_parallel, num_groups=getattr(c, "n_group", None) or 1)
        self.model = model_cls(self.model_config, self.ops, self.dtype, self.device, keep_fp8=keep_fp8, expert_slots=slots)
        if engine_config.load_format == "dummy":
            init_dummy_weights(self.model, seed=engine_config.seed, progress=progress)
        else:
            load_model(model_dir, self.model_config, self.model, progress=progress)
        self.tokenizer = load_tokenizer(model_dir)
        check_model(self.model)
        self.model.set_tokenizer(self.tokenizer)  # V4.1's Engram hashes read the compressed vocabulary
        eos_ids = self._eos_ids()

        # A backend's limits cap what the user asked for; they never raise it.
        self.max_num_seqs = min(engine_config.max_num_seqs, (limits and limits.max_num_seqs) or engine_config.max_num_seqs)
        # The step budget: the user's, capped by the backend's; else the backend's; else the default.
        suggested = limits and limits.max_num_batched_tokens
        wanted = engine_config.max_num_batched_tokens
        if wanted is None:
            self.max_num_batched_tokens = suggested or DEFAULT_MAX_NUM_BATCHED_TOKENS
        else:
            self.max_num_batched_tokens = min(wanted, suggested or wanted)
        self.speculative = sc = proposers.resolve(engine_config.speculative_config, model_cls)
        drafter = proposers.check(sc, self.model, self.model_config, model_dir)  # the drafter's own caches are needed
        lookahead = sc.num_speculative_tokens if sc else 0
        groups = self.model.cache_groups(with_mtp=True) if drafter else self.model.cache_groups()
        block_size = engine_config.block_size or self._default_block_size(limits)
        self.cache_groups = groups
        num_blocks = engine_config.num_kv_blocks or self._auto_num_blocks(groups, block_size, lookahead)
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
        self.kv_cache = KVCache(groups, num_blocks, block_size, self.max_num_seqs, lookahead, self.device)
        # an MTP entry at p depends on token p + 1: a paged one must not be shared past a block's end
        mtp_paged = drafter and any(g.kind == "paged" and any(n.startswith("mtp.") for n in g.layers) for g in groups)
        self.kv = KVCacheManager(groups, num_blocks, block_size, self.max_num_seqs, lookahead, engine_config.enable_prefix_caching,
                                 hash_next_token=mtp_paged)
        self.scheduler = Scheduler(self.kv, self.max_num_seqs, self.max_num_batched_tokens, max_len)
        self.output = OutputProcessor(self.tokenizer, eos_ids, max_len)
        for g in groups:
            unit = "token" if g.kind == "paged" else "sequence"
            size = g.bytes_per_token() if g.kind == "paged" else KVCache.bytes_per_sequence([g], block_size, lookahead)
            log.info("cache group %s (%s, %d layers): %.0f bytes per %s", g.name, g.kind, len(g.layers), size, unit)
        graphs = None
        sizes = tuple(b for b in ((limits and limits.graph_batch_sizes) or ()) if b <= self.max_num_seqs)
        capturable = self.model.supports_graphs
        if self.platform.graph_capture and self.platform.graphs is not None and sizes and not engine_config.enforce_eager and capturable:
            query_lens = (1, 1 + lookahead) if lookahead else (1,)
            widths = max_blocks_per_group(groups, max_len, block_size, max(query_lens), self.kv.rings)
            graphs = DecodeGraphs(self.model, self.kv_cache.tensors, groups, widths, sizes, query_lens, self.device, self.platform.graphs())
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv, self.device, graphs, keep_hidden=drafter and sc.method == "mtp",
                                  prefills_as_rows=engine_config.batch_invariant)
        self.proposer = proposers.build(sc, self.model, self.runner, self.ops, eos_ids, max_len, self.platform.copy_to_host,
                                        self.max_num_batched_tokens)
        if graphs is not None and sc is not None and sc.method == "mtp":  # the MTP module's decode rows as graphs too
            draft = DecodeGraphs(self.model, self.kv_cache.tensors, groups, widths, sizes, query_lens, self.device,
                                 self.platform.graphs(), draft_dim=self.model_config.hidden_size)
            try:
                draft.capture_all(progress)
                self.proposer.graphs = draft
            except Exception as e:  # noqa: BLE001 - drafting still works eagerly; the target's graphs are unaffected
                log.warning("capturing the MTP module's decode graphs failed (%s: %s); it drafts eagerly", type(e).__name__, e)
        if sc is not None and sc.adaptive:
            self.proposer.profile(groups, self.max_num_seqs, self.device, self.platform.synchronize)
        if graphs is not None:
            graphs.capture_all(progress)
        env = settings().async_scheduling
        self.async_scheduling = self.platform.async_scheduling if env is None else env
        if self.async_scheduling and self.proposer is not None:
            log.info("overlapped scheduling is off with speculative decoding (drafts are proposed from the host's tokens)")
            self.async_scheduling = False
        self._grammars = None  # sampling.structured.Grammars, built at the first constrained request
        self.stats_extra: dict = {}  # what others (data parallelism's EPLB) add to the next step's StepStats.extra
        self.in_flight: InFlight | None = None
        self.observer = None
        self._reset_counters()
        if graphs is not None:
            self._warm_up(graphs.sizes, progress)
        self.observer = self.plugins.step_observer()
        log.info(
            "engine ready: backend %s (%s), dtype %s, %d KV blocks x %d tokens, max_model_len %d, decode graphs %s, "
            "prefix caching %s, %s scheduling%s",
            self.backend.name, self.platform.name, self.dtype, num_blocks, block_size, max_len,
            f"for batch sizes up to {graphs.max_batch} (captured in {graphs.capture_seconds:.1f} s)" if graphs else "off",
            "on" if engine_config.enable_prefix_caching else "off", "overlapped" if self.async_scheduling else "synchronous",
            f", {sc.method} speculation of {lookahead} tokens" if lookahead else "",
        )

    # ---- set-up helpers ----------------------------------------------------------------------
    def _reset_counters(self) -> None:
        self.requests: dict[str, Request] = {}
        self.next_seq_id = 0  # sequence ids seed unseeded samples (see _seed)
        self.next_request_id = 0
        self._step = 0
        self.num_preemptions = 0  # total, for tests and metrics
        self.spec_stats = AcceptanceStats()  # speculative decoding since start-up: drafts verified / accepted by position

    def _warm_up(self, sizes: tuple[int, ...], progress: bool) -> None:
        """Run a few steps at every graph batch size through the whole path, so that the kernels
        a first ``generate`` (or a server's first requests) would compile for those shapes are
        compiled now; then forget them (the engine is as new). Per size: a first wave of prompts
        is prefilled and decodes while a second wave arrives (mixed steps), whose prompts share
        the first wave's prefix (prefix-cache hits: prefill after a cached context); greedy and
        sampled rows; graph replays. A server's first requests compiled 1-2 s of kernels each
        without the second wave (H200, 2026-12-02)."""
        t0 = time.perf_counter()
        block = self.kv.block_size
        vocab, length = self.model_config.vocab_size, min(2 * block + 1, self.max_model_len - 4)
        if length < 1:
            return
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4, ignore_eos=True)
        for size in tqdm(sizes, desc="Warming up", unit="batch size", disable=not progress):
            prompts = [[(7 * i + j) % vocab for j in range(length)] for i in range(size)]
            first = max(1, size // 2)
            for i in range(first):
                self.add_request(prompts[i], sampled if i % 2 else greedy)
            self.step()
            for i in range(first, size):  # the first wave's prefix and a tail of their own: cached context + new tokens
                self.add_request(prompts[i - first][: length - 3] + [(11 * i + j) % vocab for j in range(3)],
                                 sampled if i % 2 else greedy)
            while self.has_unfinished():
                self.step()
        self.platform.synchronize()
        self.scheduler.reset()
        self._reset_counters()
        log.info("warmed up %d batch sizes in %.1f s", len(sizes), time.perf_counter() - t0)

    def _default_block_size(self, limits) -> int:
        """The backend's block size where it suits the model's layout (a multiple of the model's
        default), else the model's default."""
        default = self.model.default_block_size
        wanted = limits and limits.block_size
        return wanted if wanted and wanted % default == 0 else default

    def _auto_num_blocks(self, groups, block_size: int, lookahead: int) -> int:
        """Enough blocks for max_num_seqs sequences of the longest allowed length, capped by memory:
        a quarter of free host memory on the CPU, gpu_memory_utilization of the device otherwise.
        Ring and state groups take their fixed bytes per sequence first."""
        per_block = KVCache.bytes_per_token(groups) * block_size
        fixed = KVCache.bytes_per_sequence(groups, block_size, lookahead) * self.max_num_seqs
        max_len = self.config.max_model_len or self.model_config.max_position_embeddings
        wanted = math.ceil(self.max_num_seqs * max_len / block_size)
        if not per_block:  # no paged group (e.g. a sliding-window-only model): blocks cost nothing
            return wanted
        self.platform.empty_cache()  # blocks the allocator cached while loading are free for the cache
        free, total = self.platform.memory_info()
        if self.device.type == "cpu":
            budget = free * CPU_KV_MEMORY_FRACTION - fixed
        else:
            budget = total * self.config.gpu_memory_utilization - (total - free) - fixed - self._activation_bytes(groups, block_size, max_len)
        if budget < per_block:
            raise ConfigError(
                f"no memory left for the KV cache ({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB after "
                f"loading weights); raise gpu_memory_utilization, set num_kv_blocks, or use a smaller model"
            )
        return min(int(budget // per_block), wanted)

    def _activation_bytes(self, groups, block_size: int, max_len: int) -> int:
        """Memory the steps need beside weights and cache: the measured peak of a prefill of
        max_num_batched_tokens tokens over a throw-away cache, plus what a last prompt chunk at
        max_len context adds analytically (prefill expands K and V of the whole context, one layer
        at a time), the logits of max_num_seqs rows and their sampling, and a margin for the
        decode graphs' pool."""
        if self.device.type == "cpu":
            return 0
        from deepinfer_core.engine.scheduler import ScheduledSeq

        tokens = min(self.max_num_batched_tokens, self.model_config.max_position_embeddings)
        blocks = -(-tokens // block_size)
        cache = KVCache(groups, blocks, block_size, 1, 0, self.device)
        kv = KVCacheManager(groups, blocks, block_size, 1, prefix_caching=False)
        seq = Sequence(-1, "profile", 0, [0] * tokens, SamplingParams(max_tokens=1), 0)
        kv.allocate(seq, tokens)
        batch = SchedulerOutput(prefills=[ScheduledSeq(seq, 0, tokens, samples=True)])
        runner = ModelRunner(self.model, cache, kv, self.device)
        peak = self.platform.peak_memory(lambda: runner.run(batch))
        runner = cache = None  # freed before the allocator hands its blocks back
        self.platform.empty_cache()
        c = self.model_config
        per_context_token = c.context_bytes_per_token(self.dtype.itemsize, tokens)
        long_context = max(0, max_len - tokens) * per_context_token
        logits = self.max_num_seqs * c.vocab_size * 4 * 3  # logits, sampler temporaries
        return int(peak + long_context + logits + 256 * 2**20)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Token ids that end a sequence (unless ignore_eos): the config's and the tokenizer's."""
        return self.output.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: tuple[int, ...]) -> None:
        self.output.eos_ids = tuple(ids)
        self._grammars = None  # grammars compiled from here on end at the new ids (the matchers' stop tokens)

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
        image = getattr(self.model_config, "image_token_id", None)
        if image is not None and image in prompt_token_ids:
            raise RequestError(
                f"{label} holds the image token id {image}: image input is not supported by DeepInfer (the vision tower "
                "is not loaded); send text only"
            )
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
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise RequestError(f"{label}: {name} has token ids outside the vocabulary [0, {vocab}): {outside[:5]}")
        if params.bad_words and self.tokenizer is None:
            raise RequestError(f"{label}: bad_words need a tokenizer, and this model directory has none; use logit_bias "
                               "or allowed_token_ids with token ids")
        if params.logprobs is not None and params.logprobs > vocab or params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
            raise RequestError(f"logprobs / prompt_logprobs exceed the vocabulary size {vocab}")
        if params.so_args is not None:
            self.compile_grammar(params, label)
        if params.n > MAX_SAMPLES_PER_REQUEST:
            raise RequestError(
                f"n={params.n} samples exceed {MAX_SAMPLES_PER_REQUEST}, the most one request may ask for (each sample "
                f"holds its own copy of the prompt in host memory from the start); split it into several requests"
            )

    @property
    def grammars(self):
        """The grammar compiler (``sampling.structured.Grammars``), made on first use."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise RequestError("structured outputs (so_args) need the model's tokenizer, and this model directory has none")
            self._grammars = structured.Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_ids)
        return self._grammars

    def compile_grammar(self, params: SamplingParams, label: str = "prompt"):
        """The compiled grammar of ``params.so_args`` (cached by its text); RequestError if invalid."""
        try:
            return self.grammars.compile(params.so_args)
        except ValueError as e:
            raise RequestError(f"{label}: {e}") from None

    def validate(self, prompt: str | list[int] | dict, params: SamplingParams, label: str = "prompt") -> tuple[str | None, list[int]]:
        """Every check ``add_request`` makes, without queueing anything: (prompt text, token ids).
        Raises RequestError naming what is wrong."""
        text, ids = self.encode(prompt, label)
        self.check(ids, params, label)
        self.bad_words_token_ids(params, label)
        return text, ids

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str | None = None,
                    label: str = "prompt") -> str:
        text, ids = self.validate(prompt, params, label)
        rid = request_id if request_id is not None else str(self.next_request_id)
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        bad_words = self.bad_words_token_ids(params, label)
        req = Request(rid, text, ids, params)
        first = self.next_seq_id
        compiled = self.compile_grammar(params, label) if params.so_args is not None else None  # cached by check()
        for i in range(params.n):
            seq = Sequence(first + i, rid, i, list(ids), params, self._seed(params, i, first + i), bad_words_token_ids=bad_words)
            if compiled is not None:
                seq.grammar = self.grammars.matcher(compiled)
            req.seqs.append(seq)
        for seq in req.seqs[1:]:
            seq.prefix_leader = req.seqs[0]
        self.requests[rid] = req  # known before queued: a withdraw always finds what was queued
        for seq in req.seqs:  # queued only once every sequence could be built
            self.scheduler.add(seq)
        self.next_seq_id += params.n
        if request_id is None:
            self.next_request_id += 1
        return rid

    def bad_words_token_ids(self, params: SamplingParams, label: str = "prompt") -> list[list[int]]:
        """``params.bad_words`` as token id lists, as vLLM tokenizes them: each word (leading
        whitespace stripped) without special tokens, and again after a space when that gives
        another first token and as many tokens (the word in the middle of a text)."""
        out: list[list[int]] = []
        for word in params.bad_words or ():
            plain = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            out.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        vocab = self.model_config.vocab_size
        outside = sorted({t for ids in out for t in ids if not 0 <= t < vocab})
        if outside:
            raise RequestError(f"{label}: bad_words tokenize to ids outside the model's vocabulary [0, {vocab}): {outside[:5]}")
        return out

    def _seed(self, params: SamplingParams, index: int, seq_id: int) -> int:
        """Seeded requests: seed + sample index. Others: derived from the engine seed and the
        sequence id, so a run is reproducible for the same engine seed and request order."""
        seed = params.seed + index if params.seed is not None else self.config.seed * 1_000_003 + seq_id
        return seed % 2**63

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def gauges(self) -> dict[str, float]:
        """What a server's metrics report, as counts that add up over data-parallel ranks:
        sequences waiting and running, KV blocks used and in all (tightest cache group), prompt
        tokens found in / looked up in the prefix cache, draft tokens verified / accepted."""
        return {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "kv_used_blocks": self.kv.num_blocks - self.kv.num_free, "kv_blocks": self.kv.num_blocks,
                "prefix_hit_tokens": self.kv.num_hit_tokens, "prefix_queried_tokens": self.kv.num_queried_tokens,
                "draft_tokens": self.spec_stats.num_draft_tokens, "accepted_tokens": self.spec_stats.num_accepted_tokens}

    def abort(self, request_id: str) -> Request:
        """Stop a request (unfinished samples get finish_reason "abort" and the text of the tokens
        they produced), free its blocks, return it."""
        req = self.requests.pop(request_id)
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
                seq.text = self.output.detokenize(seq)
        req.finished_time = time.time()
        return req

    def abort_all(self) -> list[Request]:
        aborted = [self.abort(rid) for rid in list(self.requests)]
        self.in_flight = None
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
            self.in_flight = None
            self.scheduler.reset()
            self.next_seq_id, self.next_request_id = ids_before

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step; return the requests that finished in it (removed from the engine). In
        overlapped mode the step launched here is resolved by the next call."""
        prev, self.in_flight = self.in_flight, None
        if prev is None:
            self.scheduler.forget_pending()
        out = self.scheduler.schedule()
        if out.empty:
            if prev is not None:
                return self._resolve(prev)
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler could not schedule any work; KV cache too small for the waiting requests")
            return []
        finished = []
        if prev is not None and self._needs_host_tokens(out):
            finished, prev = self._resolve(prev), None
            out.prefills = [s for s in out.prefills if not s.seq.is_finished]  # finished by prev's tokens
            out.decodes = [s for s in out.decodes if not s.seq.is_finished]
            if out.empty:
                return finished
        flight = self._launch(out, prev)
        if not self.async_scheduling:
            return finished + self._resolve(flight)
        self.in_flight = flight
        if flight.prev_finished is not None:
            return finished + flight.prev_finished
        return finished + (self._resolve(prev) if prev is not None else [])

    def _needs_host_tokens(self, out: SchedulerOutput) -> bool:
        """Whether this step must see the previous step's tokens on the host before it launches:
        penalties and bad_words read the generated ids; prompt logprobs and verification rows are host work."""
        return any(needs_history(s.seq.params) or s.num_drafts for s in out.scheduled) or any(
            s.seq.wants_prompt_logprobs for s in out.prefills
        )

    def _launch(self, out: SchedulerOutput, prev: InFlight | None) -> InFlight:
        t0 = time.perf_counter()
        self.num_preemptions += out.num_preempted
        prev_tokens = None
        if prev is not None and prev.sampled is not None:
            rows = {s.seq.seq_id: r0 for s, r0, n in prev.step.samples if n == 1}
            prev_tokens = PrevTokens(prev.sampled.tokens, rows)
        step = self.runner.run(out, prev_tokens)
        prev_finished = None
        if prev is not None and any(s.seq.grammar is not None for s, _, _ in step.samples):
            # a grammar mask needs the previous tokens on the host: they arrive, and the matchers
            # advance, while the device runs this step's forward
            prev_finished = self._resolve(prev)
        for seq, first, logits in step.prompt_logits:
            self.output.record_prompt_logprobs(seq, first, logits)
        rows = []
        for s, _, n in step.samples:
            if n == 1:
                rows.append(SampleRow(s.seq, pending=s.seq.num_pending - 1))
            else:  # a verification row: position j follows drafts 0..j-1
                drafts = s.seq.draft_token_ids[: s.num_drafts]
                rows.extend(SampleRow(s.seq, drafts[:j]) for j in range(n))
        sampled = None
        if rows:
            bitmask = structured.bitmask(rows, self.model_config.vocab_size, pin=self.device.type != "cpu")
            sampled = launch(self.ops, step.sample_logits, rows, self.eos_ids, self.platform.copy_to_host, bitmask)
        return InFlight(out, step, sampled, t0, prev_finished)

    def _resolve(self, flight: InFlight) -> list[Request]:
        """Bring a launched step's tokens to the host: verify drafts, update the scheduler, check
        stops, propose the next drafts. Returns the requests that finished."""
        results = flight.sampled.resolve() if flight.sampled is not None else []
        accepted: dict[int, tuple[list[int], list]] = {}
        step_spec = AcceptanceStats()
        for s, r0, n in flight.step.samples:
            tokens = [results[r0 + j][0] for j in range(n)]
            logprobs = [results[r0 + j][1:] for j in range(n)]
            if s.num_drafts:
                drafts = s.seq.draft_token_ids[: s.num_drafts]
                if len(s.seq.draft_probs) >= s.num_drafts and rejection.uses_rejection(s.seq.params, self.speculative.acceptance):
                    mask = flight.sampled.bitmask
                    tokens, logprobs = self._rejection_verify(s.seq, flight.step.sample_logits[r0 : r0 + n], drafts, tokens, logprobs,
                                                              None if mask is None else mask[r0 : r0 + n])
                else:
                    tokens = verify(tokens, drafts)
                s.seq.spec_stats.add(s.num_drafts, len(tokens) - 1)
                step_spec.add(s.num_drafts, len(tokens) - 1)
            accepted[s.seq.seq_id] = (tokens, logprobs[: len(tokens)])

        def process(seq: Sequence, tokens: list[int]) -> bool:
            return self.output.process(seq, tokens, accepted[seq.seq_id][1])

        new_tokens = {sid: toks for sid, (toks, _) in accepted.items()}
        if self.proposer is not None:  # a draft model catches up while rejected positions still hold their blocks
            self.proposer.observe(flight.output, flight.step, new_tokens)
        self.scheduler.update(flight.output, new_tokens, process)
        if step_spec.num_verify_steps:
            self.spec_stats = self.spec_stats.merge(step_spec)
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        now = time.time()
        finished = []
        for req in self.requests.values():
            if req.first_token_time is None and any(s.output_token_ids for s in req.seqs):
                req.first_token_time = now
            if req.finished:
                req.finished_time = now
                finished.append(req)
        for req in finished:
            del self.requests[req.request_id]
        self._step += 1
        if self.observer is not None:
            out = flight.output
            self.observer(StepStats(
                step=self._step,
                num_prefill_tokens=sum(s.num_tokens for s in out.prefills),
                num_decode_tokens=sum(s.num_tokens for s in out.decodes),
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                num_preempted=out.num_preempted,
                free_kv_blocks=self.kv.num_free,
                seconds=time.perf_counter() - flight.t0,
                num_cached_tokens=out.num_cached_tokens,
                num_draft_tokens=step_spec.num_draft_tokens,
                num_accepted_tokens=step_spec.num_accepted_tokens,
                drafts_by_position=step_spec.proposed,
                accepted_by_position=step_spec.accepted,
                extra=self.stats_extra,
            ))
        self.stats_extra = {}
        return finished

    def _rejection_verify(self, seq: Sequence, logits: torch.Tensor, drafts: list[int], sampled: list[int], logprobs: list,
                          bitmask: torch.Tensor | None = None):
        """Speculative sampling of one verification row (``spec_decode.rejection``): its tokens and
        their (logprob, top logprobs), computed again where a token is not the row's own sample.
        ``bitmask``: the rows' grammar masks (the target's distribution p is the masked one)."""
        rows = [SampleRow(seq, drafts[:j]) for j in range(len(drafts) + 1)]
        q = torch.stack(seq.draft_probs[: len(drafts)])
        p = probabilities(logits, rows, self.eos_ids, bitmask)
        tokens = rejection.accept(p, q, drafts, seq.seed, len(seq.output_token_ids), sampled[-1])
        k = seq.params.logprobs
        for j, token in enumerate(tokens):
            if k is not None and token != sampled[j]:
                row = torch.log_softmax(logits[j].float(), dim=-1)
                logprobs[j] = (float(row[token]), top_logprobs(row, k, token))
        return tokens, logprobs

    def summary(self) -> str:
        """One line on what the engine did since start-up: prefix-cache hits, speculative acceptance."""
        kv = self.kv
        parts = [f"prefix cache: {kv.num_hit_tokens} of {kv.num_queried_tokens} prompt tokens reused"
                 + (f" ({self.prefix_hit_rate:.0%})" if self.prefix_hit_rate is not None else "") if kv.prefix_caching else "prefix cache: off"]
        if self.proposer is not None:
            spec = self.spec_stats
            rate = f" ({spec.acceptance_rate:.0%})" if spec.num_draft_tokens else ""
            parts.append(f"speculative: {spec.num_accepted_tokens} of {spec.num_draft_tokens} draft tokens accepted{rate}")
        parts.append(f"preemptions: {self.num_preemptions}")
        return "; ".join(parts)

    @property
    def num_draft_tokens(self) -> int:
        """Drafts verified since start-up (speculative decoding)."""
        return self.spec_stats.num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        """Of those, accepted."""
        return self.spec_stats.num_accepted_tokens

    @property
    def prefix_hit_rate(self) -> float | None:
        """Tokens found in the prefix cache / tokens of the sequences admitted, since start-up (a
        sequence re-admitted after a preemption counts again, with the output it had)."""
        kv = self.kv
        return kv.num_hit_tokens / kv.num_queried_tokens if kv.prefix_caching and kv.num_queried_tokens else None


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
