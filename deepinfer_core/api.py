"""The public API, shaped like vLLM's offline ``LLM``."""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Sequence as Seq

import torch
from pydantic import ValidationError
from tqdm.auto import tqdm

from deepinfer_core.chat import check_generation_prompt, render_chat
from deepinfer_core.models.registry import describe, generation_for, read_config
from deepinfer_core.config import (DEFAULT_MODEL_DIR, ConfigError, EngineConfig, ParallelConfig, configure_logging, settings,
                                   validation_problems)
from deepinfer_core.engine.engine import Engine, Request, RequestError
from deepinfer_core.engine.output import CompletionOutput, GenerationError, RequestMetrics, RequestOutput, to_output  # noqa: F401 (the public API)
from deepinfer_core.recipe import recipe_for
from deepinfer_core.sampling.params import SamplingParams

log = logging.getLogger("deepinfer")


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """A local checkpoint directory for ``model``: a path, an HF repo id, or the default."""
    if model is None:
        model = settings().hf_model_dir or DEFAULT_MODEL_DIR
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    name = str(model)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ConfigError(f"model {name!r} is not a directory; pass a local HF checkpoint directory or a Hugging Face repo id (org/name)")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as e:
        raise ConfigError(
            f"could not fetch {name!r} from the Hugging Face Hub ({type(e).__name__}: {e}). Offline, download it on "
            f"a connected machine (`hf download {name} --local-dir DIR`), copy DIR here, and pass LLM(model=DIR) or "
            f"set DEEPINFER_HF_MODEL_DIR=DIR"
        ) from e


# vLLM's parallelism arguments, and what DeepInfer offers for several devices instead
_PARALLEL_INSTEAD = ("DeepInfer has no tensor or pipeline parallelism; to run on several devices use data_parallel_size=N "
                     "(N ranks, each with its own engine and share of the requests), with expert_parallel=True to shard "
                     "the MoE layers' routed experts over them and context_parallel_size=C to prefill long prompts across "
                     "C of them (docs/scale-out.md)")
_VLLM_HINTS = {
    "tensor_parallel_size": _PARALLEL_INSTEAD,
    "pipeline_parallel_size": _PARALLEL_INSTEAD,
    "distributed_executor_backend": _PARALLEL_INSTEAD,
    "enable_expert_parallel": "vLLM's enable_expert_parallel is expert_parallel=True here (with data_parallel_size=N)",
    "kv_offloading_size": "vLLM's kv_offloading_size (GiB of host memory for evicted KV blocks) is kv_offload_gb here",
    "hicache_size": "SGLang's hicache_size (GB of host memory for evicted KV blocks) is kv_offload_gb here",
}


def _accepted_arguments() -> list[str]:
    """LLM()'s keyword arguments, read from its signature (so an error message cannot list stale ones)."""
    import inspect

    return [name for name, p in inspect.signature(LLM.__init__).parameters.items()
            if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _refuse_vllm_names(unsupported: dict, trust_remote_code: bool) -> None:
    """Keyword arguments DeepInfer cannot honour, refused with what to do instead: each one named,
    a near miss spelled right, vLLM's parallelism arguments pointed at DeepInfer's."""
    if trust_remote_code:
        raise ConfigError("trust_remote_code=True: DeepInfer never runs code shipped with a checkpoint; it implements "
                          "DeepSeek's architectures itself and reads the config with transformers. Drop the argument")
    if not unsupported:
        return
    import difflib

    accepted = _accepted_arguments()
    named, notes = [], []
    for name in sorted(unsupported):
        close = difflib.get_close_matches(name, accepted, n=1) if name not in _VLLM_HINTS else []
        named.append(f"{name} (did you mean {close[0]}?)" if close else name)
        if name in _VLLM_HINTS and _VLLM_HINTS[name] not in notes:
            notes.append(_VLLM_HINTS[name])
    raise ConfigError(f"LLM() does not take {', '.join(named)}" + "".join(f": {n}" if i == 0 else f"; {n}" for i, n in enumerate(notes))
                      + f". It takes {', '.join(accepted)} (see help(LLM))")


KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}  # vLLM's spellings -> EngineConfig's


def check_kv_cache_dtype(value: str, name: str = "kv_cache_dtype") -> str:
    """vLLM's ``kv_cache_dtype``, normalised: "auto" (the KV cache in the compute dtype) or "fp8"
    (also spelled "fp8_e4m3": DeepSeek-V4's FP8 records for its window and compressed KV caches,
    where the model and the backend take them; the engine checks both at start-up)."""
    if value not in KV_CACHE_DTYPES:
        raise ConfigError(f"{name} {value!r} is not supported: pass 'auto' (the KV cache in the compute dtype) or 'fp8' "
                          "(also 'fp8_e4m3': DeepSeek-V4's FP8 KV records, V4 checkpoints only)")
    return KV_CACHE_DTYPES[value]


def _check_quantization(model_dir: Path, quantization: str | None) -> None:
    """``quantization`` must name the checkpoint's own format: DeepInfer runs weights as stored."""
    if quantization is None:
        return
    try:
        stored = (json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}).get("quant_method")
    except (OSError, ValueError):
        stored = None
    if quantization != stored:
        raise ConfigError(f"quantization={quantization!r}, but this checkpoint is stored "
                          f"{'as ' + repr(stored) if stored else 'unquantized'}: DeepInfer runs weights in the format they "
                          f"are stored in. Drop the argument" + (f" or pass quantization={stored!r}" if stored else ""))


class LLM:
    """Offline inference on a DeepSeek V2/V3 or V4 checkpoint.

    model: local HF checkpoint directory, HF repo id, or None for DEEPINFER_HF_MODEL_DIR / the
    embedded default. dtype "auto": DEEPINFER_DTYPE, else the checkpoint's (float32 on the CPU
    for a bf16/fp16 checkpoint: the reference is the numeric ground truth). accelerator:
    backend name (cpu, nvidia, ascend, ...); None reads DEEPINFER_ACCELERATOR, else picks
    automatically. load_format "dummy" fills the weights with
    random values instead of reading them (benchmarks: only config.json is needed). enforce_eager
    turns off graph capture of decode steps (otherwise graphs are captured while the engine
    starts). enable_prefix_caching reuses the KV blocks of prompt prefixes computed before.
    block_size: tokens per KV block; None picks the model's (16 for V2/V3, a multiple of every
    compression rate for V4). kv_cache_dtype: vLLM's "auto" (the KV cache is kept in the compute
    dtype) or "fp8" / "fp8_e4m3": DeepSeek-V4's window and compressed KV caches as FP8 records of
    584 bytes a token (``ops/kv_record.py``; V4 checkpoints on a backend whose platform has
    ``fp8_kv_cache``, without context parallelism; the indexer keys and compressor states stay).
    speculative_config, as vLLM spells it: ``{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": n}`` (prompt-lookup drafts, verified exactly).
    batch_invariant: bitwise the same logits and tokens for a request whatever batch it runs in
    and whether or not it was preempted (None reads DEEPINFER_BATCH_INVARIANT; off by default).
    data_parallel_size: N ranks, one process each (this one is rank 0 and starts the others;
    under torchrun the launched processes are the ranks and None means WORLD_SIZE), each with
    its own engine and share of the requests, stepping together. expert_parallel: the MoE
    layers' routed experts sharded over those ranks, with EPLB (``parallel/``). Under torchrun every
    rank calls ``generate``: rank 0's prompts run, and every rank gets all the outputs.
    context_parallel_size: C (dividing data_parallel_size) ranks prefill a long prompt together
    (DEEPINFER_CP_MIN_TOKENS tokens or more), and its own rank decodes it.
    kv_offload_gb: GiB of host memory (pinned on an accelerator) that keep the full KV blocks
    evicted from the device's cache, so that a prefix found there is copied back instead of
    recomputed (vLLM's kv_offloading_size, SGLang's hicache_size; 0: off). kv_disk_dir and
    kv_disk_gb: a directory and the GiB of it that keep the blocks reaching the host tier across
    restarts (same model and cache layout; another's directory is refused); ``close()`` (also
    run at exit) writes the blocks the device still caches there too and finishes the writes.
    ``RequestOutput.num_cached_tokens_by_tier`` says which tier served a prompt's cached tokens.
    kv_role: "prefill" or "decode" for prefill/decode disaggregation over NIXL (vLLM's
    ``kv_transfer_params`` protocol, ``engine/kv_transfer.py``; one process, not with data
    parallelism or speculative decoding); kv_transfer_timeout: seconds a prefill instance keeps
    blocks no decode instance read, and a decode instance waits for a READ.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        accelerator: str | None = None,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        block_size: int | None = None,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        gpu_memory_utilization: float = 0.9,
        seed: int = 0,
        load_format: str = "safetensors",
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        speculative_config: dict | None = None,
        batch_invariant: bool | None = None,
        progress: bool = True,
        trust_remote_code: bool = False,
        quantization: str | None = None,
        data_parallel_size: int | None = None,
        expert_parallel: bool = False,
        context_parallel_size: int = 1,
        kv_cache_dtype: str = "auto",
        kv_offload_gb: float = 0,
        kv_disk_dir: str | os.PathLike | None = None,
        kv_disk_gb: float | None = None,
        kv_role: str | None = None,
        kv_transfer_timeout: float = 120.0,
        **unsupported,
    ):
        env = settings()
        configure_logging(env.log_level)
        _refuse_vllm_names(unsupported, trust_remote_code)
        kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        if kv_cache_dtype == "fp8" and context_parallel_size > 1:
            raise ConfigError("kv_cache_dtype='fp8' does not work with context parallelism yet (the context-parallel prefill "
                              "attends over unquantised rows); pass context_parallel_size=1 or kv_cache_dtype='auto'")
        try:  # the settings before the model: a bad one is refused before a download or a load
            config = EngineConfig(
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                seed=seed,
                load_format=load_format,
                enforce_eager=enforce_eager,
                enable_prefix_caching=enable_prefix_caching,
                speculative_config=speculative_config,
                batch_invariant=env.batch_invariant if batch_invariant is None else batch_invariant,
                kv_cache_dtype=kv_cache_dtype,
                kv_offload_gb=kv_offload_gb,
                kv_disk_dir=None if kv_disk_dir is None else os.fspath(kv_disk_dir),
                kv_disk_gb=kv_disk_gb,
                kv_role=kv_role,
                kv_transfer_timeout=kv_transfer_timeout,
            )
        except ValidationError as e:
            raise ConfigError(f"bad LLM() arguments: {validation_problems(e)}") from None
        parallel = _parallel_config(data_parallel_size, expert_parallel, context_parallel_size)
        if kv_role is not None and parallel.data_parallel_size > 1:
            raise ConfigError(f"kv_role={kv_role!r} runs one engine per instance: start one prefill or decode instance per "
                              "GPU (vLLM's router balances them) instead of data_parallel_size > 1")
        self.model_dir = resolve_model_dir(model)
        _check_quantization(self.model_dir, quantization)
        if dtype == "auto" and env.dtype:
            dtype = env.dtype
        self.parallel = None  # parallel.data_parallel.DataParallel when several ranks run this LLM
        if parallel.data_parallel_size > 1:
            config = _parallel_engine_config(config, parallel, self.model_dir)
            self._start_parallel(parallel, (self.model_dir, config, accelerator or env.accelerator, dtype), progress, env.log_level)
        else:
            self.engine = Engine(self.model_dir, config, accelerator or env.accelerator, dtype, progress=progress)
        if config.kv_disk_dir is not None:
            atexit.register(self.close)  # what the device's cache holds at exit is written to the disk tier too
        self._lock = threading.Lock()  # one generate at a time: the engine is not thread-safe
        self._generating_in: int | None = None  # the thread running generate, to refuse re-entry

    def _start_parallel(self, parallel: ParallelConfig, engine_args: tuple, progress: bool, log_level: str) -> None:
        from deepinfer_core.parallel import data_parallel, launch

        size = parallel.data_parallel_size
        if launch.under_torchrun():
            rank = launch.torchrun_rank(size)
            shard = (rank, size) if parallel.expert_parallel else None
            self.engine = Engine(*data_parallel.rank_engine_args(engine_args, rank, size), progress=progress, expert_parallel=shard)
            group = launch.join_torchrun(self.engine.device, size)
        else:
            shard = (0, size) if parallel.expert_parallel else None
            mine = data_parallel.rank_engine_args(engine_args, 0, size)  # the spawned ranks derive theirs
            group, self.engine = launch.spawn(size, data_parallel.worker_main, (engine_args, parallel, log_level),
                                              lambda: Engine(*mine, progress=progress, expert_parallel=shard))
        try:
            self.parallel = data_parallel.DataParallel(self.engine, group, parallel)
        except BaseException:
            group.stop(wait=0)  # the other ranks would wait for rank 0 until the timeout
            raise
        atexit.register(self.close)

    def close(self) -> None:
        """Data-parallel LLM: stop the ranks this process started (also done at exit) and leave
        the process group. With a disk tier (``kv_disk_dir``): finish its writes and release its
        directory for another engine. Once closed, nothing holds the LLM but its caller: dropping
        it frees this rank's engine (weights, KV cache) for the next LLM of the process."""
        if self.engine.kv.tiers is not None:
            self.engine.kv.close_tiers()
            atexit.unregister(self.close)
        if self.engine.scheduler.transfer is not None:  # prefill/decode: the cache leaves NIXL
            self.engine.scheduler.transfer.close()
        if self.parallel is not None:
            self.parallel.close()
            atexit.unregister(self.close)  # the exit hook's reference would keep the engine alive

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (None for a checkpoint without one), as vLLM's."""
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's ``llm.llm_engine``: the request loop of vLLM's LLMEngine (``add_request``,
        ``step``, ``has_unfinished_requests``, ``abort_request``) over this LLM's engine, which
        is its ``.engine``. One engine: a data-parallel LLM's ranks step together, through ``generate``."""
        if self.parallel is not None:
            raise RuntimeError("llm_engine steps one engine, and this LLM's data-parallel ranks step together; "
                               "use generate (or the server) instead")
        return LLMEngine(self.engine)

    def chat(
        self,
        messages: list[dict] | Seq[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Reply to one conversation ([{"role": ..., "content": ...}, ...]) or to a list of
        them, as vLLM's ``LLM.chat``: each is laid out as the model's chat format wants it,
        ending with the assistant's turn, then generated like ``generate``'s prompts; each
        output's ``prompt`` is the rendered prompt text. V2/V3: the tokenizer's chat template, or
        ``chat_template`` (a Jinja template) instead (``tools`` and ``chat_template_kwargs`` go to
        it). V4/V4.1: DeepSeek's encoding (deepseek-recipe); ``chat_template_kwargs={"thinking":
        False}`` turns thinking mode off (on by default, as on DeepSeek's API), and it takes no
        ``chat_template``. vLLM's ``add_generation_prompt=False, continue_final_message=True``
        leaves the final (assistant) message open for the model to continue (V4: DeepSeek's
        prefix completion; its encoding always ends with the assistant's turn, so it has no
        other use for ``add_generation_prompt=False``). The text is the raw output: reasoning,
        then content (the server's chat routes split them)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = dict(chat_template_kwargs or {})
        check_generation_prompt(add_generation_prompt, continue_final_message)
        recipe = self._recipe
        if recipe is not None:
            if set(kwargs) - {"thinking"}:
                raise ValueError(f"chat_template_kwargs {sorted(set(kwargs) - {'thinking'})}: DeepSeek's V4 chat format takes only 'thinking'")
            if chat_template is not None:
                raise ValueError("chat_template: V4 / V4.1 conversations are laid out by DeepSeek's encoding "
                                 "(deepseek-recipe), not by a Jinja template; drop chat_template")
            if not add_generation_prompt and not continue_final_message:
                raise ValueError("add_generation_prompt=False: DeepSeek's V4 encoding always ends with the assistant's "
                                 "turn; to continue a final assistant message pass continue_final_message=True with it")
        prompts, texts = [], []
        for i, conversation in enumerate(conversations):
            try:
                if recipe is not None:
                    text, ids = recipe.render_chat(list(conversation), tools, kwargs.get("thinking"), continue_final_message)
                else:
                    text, ids = render_chat(self.engine.tokenizer, list(conversation), tools, kwargs, chat_template,
                                            add_generation_prompt, continue_final_message)
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}") from None
            prompts.append({"prompt_token_ids": ids})
            texts.append(text)
        try:
            outputs = self.generate(prompts, sampling_params, use_tqdm)
        except GenerationError as e:
            for out, text in zip(e.outputs, texts):
                out.prompt = text
            raise
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

    @functools.cached_property
    def _recipe(self):
        """deepseek-recipe for a V4 / V4.1 checkpoint (its chat format), None for the others."""
        return recipe_for(self.model_dir, self.engine.generation)

    def generate(
        self,
        prompts: str | list[int] | dict | Seq[str | list[int] | dict],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or vLLM's ``{"prompt": text}`` /
        ``{"prompt_token_ids": ids}``. ``sampling_params`` is one SamplingParams for all prompts
        or one per prompt. Every request is checked before any runs: a bad one raises and nothing
        is queued. Calls from several threads run one after another. An interrupted call
        (Ctrl-C) withdraws its requests and leaves the engine as it was before the call.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        if not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params; give one, or one per prompt")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] is a {type(p).__name__}, not a SamplingParams")
        if self._generating_in == threading.get_ident():
            raise RuntimeError("LLM.generate was called from inside a running generate call in the same thread; "
                               "call it again after the first one returns")
        with self._lock:
            try:
                self._generating_in = threading.get_ident()
                return self._generate(prompts, params, use_tqdm)
            finally:
                self._generating_in = None

    def _generate(self, prompts: list, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        if self.parallel is not None:
            return self._generate_parallel(prompts, params, use_tqdm)
        engine = self.engine
        if engine.requests:  # generate would step them too and drop their outputs
            raise RuntimeError(f"the engine holds {len(engine.requests)} request(s) added through llm_engine.add_request; "
                               "step them to the end (llm_engine.step() until has_unfinished_requests() is False) or "
                               "abort them before calling generate")
        before = engine.mark()
        order: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                order.append(engine.add_request(prompt, p, label=f"prompt {i}"))
        except BaseException:
            engine.withdraw_since(before)  # all or nothing: a refused call leaves no request behind
            raise
        done: dict[str, Request] = {}
        try:
            with tqdm(total=len(order), desc="Generating", unit="req", disable=not use_tqdm) as bar:
                while engine.has_unfinished():
                    for req in engine.step():
                        done[req.request_id] = req
                        bar.update(1)
        except Exception as e:
            for req in engine.abort_all():
                done.setdefault(req.request_id, req)
            outputs = [to_output(done[rid], engine.proposer is not None) for rid in order]
            raise GenerationError(f"generation failed: {type(e).__name__}: {e}; finished results are in .outputs", outputs) from e
        except BaseException:  # KeyboardInterrupt, SystemExit: the caller will never see these results
            engine.withdraw_since(before)
            raise
        return [to_output(done[rid], engine.proposer is not None) for rid in order]

    def _generate_parallel(self, prompts: list, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        from deepinfer_core.parallel.data_parallel import GENERATE, Work

        dp, engine = self.parallel, self.engine
        if dp.group.broken:
            raise RuntimeError(f"this LLM's data-parallel group is gone ({dp.group.broken}); create a new LLM")

        def prepare():
            work, seq_id, request_id = [], engine.next_seq_id, engine.next_request_id
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                text, ids = engine.validate(prompt, p, label=f"prompt {i}")
                p = engine.resolve_params(p, len(ids))  # max_tokens=None counts in the ranks' loads as what it may run to
                work.append(Work(str(request_id), text, ids, p, seq_id))
                seq_id, request_id = seq_id + p.n, request_id + 1
            return work, (seq_id, request_id)

        try:
            if dp.group.spawned:
                dp.command(GENERATE)
            return dp.generate(prepare if dp.rank == 0 else None, use_tqdm)
        except (GenerationError, RequestError, ValueError, TypeError):
            raise  # the group is intact: every rank got the same outcome
        except BaseException as e:  # a collective failed (a rank died), or an interrupt left the ranks out of step
            if not dp.group.spawned:
                raise
            raise dp.group.failure(e) from e



class LLMEngine:
    """``LLM.llm_engine``: vLLM's LLMEngine request loop over a DeepInfer ``Engine`` (``.engine``)::

        engine = llm.llm_engine
        engine.add_request("0", "def f(x):", SamplingParams(max_tokens=16))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    print(out.outputs[0].text)

    ``step`` returns the requests that finished in that step (vLLM's returns unfinished ones
    too, with ``finished`` False). A request is checked as ``generate`` checks it: a bad one
    raises and queues nothing. Not thread-safe, like the engine; ``LLM.generate`` refuses to run
    while requests added here are unfinished."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams) -> None:
        """Queue ``prompt`` (as ``generate`` takes it) under ``request_id``, as vLLM's."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params is a {type(params).__name__}, not a SamplingParams (add_request(request_id, prompt, params))")
        self.engine.add_request(prompt, params, request_id=str(request_id), label=f"request {request_id}")

    def step(self) -> list[RequestOutput]:
        """Run one engine step; the outputs of the requests that finished in it."""
        return [to_output(req, self.engine.proposer is not None) for req in self.engine.step()]

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.engine.requests)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop the requests with these ids (unknown ids are skipped, as vLLM's)."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            if rid in self.engine.requests:
                self.engine.abort(rid)

    def get_tokenizer(self):
        return self.engine.tokenizer


def _parallel_config(data_parallel_size: int | None, expert_parallel: bool, context_parallel_size: int) -> ParallelConfig:
    from deepinfer_core.parallel.launch import under_torchrun

    if data_parallel_size is None:
        data_parallel_size = int(os.environ.get("WORLD_SIZE", "1") or 1) if under_torchrun() else 1
    try:
        parallel = ParallelConfig(data_parallel_size=data_parallel_size, expert_parallel=expert_parallel,
                                  context_parallel_size=context_parallel_size)
    except ValidationError as e:
        raise ConfigError(f"bad parallel settings: {validation_problems(e)}") from None
    cp = parallel.context_parallel_size
    if cp > 1 and parallel.data_parallel_size % cp:
        raise ConfigError(f"context_parallel_size={cp} must divide data_parallel_size={parallel.data_parallel_size} "
                          "(each CP group is that many of the data-parallel ranks)")
    if parallel.expert_parallel and parallel.data_parallel_size == 1:
        raise ConfigError("expert_parallel=True needs data_parallel_size > 1 (the experts are sharded over the "
                          "data-parallel ranks); set data_parallel_size or run under torchrun")
    return parallel


def _parallel_engine_config(config: EngineConfig, parallel: ParallelConfig, model_dir: Path) -> EngineConfig:
    """The engine settings every rank runs with: under expert parallelism a step is one eager
    forward pass of the decoder stack (the experts' exchange has per-step sizes no graph can
    hold; the lock-step counts the passes). Speculative decoding keeps that: n-gram drafts need
    no pass, and the MTP layers (V4.1: the DSpark stages) keep every expert and draft on each
    rank alone. Context parallelism hands its prefixes over through the prefix cache, on the
    models that have a context-parallel prefill. Speculative decoding counts as asked for when
    DeepSeek's switches (DEEPINFER_USE_NEXTN_DECODE, ...) turn it on."""
    from deepinfer_core.engine.spec_decode.proposers import resolve

    generation = generation_for(read_config(model_dir))
    spec = resolve(config.speculative_config, generation.model)
    speculative = spec is not None
    if parallel.context_parallel_size > 1:
        if not generation.model.supports_context_parallel:
            raise ConfigError(f"context_parallel_size > 1 is supported for DeepSeek-V2/V3/R1, V4 and V4.1, not for "
                              f"{describe(generation)} yet; leave context_parallel_size at 1")
        if not config.enable_prefix_caching or speculative:
            raise ConfigError("context_parallel_size > 1 needs prefix caching on and no speculative decoding (the owner "
                              "rank finds the prefix the CP group computed in its prefix cache)")
    if not parallel.expert_parallel:
        return config
    if speculative and spec.adaptive:
        raise ConfigError("adaptive verification (DSpark's adaptive=True, DEEPINFER_ENABLE_MTP_VARLEN=1) with "
                          "expert_parallel=True is not supported yet: it times the target model alone at start-up, before "
                          "the experts are spread over the ranks; set adaptive=False (or unset DEEPINFER_ENABLE_MTP_VARLEN)")
    if not config.enforce_eager:
        log.info("expert parallelism: decode graphs are off (every step runs eagerly)")
    return config.model_copy(update={"enforce_eager": True})
