"""The lower tiers of the prefix cache: full paged blocks evicted from the device's pool go to a
host-memory tier (pinned where the device is an accelerator) and from there to an optional disk
tier (``kv_disk.DiskTier``), keyed by the same chain hashes; a later sequence whose prefix a lower
tier holds has those blocks copied back into the pool instead of recomputed.

A block's bytes in a lower tier are every paged group's layers' rows of that block, group after
group, layer after layer (``block_views``: FP8 record caches by row, as ``ops/kv_record.py`` lays
them out in pages), so any layout the pool has round-trips bit for bit. Ring and state groups are
not tiered: they are rebuilt by bounded replay, as after any prefix hit.

Copies between the device and the host run on a stream of their own, from and into pinned
memory, without the host waiting. They overlap the step in flight: the scheduler takes blocks
(``KVCacheManager.allocate``, ``load_from_tiers``) while the device still runs the step launched
before, and a block that step does not use (one freed before it was launched) is copied at once.
A block freed since (``BlockPool.recent``: a finished sequence's, which the step in flight may
still write) is copied after that step. Work queued on the device after the blocks were taken
waits for the copies (``join``): an evicted block is copied out before the step that overwrites
it, a loaded block copied in before the step that reads it. ``end_round`` (once per scheduled
step) records an event after them. Disk writes (every block that reaches the host tier is written
through) and disk reads run on one I/O thread that waits for that event first; a sequence whose
prefix is being read from disk waits for it (``fetch``), the others run meanwhile. On the CPU the
copies are plain synchronous ones.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer_core.config import ConfigError
from deepinfer_core.engine.kv_cache import KVCache
from deepinfer_core.engine.kv_disk import HEADER, DiskTier
from deepinfer_core.models.batch import CacheGroup
from deepinfer_core.ops.kv_record import (
    DATA_BYTES,
    PAGE_BYTES,
    PAGE_ROWS,
    SCALE_BYTES,
    SCALE_PLANE,
    is_record_cache,
    planes,
)

log = logging.getLogger("deepinfer")


def block_spans(t: torch.Tensor, rows: int, block: int) -> list[tuple[int, int]]:
    """(byte offset from ``t``'s start, bytes) of table entry ``block`` (``rows`` rows) of one
    layer's cache tensor: the entry itself, or for an FP8 record cache its rows' data then their
    scales, which sit in the data and scale planes of the pages the rows fall in
    (``ops/kv_record.py``). Computed, not sliced: a prefill/decode transfer applies them to the
    other instance's block numbers, which may lie beyond this tensor (``kv_transfer``)."""
    if not is_record_cache(t):
        return [(block * t.stride(0) * t.element_size(), rows * t.shape[-1] * t.element_size())]
    data, scales, r, end = [], [], block * rows, (block + 1) * rows
    while r < end:
        page, slot = divmod(r, PAGE_ROWS)
        n = min(PAGE_ROWS - slot, end - r)
        data.append((page * PAGE_BYTES + slot * DATA_BYTES, n * DATA_BYTES))
        scales.append((page * PAGE_BYTES + SCALE_PLANE + slot * SCALE_BYTES, n * SCALE_BYTES))
        r += n
    return data + scales


def block_views(t: torch.Tensor, rows: int, block: int) -> list[torch.Tensor]:
    """The bytes of block ``block`` of a (contiguous) cache tensor as uint8 views, span by span
    (``block_spans``)."""
    if is_record_cache(t):
        planes(t)  # its check: a contiguous record cache of whole pages
    flat = t.view(torch.uint8).reshape(-1)
    return [flat[at : at + n] for at, n in block_spans(t, rows, block)]


def block_bytes(groups: list[CacheGroup], block_size: int) -> int:
    """Bytes of one block of every paged group: what a lower tier holds per block."""
    return sum(len(g.layers) * (block_size // g.tokens_per_entry) * g.entry_bytes for g in groups if g.kind == "paged")


class IOThread:
    """One daemon thread that runs jobs in the order given (disk writes, reads, deletes). Unlike a
    ThreadPoolExecutor's, it still takes jobs while the interpreter exits, when ``LLM.close``
    writes the blocks the device still caches."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="deepinfer-kv-disk", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            future, fn, args = job
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the job
                future.set_exception(e)

    def submit(self, fn, *args) -> Future:
        future = Future()
        self.jobs.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Run the jobs queued so far, then stop."""
        self.jobs.put(None)
        self.thread.join()


@dataclass(eq=False)
class HostEntry:
    """One block in the host tier: its slot, the paged groups copied into it so far, the event
    after the last device copy that used the slot, and the I/O job that reads the slot (a disk
    write) or fills it (a disk read: ``reading``)."""

    slot: int
    groups: set[str] = field(default_factory=set)
    event: object | None = None
    job: Future | None = None
    reading: bool = False


class KVTiers:
    """The host tier (``host_blocks`` slots, LRU by chain hash) over ``cache``'s paged groups, and
    the disk tier below it (``disk``, or None)."""

    def __init__(self, cache: KVCache, block_size: int, host_blocks: int, device: torch.device, disk: DiskTier | None = None):
        self.paged = [g for g in cache.groups if g.kind == "paged"]
        self.layers = {g.name: [cache.tensors[name] for name in g.layers] for g in self.paged}
        self.rows = {g.name: block_size // g.tokens_per_entry for g in self.paged}
        self.offsets, offset = {}, 0
        for g in self.paged:
            self.offsets[g.name] = offset
            offset += len(g.layers) * self.rows[g.name] * g.entry_bytes
        self.block_bytes = offset
        self.device = device
        self.async_copies = device.type != "cpu"
        self.host = torch.empty((host_blocks, self.block_bytes), dtype=torch.uint8, pin_memory=self.async_copies)
        self.free_slots = list(range(host_blocks - 1, -1, -1))
        self.entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # least recently used first
        self.keep: set[bytes] = set()  # entries sequences admitted (or waiting for disk) this round will copy from: not evicted
        self.touched: list[HostEntry] = []  # entries a device copy used since the last end_round
        self.unwritten: list[bytes] = []  # complete entries to write to disk once their copies landed
        self.disk = disk
        self.io = IOThread() if disk is not None else None
        # the device's torch module (torch.cuda, torch.npu: its Stream, stream() and current_stream, as
        # platform.GraphBackend uses them) and the copies' own stream on it
        self.streams = getattr(torch, device.type) if self.async_copies else None
        self.stream = self.streams.Stream(device) if self.async_copies else None
        self.before_step = None  # on the compute stream, before the step in flight was launched
        self.queued = False  # copies queued on self.stream that the compute stream does not wait for yet
        self.after_step = False  # self.stream already waits for everything queued on the compute stream

    @property
    def host_blocks(self) -> int:
        return self.host.shape[0]

    # ---- device <-> host ---------------------------------------------------------------------------
    def _copy(self, group: str, block: int, slot: int, to_host: bool, recent: bool) -> None:
        """Queue the copy of block ``block`` of ``group`` to (or from) host slot ``slot``; ``recent``:
        the step in flight may still use the block, so the copy waits for it."""
        if self.stream is None:
            self._copy_views(group, block, slot, to_host)
            return
        if not self.queued:
            self.queued = True
            if self.before_step is not None and not self.after_step:
                self.stream.wait_event(self.before_step)
        if recent and not self.after_step:
            self.after_device()
        with self.streams.stream(self.stream):
            self._copy_views(group, block, slot, to_host)

    def _copy_views(self, group: str, block: int, slot: int, to_host: bool) -> None:
        at = self.offsets[group]
        for t in self.layers[group]:
            for view in block_views(t, self.rows[group], block):
                host = self.host[slot, at : at + view.numel()]
                (host if to_host else view).copy_(view if to_host else host, non_blocking=self.async_copies)
                at += view.numel()

    def launching(self) -> None:
        """A step is about to be launched on the compute stream: copies queued from now on, of
        blocks it does not use, wait only for the work queued before it."""
        if self.stream is not None:
            self.before_step = self.streams.current_stream(self.device).record_event()
        self.after_step = False

    def after_device(self) -> None:
        """Copies queued from now on wait for everything queued on the compute stream so far (after
        a reset, a dropped step may still use any block)."""
        if self.stream is not None:
            self.stream.wait_stream(self.streams.current_stream(self.device))
        self.after_step = True

    def join(self) -> None:
        """Work queued on the compute stream from now on waits for the copies queued so far."""
        if self.queued:
            self.streams.current_stream(self.device).wait_stream(self.stream)
            self.queued = False

    def offload(self, group: str, block: int, h: bytes, recent: bool) -> None:
        """Block ``block`` of paged group ``group``, holding the entries of chain hash ``h``, is
        being evicted from the pool: copy it to the host tier (nothing when the host has it);
        ``recent``: the step in flight may still use the block."""
        e = self.entries.get(h)
        if e is None:
            slot = self._free_slot()
            if slot is None:  # every slot is being filled from disk: the block is dropped
                return
            e = self.entries[h] = HostEntry(slot[0])
        elif e.reading:  # the same bytes are on their way from disk
            return
        self.entries.move_to_end(h)
        if group in e.groups:
            return
        self._copy(group, block, e.slot, True, recent)
        e.groups.add(group)
        self.touched.append(e)
        if len(e.groups) == len(self.paged) and self.disk is not None and h not in self.disk.index:
            self.unwritten.append(h)

    def load(self, group: str, h: bytes, block: int, recent: bool) -> None:
        """Copy the host tier's entries of ``h`` for ``group`` into the pool's block ``block``
        (``recent``: the step in flight may still use it)."""
        e = self.entries[h]
        self.entries.move_to_end(h)
        self._copy(group, block, e.slot, False, recent)
        self.touched.append(e)

    def tier_of(self, h: bytes, groups: list[str]) -> str | None:
        """Which lower tier can give ``groups``' entries of ``h``: "host", "disk" (on disk, or
        being read from it) or None."""
        e = self.entries.get(h)
        if e is not None and not e.reading and e.groups.issuperset(groups):
            return "host"
        return "disk" if self.disk is not None and h in self.disk.index else None

    def _free_slot(self) -> tuple[int, object | None] | None:
        """A host slot to fill, evicting the least recently used entry not in use if none is free
        (waiting for its disk write); with the event after the last device copy from it. None
        when every entry is being read from disk or about to be loaded."""
        if self.free_slots:
            return self.free_slots.pop(), None
        if self.unwritten:  # entries not on disk yet must be on their way before one is dropped
            self._record()
            self._write_through()
        victim = next((h for h, e in self.entries.items() if not e.reading and h not in self.keep), None)
        if victim is None:
            return None
        e = self.entries.pop(victim)
        if e.job is not None:
            e.job.result()
        return e.slot, e.event

    def _record(self) -> None:
        """An event after the device copies queued since the last one, for the entries they used."""
        if self.async_copies and self.touched:
            event = self.stream.record_event()
            for e in self.touched:
                e.event = event
        self.touched.clear()

    def end_round(self) -> None:
        """After a step's copies were queued: the compute stream waits for them, an event marks
        when they are done, and complete entries new to the host tier are written to disk (after
        that event)."""
        self._record()
        self.join()
        self.keep = set()
        self._write_through()

    def _write_through(self) -> None:
        """Queue the disk writes of the complete entries new to the host tier (each waits for the
        event after its copies), making room on disk by dropping its least recently used blocks."""
        for h in self.unwritten:
            e = self.entries.get(h)
            if e is None or h in self.disk.index:
                continue
            while len(self.disk.index) >= self.disk.capacity:
                self.io.submit(self.disk.delete, self.disk.index.popitem(last=False)[0])
            self.disk.index[h] = None
            e.job = self.io.submit(self._write, h, e.slot, e.event)
        self.unwritten.clear()

    # ---- disk ----------------------------------------------------------------------------------------
    def _write(self, h: bytes, slot: int, event) -> None:
        if event is not None:
            event.synchronize()
        try:
            self.disk.write(h, self.host[slot])
        except OSError as e:  # a full or failing disk costs the block, not the engine (its index entry reads as missing)
            log.error("KV disk tier: writing block %s failed (%s)", h.hex(), e)

    def _read(self, h: bytes, slot: int, event) -> bool:
        if event is not None:  # a copy to the device may still read the slot
            event.synchronize()
        return self.disk.read(h, self.host[slot])

    def fetch(self, hashes: list[bytes]) -> int:
        """Bring the blocks ``hashes`` (a prefix's, in order) into the host tier: those only the
        disk has are read on the I/O thread, as many as slots allow, and none is evicted for
        another this round. Returns how many are still being read."""
        pending = 0
        self._record()  # a read may reuse a slot a queued copy still uses: it waits for this event
        self.keep.update(hashes)
        for h in hashes:
            e = self.entries.get(h)
            if e is not None and e.reading:
                pending += not self._finish_read(h, e, wait=False)
                continue
            if e is not None and len(e.groups) == len(self.paged):
                continue
            if h not in self.disk.index:
                continue
            if e is not None:  # a partial copy: the disk's block replaces it
                del self.entries[h]
            slot = (e.slot, e.event) if e is not None else self._free_slot()
            if slot is None:
                break
            self.disk.index.move_to_end(h)
            e = self.entries[h] = HostEntry(slot[0], reading=True)
            e.job = self.io.submit(self._read, h, slot[0], slot[1])
            pending += 1
        return pending

    def _finish_read(self, h: bytes, e: HostEntry, wait: bool) -> bool:
        """Whether the disk read into ``e`` is over: its block is in the host tier, or it was
        corrupt and is gone from both tiers."""
        if not wait and not e.job.done():
            return False
        ok, e.job = e.job.result(), None
        if ok:
            e.reading, e.groups = False, {g.name for g in self.paged}
        else:
            del self.entries[h]
            self.free_slots.append(e.slot)
            self.disk.index.pop(h, None)
        return True

    def wait_reads(self) -> None:
        """Wait until every disk read in flight has landed."""
        for h, e in list(self.entries.items()):
            if e.reading:
                self._finish_read(h, e, wait=True)

    def flush(self) -> None:
        """Wait until every disk write queued so far is on disk."""
        if self.io is not None:
            self.io.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the disk tier's writes and let another engine use its directory."""
        if self.io is not None:
            self.io.shutdown()
            self.disk.close()
            self.io = None

    def usage(self) -> dict[str, int]:
        """Blocks held and the capacity, per lower tier."""
        disk = self.disk
        return {"kv_host_used_blocks": len(self.entries), "kv_host_blocks": self.host_blocks,
                "kv_disk_used_blocks": len(disk.index) if disk else 0, "kv_disk_blocks": disk.capacity if disk else 0}


WEIGHT_SAMPLE = 1 << 20  # bytes read from each end of every weight file for the model's identity


def model_identity(engine, model_dir: Path) -> dict:
    """What a block's entries depend on besides its tokens, as the disk tier records it: the
    model (config.json; the names, sizes and first and last MiB of its weight files, or the seed of
    dummy weights), the compute dtype, the block size and hashing, every paged cache group."""
    if engine.config.load_format == "dummy":
        weights = f"dummy, seed {engine.config.seed}"
    else:
        h = hashlib.sha256()
        for path in sorted(model_dir.glob("*.safetensors")):
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(WEIGHT_SAMPLE)
                f.seek(max(0, size - WEIGHT_SAMPLE))
                h.update(path.name.encode() + size.to_bytes(8, "little") + head + f.read(WEIGHT_SAMPLE))
        weights = h.hexdigest()
    return {
        "model_type": engine.model_config.model_type,
        "config": hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest(),
        "weights": weights,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "block_size": engine.kv.block_size,
        "hash_next_token": engine.kv.hash_next_token,
        "groups": [{"name": g.name, "layers": list(g.layers), "entry_dim": g.entry_dim, "dtype": str(g.dtype).removeprefix("torch."),
                    "tokens_per_entry": g.tokens_per_entry} for g in engine.cache_groups if g.kind == "paged"],
    }


def _available_host_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def build_tiers(engine, model_dir: Path) -> KVTiers:
    """The lower tiers ``engine.config`` asks for (``kv_offload_gb``, ``kv_disk_dir``,
    ``kv_disk_gb``) over the engine's KV cache; ConfigError when they cannot hold a block, the host
    lacks the memory, or the disk directory cannot be used."""
    cfg, bs = engine.config, engine.kv.block_size
    per_block = block_bytes(engine.cache_groups, bs)
    if not per_block:
        raise ConfigError("kv_offload_gb: this model's KV cache has no paged group, so nothing is evicted to a lower tier; "
                          "leave kv_offload_gb at 0")
    host_blocks = int(cfg.kv_offload_gb * 2**30 // per_block)
    if host_blocks < 1:
        raise ConfigError(f"kv_offload_gb={cfg.kv_offload_gb} holds no KV block: one block of {bs} tokens takes "
                          f"{per_block / 2**20:.2f} MiB for this model; raise kv_offload_gb to at least {per_block / 2**30:.4f}")
    available = _available_host_memory()
    if available is not None and host_blocks * per_block > available:
        raise ConfigError(f"kv_offload_gb={cfg.kv_offload_gb} is more than the host memory available "
                          f"({available / 2**30:.1f} GiB); lower it")
    disk = None
    if cfg.kv_disk_dir is not None:
        disk_blocks = int(cfg.kv_disk_gb * 2**30 // (HEADER.size + per_block))
        if disk_blocks < 1:
            raise ConfigError(f"kv_disk_gb={cfg.kv_disk_gb} holds no KV block ({(HEADER.size + per_block) / 2**20:.2f} MiB "
                              f"each for this model); raise it")
        disk = DiskTier(cfg.kv_disk_dir, disk_blocks, per_block, model_identity(engine, model_dir))
    tiers = KVTiers(engine.kv_cache, bs, host_blocks, engine.device, disk)
    log.info("KV tiers: host %d blocks (%.2f GiB%s)%s", host_blocks, host_blocks * per_block / 2**30,
             ", pinned" if tiers.async_copies else "",
             f", disk {disk.dir}: {disk.capacity} blocks, {len(disk.index)} found" if disk else "")
    return tiers
