"""The prefix cache's lower tiers (engine/kv_tiers.py, engine/kv_disk.py): a block round-trips bit
for bit through the host and disk tiers in every paged layout (MLA latents, V4's compressed
entries, FP8 records whose rows straddle pages), leaving every other block and the ring and state
groups alone; an engine with a tiny device pool serves an evicted prefix from host memory and from
disk with the float32 greedy tokens and logprobs of the same prefix served from the device (and
of recomputing it, within the prefix cache's summation order); a restart finds the disk tier's
prefixes again; a corrupt or foreign directory and bad options are refused with what to do."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError
from deepinfer_core.engine.kv_cache import KVCache
from deepinfer_core.engine.kv_disk import HEADER, MANIFEST, DiskTier
from deepinfer_core.engine.kv_tiers import KVTiers, block_views
from deepinfer_core.models.batch import CacheGroup
from deepinfer_core.ops.kv_record import DATA_BYTES, PAGE_BYTES, PAGE_ROWS, RECORD_BYTES, SCALE_BYTES, SCALE_PLANE
from tests.hf_checkpoints import write_checkpoint
from tests.hf_checkpoints_v4 import random_prompt, write_checkpoint_v4
from tests.v41_checkpoints import write_checkpoint_v41

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 48  # FP8 record rows of a block straddle the 64-row pages (48 rows at 1 token an entry, 12 at 4)
GROUPS = [
    CacheGroup("mla", "paged", ("a.latent", "b.latent"), 8, torch.bfloat16),  # V3's latents
    CacheGroup("csa_kv", "paged", ("a.compressed",), 8, torch.float32, tokens_per_entry=4),  # V4's compressed entries
    CacheGroup("csa_index", "paged", ("a.indexer",), 4, torch.bfloat16, tokens_per_entry=8),
    CacheGroup("window", "ring", ("a.window",), RECORD_BYTES, torch.uint8, window=8, row_multiple=64),  # not tiered
    CacheGroup("state", "state", ("a.state",), 6, torch.float32, state_rows=2),
    CacheGroup("rec1", "paged", ("a.rec",), RECORD_BYTES, torch.uint8, row_multiple=64),  # V4's FP8 records
    CacheGroup("rec4", "paged", ("b.rec",), RECORD_BYTES, torch.uint8, tokens_per_entry=4, row_multiple=64),
]
IDENTITY = {"model_type": "test", "weights": "w0", "groups": ["layout"]}


def _random_cache(num_blocks: int = 8) -> KVCache:
    cache = KVCache(GROUPS, num_blocks, BLOCK, max_num_seqs=2, lookahead=0, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for t in cache.tensors.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8))
    return cache


def _paged_bytes(cache: KVCache, block: int) -> dict[str, torch.Tensor]:
    """Every paged layer's bytes of ``block`` (an FP8 record block: its rows' data, then their scales)."""
    return {layer: torch.cat(block_views(cache.tensors[layer], BLOCK // g.tokens_per_entry, block))
            for g in GROUPS if g.kind == "paged" for layer in g.layers}


def _assert_only_block_changed(before: dict[str, torch.Tensor], cache: KVCache, block: int, want: dict[str, torch.Tensor]):
    """Block ``block`` of every paged layer holds ``want``; every other byte is as ``before``."""
    got = _paged_bytes(cache, block)
    assert all(torch.equal(got[layer], want[layer]) for layer in want)
    for layer, t in cache.tensors.items():
        expected = before[layer].clone()
        g = next(g for g in GROUPS if layer in g.layers)
        if g.kind == "paged":
            at = 0
            for view in block_views(expected, BLOCK // g.tokens_per_entry, block):
                view.copy_(want[layer][at : at + view.numel()])
                at += view.numel()
        assert torch.equal(t.view(torch.uint8), expected.view(torch.uint8)), layer


def _record_rows(t: torch.Tensor, rows: range) -> torch.Tensor:
    """Rows of an FP8 record cache as ops/kv_record.py lays them out: row r's 576 data bytes at
    slot r % 64 of page r // 64, its 8 scale bytes in that page's scale plane."""
    flat = t.view(-1)
    out = []
    for r in rows:
        page, slot = divmod(r, PAGE_ROWS)
        base = page * PAGE_BYTES
        out.append(torch.cat([flat[base + slot * DATA_BYTES : base + (slot + 1) * DATA_BYTES],
                              flat[base + SCALE_PLANE + slot * SCALE_BYTES : base + SCALE_PLANE + (slot + 1) * SCALE_BYTES]]))
    return torch.stack(out)


def _record_block(cache: KVCache, block: int) -> dict[str, torch.Tensor]:
    return {layer: _record_rows(cache.tensors[layer], range(block * rows, (block + 1) * rows))
            for layer, rows in (("a.rec", BLOCK), ("b.rec", BLOCK // 4))}


def test_blocks_round_trip_bit_for_bit_through_host_and_disk_in_every_paged_layout(tmp_path):
    cache = _random_cache()
    paged = [g.name for g in GROUPS if g.kind == "paged"]
    original, records = _paged_bytes(cache, 5), _record_block(cache, 5)
    disk = DiskTier(tmp_path / "tier", capacity=4, block_bytes=KVTiers(cache, BLOCK, 1, torch.device("cpu")).block_bytes,
                    identity=IDENTITY)
    tiers = KVTiers(cache, BLOCK, host_blocks=2, device=torch.device("cpu"), disk=disk)
    h = bytes(range(16))
    for name in paged:
        tiers.offload(name, 5, h, False)
    tiers.end_round()
    assert tiers.tier_of(h, paged) == "host"

    before = {layer: t.clone() for layer, t in cache.tensors.items()}
    for name in paged:  # host -> block 2
        tiers.load(name, h, 2, False)
    _assert_only_block_changed(before, cache, 2, original)
    assert all(torch.equal(a, b) for a, b in zip(_record_block(cache, 2).values(), records.values()))

    tiers.flush()
    assert disk.path(h).stat().st_size == HEADER.size + tiers.block_bytes
    tiers.entries.clear()  # the host tier forgets it: only the disk has it
    tiers.free_slots = [0, 1]
    assert tiers.tier_of(h, paged) == "disk"
    while tiers.fetch([h]):
        tiers.wait_reads()
    assert tiers.tier_of(h, paged) == "host"
    before = {layer: t.clone() for layer, t in cache.tensors.items()}
    for name in paged:  # disk -> host -> block 7
        tiers.load(name, h, 7, False)
    _assert_only_block_changed(before, cache, 7, original)
    assert all(torch.equal(a, b) for a, b in zip(_record_block(cache, 7).values(), records.values()))
    tiers.close()


class _Stream:
    """A device stream that logs what is asked of it (the ordering of the tiers' copies, on a CPU)."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def record_event(self):
        self.log.append(f"{self.name} records")
        return f"event on {self.name} #{sum(e.endswith('records') for e in self.log)}"

    def wait_event(self, event):
        self.log.append(f"{self.name} waits for {event}")

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")


class _Streams:
    """The device's torch module as the tiers use it (torch.cuda's Stream, stream, current_stream)."""

    def __init__(self, compute: _Stream):
        self.compute = compute

    def current_stream(self, device=None):
        return self.compute

    @contextlib.contextmanager
    def stream(self, s):
        s.log.append(f"copies on {s.name}")
        yield


def test_tier_copies_overlap_the_step_in_flight_unless_it_may_use_the_block():
    """The copies' stream waits only for the work queued before the step in flight was launched,
    unless a block was freed since (the step may still write it): then for everything queued; and
    the work queued after the blocks were taken waits for the copies (logged on fake streams)."""
    log = []
    tiers = KVTiers(_random_cache(), BLOCK, host_blocks=4, device=torch.device("cpu"))
    tiers.streams, tiers.stream, tiers.async_copies = _Streams(_Stream("compute", log)), _Stream("copies", log), True
    tiers.launching()  # step 1 launched
    tiers.offload("mla", 5, b"a" * 16, False)
    tiers.offload("mla", 6, b"b" * 16, True)  # freed since step 1 was launched
    tiers.offload("mla", 7, b"c" * 16, True)
    tiers.end_round()
    assert log == ["compute records", "copies waits for event on compute #1", "copies on copies", "copies waits for compute",
                   "copies on copies", "copies on copies", "copies records", "compute waits for copies"]
    log.clear()
    tiers.launching()  # step 2 launched
    tiers.load("mla", b"a" * 16, 2, False)
    tiers.join()  # what KVCacheManager does after taking blocks
    tiers.join()
    tiers.end_round()
    assert log == ["compute records", "copies waits for event on compute #1", "copies on copies", "compute waits for copies",
                   "copies records"]
    log.clear()
    tiers.after_device()  # a reset: a dropped step may use any block
    tiers.load("mla", b"b" * 16, 3, False)
    assert log == ["copies waits for compute", "copies on copies"]


def test_the_pool_tells_the_tiers_which_evicted_blocks_the_step_in_flight_may_use():
    """A cached block freed since the last launch is evicted as ``recent``; after the next launch
    (``KVCacheManager.launching``) it is not."""
    from deepinfer_core.engine.kv_cache import KVCacheManager

    manager = KVCacheManager([GROUPS[0]], num_blocks=2, block_size=BLOCK, max_num_seqs=2)
    pool = manager.pools["mla"]
    evicted = []
    pool.on_evict = lambda block, h, recent: evicted.append((block, recent))
    blocks = pool.take(2)
    for b, h in zip(blocks, (b"x" * 16, b"y" * 16)):
        pool.register(b, h)
    pool.release(blocks)
    pool.take(1)
    manager.launching()
    pool.take(1)
    assert evicted == [(blocks[1], True), (blocks[0], False)]  # a sequence's tail is evicted first


def test_a_block_evicted_before_every_group_reached_the_host_is_not_written(tmp_path):
    cache = _random_cache()
    tiers = KVTiers(cache, BLOCK, host_blocks=1, device=torch.device("cpu"),
                    disk=DiskTier(tmp_path, 4, KVTiers(cache, BLOCK, 1, torch.device("cpu")).block_bytes, IDENTITY))
    tiers.offload("mla", 1, b"a" * 16, False)
    tiers.offload("mla", 2, b"b" * 16, False)  # one slot: the partial "a" goes
    tiers.end_round()
    tiers.flush()
    assert list(tiers.entries) == [b"b" * 16] and not tiers.disk.index and tiers.tier_of(b"a" * 16, ["mla"]) is None
    tiers.close()


def test_the_disk_tier_keeps_its_most_recent_blocks_within_its_capacity(tmp_path):
    cache = _random_cache()
    size = KVTiers(cache, BLOCK, 1, torch.device("cpu")).block_bytes
    tiers = KVTiers(cache, BLOCK, host_blocks=4, device=torch.device("cpu"), disk=DiskTier(tmp_path, 2, size, IDENTITY))
    paged = [g.name for g in GROUPS if g.kind == "paged"]
    hashes = [bytes([i]) * 16 for i in range(3)]
    for block, h in enumerate(hashes):
        for name in paged:
            tiers.offload(name, block, h, False)
        tiers.end_round()
    tiers.close()
    assert sorted(p.name for p in tmp_path.glob("blocks/*/*")) == sorted(f"{h.hex()}.kv" for h in hashes[1:])
    assert list(DiskTier(tmp_path, 1, size, IDENTITY).index) == [hashes[2]]  # a smaller tier drops the oldest


# ---- the disk tier's directory ---------------------------------------------------------------------
def _tier_with_one_block(path: Path) -> tuple[DiskTier, bytes]:
    disk = DiskTier(path, 4, 64, IDENTITY)
    h = b"\x01" * 16
    disk.write(h, torch.arange(64, dtype=torch.uint8))
    disk.close()
    return disk, h


def test_a_restarted_disk_tier_finds_its_blocks_and_reads_them_back(tmp_path):
    _, h = _tier_with_one_block(tmp_path)
    disk = DiskTier(tmp_path, 4, 64, IDENTITY)
    out = torch.zeros(64, dtype=torch.uint8)
    assert list(disk.index) == [h] and disk.read(h, out) and torch.equal(out, torch.arange(64, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="is in use by another engine"):
        DiskTier(tmp_path, 4, 64, IDENTITY)
    disk.close()


def test_a_foreign_directory_is_refused_naming_what_differs(tmp_path):
    _tier_with_one_block(tmp_path)
    with pytest.raises(ConfigError, match=rf"kv_disk_dir {tmp_path} holds the KV blocks of another model or cache layout "
                                          r"\(weights differ.*\); point kv_disk_dir .* or empty this one"):
        DiskTier(tmp_path, 4, 64, {**IDENTITY, "weights": "w1"})
    with pytest.raises(ConfigError, match=r"\(block_bytes differ"):
        DiskTier(tmp_path, 4, 128, IDENTITY)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=f"kv_disk_dir {other} is not empty and is not a DeepInfer KV tier"):
        DiskTier(other, 4, 64, IDENTITY)


@pytest.mark.parametrize("damage", ["truncated", "header", "manifest"])
def test_a_corrupt_directory_is_refused_naming_the_file(tmp_path, damage):
    disk, h = _tier_with_one_block(tmp_path)
    path = disk.path(h)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-1])
    elif damage == "header":
        path.write_bytes(b"X" + path.read_bytes()[1:])
    else:
        (tmp_path / MANIFEST).write_text("{not json")
    where = MANIFEST if damage == "manifest" else str(path)
    with pytest.raises(ConfigError, match=rf"kv_disk_dir {tmp_path}: .*{where}.* (corrupt|is not a block of this tier)"):
        DiskTier(tmp_path, 4, 64, IDENTITY)


def test_a_block_whose_checksum_fails_is_dropped_not_used(tmp_path, caplog):
    disk, h = _tier_with_one_block(tmp_path)
    data = bytearray(disk.path(h).read_bytes())
    data[-1] ^= 1
    disk.path(h).write_bytes(bytes(data))
    disk = DiskTier(tmp_path, 4, 64, IDENTITY)  # the header is sound: found at start-up
    assert not disk.read(h, torch.zeros(64, dtype=torch.uint8))
    assert not disk.path(h).exists() and "is missing or corrupt" in caplog.text
    disk.close()


# ---- engines ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiers-v3")
    write_checkpoint("v3_grouped", path)
    return path


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiers-v4")
    write_checkpoint_v4("v4_flash_like", path)
    return path


@pytest.fixture(scope="module")
def v4_fp8(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiers-v4-fp8")
    write_checkpoint_v4("v4_flash_like", path, head_dim=512, qk_rope_head_dim=64, index_head_dim=64)
    return path


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiers-v41")
    write_checkpoint_v41("v41-tiny", path, quant=None)
    return path


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
# model -> (LLM arguments: a device pool two prompts cannot share, prompt length, the prefix's
# tokens the device pool still holds when it comes back (the chain's head is evicted last))
CASES = {
    "v3": ({"block_size": 4, "num_kv_blocks": 14, "max_model_len": 48}, 40),
    "v4": ({"num_kv_blocks": 8, "max_model_len": 100}, 90),
    "v4_fp8": ({"num_kv_blocks": 8, "max_model_len": 100, "kv_cache_dtype": "fp8"}, 90),
    "v41": ({"num_kv_blocks": 8, "max_model_len": 100}, 90),
}


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False, max_num_seqs=1, **kw)


def _run(llm: LLM, prompt):
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    return out, out.outputs[0].token_ids, out.outputs[0].logprobs


@pytest.mark.parametrize("model", list(CASES))
def test_an_evicted_prefix_comes_back_from_host_and_disk_as_from_the_device(request, monkeypatch, tmp_path, model):
    monkeypatch.setenv("DEEPINFER_SWA_BOUNDED_REPLAY", "0")  # V4.1: a prefix hit computes what recomputing it does
    path = request.getfixturevalue(model)
    kw, length = CASES[model]
    a, b = random_prompt(length, seed=1), random_prompt(length, seed=2)
    recomputed = _run(_llm(path, enable_prefix_caching=False, **kw), a)
    roomy = _llm(path, **{**kw, "num_kv_blocks": 64})
    _run(roomy, a)
    from_device = _run(roomy, a)  # the prefix from the device's own pool
    assert from_device[0].num_cached_tokens > 0 and from_device[0].num_cached_tokens_by_tier["host"] == 0

    llm = _llm(path, kv_offload_gb=1e-3, kv_disk_dir=tmp_path, kv_disk_gb=1e-2, **kw)
    _run(llm, a)
    _run(llm, b)  # evicts most of a's blocks to the host tier
    from_host = _run(llm, a)
    tiers = from_host[0].num_cached_tokens_by_tier
    assert tiers["host"] > 0 and tiers["disk"] == 0 and sum(tiers.values()) == from_host[0].num_cached_tokens
    assert from_host[0].num_cached_tokens == from_device[0].num_cached_tokens
    assert from_host[1:] == from_device[1:]  # bit for bit: the same entries
    assert from_host[1] == recomputed[1]
    for lp, want in zip(from_host[2], recomputed[2]):  # the cached prefix is summed in another order
        assert lp.keys() == want.keys() and all(abs(lp[t] - want[t]) < 1e-4 for t in lp)
    assert llm.engine.gauges()["prefix_hit_tokens_host"] == tiers["host"]
    assert "from host memory" in llm.engine.summary()
    llm.close()

    restarted = _llm(path, kv_offload_gb=1e-3, kv_disk_dir=tmp_path, kv_disk_gb=1e-2, **kw)
    from_disk = _run(restarted, a)
    assert from_disk[0].num_cached_tokens_by_tier == {"gpu": 0, "host": 0, "disk": from_device[0].num_cached_tokens}
    assert from_disk[1:] == from_device[1:]
    assert restarted.engine.gauges()["prefix_hit_tokens_disk"] == from_device[0].num_cached_tokens
    restarted.close()


def test_data_parallel_ranks_keep_disk_tiers_of_their_own_across_a_restart(v3, tmp_path):
    """data_parallel_size=2 with a disk tier: each rank writes a directory of its own
    (rank<R>-of-2, half the GiB), closing writes both, and a restarted group finds its prompts'
    prefixes on disk and gives the same tokens."""
    kw = {"block_size": 4, "num_kv_blocks": 64, "max_model_len": 48, "data_parallel_size": 2, "kv_offload_gb": 1e-3,
          "kv_disk_dir": tmp_path, "kv_disk_gb": 2e-2}
    prompts = [random_prompt(40, seed=s) for s in range(4)]
    llm = _llm(v3, **kw)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.close()
    ranks = sorted(p.name for p in tmp_path.iterdir())
    assert ranks == ["rank0-of-2", "rank1-of-2"]
    assert all(len(list((tmp_path / r).rglob("*"))) > 1 for r in ranks)  # a manifest and blocks in each
    restarted = _llm(v3, **kw)
    again = restarted.generate(prompts, GREEDY, use_tqdm=False)
    restarted.close()
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert sum(o.num_cached_tokens_by_tier["disk"] for o in again) > 0


def test_a_corrupt_block_found_when_read_is_recomputed(v3, tmp_path, caplog):
    kw, length = CASES["v3"]
    a = random_prompt(length, seed=1)
    llm = _llm(v3, kv_offload_gb=1e-3, kv_disk_dir=tmp_path, kv_disk_gb=1e-2, **kw)
    want = _run(llm, a)
    llm.close()  # the device's cached blocks are written too
    files = sorted(tmp_path.glob("blocks/*/*"), key=lambda p: p.stat().st_mtime_ns)
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0x40  # the payload, not the header: found at start-up, refused when read
    files[0].write_bytes(bytes(data))
    restarted = _llm(v3, kv_offload_gb=1e-3, kv_disk_dir=tmp_path, kv_disk_gb=1e-2, **kw)
    again = _run(restarted, a)
    assert again[1] == want[1] and again[0].num_cached_tokens < (length - 1) // 4 * 4
    assert "is missing or corrupt" in caplog.text and not files[0].exists()
    restarted.close()


def test_a_small_host_tier_passes_blocks_on_to_disk_and_reads_what_it_can_hold(v3, tmp_path):
    """Three host slots: after two other prompts a's blocks are on disk only; coming back, as
    many as the host holds are read (12 tokens), the rest recomputed."""
    kw, length = CASES["v3"]
    a, b, c = (random_prompt(length, seed=s) for s in (1, 2, 3))
    want = _run(_llm(v3, **kw), a)
    block_bytes = 4 * 480  # 4 tokens of the MLA layers' 480 bytes a token
    llm = _llm(v3, kv_offload_gb=3 * block_bytes / 2**30, kv_disk_dir=tmp_path, kv_disk_gb=1e-2, **kw)
    assert llm.engine.kv.tiers.host_blocks == 3
    for prompt in (a, b, c):
        _run(llm, prompt)
    again = _run(llm, a)
    assert again[0].num_cached_tokens_by_tier == {"gpu": 0, "host": 0, "disk": 12} and again[1] == want[1]
    llm.close()


def test_another_models_directory_is_refused_at_start_up(v3, v4, tmp_path):
    _llm(v3, kv_offload_gb=1e-3, kv_disk_dir=tmp_path, kv_disk_gb=1e-2, block_size=4).close()
    json.loads((tmp_path / MANIFEST).read_text())  # readable: it says whose blocks they are
    with pytest.raises(ConfigError, match=f"kv_disk_dir {tmp_path} holds the KV blocks of another model or cache layout"):
        _llm(v4, kv_offload_gb=1e-3, kv_disk_dir=tmp_path, kv_disk_gb=1e-2)
    with pytest.raises(ConfigError, match=r"\(block_bytes, block_size differ"):
        _llm(v3, kv_offload_gb=1e-3, kv_disk_dir=tmp_path, kv_disk_gb=1e-2, block_size=8)


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_offload_gb": -1}, "kv_offload_gb: Input should be greater than or equal to 0"),
    ({"kv_offload_gb": 1, "kv_disk_dir": "d"}, "kv_disk_dir needs kv_disk_gb"),
    ({"kv_offload_gb": 1, "kv_disk_gb": 1}, "kv_disk_gb needs kv_disk_dir"),
    ({"kv_disk_dir": "d", "kv_disk_gb": 1}, "kv_disk_dir needs kv_offload_gb > 0"),
    ({"kv_offload_gb": 1, "kv_disk_dir": "d", "kv_disk_gb": 0}, "kv_disk_gb: Input should be greater than 0"),
    ({"kv_offload_gb": 1, "enable_prefix_caching": False}, "kv_offload_gb needs prefix caching"),
    ({"kv_offloading_size": 4}, "vLLM's kv_offloading_size .* is kv_offload_gb here"),
])
def test_bad_tier_options_are_refused_before_loading(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(accelerator="cpu", progress=False, **kwargs)


def test_a_host_tier_too_small_for_one_block_is_refused(v3):
    with pytest.raises(ConfigError, match=r"kv_offload_gb=1e-09 holds no KV block: .* raise kv_offload_gb to at least"):
        _llm(v3, kv_offload_gb=1e-9, block_size=4)


@pytest.mark.parametrize("argv, message", [
    (["--kv-disk-dir", "d"], "error: --kv-disk-dir needs --kv-disk-gb"),
    (["--hicache-size", "-1"], "error: --kv-offload-gb: Input should be greater than or equal to 0"),
    (["--kv-offloading-size", "1", "--no-prefix-caching"], "error: --kv-offload-gb needs prefix caching"),
])
def test_bad_tier_flags_are_one_error_line(capsys, argv, message):
    from deepinfer_core.cli import main

    assert main(["generate", "--prompt", "x", *argv]) == 1
    assert capsys.readouterr().err.strip().startswith(message)


@pytest.mark.parametrize("size_flag", ["--kv-offload-gb", "--kv-offloading-size", "--hicache-size"])
def test_tier_flags_reach_llm(llm_arguments, size_flag):
    """vLLM's and SGLang's spellings of the host tier's size are the same flag."""
    from deepinfer_core.cli import main

    seen = llm_arguments
    assert main(["serve", "--port", "0", size_flag, "2.5", "--kv-disk-dir", "/kv", "--kv-disk-gb", "100"]) == 1
    assert (seen["kv_offload_gb"], seen["kv_disk_dir"], seen["kv_disk_gb"]) == (2.5, "/kv", 100)


def test_the_tier_hit_benchmark_runs(tmp_path):
    """benchmarks/kv_tier_hit.py: a prompt whose prefix was evicted comes back from the host tier
    (its tokens counted there), timed beside recomputing it and a device hit."""
    from benchmarks import kv_tier_hit

    kv_tier_hit.main(["--accelerator", "cpu", "--lengths", "64", "--repeats", "1", "--out", str(tmp_path)])
    (point,) = json.loads((tmp_path / "kv_tier_hit.json").read_text())["points"]
    assert point["host_tokens"] > 0 and point["host_bytes"] > 0
    assert point["recompute_s"] > 0 and point["device_hit_s"] > 0 and point["host_hit_s"] > 0
