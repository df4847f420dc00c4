"""An Engine's start-up, in the order it runs (``start``): the config and the backend, the model,
its weights and tokenizer, the step budget, the KV cache sized from the memory left
(``auto_num_blocks``, ``activation_bytes``), the prefix cache's lower tiers (``kv_tiers``),
scheduler, output processing and runner, decode graphs, the drafter, and a warm-up over the graph
batch sizes (``warm_up``), after which the tiers take evicted blocks. ``self`` in these
functions is the engine being built (engine/engine.py holds what it does once running)."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from deepinfer_core.config import ConfigError, EngineConfig, settings
from deepinfer_core.dtypes import DTYPES, dtype_from_name
from deepinfer_core.engine.graphs import DecodeGraphs, context_buckets, max_blocks_per_group
from deepinfer_core.engine.kv_cache import KVCache, KVCacheManager
from deepinfer_core.engine.kv_tiers import build_tiers
from deepinfer_core.engine.output import OutputProcessor
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.engine.scheduler import Scheduler, SchedulerOutput
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.engine.spec_decode import proposers
from deepinfer_core.models.registry import read_config
from deepinfer_core.sampling.params import SamplingParams

log = logging.getLogger("deepinfer")

CPU_KV_MEMORY_FRACTION = 0.25
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # tokens per step where neither the user nor the backend chose


def start(self, model_dir: Path, engine_config: EngineConfig, backend_name: str | None, dtype: str | torch.dtype,
          progress: bool = True, expert_parallel: tuple[int, int] | None = None) -> None:
    """Everything ``Engine(...)`` does before the first request: ``self`` is the new engine.
    ``expert_parallel``: (this rank, EP size) when the MoE layers are sharded over a group
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
    self.dtype = resolve_dtype(dtype, self.model_config, self.platform.supported_dtypes, self.device.type)
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
    # MXFP4 routed experts stay packed where the platform's expert ops take them (V4-family checkpoints
    # with expert_dtype fp4 only: no other model is asked)
    fp4 = {"keep_fp4": True} if self.platform.fp4_experts and getattr(self.model_config, "expert_dtype", None) == "fp4" else {}
    fp8_kv = {"fp8_kv_cache": True} if check_fp8_kv_cache(self, engine_config, model_cls, describe) else {}
    self.model = model_cls(self.model_config, self.ops, self.dtype, self.device, keep_fp8=keep_fp8, expert_slots=slots,
                           **fp4, **fp8_kv)
    if engine_config.load_format == "dummy":
        init_dummy_weights(self.model, seed=engine_config.seed, progress=progress)
    else:
        load_model(model_dir, self.model_config, self.model, progress=progress)
    self.tokenizer = load_tokenizer(model_dir)
    check_model(self.model)
    self.model.set_tokenizer(self.tokenizer)  # V4.1's Engram hashes read the compressed vocabulary
    eos_ids = eos_ids_of(self.model_config, self.tokenizer)

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
    block_size = engine_config.block_size or default_block_size(self.model, limits)
    self.cache_groups = groups
    num_blocks = engine_config.num_kv_blocks or auto_num_blocks(self, groups, block_size, lookahead)
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
    # the lower tiers are made (and a disk tier's directory checked) now, attached after the warm-up
    tiers = build_tiers(self, model_dir) if engine_config.kv_offload_gb else None
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
        streams = drafter and sc.method == "mtp" and self.model.mtp_reads_streams  # V4's MTP block reads the streams
        buckets = context_buckets(max_len) if self.model.graphs_by_context else ()
        graphs = DecodeGraphs(self.model, self.kv_cache.tensors, groups, widths, sizes, query_lens, self.device, self.platform.graphs(),
                              keep_streams=streams, context_buckets=buckets, block_size=block_size)
    self.runner = ModelRunner(self.model, self.kv_cache, self.kv, self.device, graphs, keep_hidden=drafter and sc.method == "mtp",
                              prefills_as_rows=engine_config.batch_invariant)
    self.proposer = proposers.build(sc, self.model, self.runner, self.ops, eos_ids, max_len, self.platform.copy_to_host,
                                    self.max_num_batched_tokens)
    if graphs is not None and sc is not None and sc.method == "mtp":  # the MTP module's decode rows as graphs too
        c = self.model_config  # the MTP block reads the last layer's streams where the model says so (V4)
        state = (c.hc_mult, c.hidden_size) if self.model.mtp_reads_streams else c.hidden_size
        draft = DecodeGraphs(self.model, self.kv_cache.tensors, groups, widths, sizes, query_lens, self.device,
                             self.platform.graphs(), draft_dim=state, context_buckets=buckets, block_size=block_size)
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
    self.in_flight = None  # an InFlight: a launched step not resolved yet
    self.observer = None
    self._reset_counters()
    if graphs is not None:
        warm_up(self, graphs.sizes, progress)
    if tiers is not None:  # the warm-up's blocks are not offered to them
        self.kv.attach_tiers(tiers)
    if engine_config.kv_role is not None:  # prefill/decode disaggregation: the cache registered with NIXL
        from deepinfer_core.engine.kv_transfer import KVTransfer

        self.scheduler.transfer = KVTransfer(self, model_dir, engine_config.kv_role, engine_config.kv_transfer_timeout)
    self.observer = self.plugins.step_observer()
    log.info(
        "engine ready: backend %s (%s), dtype %s, %d KV blocks x %d tokens, max_model_len %d, decode graphs %s, "
        "prefix caching %s%s, %s scheduling%s",
        self.backend.name, self.platform.name, self.dtype, num_blocks, block_size, max_len,
        f"for batch sizes up to {graphs.max_batch} (captured in {graphs.capture_seconds:.1f} s)" if graphs else "off",
        "on" if engine_config.enable_prefix_caching else "off",
        ((" (with host and disk tiers)" if tiers.disk else " (with a host tier)") if tiers else ""),
        "overlapped" if self.async_scheduling else "synchronous",
        f", {sc.method} speculation of {lookahead} tokens" if lookahead else "",
    )


def warm_up(self, sizes: tuple[int, ...], progress: bool) -> None:
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
    prefills = warm_up_prefill(self) if self.device.type != "cpu" else []
    self.platform.synchronize()
    self.scheduler.reset()
    self._reset_counters()
    log.info("warmed up %d batch sizes and prompts of %s tokens in %.1f s", len(sizes), prefills, time.perf_counter() - t0)


def default_block_size(model, limits) -> int:
    """The backend's block size where it suits the model's layout (a multiple of the model's
    default), else the model's default."""
    default = model.default_block_size
    wanted = limits and limits.block_size
    return wanted if wanted and wanted % default == 0 else default


def auto_num_blocks(self, groups, block_size: int, lookahead: int) -> int:
    """Enough blocks for max_num_seqs sequences of the longest allowed length, capped by memory:
    a quarter of free host memory on the CPU; on a device, this engine's share of it
    (gpu_memory_utilization x the device's memory, less what this process already holds: vLLM's
    meaning, so two instances at 0.45 share one GPU), and never more than the device has free.
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
        if budget < per_block:
            raise ConfigError(f"no memory left for the KV cache ({free / 2**30:.1f} GiB of host memory free); "
                              "set num_kv_blocks or use a smaller model")
        return min(int(budget // per_block), wanted)
    held = self.platform.memory_held()  # weights (the allocator's cache was handed back above)
    needed = fixed + activation_bytes(self, groups, block_size, max_len)
    share = total * self.config.gpu_memory_utilization - held - needed
    room = free - needed
    gib = 2**30
    if share < per_block:
        raise ConfigError(
            f"no memory left for the KV cache: this engine's share of the device (gpu_memory_utilization "
            f"{self.config.gpu_memory_utilization} of {total / gib:.1f} GiB) is taken by its weights ({held / gib:.1f} GiB) "
            f"and activations ({needed / gib:.1f} GiB); raise gpu_memory_utilization, set num_kv_blocks, or use a smaller model"
        )
    if room < per_block:
        raise ConfigError(
            f"no memory left for the KV cache: the device has {free / gib:.1f} GiB free of {total / gib:.1f} GiB "
            f"(other processes hold {(total - free - held) / gib:.1f} GiB) and the activations need {needed / gib:.1f} GiB; "
            "lower the other instances' gpu_memory_utilization, set num_kv_blocks, or use a smaller model"
        )
    return min(int(min(share, room) // per_block), wanted)

def activation_bytes(self, groups, block_size: int, max_len: int) -> int:
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


def check_fp8_kv_cache(self, engine_config: EngineConfig, model_cls, describe) -> bool:
    """Whether the KV cache is kept as FP8 records (``kv_cache_dtype="fp8"``): ConfigError when the
    model or the backend's platform cannot take them."""
    if engine_config.kv_cache_dtype != "fp8":
        return False
    if not model_cls.supports_fp8_kv_cache:
        raise ConfigError(f"kv_cache_dtype='fp8' is supported for DeepSeek-V4 (V4-Flash, V4-Pro) checkpoints, not for "
                          f"{describe(self.generation)} yet; run it with kv_cache_dtype='auto'")
    if not self.platform.fp8_kv_cache:
        raise ConfigError(f"kv_cache_dtype='fp8': the {self.backend.name!r} backend's ops do not take FP8 KV records "
                          f"(its platform {self.platform.name} has no fp8_kv_cache); run with kv_cache_dtype='auto', or "
                          f"on a backend that has it (accelerator='cpu': the reference)")
    return True


def resolve_dtype(dtype: str | torch.dtype, config, supported: tuple[torch.dtype, ...], device_type: str | None = None) -> torch.dtype:
    """The compute dtype: ``dtype`` by name (vLLM's spellings too), or for "auto" the checkpoint's,
    except on the CPU (``device_type`` "cpu"), where a half-precision checkpoint runs in float32:
    the reference backend is the numeric ground truth, and in bf16 a request's greedy tokens can
    change with the prefix cache (a reused prefix is summed in another order than a fresh
    prefill) and with the CPU's instruction set (``specs/baselines/README.md``). Float32 doubles
    the weights' host memory; pass dtype="bfloat16" to keep the checkpoint's."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        name = (config.torch_dtype or "").replace("torch.", "")
        resolved = DTYPES.get(name, torch.bfloat16)
        if device_type == "cpu" and resolved in (torch.bfloat16, torch.float16) and torch.float32 in supported:
            log.info("dtype auto on the CPU: float32 (the checkpoint's is %s; dtype=%r keeps it)", resolved,
                     str(resolved).removeprefix("torch."))
            resolved = torch.float32
    else:
        try:
            resolved = dtype_from_name(dtype)
        except (ValueError, AttributeError):
            raise ConfigError(f"dtype {dtype!r} is not supported; use 'auto', {', '.join(DTYPES)} (or vLLM's half, "
                              "float)") from None
    if resolved not in supported:
        raise ConfigError(f"dtype {resolved} is not supported by this backend (supported: {supported})")
    return resolved


def eos_ids_of(model_config, tokenizer) -> tuple[int, ...]:
    """Token ids that end a sequence (unless ignore_eos): the config's and the tokenizer's."""
    ids = set(model_config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, or None when the directory has no tokenizer files."""
    if not any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except Exception as e:
        raise ConfigError(f"{model_dir}: the tokenizer files could not be loaded: {e}") from e


WARM_PREFILL_TOKENS = 256  # the shortest prompt of the long-prefill warm-up (doubled up to a prefill chunk)


def warm_up_prefill(self) -> list[int]:
    """Prefill steps of 256, 512, 1024, ... tokens and of a whole chunk (max_num_batched_tokens, as
    far as the KV pool and max_num_seqs allow), each of prompts of their own (one, or several of
    max_model_len when a step is longer): the prefill kernels' variants for long steps (expert
    tiles chosen by tokens per expert, attention over a long chunk) compile at start-up, not in a
    user's first long request (H100, 2026-12-07: the V4-Flash slice's first 2048-token prompt took
    2.6 s, its repeat 0.1 s; a first batch of 8 such prompts, one 16384-token step, 0.8 s).
    Returns the step sizes run."""
    vocab, block = self.model_config.vocab_size, self.kv.block_size
    longest = self.max_model_len - 4  # room for the one token each generates
    if longest < 1:
        return []
    per_prompt = -(-(longest + 1) // block)  # blocks a longest prompt holds (the pool holds max_model_len)
    limit = min(self.max_num_batched_tokens, min(self.max_num_seqs, self.kv.num_free // per_prompt) * longest)
    steps = []
    size = WARM_PREFILL_TOKENS
    while size < limit:
        steps.append(size)
        size *= 2
    if limit >= WARM_PREFILL_TOKENS:
        steps.append(limit)
    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    k = 0
    for size in steps:  # prompts added together (the scheduler packs them), each its own first token: no prefix hit
        for start in range(0, size, longest):
            self.add_request([k % vocab] + [(13 * j + k) % vocab for j in range(1, min(longest, size - start))], once)
            k += 1
        while self.has_unfinished():
            self.step()
    return steps
