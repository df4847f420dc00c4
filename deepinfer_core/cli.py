"""The ``deepinfer`` command.

``deepinfer backends [--accelerator NAME]``: every installed backend, whether it can run here
(and why not, and the fix), which one would be selected, and op by op who provides it; with
``--plan NAME``, instead of selecting, the op table backend NAME would build on its own hardware
(its ``deepinfer_op_plan``), shown on any machine.
``deepinfer generate --prompt TEXT ...``: offline generation through ``deepinfer_core.LLM``.
``deepinfer conformance [--backend NAME] ...``: the backend's ops against the reference (or, with
``--e2e``, end-to-end baselines; with ``--replay CASE``, one failing case again); exit status 0
pass, 1 fail, 2 could not run.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import Sequence


def _one_line(text: str) -> str:
    """Plugin errors (pluggy's validation messages) span lines; a listing row must not."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def _backends(args: argparse.Namespace) -> int:
    from deepinfer_core.config import settings
    from deepinfer_core.hookspecs import SPEC_VERSION
    from deepinfer_core.ops import OP_NAMES, OPTIONAL_OPS
    from deepinfer_core.plugins import ENTRY_POINT_GROUP, REFERENCE_BACKEND, BackendError, PluginManager

    if args.plan and (args.accelerator or args.batch_invariant):
        print("error: --plan NAME shows one backend's op table without selecting or loading one; "
              "--accelerator and --batch-invariant do not apply to it", file=sys.stderr)
        return 2
    manager = PluginManager()
    backends = manager.discover()
    rows = sorted([*backends.values(), *manager.rejected], key=lambda b: (-(b.info.priority if b.info else -1), b.name))
    print(f"Backends (entry-point group {ENTRY_POINT_GROUP!r}, hookspec version {SPEC_VERSION}):")
    width = max([len("BACKEND")] + [len(b.name) + (len(" (" + ", ".join(b.info.aliases) + ")") if b.info and b.info.aliases else 0) for b in rows])
    print(f"  {'BACKEND':<{width}}  {'PRIORITY':>8}  STATUS")
    for b in rows:
        label = b.name + (f" ({', '.join(b.info.aliases)})" if b.info and b.info.aliases else "")
        priority = str(b.info.priority) if b.info else "?"
        print(f"  {label:<{width}}  {priority:>8}  {_one_line(b.status())}")
        print(f"  {'':<{width}}  {'':>8}  source: {b.source}")
        if b.info and b.info.description:
            print(f"  {'':<{width}}  {'':>8}  about:  {b.info.description}")
    print()
    if args.plan:
        return _plan(manager, args.plan)

    requested = args.accelerator or settings().accelerator
    how = (
        f"requested by {'--accelerator' if args.accelerator else 'DEEPINFER_ACCELERATOR'}={requested}"
        if requested and requested.strip().lower() not in ("", "auto")
        else "auto: the highest-priority available backend"
    )
    try:
        backend = manager.select(requested)
        print(f"Selected: {backend.name} ({how})")
        platform, ops, _, fallback = manager.load(backend, model_config=None, batch_invariant=args.batch_invariant)
    except BackendError as e:
        print(f"error: {_one_line(str(e))}", file=sys.stderr)
        return 1
    print(f"Platform: {platform.name} on {platform.device}" + (" (batch-invariant op table)" if args.batch_invariant else ""))
    unused = [name for name in OPTIONAL_OPS if not ops.backend_provides(name)]  # fusions the model does not call
    falls_back = len([name for name in fallback if name not in unused])
    own = len(OP_NAMES) - falls_back - len(unused)
    print(f"Ops: {own} of {len(OP_NAMES)} from {backend.name}"
          + (f", {falls_back} fall back to the reference" if backend.name != REFERENCE_BACKEND else "")
          + (f", {len(unused)} optional fusion{'s' * (len(unused) > 1)} not provided (not called)" if unused else ""))
    op_width = max(len(name) for name in OP_NAMES)
    who = {name: "none (optional)" if name in unused else ops.providers[name] + (" (fallback)" if ops.providers[name] != backend.name else "")
           for name in OP_NAMES}
    who_width = max(len("PROVIDER"), *(len(w) for w in who.values()))
    print(f"  {'OP':<{op_width}}  {'PROVIDER':<{who_width}}  IMPLEMENTATION")
    for name in OP_NAMES:
        impl = ops.implementations[name] or ("torch reference" if ops.providers[name] == REFERENCE_BACKEND else "")
        if name in unused:
            impl = "not called: the model runs the ops it fuses"
        print(f"  {name:<{op_width}}  {who[name]:<{who_width}}  {impl}")
    return 0


def _plan(manager, name: str) -> int:
    """``backends --plan NAME``: the op table backend NAME would build on its own hardware, from its
    ``deepinfer_op_plan``, without loading it (so on any machine)."""
    from deepinfer_core.ops import OP_NAMES, OPTIONAL_OPS
    from deepinfer_core.plugins import BackendError

    try:
        backend = manager.find(name)
        plan = manager.op_plan(backend)
    except BackendError as e:
        print(f"error: {_one_line(str(e))}", file=sys.stderr)
        return 1
    here = "available here" if backend.available else f"unavailable here: {backend.probe.reason}"
    print(f"Plan: {backend.name} ({here}): the op table it builds on its own hardware, from its deepinfer_op_plan; "
          f"nothing was loaded")
    unused = [op for op in OP_NAMES if op in OPTIONAL_OPS and op not in plan.provides]
    falls_back = [op for op in OP_NAMES if op not in plan.provides and op not in unused]
    print(f"Ops: {len(plan.provides)} of {len(OP_NAMES)} from {backend.name}, {len(falls_back)} fall back to the reference"
          + (f", {len(unused)} optional fusion{'s' * (len(unused) > 1)} not provided (not called)" if unused else ""))
    op_width = max(len(op) for op in OP_NAMES)
    who = {op: backend.name if op in plan.provides else "none (optional)" if op in unused else "reference (fallback)"
           for op in OP_NAMES}
    who_width = max(len("PROVIDER"), *(len(w) for w in who.values()))
    print(f"  {'OP':<{op_width}}  {'PROVIDER':<{who_width}}  IMPLEMENTATION")
    for op in OP_NAMES:
        how = plan.provides.get(op) or f"why not: {plan.left_out.get(op, 'no reason given')}"
        print(f"  {op:<{op_width}}  {who[op]:<{who_width}}  {how}")
    return 0


# LLM() arguments by the flags that set them (the engine flags generate and serve share)
ENGINE_FLAGS = {"max_num_seqs": "--max-num-seqs", "max_model_len": "--max-model-len", "seed": "--seed",
                "gpu_memory_utilization": "--gpu-memory-utilization", "data_parallel_size": "--data-parallel-size",
                "context_parallel_size": "--context-parallel-size", "kv_offload_gb": "--kv-offload-gb",
                "kv_disk_dir": "--kv-disk-dir", "kv_disk_gb": "--kv-disk-gb", "num_kv_blocks": "--num-gpu-blocks-override"}


class ArgumentError(ValueError):
    """A command-line value that cannot be used (printed as one ``error:`` line)."""


def _load_errors() -> tuple[type[BaseException], ...]:
    """The errors an LLM's construction (or a generate) reports for what it was given: a bad
    setting, checkpoint or request (ValueError: ConfigError, RequestError, pydantic's
    ValidationError), a backend that cannot run here, a failed rank, a failed generation."""
    from deepinfer_core import GenerationError
    from deepinfer_core.parallel.launch import RankFailure
    from deepinfer_core.plugins import BackendError

    return (BackendError, GenerationError, RankFailure, ValueError)


def _llm_arguments(args: argparse.Namespace) -> dict:
    """``LLM(...)``'s keyword arguments from the engine flags (``_engine_arguments``), every one
    checked first: ArgumentError naming the flag, before minutes of loading a model."""
    from pydantic import ValidationError

    from deepinfer_core.api import check_kv_cache_dtype
    from deepinfer_core.config import ConfigError, EngineConfig, ParallelConfig, validation_problems

    for flag, k in (("--ngram", args.ngram), ("--mtp", args.mtp)):
        if not 0 <= k <= 16:
            raise ArgumentError(f"{flag} {k}: the number of draft tokens per step must be 0 (off) to 16")
    if args.ngram and args.mtp:
        raise ArgumentError("--ngram and --mtp are two ways to draft; give one")
    try:
        check_kv_cache_dtype(args.kv_cache_dtype, "--kv-cache-dtype")
    except ConfigError as e:
        raise ArgumentError(str(e)) from None
    spec = {"method": "ngram", "num_speculative_tokens": args.ngram, "prompt_lookup_max": 3, "prompt_lookup_min": 1} if args.ngram else None
    spec = {"method": "mtp", "num_speculative_tokens": args.mtp} if args.mtp else spec
    kwargs = {"model": args.model, "accelerator": args.accelerator, "dtype": args.dtype, "max_model_len": args.max_model_len,
              "max_num_seqs": args.max_num_seqs, "gpu_memory_utilization": args.gpu_memory_utilization, "seed": args.seed,
              "kv_cache_dtype": args.kv_cache_dtype, "enable_prefix_caching": not args.no_prefix_caching,
              "speculative_config": spec, "batch_invariant": args.batch_invariant or None,
              "data_parallel_size": args.data_parallel_size, "expert_parallel": args.expert_parallel,
              "context_parallel_size": args.context_parallel_size, "kv_offload_gb": args.kv_offload_gb,
              "kv_disk_dir": args.kv_disk_dir, "kv_disk_gb": args.kv_disk_gb, "num_kv_blocks": args.num_kv_blocks,
              "load_format": args.load_format}
    try:
        EngineConfig(**{k: kwargs[k] for k in ("max_model_len", "max_num_seqs", "gpu_memory_utilization", "seed",
                                                "speculative_config", "enable_prefix_caching", "kv_offload_gb",
                                                "kv_disk_dir", "kv_disk_gb", "num_kv_blocks")})
        ParallelConfig(data_parallel_size=1 if args.data_parallel_size is None else args.data_parallel_size,
                       expert_parallel=args.expert_parallel,
                       context_parallel_size=args.context_parallel_size)
    except ValidationError as e:
        flags = {**ENGINE_FLAGS, "enable_prefix_caching=False": "--no-prefix-caching"}  # the settings the tiers' checks name
        problems = re.sub(r"\b(kv_offload_gb|kv_disk_dir|kv_disk_gb|enable_prefix_caching=False)\b",
                          lambda m: flags[m.group(1)], validation_problems(e, ENGINE_FLAGS))
        raise ArgumentError(problems) from None
    return kwargs


def _generate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.config import validation_problems

    try:  # the parameters first: a bad one is reported before minutes of loading a model
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
        llm_args = _llm_arguments(args)
    except ValidationError as e:
        flags = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p"}
        print(f"error: {validation_problems(e, flags)}", file=sys.stderr)
        return 1
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        llm = LLM(**llm_args)
        outputs = llm.generate(args.prompt, params)
        llm.close()
    except _load_errors() as e:  # ValueError: bad config, checkpoint, request or parameter
        print(f"error: {_one_line(str(e))}", file=sys.stderr)
        return 1
    for out in outputs:
        print(f"=== {out.prompt!r}\n{out.outputs[0].text}")
    print((llm.parallel or llm.engine).summary(), file=sys.stderr)  # a data-parallel group's: every rank's counts
    return 0


def _split(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def _conformance(args: argparse.Namespace) -> int:
    from deepinfer_core.config import settings
    from deepinfer_core.conformance.spec import SpecError, dtype_from_name
    from deepinfer_core.plugins import BackendError

    backend = args.backend or settings().accelerator
    if args.e2e:
        if args.ops or args.replay is not None or args.batch_invariant:
            print("error: --ops, --replay and --batch-invariant select op checks; they do not apply to --e2e", file=sys.stderr)
            return 2
        from deepinfer_core.conformance import e2e

        return e2e.main(backend, workloads=_split(args.workloads), refresh=args.refresh, json_out=args.json,
                        structured=args.check_structured_output, dtype=args.dtype)
    if args.refresh or args.workloads or args.check_structured_output:
        print("error: --refresh, --workloads and --check-structured-output belong to --e2e", file=sys.stderr)
        return 2
    from deepinfer_core.conformance import ops_suite

    if args.replay is not None:
        return _replay(args, backend)
    examples = ops_suite.DEFAULT_EXAMPLES if args.examples is None else args.examples
    explore = ops_suite.DEFAULT_EXPLORE_MAX_ELEMENTS if args.explore_max_elements is None else args.explore_max_elements
    try:
        dtypes = [dtype_from_name(d) for d in _split(args.dtype) or []] or None
        report = ops_suite.run_suite(backend, ops=_split(args.ops), dtypes=dtypes, examples=examples, seed=args.seed,
                                     progress=not args.quiet, explore_max_elements=explore, max_elements=args.max_elements,
                                     batch_invariant=args.batch_invariant)
    except (BackendError, SpecError, ValueError) as e:
        print(f"error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    return _op_report(report, args.json)


def _op_report(report, json_path: str | None) -> int:
    """Print an op-suite report (and write it as JSON when asked); its exit status."""
    from deepinfer_core.conformance import ops_suite

    print(ops_suite.format_report(report))
    if json_path:
        ops_suite.write_json(report, json_path)
    return 0 if report.passed else 1


def _replay(args: argparse.Namespace, backend: str | None) -> int:
    """``--replay CASE``: exactly one case of the op suite, as a failing report row printed it."""
    from deepinfer_core.conformance import ops_suite
    from deepinfer_core.conformance.spec import SpecError
    from deepinfer_core.plugins import BackendError

    search = {"--ops": args.ops, "--dtype": args.dtype, "--examples": args.examples, "--seed": args.seed,
              "--explore-max-elements": args.explore_max_elements, "--max-elements": args.max_elements}
    given = [flag for flag, value in search.items() if value is not None]
    if given:  # the case names its op and dtype, and nothing is searched
        print(f"error: --replay runs exactly the case it is given (its op and dtype, no search); drop {', '.join(given)}",
              file=sys.stderr)
        return 2
    try:
        case = ops_suite.ReplayCase.parse(args.replay)
    except (SpecError, ValueError) as e:
        print(f"error: --replay: {_one_line(str(e))}", file=sys.stderr)
        return 2
    try:
        report = ops_suite.replay(backend, case, batch_invariant=args.batch_invariant)
    except (BackendError, SpecError, ValueError) as e:
        print(f"error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    return _op_report(report, args.json)


def _listen_socket(host: str, port: int):
    """A socket bound to (host, port), for uvicorn to serve on: bound before the model loads, so a
    busy port is an error at once, not after the load (vLLM's serve binds first too). Not yet
    listening: a client is refused while the model loads. ArgumentError naming the address."""
    import errno
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as e:
        raise ArgumentError(f"--host {host}: not an address to listen on ({e})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait out TIME_WAIT
        sock.bind(address)
    except OSError as e:
        sock.close()
        fix = {errno.EADDRINUSE: f"port {port} is in use: stop what holds it or pass another --port",
               errno.EACCES: "ports below 1024 need privileges: pass a --port above 1023",
               errno.EADDRNOTAVAIL: f"{host} is not an address of this machine: pass one of its addresses as --host "
                                    "(0.0.0.0 for every interface)"}.get(e.errno, "check --host and --port")
        raise ArgumentError(f"cannot listen on {host}:{port}: {e.strerror or e}; {fix}") from None
    return sock


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from deepinfer_core import LLM
    from deepinfer_core.serving.async_llm import AsyncLLM
    from deepinfer_core.serving.protocol import Limits
    from deepinfer_core.serving.server import build_app

    api_key = args.api_key or os.environ.get("DEEPINFER_API_KEY") or None
    try:  # the flags and the port first: either is reported before minutes of loading a model
        llm_args = _llm_arguments(args)
        if args.role is not None:
            if args.kv_transfer_timeout <= 0:
                raise ArgumentError(f"--kv-transfer-timeout {args.kv_transfer_timeout}: give a positive number of seconds")
            if llm_args["speculative_config"] is not None or (args.data_parallel_size or 1) > 1:
                raise ArgumentError("--role runs one engine per instance without speculative decoding: drop --ngram / --mtp "
                                    "and --data-parallel-size")
            llm_args.update(kv_role=args.role, kv_transfer_timeout=args.kv_transfer_timeout)
        for flag, value in (("--max-tokens", args.max_tokens), ("--max-n", args.max_n), ("--max-body-bytes", args.max_body_bytes)):
            if value < 1:
                raise ArgumentError(f"{flag} {value}: a request's limit must be at least 1")
        sock = _listen_socket(args.host, args.port)
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        try:
            llm = LLM(**llm_args)
        except _load_errors() as e:  # ValueError: a bad setting or checkpoint (ConfigError, pydantic's, ...)
            print(f"error: {_one_line(str(e))}", file=sys.stderr)
            return 1
        name = args.served_model_name or (args.model or "deepinfer-default")
        limits = Limits(max_tokens=args.max_tokens, max_n=args.max_n, max_body_bytes=args.max_body_bytes)
        engine = AsyncLLM(llm)
        try:
            server = uvicorn.Server(uvicorn.Config(build_app(engine, name, api_key, limits), host=args.host, port=args.port,
                                                   log_level="info"))
            host, port = sock.getsockname()[:2]  # --port 0: the port the system chose
            logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                                                    f"[{host}]" if ":" in host else host, port)  # uvicorn logs it only for a socket of its own
            server.run(sockets=[sock])
        finally:
            engine.shutdown()
            llm.close()
    finally:
        sock.close()
    return 0


def _engine_arguments(p: argparse.ArgumentParser, ranks_help: str) -> None:
    """The engine options ``generate`` and ``serve`` share, with vLLM's names where vLLM has them
    (``_llm_arguments`` turns them into LLM's arguments)."""
    p.add_argument("--accelerator", help="backend to use (default: DEEPINFER_ACCELERATOR, else automatic)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
                   help="compute dtype, vLLM's names (default auto: DEEPINFER_DTYPE, else the checkpoint's; float32 on the CPU)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="the longest prompt + output, in tokens (default: the model's, as far as the KV cache holds)")
    p.add_argument("--max-num-seqs", type=int, default=64, metavar="N", help="sequences decoded together (default 64)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="fraction of the device memory for weights, activations and KV cache (default 0.9)")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="the engine's seed: requests without a seed of their own draw their samples from it (default 0)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="'auto' (the KV cache in the compute dtype) or 'fp8' / 'fp8_e4m3' (DeepSeek-V4's FP8 KV records, "
                        "V4 checkpoints on a backend that takes them); vLLM's flag")
    p.add_argument("--no-prefix-caching", action="store_true", help="recompute every prompt (no reuse of cached prefixes)")
    p.add_argument("--num-gpu-blocks-override", "--num-kv-blocks", dest="num_kv_blocks", type=int, default=None, metavar="N",
                   help="the KV cache's size in blocks, instead of what the memory fraction leaves (vLLM's flag; on the CPU "
                        "too); benchmarks shrink it to make the cache evict")
    p.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"],
                   help="'dummy': random weights of the checkpoint's shapes (benchmarks of a config-only checkpoint)")
    p.add_argument("--kv-offload-gb", "--kv-offloading-size", "--hicache-size", type=float, default=0, metavar="GIB",
                   help="GiB of host memory that keep KV blocks evicted from the device, copied back on a prefix hit "
                        "(vLLM's --kv-offloading-size, SGLang's --hicache-size; default 0: off)")
    p.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="a directory that keeps the blocks reaching the host tier, across restarts of the same model "
                        "(needs --kv-offload-gb and --kv-disk-gb)")
    p.add_argument("--kv-disk-gb", type=float, default=None, metavar="GIB", help="the most GiB the --kv-disk-dir tier may fill")
    p.add_argument("--ngram", type=int, default=0, metavar="K", help="speculative decoding: K prompt-lookup draft tokens per step")
    p.add_argument("--mtp", type=int, default=0, metavar="K", help="speculative decoding: K draft tokens per step from the model's MTP module")
    p.add_argument("--batch-invariant", action="store_true",
                   help="bitwise the same output for a prompt whatever batch it runs in (DEEPINFER_BATCH_INVARIANT=1)")
    p.add_argument("--data-parallel-size", type=int, default=None, metavar="N", help=ranks_help)
    p.add_argument("--expert-parallel", action="store_true",
                   help="shard the MoE layers' routed experts over the data-parallel ranks (with EPLB)")
    p.add_argument("--context-parallel-size", type=int, default=1, metavar="C",
                   help="C ranks (dividing the data-parallel size) prefill a long prompt together (DEEPINFER_CP_MIN_TOKENS)")


def build_parser() -> argparse.ArgumentParser:
    from deepinfer_core import __version__

    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer: inference for DeepSeek MoE models.")
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("backends", help="list installed backends, the one selected, and who provides each op")
    p.add_argument("--accelerator", help="backend to select (default: DEEPINFER_ACCELERATOR, else automatic)")
    p.add_argument("--batch-invariant", action="store_true", help="show the backend's batch-invariant op table")
    p.add_argument("--plan", metavar="NAME",
                   help="instead of selecting a backend, show op by op what backend NAME would run on its own hardware "
                        "(and why it leaves an op to the reference), on any machine: nothing is loaded")
    p.set_defaults(func=_backends)
    g = sub.add_parser("generate", help="generate completions for prompts")
    g.add_argument("--model", help="HF checkpoint directory or repo id (default: DEEPINFER_HF_MODEL_DIR or the built-in tiny model)")
    g.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    _engine_arguments(g, "N ranks, one process each with its own engine and share of the prompts (under torchrun: WORLD_SIZE)")
    g.set_defaults(func=_generate)
    v = sub.add_parser("serve", help="serve a model over an OpenAI- and Anthropic-compatible HTTP API")
    v.add_argument("model", nargs="?", default=None,
                   help="HF checkpoint directory or repo id (default: DEEPINFER_HF_MODEL_DIR or the built-in tiny model)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", help="require Authorization: Bearer KEY on every route but /health (also DEEPINFER_API_KEY)")
    v.add_argument("--served-model-name", help="the model name clients send and /v1/models lists (default: MODEL)")
    v.add_argument("--max-tokens", type=int, default=4096, help="the most tokens one request may ask for")
    v.add_argument("--max-n", type=int, default=16, help="the most samples one request may ask for")
    v.add_argument("--max-body-bytes", type=int, default=4 << 20, help="the largest request body accepted")
    v.add_argument("--role", choices=["prefill", "decode"], default=None,
                   help="prefill/decode disaggregation over NIXL: this instance prefills for decode instances, or decodes "
                        "from prefill instances' KV cache; vllm-router --vllm-pd-disaggregation --kv-connector nixl routes "
                        "between them (docs/serving.md)")
    v.add_argument("--kv-transfer-timeout", type=float, default=120.0, metavar="S",
                   help="with --role: seconds a prefill instance keeps blocks no decode instance read, and a decode "
                        "instance waits for a READ (default 120)")
    _engine_arguments(v, "N ranks (processes started here), each with its own engine; each request runs on the least loaded")
    v.set_defaults(func=_serve)
    from deepinfer_core.conformance.ops_suite import DEFAULT_EXAMPLES, DEFAULT_EXPLORE_MAX_ELEMENTS

    c = sub.add_parser("conformance", help="check a backend against the reference ops (or, with --e2e, the platform baselines)",
                       description="Op level (default): every op the backend provides, against the reference on the shapes of "
                       "specs/ops.toml with its tolerances. --e2e: perplexity and greedy tokens on specs/workloads against the "
                       "platform's entry in specs/baselines/offline_decode_ppl.json. Exit status: 0 pass, 1 fail, 2 could not run.")
    c.add_argument("--backend", "--accelerator", dest="backend", help="backend to check (default: DEEPINFER_ACCELERATOR, else automatic)")
    c.add_argument("--ops", help="comma-separated ops to check (default: every op the backend provides)")
    c.add_argument("--dtype", help="comma-separated compute dtypes, e.g. bf16,fp32 (default: every dtype the platform supports); "
                   "with --e2e --refresh: the one dtype to record the workloads in (default: as recorded before)")
    # None = not given (the defaults are filled in later): --replay refuses the search options
    c.add_argument("--examples", type=int, default=None,
                   help=f"hypothesis cases per op and dtype beyond the declared shapes (default {DEFAULT_EXAMPLES}; 0: declared shapes only)")
    c.add_argument("--seed", type=int, default=None,
                   help="seed of hypothesis' search for cases (default: a fixed, derandomised search); not a case's value seed: "
                   "to re-run one failing case use --replay")
    c.add_argument("--explore-max-elements", type=int, default=None,
                   help="hypothesis varies only declared shapes whose inputs hold at most this many elements "
                   f"(default {DEFAULT_EXPLORE_MAX_ELEMENTS}); larger ones run once")
    c.add_argument("--max-elements", type=int, default=None,
                   help="run only the declared shapes whose inputs hold at most this many values (a simulator or an "
                   "interpreter); the report counts the others as not run (default: every declared shape)")
    c.add_argument("--replay", metavar="CASE",
                   help="run exactly one case, the JSON object a failing row of the report prints (op, dtype, dims, value seed), "
                   "on the backend and print its verdict")
    c.add_argument("--batch-invariant", action="store_true",
                   help="op level: check the backend's batch-invariant op table (what LLM(batch_invariant=True) runs)")
    c.add_argument("--json", help="also write the report as JSON to this path")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("--e2e", action="store_true", help="end-to-end: per-sample perplexity and greedy tokens against the platform baseline")
    c.add_argument("--workloads", help="with --e2e: comma-separated workload names (default: all in specs/workloads)")
    c.add_argument("--refresh", action="store_true", help="with --e2e: rewrite this platform's baseline entry (prints the diff)")
    c.add_argument("--check-structured-output", "--check_structured_output", dest="check_structured_output", action="store_true",
                   help="with --e2e: also run the default model under JSON-schema, regex, EBNF, choice and JSON-object "
                   "constraints and check every output")
    c.set_defaults(func=_conformance)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `deepinfer backends | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
