"""The contract between the DeepInfer core and its backends.

A backend is a Python module registered under the entry-point group ``deepinfer.backends``.
The module itself must be cheap to import (no torch_npu, no CUDA initialisation, no kernel
compilation): the core imports every installed backend module to probe it, and loads only the
one it selects. Heavy imports belong inside ``deepinfer_platform`` / ``deepinfer_ops``.

Hooks are called by the core:

* at discovery, for every backend: ``deepinfer_backend`` then ``deepinfer_probe``;
* once at start-up, for the selected backend only: ``deepinfer_platform``, then
  ``deepinfer_ops`` and ``deepinfer_scheduler_limits``;
* once per engine step, for every backend that implements it: ``deepinfer_step_observer``;
* by ``deepinfer backends --plan NAME``, for the named backend whether or not it can run here:
  ``deepinfer_op_plan`` (optional: the op table it would build on its own hardware);
* once per process group, by ``parallel.communicator.communicator_for`` (the expert-parallel layer
  ``parallel.expert_parallel`` uses what it returns): ``deepinfer_communicator``. The engine itself
  runs one process yet, so it never asks.

What each hook returns is checked against this contract when it is called (types and fields of
the returned objects, the signatures of op callables): a mistake is reported naming the plugin,
at discovery (BackendInfo, ProbeResult) or at start-up (the rest).

No other plugin code runs on the hot path except the op callables that ``deepinfer_ops``
returns. A backend that needs a seam that is not here asks for a new hook; it never patches
the core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    from deepinfer_core.models.v3.config import V3ModelConfig
    from deepinfer_core.platform import Platform

PROJECT = "deepinfer"
# Bumped on any incompatible change to a hook's signature or meaning, or to an op's contract
# (an op callable is called by the model: its signature is part of the hook ``deepinfer_ops``).
# A backend declares the range it supports in BackendInfo; the core refuses a backend whose
# range excludes this.
#   1: the first contract.
#   2: ``mla_decode_attention(q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc,
#      scale)`` takes ``query_start_loc`` and several query rows per sequence, causal within a
#      sequence (speculative decoding verifies 1 + k tokens per sequence in one decode step);
#      version 1's took one row per sequence and no ``query_start_loc``. ``sample_tokens`` takes
#      the keyword-only ``host_params`` (CPU copies of its parameters: no device read). Platform
#      gains ``graphs`` (the graph capture/replay object) and ``async_scheduling``.
#   3: ``deepinfer_ops`` takes ``batch_invariant``: when True it must return a batch-invariant
#      table (every op's result for a row independent of the rest of the batch), and
#      ``Platform.batch_invariant`` says whether the backend can (no longer informational). New
#      ops ``head_linear`` (MLA's per-head absorbed projections, which the model computed with
#      torch.einsum) and ``apply_token_bitmask`` (grammar masks); a backend that leaves them out
#      gets the reference's, as for any op. (Later, within 3: the optional op
#      ``norm_rope_write_latent``, which the model calls only where a backend provides it; a
#      core older than it refuses a table that names it as an unknown op. Later still, within 3: the
#      optional hook ``deepinfer_op_plan``, which a core older than it never calls. And ``compress_entries``,
#      DeepSeek-V4's compressor from its window rows to rotated entries in one op, which V4 calls
#      instead of gathering and ``compress_pool`` + ``rotary_embedding`` (V4.1 still calls
#      ``compress_pool``): a backend that leaves it out gets the reference's, as for any op. Later again,
#      within 3: the communicator's optional ``moe_dispatch`` / ``moe_combine`` pair, which a core
#      older than it never calls: it exchanges through ``all_to_all`` as before.)
SPEC_VERSION = 3

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class BackendInfo:
    """What a backend says about itself, before any probing.

    name: the name users select it by (``DEEPINFER_ACCELERATOR=name``); must equal the
        entry-point name.
    priority: automatic selection picks the available backend with the highest priority;
        between equal priorities the reference backend wins, then the name that sorts first.
    min_spec_version / max_spec_version: the hookspec versions this backend implements. The
        defaults (1..1) describe a backend written before versions were bumped; one written for
        this core declares ``SPEC_VERSION`` (2) explicitly.
    aliases: other names that select it (the reference backend answers to ``cpu``). A name or
        alias that two backends claim makes both broken; ``reference``, ``cpu`` and ``auto``
        are reserved (the core's reference backend, automatic selection).
    required_ops: ops this backend must provide itself; if its op table lacks one, start-up
        fails instead of falling back to the reference implementation.
    description: one line for ``deepinfer backends``.
    """

    name: str
    priority: int
    min_spec_version: int = 1
    max_spec_version: int = 1
    aliases: tuple[str, ...] = ()
    required_ops: frozenset[str] = frozenset()
    description: str = ""


@dataclass(frozen=True)
class ProbeResult:
    """Whether a backend could run on this machine, from cheap checks only.

    available: True when the backend could be loaded here.
    reason: when unavailable, what is missing (e.g. "no CUDA device visible").
    fix: when unavailable, what the user can do about it.
    detail: when available, what was found (e.g. "NVIDIA H200, sm_90").
    """

    available: bool
    reason: str = ""
    fix: str = ""
    detail: str = ""


@dataclass(frozen=True)
class SchedulerLimits:
    """Limits a backend imposes on or suggests to the scheduler.

    Any field left ``None`` keeps the engine's default.
    max_num_batched_tokens: the most tokens one step may carry (prefill chunk budget): the
        budget when the user chose none, a cap on the user's choice otherwise. Choose it from
        measurement (prefill tokens/s against the budget on the platform).
    max_num_seqs: the most sequences one step may carry.
    graph_batch_sizes: decode batch sizes the runner captures as graphs (sorted ascending);
        decode batches are padded up to the next size, larger ones run eagerly.
    block_size: the KV cache block size (tokens) the backend's attention kernels want, taken when
        the user chose none and it is a multiple of the model's own default (else the default).
    """

    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    graph_batch_sizes: tuple[int, ...] | None = None
    block_size: int | None = None


@dataclass(frozen=True)
class OpPlan:
    """What a backend's op table holds on its own hardware, said without loading anything
    (``deepinfer_op_plan``; ``deepinfer backends --plan NAME`` prints it on any machine).

    provides: {op name: what implements it there} for the ops ``deepinfer_ops`` returns there
        (one line each, like an op callable's ``impl``: "torch_npu.npu_rms_norm", with the cases
        it hands back to the reference, if any);
    left_out: {op name: why the backend leaves it to the reference} for the others.
    An op named in neither is shown as a fallback with no reason given.
    """

    provides: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)


@dataclass
class StepStats:
    """What one engine step did; passed to ``deepinfer_step_observer`` once its tokens reached
    the host (in overlapped mode one step after it was launched).

    num_decode_tokens counts every token of the decode rows (drafts included); num_cached_tokens:
    prompt tokens that sequences admitted in this step took from the prefix cache;
    num_draft_tokens / num_accepted_tokens: drafts verified / accepted (speculative decoding),
    drafts_by_position / accepted_by_position the same counts by draft position;
    seconds: from the step's launch to its tokens being processed. ``extra["eplb"]``, on the step
    after experts were re-placed (data parallelism with expert_parallel): the imbalance (busiest
    rank's routed tokens / the mean) under the old and the new placement, and the slots moved.
    """

    step: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_preempted: int
    free_kv_blocks: int
    seconds: float
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafts_by_position: list[int] = field(default_factory=list)  # drafts verified, by draft position (0 = first)
    accepted_by_position: list[int] = field(default_factory=list)  # of those, accepted
    extra: dict[str, Any] = field(default_factory=dict)


class BackendSpec:
    """Hook specifications. Each docstring is the contract of that hook."""

    @hookspec(firstresult=True)
    def deepinfer_backend(self) -> BackendInfo:
        """Return this backend's BackendInfo. Called at discovery; must not import heavy modules."""

    @hookspec(firstresult=True)
    def deepinfer_probe(self) -> ProbeResult:
        """Say whether this backend can run here, from cheap checks.

        Called at discovery for every installed backend, selected or not. Must not raise for an
        ordinary "not here" (return ``ProbeResult(False, reason, fix)`` instead) and must not
        import modules that can break the process (``torch_npu`` without CANN breaks
        ``import torch``). An exception is reported as a broken plugin, naming it.
        """

    @hookspec(firstresult=True)
    def deepinfer_platform(self) -> Platform:
        """Return the Platform object for this machine (device, capabilities, memory query).

        Called once, only for the selected backend, after a successful probe. May import the
        backend's heavy dependencies. Raise with a clear message if loading fails.
        """

    @hookspec(firstresult=True)
    def deepinfer_ops(self, platform: Platform, model_config: V3ModelConfig | None, batch_invariant: bool) -> dict[str, Callable]:
        """Return ``{op_name: callable}`` for the ops this backend implements.

        Called once at start-up, for the selected backend. Each callable must follow the
        contract of the op of that name in ``deepinfer_core.ops`` (signature, shapes, dtypes,
        in-place behaviour) and match the reference within ``specs/ops.toml``. Ops left out come
        from the reference backend and are reported by ``deepinfer backends``. ``model_config``
        is ``None`` when the table is built without a model (e.g. for conformance checks); a
        backend may use it to choose kernels for the model's shapes. Unknown op names are an
        error.

        ``batch_invariant`` (asked for only when ``Platform.batch_invariant`` is True): every op's
        result for a row (a token; a query row of ``mla_decode_attention``; a sampled row) must be
        bitwise the same whatever else is in the call and however many rows it has, CUDA-graph
        padding included: no kernel choice, tile, split of a reduction (split-K, split-KV) or
        summation order taken from the number of rows. ``mla_decode_attention`` must also give a
        row the same bits whatever query length its sequence has in the call: a batch-invariant
        engine computes prompt tokens through it, as rows as long as the prompt chunk (so a
        prompt token, a token recomputed after a preemption and a decoded token go through the
        same arithmetic); ``mla_prefill_attention`` is not called then. Ops left out come from
        the reference's batch-invariant table (``deepinfer_core.ops.invariant``).
        """

    @hookspec(firstresult=True)
    def deepinfer_op_plan(self) -> OpPlan:
        """Return the OpPlan of this backend: op by op, what its ``deepinfer_ops`` would return on
        its own hardware and why it leaves the rest to the reference. Optional.

        Called by ``deepinfer backends --plan NAME`` for the named backend, whether or not its
        probe found the hardware (it is how a machine without the chip shows what the backend
        would run), so it follows the probe's rules: cheap, no heavy imports (no ``torch_npu``,
        no CUDA initialisation), and it must not raise for an ordinary "not here".
        """

    @hookspec(firstresult=True)
    def deepinfer_communicator(self, platform: Platform, group: Any) -> Any:
        """Return a communicator for ``group`` (all_reduce, all_gather, reduce_scatter,
        all_to_all / MoE dispatch-combine, broadcast, barrier), or ``None`` to use the core's
        torch.distributed one (``parallel.communicator.TorchCommunicator``, whose methods are the
        interface; ``all_to_all_start``, the non-blocking exchange the shared expert overlaps
        with, is optional). Also optional, as a pair: ``moe_dispatch(x, topk_weights, topk_ids,
        slots, num_slots)`` and ``moe_combine(y, dispatched)``, a fused MoE dispatch-combine (a
        vendor operator) that the expert-parallel layer uses instead of its ``all_to_all``
        exchange for each call the communicator takes; ``moe_dispatch`` returns ``None`` to
        decline a call, on every rank of the group alike (the contract:
        ``parallel.communicator.Dispatched``). Called once per process group of a data-parallel
        LLM (the expert- and context-parallel groups), through
        ``parallel.communicator.communicator_for``.
        """

    @hookspec(firstresult=True)
    def deepinfer_scheduler_limits(self, platform: Platform, model_config: V3ModelConfig) -> SchedulerLimits | None:
        """Return SchedulerLimits for this platform and model, or ``None`` for the defaults.
        Called once at start-up, for the selected backend.
        """

    @hookspec
    def deepinfer_step_observer(self, stats: StepStats) -> None:
        """Observe one finished engine step (metrics, profiling). Called after every step for
        every registered plugin that implements it; must be cheap and must not raise. One that
        raises is logged once, naming its plugin, and not called again in that engine.
        """
