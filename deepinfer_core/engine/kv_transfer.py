"""Prefill/decode disaggregation: a request's KV cache moves from a prefill instance to a decode
instance through NIXL (``nixl`` on PyPI: UCX over TCP or shared memory between CPU processes,
CUDA memory between GPUs), in vLLM's ``kv_transfer_params`` protocol, so that vLLM's router
(``vllm-router --vllm-pd-disaggregation --kv-connector nixl``) drives a pair of our servers.

The two hops (docs/serving.md, "Prefill/decode disaggregation"):

1. The router sends the request to the prefill instance (``kv_role="prefill"``) with
   ``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``. The prefill engine
   computes the prompt **but its last token** (``prefill_params``: one greedy sample, which is
   dropped), then parks the sequence instead of freeing it: every cache group's blocks (paged
   blocks, the ring, the state slot) stay as they are, and the response's ``kv_transfer_params``
   say where they are (``Parked.params``: this agent's NIXL metadata, every cache layer's base
   address, the blocks, how many tokens they hold and a hash of those tokens, the cache layout's
   identity).
2. The router sends the request, with those ``kv_transfer_params``, to the decode instance
   (``kv_role="decode"``). Its scheduler admits the sequence only when blocks for those tokens
   are free: it takes them and one NIXL READ copies the prefill's bytes into them
   (``KVTransfer.receive``); when the READ is done the sequence joins the running ones with those
   tokens computed, and its next step computes the prompt's last token and samples the first
   output token there: logprobs, stops, grammars and seeds as in one engine. NIXL tells the
   prefill agent when the READ is over (its notification), and the prefill frees the parked
   blocks (cached: a later prompt with that prefix finds them).

The prefill computes all but the last prompt token so that nothing is computed twice: ring and
state groups (V4's window and compressor state) cannot recompute a position they already hold.

Failures end the request, never an instance: a READ that fails (the prefill instance died) or
takes longer than ``timeout_s`` ends the request on the decode side with ``Request.error``
(``KVTransferError`` through the server: a 502); blocks a READ may still write into are held until
NIXL lets the READ go. Parked blocks nobody reads within ``timeout_s`` are freed by the prefill
instance; a decode instance that could not start its READ within half that time (it had no free
blocks) refuses the request rather than read blocks that may be reused.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from deepinfer_core.config import ConfigError
from deepinfer_core.engine.kv_cache import KVCache
from deepinfer_core.engine.kv_tiers import block_spans, model_identity
from deepinfer_core.engine.sequence import Sequence

log = logging.getLogger("deepinfer")

ROLES = ("prefill", "decode")
PROTOCOL = 1  # bumped whenever what the prefill's kv_transfer_params say changes meaning
RELEASE = b"deepinfer-release:"  # NIXL notification prefix: the READ of a parked sequence is over


class KVTransferError(RuntimeError):
    """A request's KV cache could not be brought from its prefill instance."""


NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")  # the meta-package's, then the wheels' own


def nixl_api():
    """NIXL's Python API module: through the ``nixl`` meta-package where it is installed, else
    straight from the ``nixl-cu13`` or ``nixl-cu12`` wheel (the ``pd`` extra installs nixl-cu12
    alone: the meta-package pulls both and a CUDA build of torch). None when none imports."""
    import importlib

    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def _nixl():
    """NIXL's agent classes; ConfigError naming the fix when no NIXL wheel imports."""
    api = nixl_api()
    if api is None:
        raise ConfigError(
            "kv_role (--role) needs NIXL, and none of nixl, nixl-cu13, nixl-cu12 imports here: pip install 'deepinfer[pd]' "
            "(nixl-cu12), or the NIXL wheel for your CUDA (nixl-cu13 for CUDA 13)")
    return api.nixl_agent, api.nixl_agent_config


def tokens_hash(token_ids: list[int]) -> str:
    """What both instances compute of the tokens whose KV moves: a prompt tokenised differently
    (another tokenizer, chat template) is refused instead of decoded from the wrong cache."""
    return hashlib.blake2b(json.dumps(token_ids).encode(), digest_size=16).hexdigest()


def rows_per_block(group, block_size: int, t: torch.Tensor) -> int:
    """Rows of one table entry of ``group``: a paged block, a ring block, a state slot."""
    if group.kind == "paged":
        return block_size // group.tokens_per_entry
    if group.kind == "ring":
        return KVCache.ring_block(group, block_size)
    return t.shape[1]


def merge(pairs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(local address, remote address, bytes) copies, those that continue the one before on both
    sides joined into one."""
    out: list[list[int]] = []
    for lo, ro, n in pairs:
        if out and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == ro:
            out[-1][2] += n
        else:
            out.append([lo, ro, n])
    return [tuple(p) for p in out]


def layout_identity(engine, model_dir) -> str:
    """What both instances must share for one's bytes to mean the same in the other: the model
    (type, config, weights' identity, dtype), the block size, and per cache group its kind,
    layers, row format and rows per table entry (not the pool sizes: those may differ)."""
    ident = model_identity(engine, model_dir)
    ident["groups"] = []
    for g in engine.cache_groups:
        t = engine.kv_cache.tensors[g.layers[0]]
        ident["groups"].append({"name": g.name, "kind": g.kind, "layers": list(g.layers), "row": [t.shape[-1], str(t.dtype)],
                                "rows": rows_per_block(g, engine.kv.block_size, t), "entries": engine.kv.rings.get(g.name, 1)})
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


class RemoteKV(BaseModel):
    """The prefill instance's ``kv_transfer_params``, as the decode instance gets them back."""

    model_config = ConfigDict(extra="ignore", strict=True)

    do_remote_prefill: bool
    deepinfer_protocol: int
    remote_engine_id: str
    remote_agent_metadata: str  # base64
    remote_layout: str
    remote_memory: str  # NIXL memory type of the prefill's cache: DRAM or VRAM
    remote_bases: dict[str, list[int]]  # layer -> [address, device id]
    remote_block_ids: dict[str, list[int]]  # cache group -> table entries
    remote_num_tokens: int
    remote_tokens_hash: str
    transfer_id: str
    timeout_s: float


def parse_remote(params: dict, label: str) -> RemoteKV:
    """The decode side's check of ``kv_transfer_params``; ValueError naming what is wrong."""
    try:
        remote = RemoteKV.model_validate(params)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:3])
        raise ValueError(f"{label}: kv_transfer_params are not a DeepInfer prefill instance's ({problems}); send the "
                         "prefill response's kv_transfer_params unchanged") from None
    if remote.deepinfer_protocol != PROTOCOL:
        raise ValueError(f"{label}: the prefill instance speaks KV transfer protocol {remote.deepinfer_protocol}, this one "
                         f"{PROTOCOL}; run the same DeepInfer version on both")
    return remote


@dataclass(eq=False)
class Receiving:
    """A READ in flight into ``seq``'s blocks."""

    seq: Sequence
    handle: object | None
    agent: str
    transfer_id: str
    deadline: float
    failure: str | None = None
    device_done: object | None = None  # on a GPU: an event after the steps queued when the blocks were taken
    posted: bool = False
    nothing: bool = False  # every block it needs is cached here: no READ


@dataclass
class Polled:
    """What changed since the last poll: sequences whose blocks arrived, sequences whose READ
    failed (with why), and sequences whose blocks nobody uses any more (to free)."""

    received: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)
    freed: list[Sequence] = field(default_factory=list)


class KVTransfer:
    """One engine's NIXL agent over every tensor of its KV cache, and the sequences it parks
    (prefill) or receives (decode)."""

    def __init__(self, engine, model_dir, role: str, timeout_s: float):
        if role not in ROLES:
            raise ConfigError(f"kv_role {role!r}: one of {', '.join(ROLES)}")
        self.role, self.timeout_s = role, timeout_s
        self.block_size = engine.kv.block_size
        self.groups = engine.cache_groups
        self.tensors = engine.kv_cache.tensors
        self.layout = layout_identity(engine, model_dir)
        tensors = list(self.tensors.values())
        self.memory = "DRAM" if tensors[0].device.type == "cpu" else "VRAM"
        self.device_id = max(tensors[0].get_device(), 0)
        self.agent = None
        self._start_agent()
        self.parked: dict[str, tuple[Sequence, float]] = {}  # transfer id -> (sequence, when it is freed anyway)
        self.receiving: dict[Sequence, Receiving] = {}
        self.abandoned: list[Receiving] = []  # READs whose request ended, still to let go of their blocks
        self.held: set[Sequence] = set()  # the sequences above: their blocks are not to be freed yet
        log.info("KV transfer (%s): NIXL agent %s over %d cache tensors (%s)", role, self.name, len(tensors), self.memory)

    def _start_agent(self) -> None:
        """A NIXL agent of a new name over every cache tensor; its metadata is what parked
        sequences' kv_transfer_params carry."""
        nixl_agent, nixl_agent_config = _nixl()
        self.name = f"deepinfer-{self.role}-{uuid.uuid4().hex[:12]}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
        self.registered = self.agent.register_memory(list(self.tensors.values()))
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self.remote_agents: dict[str, str] = {}  # engine id -> NIXL agent name

    def _stop_agent(self) -> None:
        """Deregister the cache and drop the agent: READs that name it fail from now on."""
        try:
            self.agent.deregister_memory(self.registered)
        except Exception:  # noqa: BLE001 - the agent goes anyway
            log.warning("KV transfer: deregistering the cache from NIXL failed", exc_info=True)
        self.agent = None

    # ---- prefill side ----------------------------------------------------------------------------
    def park(self, seq: Sequence, token_ids: list[int]) -> dict:
        """Keep ``seq``'s blocks (which hold ``token_ids``) for a decode instance to read; the
        ``kv_transfer_params`` that say where they are."""
        tid = uuid.uuid4().hex
        self.parked[tid] = (seq, time.monotonic() + self.timeout_s)
        self.held.add(seq)
        bases = {layer: [t.data_ptr(), self.device_id] for layer, t in self.tensors.items()}
        return {"do_remote_prefill": True, "do_remote_decode": False, "deepinfer_protocol": PROTOCOL,
                "remote_engine_id": self.name, "remote_agent_metadata": self.metadata, "remote_layout": self.layout,
                "remote_memory": self.memory, "remote_bases": bases,
                "remote_block_ids": {name: list(blocks) for name, blocks in seq.block_tables.items()},
                "remote_num_tokens": len(token_ids), "remote_tokens_hash": tokens_hash(token_ids), "transfer_id": tid,
                "timeout_s": self.timeout_s, "remote_host": None, "remote_port": None}

    # ---- decode side -----------------------------------------------------------------------------
    def check(self, remote: RemoteKV, token_ids: list[int], label: str) -> None:
        """ValueError unless ``remote`` can fill this engine's cache for ``token_ids``."""
        if remote.remote_layout != self.layout:
            raise ValueError(f"{label}: the prefill instance runs another model or KV cache layout than this decode instance "
                             "(model, dtype, --kv-cache-dtype, block size and speculative settings must match)")
        if remote.remote_num_tokens != len(token_ids) or remote.remote_tokens_hash != tokens_hash(token_ids):
            raise ValueError(f"{label}: the prefill instance computed other tokens than this prompt's ({remote.remote_num_tokens} "
                             f"against {len(token_ids)}); send both instances the same request")

    def receive(self, seq: Sequence, cached: int = 0) -> None:
        """Start the READ of ``seq.remote``'s blocks into ``seq``'s (just allocated; its first
        ``cached`` paged blocks are this pool's own cached ones, not read); its outcome comes from
        ``poll``."""
        remote, waited = seq.remote, time.monotonic() - seq.remote_since
        # the READ ends before the prefill instance frees the blocks (its timeout runs from its answer,
        # about when the request arrived here): counted from the arrival, not from the READ's start
        r = Receiving(seq, None, "", remote.transfer_id, seq.remote_since + remote.timeout_s * 0.9)
        self.receiving[seq] = r
        self.held.add(seq)
        try:
            if waited > remote.timeout_s / 2:
                raise KVTransferError(f"the request waited {waited:.0f} s for free KV blocks here; the "
                                      f"prefill instance keeps its blocks {remote.timeout_s:.0f} s (--kv-transfer-timeout)")
            r.agent = self._agent(remote)
            pairs = []
            for g in self.groups:
                mine, theirs = seq.block_tables.get(g.name, []), remote.remote_block_ids.get(g.name)
                if theirs is None or (g.kind != "paged" and len(theirs) != len(mine)) or len(theirs) < len(mine):
                    raise KVTransferError(f"the prefill instance's cache group {g.name!r} has {theirs and len(theirs)} "
                                          f"entries for this sequence, this instance {len(mine)}")
                skip = cached if g.kind == "paged" else 0
                for layer in g.layers:
                    t, (base, _) = self.tensors[layer], remote.remote_bases[layer]
                    rows = rows_per_block(g, self.block_size, t)
                    for lb, rb in zip(mine[skip:], theirs[skip:]):
                        for (lo, n), (ro, _) in zip(block_spans(t, rows, lb), block_spans(t, rows, rb)):
                            pairs.append((t.data_ptr() + lo, base + ro, n))
            pairs = merge(pairs)
            if not pairs:
                r.nothing = True
                return
            rdev = next(iter(remote.remote_bases.values()))[1]
            local = self.agent.get_xfer_descs([(a, n, self.device_id) for a, _, n in pairs], self.memory)
            theirs = self.agent.get_xfer_descs([(b, n, rdev) for _, b, n in pairs], remote.remote_memory)
            r.handle = self.agent.initialize_xfer("READ", local, theirs, r.agent, RELEASE + remote.transfer_id.encode())
            if self.memory == "VRAM":
                # a step still queued on the device may write the blocks just taken (a finished sequence's
                # last row, in overlapped scheduling): the READ is posted once the device is past it
                r.device_done = torch.cuda.Event()
                r.device_done.record()
            self._post(r)
        except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
            r.failure = f"{type(e).__name__}: {e}" if not isinstance(e, KVTransferError) else str(e)

    def _post(self, r: Receiving) -> None:
        """Post ``r``'s READ once nothing queued on the device before it can still write its blocks."""
        if r.posted or (r.device_done is not None and not r.device_done.query()):
            return
        r.posted = True
        if self.agent.transfer(r.handle) == "ERR":
            raise KVTransferError("NIXL could not start the READ")

    def _agent(self, remote: RemoteKV) -> str:
        name = self.remote_agents.get(remote.remote_engine_id)
        if name is None:
            name = self.agent.add_remote_agent(base64.b64decode(remote.remote_agent_metadata))
            self.remote_agents[remote.remote_engine_id] = name
        return name

    def abandon(self, seq: Sequence) -> None:
        """``seq``'s request ended while its READ runs: its blocks are freed once NIXL lets go."""
        r = self.receiving.pop(seq)
        self.abandoned.append(r)

    def holds(self, seq: Sequence) -> bool:
        """Whether ``seq``'s blocks must not be freed yet (parked, or a READ may write them)."""
        return seq in self.held

    @property
    def busy(self) -> bool:
        """Blocks are held for a transfer: a step with nothing to run waits for it."""
        return bool(self.parked or self.receiving or self.abandoned)

    # ---- both ----------------------------------------------------------------------------------
    def _state(self, r: Receiving, post: bool = True) -> str:
        """"DONE", "PROC" or "ERR" of ``r``'s READ (``post``: posted first if it may be now; an
        abandoned READ never posted is over)."""
        if r.nothing and r.failure is None:
            return "DONE"
        if r.failure is not None or r.handle is None:
            return "ERR"
        try:
            if post:
                self._post(r)
            if not r.posted:
                return "PROC" if post else "ERR"
            return self.agent.check_xfer_state(r.handle)
        except Exception as e:  # noqa: BLE001 - NIXL raises for a peer that went away
            r.failure = f"{type(e).__name__}: {e}"
            return "ERR"

    def _release(self, r: Receiving) -> bool:
        """Let go of ``r``'s READ (cancelled if still running); False while NIXL cannot yet."""
        if r.handle is not None:
            try:
                self.agent.release_xfer_handle(r.handle)
            except Exception:  # noqa: BLE001 - still running and not cancellable: try again at the next poll
                return False
            r.handle = None
        return True

    def _tell_prefill(self, r: Receiving) -> None:
        """Tell the prefill instance its parked blocks are free to go (a READ that completes tells it itself)."""
        if r.agent:
            try:
                self.agent.send_notif(r.agent, RELEASE + r.transfer_id.encode())
            except Exception:  # noqa: BLE001 - the prefill instance is gone, or frees them at its timeout
                pass

    def poll(self) -> Polled:
        out, now = Polled(), time.monotonic()
        for seq, r in list(self.receiving.items()):
            state = self._state(r)
            if state == "PROC" and now > r.deadline:
                state, r.failure = "ERR", (f"the READ did not end in time: the prefill instance keeps the blocks "
                                           f"{seq.remote.timeout_s:.0f} s after its answer (--kv-transfer-timeout)")
            if state == "PROC":
                continue
            del self.receiving[seq]
            if state == "DONE":
                self._release(r)
                if r.nothing:  # no READ tells the prefill instance
                    self._tell_prefill(r)
                self.held.discard(seq)
                out.received.append(seq)
                continue
            self._tell_prefill(r)
            out.failed.append((seq, r.failure or "NIXL reported an error"))
            if self._release(r):
                self.held.discard(seq)
            else:
                self.abandoned.append(r)  # failed for the request; the blocks stay held until NIXL lets go
        for r in list(self.abandoned):
            if self._state(r, post=False) != "PROC" and self._release(r):
                self._tell_prefill(r)
                self.abandoned.remove(r)
                self._free(r.seq, out)
        if self.parked:
            for msgs in self.agent.get_new_notifs().values():
                for msg in msgs:
                    if msg.startswith(RELEASE):
                        seq, _ = self.parked.pop(msg[len(RELEASE):].decode(), (None, 0))
                        if seq is not None:
                            self._free(seq, out)
            for tid, (seq, deadline) in list(self.parked.items()):
                if now > deadline:
                    log.warning("KV transfer: no decode instance read the blocks of request %s within %.0f s; freed",
                                seq.request_id, self.timeout_s)
                    del self.parked[tid]
                    self._free(seq, out)
        return out

    def _free(self, seq: Sequence, out: Polled) -> None:
        self.held.discard(seq)
        out.freed.append(seq)

    def reset(self) -> None:
        """Every block pool is being reset (an engine error, an interrupted generate): let go of
        the READs and forget parked sequences. Their blocks will be reused, so a prefill instance
        that had any restarts its agent under a new name: a decode instance still holding their
        kv_transfer_params gets a failed READ (its request ends with an error), never another
        request's bytes."""
        for r in list(self.receiving.values()) + self.abandoned:
            if not self._release(r):
                log.warning("KV transfer: a READ NIXL cannot cancel may still write into blocks of the reset pool")
            self._tell_prefill(r)
        self.receiving.clear()
        self.abandoned.clear()
        if self.parked:
            self._stop_agent()
            self._start_agent()
            log.warning("KV transfer: %d parked sequences dropped with the pool; NIXL agent restarted as %s",
                        len(self.parked), self.name)
        self.parked.clear()
        self.held.clear()

    def close(self) -> None:
        """Let go of every transfer and deregister the cache (``LLM.close``)."""
        if self.agent is not None:
            self.parked.clear()  # no restart: the agent goes
            self.reset()
            self._stop_agent()
