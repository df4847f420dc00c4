"""The cache managers alone: BlockPool, KVCacheManager (paged / ring / state groups), KVCache
shapes and sizes, and how the runner maps positions to cache rows (``_slots`` / ``_context``).

No model runs here; sequences are built directly and block ids are checked exactly.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer_core.engine.kv_cache import BlockPool, KVCache, KVCacheManager, block_hash
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.models.batch import CacheGroup
from deepinfer_core.sampling.params import SamplingParams

H1, H2, H3 = (bytes([i]) * 16 for i in (1, 2, 3))


def paged(name="kv", layers=("l0",), entry_dim=8, dtype=torch.float16, tokens_per_entry=1) -> CacheGroup:
    return CacheGroup(name, "paged", layers, entry_dim, dtype, tokens_per_entry=tokens_per_entry)


def ring(name="win", layers=("w0",), entry_dim=8, dtype=torch.float16, window=8, replay_tokens=0) -> CacheGroup:
    return CacheGroup(name, "ring", layers, entry_dim, dtype, window=window, replay_tokens=replay_tokens)


def state(name="st", layers=("s0",), entry_dim=16, dtype=torch.float32, state_rows=3, replay_tokens=0) -> CacheGroup:
    return CacheGroup(name, "state", layers, entry_dim, dtype, state_rows=state_rows, replay_tokens=replay_tokens)


def make_seq(ids, seq_id=0, **params) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(ids), SamplingParams(max_tokens=8, **params), seed=0)


def manager(groups=None, num_blocks=8, block_size=4, max_num_seqs=4, lookahead=0, prefix_caching=True) -> KVCacheManager:
    return KVCacheManager(groups or [paged()], num_blocks, block_size, max_num_seqs, lookahead, prefix_caching)


def runner_for(kv: KVCacheManager) -> ModelRunner:
    """A ModelRunner with only what ``_slots`` / ``_context`` read."""
    r = ModelRunner.__new__(ModelRunner)
    r.block_size = kv.block_size
    r.kv = kv
    return r


def cached_prefix(kv: KVCacheManager, ids, seq_id=0) -> Sequence:
    """A sequence that computed ``ids`` in full, registered its full blocks and finished."""
    s = make_seq(ids, seq_id)
    kv.allocate(s, len(ids))
    kv.cache(s, len(ids))
    kv.free(s)
    return s


# ---- block_hash -------------------------------------------------------------------------------

def test_block_hash_depends_on_parent_tokens_order_and_extra():
    h = block_hash(None, [1, 2, 3, 4])
    assert len(h) == 16 and h == block_hash(None, [1, 2, 3, 4])
    assert block_hash(None, [1, 2, 4, 3]) != h
    assert block_hash(h, [1, 2, 3, 4]) != h
    assert block_hash(None, [1, 2, 3, 4], b"lora") != h
    assert block_hash(H1, [5]) != block_hash(H2, [5])


# ---- BlockPool --------------------------------------------------------------------------------

def test_pool_take_share_release_ref_counts():
    pool = BlockPool(4)
    assert pool.take(2) == [0, 1]
    assert pool.refs == [1, 1, 0, 0] and pool.num_free == 2
    pool.share(0)
    assert pool.refs == [2, 1, 0, 0] and pool.num_free == 2
    pool.release([0])
    assert pool.refs == [1, 1, 0, 0] and pool.num_free == 2 and 0 not in pool.free
    pool.release([0, 1])
    assert pool.refs == [0, 0, 0, 0] and pool.num_free == 4
    assert pool.take(4) == [0, 1, 2, 3]  # uncached blocks come back in table order


def test_pool_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4)
    pool.take(4)
    pool.register(1, H1)
    pool.register(2, H2)
    pool.release([0, 1, 2, 3])
    assert list(pool.free) == [0, 3, 2, 1]
    assert pool.take(2) == [0, 3] and pool.num_evicted == 0
    assert pool.by_hash == {H1: 1, H2: 2}
    assert pool.take(1) == [2]  # the tail of the cached ones goes first
    assert pool.num_evicted == 1 and pool.by_hash == {H1: 1}


def test_pool_least_recently_freed_cached_block_goes_first_tail_before_head():
    pool = BlockPool(4)
    pool.take(4)
    for b, h in zip(range(4), (H1, H2, H3, b"\x04" * 16)):
        pool.register(b, h)
    pool.release([0, 1])  # sequence A: head 0, tail 1
    pool.release([2, 3])  # sequence B, freed later
    assert pool.take(4) == [1, 0, 3, 2]
    assert pool.num_evicted == 4 and pool.by_hash == {} and pool.hash_of == [None] * 4


def test_pool_eviction_drops_the_hash():
    pool = BlockPool(2)
    pool.take(1)
    pool.register(0, H1)
    pool.release([0])
    assert pool.by_hash == {H1: 0} and pool.hash_of[0] == H1 and list(pool.free) == [1, 0]
    assert pool.take(1) == [1]  # the uncached one first: the cache survives
    assert pool.by_hash == {H1: 0}
    assert pool.take(1) == [0]
    assert H1 not in pool.by_hash and pool.hash_of[0] is None and pool.num_evicted == 1
    pool.release([0])
    assert list(pool.free)[0] == 0  # evicted, so uncached again: back to the front


def test_pool_register_never_overwrites():
    pool = BlockPool(3)
    pool.take(3)
    pool.register(0, H1)
    pool.register(1, H1)  # the same prefix computed twice: the first block keeps it
    assert pool.by_hash == {H1: 0} and pool.hash_of == [H1, None, None]
    pool.register(0, H2)  # a block keeps its first hash
    assert pool.by_hash == {H1: 0} and pool.hash_of[0] == H1
    pool.release([0, 1, 2])
    assert list(pool.free) == [1, 2, 0]  # the duplicate holds nothing findable: reused first


def test_pool_share_of_a_free_cached_block_takes_it_off_the_queue():
    pool = BlockPool(3)
    pool.take(1)
    pool.register(0, H1)
    pool.release([0])
    assert pool.num_free == 3
    pool.share(0)
    assert pool.refs[0] == 1 and 0 not in pool.free and pool.num_free == 2 and pool.by_hash == {H1: 0}
    assert pool.take(2) == [1, 2] and pool.num_evicted == 0


def test_pool_taking_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.take(2)
    with pytest.raises(RuntimeError, match="need 2, 1 free"):
        pool.take(2)
    assert pool.num_free == 1 and pool.refs == [1, 1, 0]
    pool.reset()
    assert pool.num_free == 3 and pool.refs == [0, 0, 0] and pool.num_evicted == 0


# ---- KVCacheManager: paged allocation --------------------------------------------------------

def test_allocate_grows_one_block_per_block_size_tokens():
    kv = manager(num_blocks=8, block_size=4)
    s = make_seq(range(10))
    assert kv.allocate(s, 1) == {"kv": [0]}
    assert kv.allocate(s, 4) == {}
    assert kv.allocate(s, 5) == {"kv": [1]}
    assert kv.allocate(s, 12) == {"kv": [2]}
    assert kv.allocate(s, 17) == {"kv": [3, 4]}
    assert s.block_tables == {"kv": [0, 1, 2, 3, 4]} and kv.num_free == 3
    t = make_seq(range(3), seq_id=1)
    assert kv.allocate(t, 3) == {"kv": [5]}


def test_can_allocate_respects_free_blocks():
    kv = manager(num_blocks=4, block_size=4)
    a, b = make_seq(range(12)), make_seq(range(8), seq_id=1)
    kv.allocate(a, 12)
    assert kv.num_free == 1
    assert kv.can_allocate(b, 4) and not kv.can_allocate(b, 5)
    assert kv.can_allocate(a, 16) and not kv.can_allocate(a, 17)
    with pytest.raises(RuntimeError, match="out of KV blocks for sequence 1"):
        kv.allocate(b, 5)
    assert b.block_tables == {} and kv.num_free == 1


def test_a_sequence_may_hold_every_block_of_the_pool():
    """Exactly at capacity: the pool's last free block is handed out, and a sequence holding all
    of them still fits what it already holds; one token more, or anyone else, does not."""
    pool = BlockPool(4)
    assert pool.take(4) == [0, 1, 2, 3] and pool.num_free == 0
    kv = manager(num_blocks=4, block_size=4)
    s = make_seq(range(16))
    assert kv.can_allocate(s, 16)
    assert kv.allocate(s, 16) == {"kv": [0, 1, 2, 3]} and kv.num_free == 0
    assert kv.can_allocate(s, 16) and kv.allocate(s, 16) == {}  # up to the last slot of the last block
    assert not kv.can_allocate(s, 17) and not kv.can_allocate(make_seq([1], seq_id=1), 1)
    kv.free(s)
    for n in range(1, 17):  # grown a token at a time: the last block is taken as position 12 arrives
        assert kv.can_allocate(s, n), n
        kv.allocate(s, n)
    assert sorted(s.block_tables["kv"]) == [0, 1, 2, 3] and kv.num_free == 0


def test_the_last_blocks_ring_and_state_slot_go_to_the_last_sequence():
    """Two sequences take exactly every paged block, ring and state slot there is."""
    kv = manager([paged("p"), ring("r", window=4), state("st")], num_blocks=4, block_size=4, max_num_seqs=2)
    assert kv.rings == {"r": 2}
    a, b, c = (make_seq(range(8), seq_id=i) for i in range(3))
    assert kv.allocate(a, 8) == {"p": [0, 1], "r": [0, 1], "st": [0]}
    assert kv.can_allocate(b, 8)  # what is left, exactly
    assert kv.allocate(b, 8) == {"p": [2, 3], "r": [2, 3], "st": [1]}
    assert kv.num_free == 0 and kv.ring_free == {"r": []} and kv.state_free == {"st": []}
    assert kv.can_allocate(a, 8) and kv.can_allocate(b, 8) and not kv.can_allocate(a, 9) and not kv.can_allocate(c, 1)


def test_the_scheduler_fills_the_cache_to_its_last_slot():
    """A 15-token prompt over 4 blocks of 4 is admitted in one chunk, and its first decode row
    writes position 15, the last slot of the last block: nobody is preempted."""
    kv = manager(num_blocks=4, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16)
    seq = make_seq(range(15))
    scheduler.add(seq)
    out = scheduler.schedule()
    assert [(s.start, s.num_tokens) for s in out.prefills] == [(0, 15)] and kv.num_free == 0
    scheduler.update(out, {0: [99]}, lambda s, toks: s.output_token_ids.extend(toks) or False)
    out = scheduler.schedule()
    assert not out.preempted and [(s.start, s.num_tokens) for s in out.decodes] == [(15, 1)]
    assert seq.block_tables["kv"] == [0, 1, 2, 3] and kv.num_free == 0


def test_truncate_frees_only_blocks_past_the_kept_tokens():
    kv = manager(num_blocks=8, block_size=4)
    s = make_seq(range(12))
    kv.allocate(s, 12)
    kv.cache(s, 11)
    assert s.num_registered_blocks == 2
    v = s.table_version
    kv.truncate(s, 9)  # still needs 3 blocks
    assert s.block_tables["kv"] == [0, 1, 2] and s.table_version == v and kv.num_free == 5
    kv.truncate(s, 5)
    assert s.block_tables["kv"] == [0, 1] and s.table_version > v and kv.num_free == 6
    v = s.table_version
    assert s.num_registered_blocks == 2
    kv.truncate(s, 3)
    assert s.block_tables["kv"] == [0] and s.table_version > v and s.num_registered_blocks == 1
    assert kv.pools["kv"].refs[:3] == [1, 0, 0]
    # block 2 was never registered: reused first; block 1 is cached (tail of the freed ones)
    assert list(kv.pools["kv"].free)[:1] == [2] and list(kv.pools["kv"].free)[-1] == 1


def test_table_versions_are_never_reused_across_resets():
    """The graphs' host tables key rows by (seq id, table version): a reset must not bring a
    version back (sequence ids restart after one)."""
    kv = KVCacheManager([CacheGroup("kv", "paged", ("l",), 4, torch.float32)], num_blocks=8, block_size=4, max_num_seqs=2)
    first = Sequence(0, "r", 0, [1, 2, 3], SamplingParams(max_tokens=4), 0)
    kv.allocate(first, 3)
    kv.reset()
    again = Sequence(0, "r", 0, [4, 5, 6], SamplingParams(max_tokens=4), 0)
    kv.allocate(again, 3)
    assert again.table_version != first.table_version


def test_free_returns_everything():
    kv = manager(num_blocks=8, block_size=4)
    a, b = make_seq(range(9)), make_seq(range(100, 105), seq_id=1)
    kv.allocate(a, 9)
    kv.allocate(b, 5)
    kv.cache(a, 8)
    assert kv.num_free == 3
    v = a.table_version
    kv.free(a)
    assert a.block_tables == {} and a.num_registered_blocks == 0 and a.table_version > v
    assert kv.num_free == 6 and kv.pools["kv"].refs == [0, 0, 0, 1, 1, 0, 0, 0]
    kv.free(b)
    assert kv.num_free == 8 and kv.pools["kv"].refs == [0] * 8
    assert list(kv.pools["kv"].free) == [3, 4, 2, 5, 6, 7, 1, 0]


def test_reset_forgets_blocks_cache_and_counters():
    kv = manager(num_blocks=4, block_size=4)
    cached_prefix(kv, range(8))
    kv.allocate(make_seq(range(5), seq_id=1), 5)
    kv.count_lookup(9, 8)
    kv.reset()
    pool = kv.pools["kv"]
    assert kv.num_free == 4 and pool.by_hash == {} and pool.refs == [0] * 4 and list(pool.free) == [0, 1, 2, 3]
    assert kv.num_queried_tokens == 0 and kv.num_hit_tokens == 0
    assert kv.find_cached(make_seq(range(9), seq_id=2)) == (0, {"kv": []})


# ---- prefix caching ---------------------------------------------------------------------------

def test_cache_registers_only_full_computed_blocks():
    kv = manager(num_blocks=8, block_size=4)
    s = make_seq(range(10))
    kv.allocate(s, 10)
    kv.cache(s, 10)
    pool = kv.pools["kv"]
    h0 = block_hash(None, [0, 1, 2, 3])
    h1 = block_hash(h0, [4, 5, 6, 7])
    assert pool.by_hash == {h0: 0, h1: 1} and pool.hash_of[2] is None
    assert s.num_registered_blocks == 2 and s.block_hashes == [h0, h1]
    kv.cache(s, 7)  # less than before: nothing is undone
    assert s.num_registered_blocks == 2 and len(pool.by_hash) == 2


def test_cache_after_find_cached_registers_only_computed_blocks():
    """find_cached hashes the whole prompt; a chunk that ends inside block 1 must not register it."""
    kv = manager(num_blocks=8, block_size=4)
    s = make_seq(range(12))
    assert kv.find_cached(s) == (0, {"kv": []})
    assert len(s.block_hashes) == 2  # hashes of the first 11 tokens' full blocks
    kv.allocate(s, 6)  # a prefill chunk [0, 6): block 1 only half computed
    kv.cache(s, 6)
    pool = kv.pools["kv"]
    assert pool.by_hash == {s.block_hashes[0]: 0} and pool.hash_of[1] is None
    assert s.num_registered_blocks == 1
    kv.allocate(s, 12)
    kv.cache(s, 12)
    assert pool.hash_of[:3] == s.block_hashes[:3] and s.num_registered_blocks == 3


def test_a_chunk_interrupted_inside_a_block_is_not_a_prefix_hit_through_the_scheduler():
    """A prompt prefilled in a chunk that ends inside block 1, then aborted: the same prompt may
    reuse block 0 only (block 1's last positions were never computed)."""
    kv = manager(num_blocks=8, block_size=4)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=6, max_model_len=64)
    a = make_seq(range(12))
    sched.add(a)
    out = sched.schedule()
    assert [(s.start, s.num_tokens) for s in out.prefills] == [(0, 6)]
    sched.update(out, {}, lambda seq, tokens: False)
    sched.finish(a)  # aborted
    b = make_seq(range(12), seq_id=1)
    sched.add(b)
    out = sched.schedule()
    assert out.num_cached_tokens == 4 and [(s.start, s.num_tokens) for s in out.prefills] == [(4, 6)]


def test_find_cached_leaves_at_least_the_last_token():
    kv = manager(num_blocks=8, block_size=16)
    prompt = list(range(32))
    cached_prefix(kv, prompt)
    assert kv.find_cached(make_seq(prompt, seq_id=1)) == (16, {"kv": [0]})
    assert kv.find_cached(make_seq(prompt + [7], seq_id=2)) == (32, {"kv": [0, 1]})
    assert kv.find_cached(make_seq(prompt[:17], seq_id=3)) == (16, {"kv": [0]})
    assert kv.find_cached(make_seq(prompt[:16], seq_id=4)) == (0, {"kv": []})


def test_find_cached_on_a_fully_cached_sequence_still_leaves_its_last_token():
    """A sequence whose every token was computed and registered (cache(seq, num_tokens)), then
    freed (preempted): re-admitted, it must still compute its last token (its logits)."""
    kv = manager(num_blocks=8, block_size=4)
    s = cached_prefix(kv, range(8))
    assert len(s.block_hashes) == 2
    assert kv.find_cached(s) == (4, {"kv": [0]})


def test_a_different_token_breaks_the_chain_for_every_later_block():
    kv = manager(num_blocks=8, block_size=4)
    prompt = list(range(12))
    cached_prefix(kv, prompt)
    assert kv.find_cached(make_seq(prompt + [1], seq_id=1)) == (12, {"kv": [0, 1, 2]})
    assert kv.find_cached(make_seq([99] + prompt[1:] + [1], seq_id=2)) == (0, {"kv": []})
    changed_block1 = prompt[:5] + [99] + prompt[6:] + [1]
    assert kv.find_cached(make_seq(changed_block1, seq_id=3)) == (4, {"kv": [0]})


def test_sharing_counts_refs_and_one_holder_freeing_keeps_the_block():
    kv = manager(num_blocks=8, block_size=4)
    a = make_seq(range(10))
    kv.allocate(a, 10)
    kv.cache(a, 9)
    b = make_seq(list(range(8)) + [50, 51, 52], seq_id=1)
    hit, cached = kv.find_cached(b)
    assert (hit, cached) == (8, {"kv": [0, 1]})
    assert kv.allocate(b, 11, cached) == {"kv": [0, 1, 3]}
    assert b.block_tables["kv"] == [0, 1, 3] and b.num_registered_blocks == 2
    pool = kv.pools["kv"]
    assert pool.refs[:4] == [2, 2, 1, 1] and kv.num_free == 4
    kv.free(a)
    assert pool.refs[:4] == [1, 1, 0, 1] and kv.num_free == 5
    assert 0 not in pool.free and 1 not in pool.free
    assert kv.find_cached(make_seq(range(9), seq_id=2)) == (8, {"kv": [0, 1]})
    kv.free(b)
    assert pool.refs == [0] * 8 and kv.num_free == 8


def test_cached_free_blocks_are_reused_and_counted_once():
    kv = manager(num_blocks=4, block_size=4)
    cached_prefix(kv, range(8))
    pool = kv.pools["kv"]
    assert list(pool.free) == [2, 3, 1, 0] and pool.refs == [0] * 4
    b = make_seq(list(range(8)) + list(range(100, 109)), seq_id=1)  # 17 tokens: 5 blocks
    hit, cached = kv.find_cached(b)
    assert (hit, cached) == (8, {"kv": [0, 1]})
    # 2 cached blocks come off the free queue, so only 2 fresh ones remain for them
    assert kv.can_allocate(b, 16, cached) and not kv.can_allocate(b, 17, cached)
    assert kv.allocate(b, 16, cached) == {"kv": [0, 1, 2, 3]}
    assert pool.refs == [1, 1, 1, 1] and kv.num_free == 0 and pool.num_evicted == 0
    assert pool.by_hash == {b.block_hashes[0]: 0, b.block_hashes[1]: 1}


def test_eviction_under_pressure_tail_first_then_a_miss():
    kv = manager(num_blocks=4, block_size=4)
    cached_prefix(kv, range(8))
    probe = make_seq(range(9), seq_id=9)
    c = make_seq(range(100, 112), seq_id=1)
    assert kv.allocate(c, 12) == {"kv": [2, 3, 1]}  # uncached ones, then the cached tail
    assert kv.pools["kv"].num_evicted == 1
    assert kv.find_cached(probe) == (4, {"kv": [0]})
    d = make_seq(range(200, 204), seq_id=2)
    assert kv.allocate(d, 4) == {"kv": [0]}
    assert kv.pools["kv"].num_evicted == 2
    assert kv.find_cached(probe) == (0, {"kv": []})


def test_prompt_logprobs_requests_never_hit():
    kv = manager(num_blocks=8, block_size=4)
    cached_prefix(kv, range(8))
    assert kv.find_cached(make_seq(range(9), seq_id=1)) == (8, {"kv": [0, 1]})
    assert kv.find_cached(make_seq(range(9), seq_id=2, prompt_logprobs=1)) == (0, {})


def test_prefix_caching_off_never_registers_nor_hits_nor_counts():
    kv = manager(num_blocks=8, block_size=4, prefix_caching=False)
    a = cached_prefix(kv, range(8))
    assert kv.pools["kv"].by_hash == {} and a.block_hashes == []
    assert kv.find_cached(make_seq(range(9), seq_id=1)) == (0, {})
    kv.count_lookup(9, 0)
    assert kv.num_queried_tokens == 0 and kv.num_hit_tokens == 0


def test_count_lookup_sums_queries_and_hits():
    kv = manager()
    kv.count_lookup(9, 8)
    kv.count_lookup(5, 0)
    assert (kv.num_queried_tokens, kv.num_hit_tokens) == (14, 8)


# ---- several paged groups ---------------------------------------------------------------------

def two_groups():
    return [paged("mla", ("a0", "a1"), entry_dim=8, dtype=torch.float16),
            paged("cmp", ("c0",), entry_dim=4, dtype=torch.float32, tokens_per_entry=4)]


def test_paged_groups_allocate_in_lockstep():
    kv = manager(two_groups(), num_blocks=6, block_size=8)
    a, b = make_seq(range(20)), make_seq(range(3), seq_id=1)
    assert kv.allocate(a, 20) == {"mla": [0, 1, 2], "cmp": [0, 1, 2]}
    assert kv.allocate(b, 3) == {"mla": [3], "cmp": [3]}
    assert kv.num_free == 2
    kv.free(a)
    assert kv.num_free == 5 and all(p.refs == [0, 0, 0, 1, 0, 0] for p in kv.pools.values())


def test_a_hit_needs_every_paged_group_to_hold_the_block():
    kv = manager(two_groups(), num_blocks=6, block_size=8)
    cached_prefix(kv, range(16))
    probe = make_seq(range(17), seq_id=1)
    assert kv.find_cached(probe) == (16, {"mla": [0, 1], "cmp": [0, 1]})
    cmp = kv.pools["cmp"]
    assert cmp.take(5) == [2, 3, 4, 5, 1]  # only this group evicts block 1
    assert kv.find_cached(probe) == (8, {"mla": [0], "cmp": [0]})
    assert kv.num_free == 1  # the tightest group
    cmp.take(1)
    assert kv.find_cached(probe) == (0, {"mla": [], "cmp": []})


def test_kv_cache_tensor_shapes_per_group():
    cache = KVCache(two_groups(), num_blocks=6, block_size=8, max_num_seqs=2, lookahead=0, device=torch.device("cpu"))
    assert {k: (tuple(t.shape), t.dtype) for k, t in cache.tensors.items()} == {
        "a0": ((6, 8, 8), torch.float16), "a1": ((6, 8, 8), torch.float16), "c0": ((6, 2, 4), torch.float32)}


def test_block_size_must_be_a_multiple_of_tokens_per_entry():
    with pytest.raises(ValueError, match="block_size 6 is not a multiple of cache group 'cmp'"):
        manager(two_groups(), block_size=6)
    assert manager(two_groups(), block_size=4).block_size == 4
    manager([paged(tokens_per_entry=4), ring()], block_size=4)  # only paged groups compress


def test_bytes_per_token_sums_paged_groups_over_tokens_per_entry():
    # mla: 2 layers * 8 * 2 bytes = 32; cmp: 1 layer * 4 * 4 bytes / 4 tokens = 4; rings not counted
    assert KVCache.bytes_per_token(two_groups() + [ring()]) == 36.0
    assert paged(tokens_per_entry=128, entry_dim=64).bytes_per_token() == 1.0


# ---- runner addressing: paged groups ----------------------------------------------------------

def test_slots_of_compressed_entries_at_block_boundaries():
    g = paged("cmp", tokens_per_entry=4)
    kv = manager([g], block_size=8)
    s = make_seq(range(24))
    s.block_tables = {"cmp": [5, 2, 7]}  # 2 entries per block
    slots = runner_for(kv)._slots(g, s, range(0, 20))
    assert {p: x for p, x in enumerate(slots) if x != -1} == {3: 10, 7: 11, 11: 4, 15: 5, 19: 14}
    s.paged_write_from = 8  # a bounded replay: block 0 is already cached
    assert runner_for(kv)._slots(g, s, range(0, 12)) == [-1] * 11 + [4]


def test_context_of_compressed_entries_is_complete_groups_only():
    g = paged("cmp", tokens_per_entry=4)
    kv = manager([g], block_size=8)
    s = make_seq(range(24))
    s.block_tables = {"cmp": [5, 2, 7]}
    r = runner_for(kv)
    assert r._context(g, s, 8, 15).tolist() == [10, 11, 4]
    assert r._context(g, s, 8, 16).tolist() == [10, 11, 4, 5]
    assert r._context(g, s, 16, 20).tolist() == [10, 11, 4, 5, 14]
    assert r._context(g, s, 0, 3).tolist() == []


def test_slots_and_context_of_an_uncompressed_paged_group():
    g = paged()
    kv = manager([g], block_size=8)
    s = make_seq(range(16))
    s.block_tables = {"kv": [5, 2]}
    r = runner_for(kv)
    assert r._slots(g, s, range(6, 10)) == [46, 47, 16, 17]
    assert r._context(g, s, 8, 10).tolist() == list(range(40, 48)) + [16, 17]


def full_runner(kv: KVCacheManager, max_position_embeddings: int = 64) -> ModelRunner:
    """A ModelRunner on the CPU that can ``prepare`` a step and build its BatchMeta (no model runs)."""
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=max_position_embeddings), lookback_tokens=0)
    return ModelRunner(model, None, kv, torch.device("cpu"))


def test_a_step_maps_positions_to_slots_of_shuffled_blocks_across_block_boundaries():
    """The slot mappings the model is given for a mixed step, with blocks out of order: a second
    prefill chunk over two block boundaries, decode rows at the last and the first position of a
    block. Slot = table[p // block_size] * entries per block + p % block_size // tokens per entry
    (written at a compressed group's last token of each entry only), counted by hand here."""
    groups = [paged("kv"), paged("cmp", tokens_per_entry=2)]
    kv = manager(groups, num_blocks=16, block_size=4)
    a, b, c = make_seq(range(13)), make_seq(range(8), seq_id=1), make_seq(range(9), seq_id=2)
    a.block_tables = {"kv": [9, 2, 14, 5], "cmp": [3, 11, 0, 7]}
    b.block_tables = {"kv": [12, 6], "cmp": [1, 8]}
    c.block_tables = {"kv": [4, 15, 10], "cmp": [13, 4, 6]}
    out = SchedulerOutput(prefills=[ScheduledSeq(a, 6, 7, samples=True)],
                          decodes=[ScheduledSeq(b, 7, 1, is_decode=True, samples=True),
                                   ScheduledSeq(c, 8, 1, is_decode=True, samples=True)])
    runner = full_runner(kv)
    ids, positions, meta = runner._meta(runner.prepare(out))
    assert positions.tolist() == [6, 7, 8, 9, 10, 11, 12, 7, 8] and ids.tolist() == [6, 7, 8, 9, 10, 11, 12, 7, 8]
    # kv: a's 6, 7 in block 2; 8..11 in block 14; 12 in block 5; b's 7 in block 6; c's 8 in block 10
    assert meta.groups["kv"].slot_mapping.tolist() == [10, 11, 56, 57, 58, 59, 20, 27, 40]
    # cmp (2 entries per block): a's 7 -> block 11 entry 1; 9 -> block 0 entry 0; 11 -> block 0 entry 1; b's 7 -> block 8 entry 1
    assert meta.groups["cmp"].slot_mapping.tolist() == [-1, 23, -1, 0, -1, 1, -1, 17, -1]
    # the chunk reads the whole context before it and itself: positions 0..12 / entries 0..5
    assert meta.groups["kv"].context_slots.tolist() == [36, 37, 38, 39, 8, 9, 10, 11, 56, 57, 58, 59, 20]
    assert meta.groups["cmp"].context_slots.tolist() == [6, 7, 22, 23, 0, 1]
    assert meta.prefill_cu_seqlens_q.tolist() == [0, 7] and meta.prefill_cu_seqlens_k.tolist() == [0, 13]
    assert meta.groups["kv"].block_tables.tolist() == [[12, 6, 0], [4, 15, 10]]
    assert meta.decode_seq_lens.tolist() == [8, 9] and meta.decode_query_start_loc.tolist() == [0, 1, 2]


def test_the_second_chunk_of_a_prompt_is_at_its_positions_in_the_sequence():
    """Chunked prefill through the scheduler: the second 6-token chunk of a 13-token prompt is at
    positions 6..11 (not 0..5), attends to 12 tokens, and writes the slots of those positions, in
    blocks handed out out of order."""
    kv = manager(num_blocks=8, block_size=4)
    fillers = [make_seq([1], seq_id=10 + i) for i in range(3)]
    for f in fillers:
        kv.allocate(f, 1)  # blocks 0, 1, 2
    kv.free(fillers[0])
    kv.free(fillers[2])  # free queue: 2, 0, 3, 4, ...
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=6, max_model_len=32)
    seq = make_seq([100 + i for i in range(13)])
    scheduler.add(seq)
    first = scheduler.schedule()
    assert [(s.start, s.num_tokens, s.samples) for s in first.prefills] == [(0, 6, False)]
    scheduler.update(first, {}, lambda s, toks: False)
    kv.allocate(make_seq([1], seq_id=20), 1)  # someone else takes block 3 in between
    second = scheduler.schedule()
    assert [(s.start, s.num_tokens, s.samples) for s in second.prefills] == [(6, 6, False)]
    assert seq.block_tables["kv"] == [2, 0, 4]
    runner = full_runner(kv)
    ids, positions, meta = runner._meta(runner.prepare(second))
    assert ids.tolist() == [106, 107, 108, 109, 110, 111]
    assert positions.tolist() == [6, 7, 8, 9, 10, 11]
    assert meta.num_prefill_tokens == 6
    assert meta.prefill_cu_seqlens_q.tolist() == [0, 6] and meta.prefill_cu_seqlens_k.tolist() == [0, 12]
    assert meta.groups["kv"].slot_mapping.tolist() == [2, 3, 16, 17, 18, 19]
    assert meta.groups["kv"].context_slots.tolist() == [8, 9, 10, 11, 0, 1, 2, 3, 16, 17, 18, 19]


# ---- ring groups ------------------------------------------------------------------------------

def test_ring_blocks():
    assert KVCache.ring_blocks(ring(window=8), 4, 0) == 3
    assert KVCache.ring_blocks(ring(window=8), 4, 2) == 4
    assert KVCache.ring_blocks(ring(window=9), 4, 0) == 4
    assert KVCache.ring_blocks(ring(window=128), 64, 3) == 4


def test_ring_is_given_on_first_allocation_kept_on_growth_and_truncate_returned_on_free():
    kv = manager([paged("p"), ring("r", window=8)], num_blocks=16, block_size=4, max_num_seqs=2, lookahead=2)
    assert kv.rings == {"r": 4}
    a, b, c = (make_seq(range(40), seq_id=i) for i in range(3))
    assert kv.allocate(a, 5) == {"r": [0, 1, 2, 3], "p": [0, 1]}
    assert kv.allocate(a, 30) == {"p": [2, 3, 4, 5, 6, 7]}
    kv.truncate(a, 5)
    assert a.block_tables == {"r": [0, 1, 2, 3], "p": [0, 1]}
    assert kv.allocate(b, 1) == {"r": [4, 5, 6, 7], "p": [2]}
    assert not kv.can_allocate(c, 1)  # no ring left, though paged blocks are
    assert kv.can_allocate(b, 20)  # a running sequence grows without a new ring
    with pytest.raises(RuntimeError):
        kv.allocate(c, 1)
    kv.free(a)
    assert sorted(kv.ring_free["r"]) == [0, 1, 2, 3]
    assert kv.allocate(c, 1) == {"r": [0, 1, 2, 3], "p": [0]}


def test_ring_slots_wrap_around_and_skip_what_the_chunk_overwrites():
    g = ring("r", window=8)
    kv = manager([g], block_size=4, max_num_seqs=1)
    s = make_seq(range(40))
    s.block_tables = {"r": [10, 11, 12]}  # 12 positions
    r = runner_for(kv)
    # a 20-token chunk: only its last 12 positions survive
    assert r._slots(g, s, range(0, 20)) == [-1] * 8 + [48, 49, 50, 51, 40, 41, 42, 43, 44, 45, 46, 47]
    assert r._slots(g, s, range(13, 17)) == [41, 42, 43, 44]
    assert r._slots(g, s, range(20, 21)) == [48]
    for start in range(0, 9):
        for n in range(1, 20):
            slots = r._slots(g, s, range(start, start + n))
            written = [x for x in slots if x != -1]
            assert len(written) == min(n, 12) and len(set(written)) == len(written)
            assert slots[-len(written):] == written  # the newest positions are the ones written
            for p, x in zip(range(start, start + n), slots):
                if x != -1:
                    assert x == [10, 11, 12][(p // 4) % 3] * 4 + p % 4


def test_ring_context_is_the_window_before_the_chunk():
    g = ring("r", window=8)
    kv = manager([g], block_size=4, max_num_seqs=1)
    s = make_seq(range(40))
    s.block_tables = {"r": [10, 11, 12]}
    r = runner_for(kv)
    assert r._context(g, s, 12, 16).tolist() == [44, 45, 46, 47, 48, 49, 50, 51]  # positions 4..11
    assert r._context(g, s, 14, 15).tolist() == [46, 47, 48, 49, 50, 51, 40, 41]  # positions 6..13, wrapped
    assert r._context(g, s, 3, 8).tolist() == [40, 41, 42]
    assert r._context(g, s, 0, 4).tolist() == []


def test_ring_context_after_a_bounded_replay_starts_at_the_replay():
    g = ring("r", window=8, replay_tokens=6)
    kv = manager([paged("p"), g], num_blocks=16, block_size=4, max_num_seqs=1)
    assert kv.replay_tokens == 6
    s = make_seq(range(40))
    s.block_tables = {"p": [0, 1, 2, 3, 4], "r": [10, 11, 12]}
    s.paged_write_from = 16  # hit of 16 tokens: replay from 10
    r = runner_for(kv)
    assert kv.replay_start(s.paged_write_from) == 10 and kv.replay_start(0) == 0
    assert r._context(g, s, 14, 20).tolist() == [50, 51, 40, 41]  # positions 10..13, not 6..9
    assert r._context(g, s, 10, 20).tolist() == []
    assert r._context(g, s, 20, 21).tolist() == list(range(40, 48))  # the full window again: 12..19
    # the paged group does not rewrite what the hit shares
    assert r._slots(paged("p"), s, range(14, 18)) == [-1, -1, 16, 17]


# ---- state groups -----------------------------------------------------------------------------

def test_state_slots_one_per_sequence_and_reused_after_free():
    kv = manager([state("st")], num_blocks=0, max_num_seqs=3, lookahead=2)
    seqs = [make_seq(range(5), seq_id=i) for i in range(5)]
    assert [kv.allocate(s, 5)["st"] for s in seqs[:3]] == [[0], [1], [2]]
    assert kv.allocate(seqs[0], 9) == {} and seqs[0].block_tables == {"st": [0]}
    assert not kv.can_allocate(seqs[3], 1)
    kv.free(seqs[1])
    kv.free(seqs[0])
    assert seqs[0].block_tables == {}
    assert kv.allocate(seqs[3], 5) == {"st": [0]}
    assert kv.allocate(seqs[4], 5) == {"st": [1]}


def test_state_slots_are_version_rows():
    g = state("st")
    kv = manager([g], num_blocks=0, max_num_seqs=3, lookahead=2)
    s = make_seq(range(12))
    s.block_tables = {"st": [2]}
    r = runner_for(kv)
    assert r._slots(g, s, range(5, 9)) == [6, 7, 8, 6]
    assert r._context(g, s, 5, 9).tolist() == [8]  # the state after token 4: (4 + 1) % 3
    kv0 = manager([g], num_blocks=0, max_num_seqs=3, lookahead=0)
    assert runner_for(kv0)._slots(g, s, range(5, 8)) == [2, 2, 2]


# ---- sizes and shapes of ring / state groups --------------------------------------------------

def test_layer_shape_per_kind():
    assert KVCache.layer_shape(paged(tokens_per_entry=4, entry_dim=32), 10, 16, 3, 2) == (10, 4, 32)
    assert KVCache.layer_shape(ring(window=8, entry_dim=8), 10, 4, 2, 2) == (8, 4, 8)  # 2 seqs * 4 blocks
    assert KVCache.layer_shape(state(state_rows=3, entry_dim=16), 10, 4, 3, 2) == (9, 3, 16)


def test_kv_cache_tensors_of_every_kind():
    groups = [paged("p", ("p0",)), ring("r", ("r0", "r1"), window=8), state("st", ("s0",))]
    cache = KVCache(groups, num_blocks=5, block_size=4, max_num_seqs=2, lookahead=2, device=torch.device("cpu"))
    assert {k: tuple(t.shape) for k, t in cache.tensors.items()} == {
        "p0": (5, 4, 8), "r0": (8, 4, 8), "r1": (8, 4, 8), "s0": (6, 3, 16)}


def test_bytes_per_sequence_counts_ring_and_state_groups_only():
    groups = [paged("p", ("p0",)), ring("r", ("r0", "r1"), window=8), state("st", ("s0",))]
    # ring: 4 blocks * 4 rows * 8 * 2 bytes * 2 layers = 512; state: 3 versions * 3 rows * 16 * 4 bytes = 576
    assert KVCache.bytes_per_sequence(groups, 4, 2) == 512 + 576
    assert KVCache.bytes_per_sequence([paged()], 4, 2) == 0
    assert KVCache.bytes_per_sequence([ring(window=8)], 4, 0) == 3 * 4 * 8 * 2


def test_cache_prefix_computed_elsewhere_is_found_by_a_new_sequence():
    """A context-parallel prefill's prefix: written into fresh blocks, registered, left free and cached."""
    kv = manager(num_blocks=8, block_size=4)
    written = {}
    assert kv.cache_prefix(list(range(8)), lambda blocks: written.update(blocks))
    assert len(written["kv"]) == 2 and kv.num_free == 8  # released: free, but holding the prefix
    hit, blocks = kv.find_cached(make_seq(range(11)))
    assert hit == 8 and blocks == written
    assert not kv.cache_prefix(list(range(6)), lambda blocks: None)  # not whole blocks
    assert not manager(num_blocks=1, block_size=4).cache_prefix(list(range(8)), lambda blocks: None)  # no room
    assert not manager(prefix_caching=False).cache_prefix(list(range(8)), lambda blocks: None)


def test_cache_prefix_frees_its_blocks_when_the_write_fails():
    kv = manager(num_blocks=4, block_size=4)

    def fail(blocks):
        raise RuntimeError("write failed")

    with pytest.raises(RuntimeError, match="write failed"):
        kv.cache_prefix(list(range(8)), fail)
    assert kv.num_free == 4 and not kv.pools["kv"].by_hash


@pytest.mark.parametrize("hash_next_token", [False, True])
def test_prompt_hashes_are_the_keys_a_new_sequence_looks_up(hash_next_token):
    """Data parallelism routes a request by ``prompt_hashes``: they must be the keys the owner's
    cache registers for the prompt and looks up for it (one helper computes both)."""
    kv = KVCacheManager([paged()], 8, 4, 4, 0, True, hash_next_token=hash_next_token)
    ids = list(range(1, 12))  # 11 tokens: two full blocks before the last token
    s = cached_prefix(kv, ids)
    assert kv.prompt_hashes(ids) == s.block_hashes[:2] and len(kv.prompt_hashes(ids)) == 2
    assert kv.prompt_hashes(ids[:9]) == s.block_hashes[:2]  # 9 tokens: the second block's next token is known
    assert kv.prompt_hashes(ids[:8]) == s.block_hashes[:1]
    assert kv.prompt_hashes([1, 2, 3, 9] + ids[4:]) != s.block_hashes[:2]
    assert manager(prefix_caching=False).prompt_hashes(ids) == []
