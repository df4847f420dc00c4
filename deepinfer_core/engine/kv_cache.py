"""The KV cache: one tensor per layer of every cache group, and the managers that hand out blocks.

Every group uses one logical block size in tokens (``block_size``): block i of a sequence's
table in every paged group covers its tokens [i * block_size, (i + 1) * block_size).

* ``paged`` groups draw blocks from a ``BlockPool`` (one per group): ref-counted, and with
  prefix caching on, every full block a sequence computed is registered under a chain hash
  (parent hash + the block's token ids), so a later sequence with the same prefix shares the
  block instead of recomputing it. Blocks nobody holds stay cached until the pool runs out of
  unused ones; then the least recently freed is evicted.
* ``ring`` groups give each running sequence a fixed ring of blocks (window + lookahead tokens).
* ``state`` groups give each running sequence one slot.

Ring and state groups cannot be shared: after a prefix hit they are rebuilt by recomputing the
last ``replay_tokens`` tokens before the first uncached one (bounded replay).

With lower tiers (``tiers``: ``engine/kv_tiers.py``), an evicted cached block is copied to host
memory (and from there to disk) first, and ``load_from_tiers`` copies a sequence's prefix blocks
back into free blocks of the pool before ``find_cached`` looks for them.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from array import array
from collections import OrderedDict

import torch

from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.models.batch import CacheGroup


TIERS = ("gpu", "host", "disk")  # where a reused block was found ("gpu": the device's own pools, whatever the device)

# Block-table versions are unique for the life of the process (never reset with the pools): the
# graphs' incremental host tables key their rows by them.
_table_versions = itertools.count(1)


def block_hash(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """The prefix-cache key of a full block: its parent's key, its token ids, and ``extra``
    (anything else its entries depend on)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def chain_hashes(hashes: list[bytes], count: int, block_size: int, token_slice, next_token=None) -> list[bytes]:
    """Extend ``hashes`` (the chain hashes of a token sequence's first full blocks, in order) to
    its first ``count`` blocks, in place: ``token_slice(start, end)`` gives the sequence's tokens,
    ``next_token(position)`` the token after a block when a block's key includes it (MTP's paged
    cache, ``KVCache.hash_next_token``). The one place the prefix cache's keys are computed."""
    bs = block_size
    for i in range(len(hashes), count):
        extra = array("q", [next_token((i + 1) * bs)]).tobytes() if next_token else b""
        hashes.append(block_hash(hashes[-1] if hashes else None, token_slice(i * bs, (i + 1) * bs), extra))
    return hashes


class BlockPool:
    """The blocks of one paged group: ref counts, hashes of cached blocks, LRU free queue.

    ``free`` holds every block nobody references, in the order they are taken: blocks holding no
    cached prefix first, then cached ones from the least recently freed. Taking a cached block
    evicts its hash.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.on_evict = None  # on_evict(block, hash, recent): a cached block is about to be reused (lower tiers keep it)
        self.reset()

    def reset(self) -> None:
        self.refs = [0] * self.num_blocks
        self.hash_of: list[bytes | None] = [None] * self.num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(self.num_blocks))
        self.recent: set[int] = set()  # freed since the step in flight was launched: it may still use them
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, count: int) -> list[int]:
        if count > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {count}, {len(self.free)} free")
        out = []
        for _ in range(count):
            block, _ = self.free.popitem(last=False)
            h = self.hash_of[block]
            if h is not None:  # evict
                self.hash_of[block] = None
                if self.by_hash.get(h) == block:
                    del self.by_hash[h]
                    if self.on_evict is not None:
                        self.on_evict(block, h, block in self.recent)
                self.num_evicted += 1
            self.refs[block] = 1
            out.append(block)
        return out

    def share(self, block: int) -> None:
        """One more holder of a cached block (taken off the free queue if nobody held it)."""
        if self.refs[block] == 0:
            del self.free[block]
        self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; last ones first, so a sequence's tail is evicted before its head."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None
                self.recent.add(block)
                if self.hash_of[block] is None:  # nothing cached in it: reuse it before any cached block
                    self.free.move_to_end(block, last=False)

    def register(self, block: int, h: bytes) -> None:
        if self.hash_of[block] is None and h not in self.by_hash:
            self.hash_of[block] = h
            self.by_hash[h] = block


class KVCache:
    """The cache tensors, by layer name: paged groups [num_blocks, block_size // tokens_per_entry,
    entry_dim], ring groups [ring blocks, block_size, entry_dim], state groups [slots *
    (1 + lookahead), state_rows, entry_dim]."""

    def __init__(self, groups: list[CacheGroup], num_blocks: int, block_size: int, max_num_seqs: int, lookahead: int, device: torch.device):
        self.groups = groups
        self.tensors: dict[str, torch.Tensor] = {}
        for g in groups:
            shape = self.layer_shape(g, num_blocks, block_size, max_num_seqs, lookahead)
            for layer in g.layers:
                self.tensors[layer] = torch.zeros(shape, dtype=g.dtype, device=device)

    @staticmethod
    def ring_block(group: CacheGroup, block_size: int) -> int:
        """Tokens per block of a ring group (its own ``ring_block``, else the engine's block size)."""
        return group.ring_block or block_size

    @classmethod
    def ring_blocks(cls, group: CacheGroup, block_size: int, lookahead: int) -> int:
        """Blocks in one sequence's ring: room for window + lookahead tokens wherever they start."""
        return math.ceil((group.window + lookahead) / cls.ring_block(group, block_size)) + 1

    @classmethod
    def layer_shape(cls, g: CacheGroup, num_blocks: int, block_size: int, max_num_seqs: int, lookahead: int) -> tuple[int, int, int]:
        if g.kind == "paged":
            blocks, rows = num_blocks, block_size // g.tokens_per_entry
        elif g.kind == "ring":
            blocks, rows = max_num_seqs * cls.ring_blocks(g, block_size, lookahead), cls.ring_block(g, block_size)
        else:
            blocks, rows = max_num_seqs * (1 + lookahead), g.state_rows
        while blocks * rows % g.row_multiple:  # padding blocks (no table names them): whole row_multiples
            blocks += 1
        return (blocks, rows, g.entry_dim)

    @staticmethod
    def bytes_per_token(groups: list[CacheGroup]) -> float:
        """Bytes the paged groups need per token of context."""
        return sum(g.bytes_per_token() for g in groups if g.kind == "paged")

    @classmethod
    def bytes_per_sequence(cls, groups: list[CacheGroup], block_size: int, lookahead: int) -> int:
        """Bytes the ring and state groups need per running sequence, whatever its length."""
        total = 0
        for g in groups:
            if g.kind != "paged":
                rows = math.prod(cls.layer_shape(g, 0, block_size, 1, lookahead)[:2])
                total += rows * g.entry_bytes * len(g.layers)
        return total


class KVCacheManager:
    """Block tables of every group for every sequence (``Sequence.block_tables[group]``).

    Paged groups hold blocks for the first n tokens of a sequence (``allocate``, ``truncate``
    after a rollback, ``free``); with ``prefix_caching`` their full computed blocks are registered
    (``cache``) and found again for new sequences (``find_cached``). Ring and state groups hand
    out a sequence's ring / slot on its first allocation and take it back on ``free``.
    """

    def __init__(self, groups: list[CacheGroup], num_blocks: int, block_size: int, max_num_seqs: int,
                 lookahead: int = 0, prefix_caching: bool = True, hash_next_token: bool = False):
        for g in groups:
            if g.kind == "paged" and block_size % g.tokens_per_entry:
                raise ValueError(
                    f"block_size {block_size} is not a multiple of cache group {g.name!r}'s {g.tokens_per_entry} "
                    f"tokens per entry; choose a block_size that is"
                )
        self.groups = groups
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.lookahead = lookahead
        self.prefix_caching = prefix_caching
        self.hash_next_token = hash_next_token
        self.paged = [g.name for g in groups if g.kind == "paged"]
        self.rings = {g.name: KVCache.ring_blocks(g, block_size, lookahead) for g in groups if g.kind == "ring"}
        self.states = [g.name for g in groups if g.kind == "state"]
        self.replay_tokens = max((g.replay_tokens for g in groups if g.kind != "paged"), default=0)
        self.pools = {name: BlockPool(num_blocks) for name in self.paged}
        self.tiers = None  # kv_tiers.KVTiers: the host and disk tiers below the pools (attach_tiers)
        self.reset()

    def reset(self) -> None:
        """Every block and slot free, no prefix cached (the sequences that held them must be gone)."""
        for pool in self.pools.values():
            pool.reset()
        if self.tiers is not None:  # a step dropped unresolved may still use any block
            self.tiers.after_device()
        self.ring_free = {name: list(range(self.max_num_seqs * n - 1, -1, -1)) for name, n in self.rings.items()}
        self.state_free = {name: list(range(self.max_num_seqs - 1, -1, -1)) for name in self.states}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_hit_tokens_by_tier = dict.fromkeys(TIERS, 0)  # the tier each reused token's block came from

    @property
    def num_free(self) -> int:
        """Free blocks of the tightest paged group (blocks holding a cached prefix count as free)."""
        return min((p.num_free for p in self.pools.values()), default=0)

    # ---- prefix caching ---------------------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Chain hashes of the full blocks among the first ``num_tokens`` tokens (kept on the sequence)."""
        bs = self.block_size
        full = num_tokens // bs
        if self.hash_next_token:  # only blocks whose next token is known
            full = min(full, (seq.num_tokens - 1) // bs)
        return chain_hashes(seq.block_hashes, full, bs, seq.token_slice, seq.token_at if self.hash_next_token else None)

    def prompt_hashes(self, token_ids: list[int]) -> list[bytes]:
        """The keys ``find_cached`` looks up for a new sequence with this prompt (its full blocks
        before its last token), computed as for the sequence itself; none with prefix caching off.
        Data parallelism's prefix affinity routes a request by them."""
        if not self.prefix_caching or not self.paged:
            return []
        count = (len(token_ids) - 1) // self.block_size
        return chain_hashes([], count, self.block_size, lambda a, b: token_ids[a:b],
                            token_ids.__getitem__ if self.hash_next_token else None)

    def find_cached(self, seq: Sequence) -> tuple[int, dict[str, list[int]]]:
        """(tokens, blocks per paged group) of the longest cached prefix ``seq`` may reuse: whole
        blocks that every paged group holds, leaving at least its last token to compute (its logits
        are needed). Nothing is taken yet."""
        if not self.prefix_caching or not self.paged or seq.wants_prompt_logprobs:
            return 0, {}
        usable = (seq.num_tokens - 1) // self.block_size  # the sequence's hashes may cover its last token
        hashes = self._hashes(seq, seq.num_tokens - 1)[:usable]
        blocks: dict[str, list[int]] = {name: [] for name in self.paged}
        for h in hashes:
            found = [self.pools[name].by_hash.get(h) for name in self.paged]
            if None in found:
                break
            for name, b in zip(self.paged, found):
                blocks[name].append(b)
        return len(blocks[self.paged[0]]) * self.block_size, blocks

    def replay_start(self, num_hit: int) -> int:
        """Where a sequence whose first ``num_hit`` tokens came from the prefix cache starts
        computing: ``replay_tokens`` earlier, to rebuild its ring and state groups (bounded
        replay). Also the first position those groups hold for it."""
        return max(0, num_hit - self.replay_tokens) if num_hit else 0

    def count_lookup(self, num_tokens: int, num_hit: int, by_tier: dict[str, int] | None = None) -> None:
        """A sequence of ``num_tokens`` tokens was admitted with ``num_hit`` of them cached (hit
        rate), ``by_tier`` of them from each tier (``tokens_by_tier``)."""
        if self.prefix_caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit
            for tier, n in (by_tier or {"gpu": num_hit}).items():
                self.num_hit_tokens_by_tier[tier] += n

    # ---- lower tiers ------------------------------------------------------------------------------
    def attach_tiers(self, tiers) -> None:
        """From now on evicted cached blocks go to ``tiers`` (a ``kv_tiers.KVTiers`` over this
        manager's cache) and come back through ``load_from_tiers``."""
        self.tiers = tiers
        for name, pool in self.pools.items():
            pool.on_evict = lambda block, h, recent, name=name: tiers.offload(name, block, h, recent)

    def launching(self) -> None:
        """A step is about to be launched: blocks freed before now are not among those it uses
        (the lower tiers' copies of them need not wait for it)."""
        for pool in self.pools.values():
            pool.recent.clear()
        if self.tiers is not None:
            self.tiers.launching()

    def _join_tiers(self) -> None:
        """Work queued on the device from now on waits for the lower tiers' copies queued so far
        (blocks just taken are copied out of, or into, before anything writes or reads them)."""
        if self.tiers is not None:
            self.tiers.join()

    def close_tiers(self) -> None:
        """Detach the lower tiers; with a disk tier, every block the pools cache is written to it
        first (the next start with the same directory finds them) and its writes are finished."""
        tiers, self.tiers = self.tiers, None
        if tiers is None:
            return
        for pool in self.pools.values():
            pool.on_evict = None
        if tiers.disk is not None:
            for h in list(self.pools[self.paged[0]].by_hash):  # block by block: every group's part together
                for name, pool in self.pools.items():
                    if h in pool.by_hash:
                        tiers.offload(name, pool.by_hash[h], h, False)
            tiers.end_round()
        tiers.close()

    def _tier_plan(self, hashes: list[bytes]) -> tuple[int, list[tuple[int, bytes, list[str], str]]]:
        """(n, plan): the first n blocks every pool holds, then per following block (position,
        hash, the paged groups whose pool lacks it, the tier that has them: "gpu" when none
        lacks it), up to the first block no tier has."""
        n = 0
        while n < len(hashes) and all(hashes[n] in p.by_hash for p in self.pools.values()):
            n += 1
        plan = []
        for i in range(n, len(hashes)):
            missing = [name for name in self.paged if hashes[i] not in self.pools[name].by_hash]
            tier = self.tiers.tier_of(hashes[i], missing) if missing else "gpu"
            if tier is None:
                break
            plan.append((i, hashes[i], missing, tier))
        return n, plan

    def load_from_tiers(self, seq: Sequence) -> bool:
        """Copy the blocks of ``seq``'s prefix that follow those the pools hold and that a lower
        tier has into free blocks of the pools, registered under their hashes and left cached and
        free as if never evicted (``find_cached`` then finds them; ``seq.loaded_from`` notes the
        tier of each). Only what fits the free blocks, and only a prefix that outlasts the bounded
        replay. False while a disk read for them is in flight: the sequence waits (the reads go on)."""
        tiers = self.tiers
        if tiers is None or not self.prefix_caching or not self.paged or seq.wants_prompt_logprobs:
            return True
        usable = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes(seq, seq.num_tokens - 1)[:usable]
        n, plan = self._tier_plan(hashes)
        if not plan or (plan[-1][0] + 1) * self.block_size <= self.replay_tokens:
            return True
        if any(tier == "disk" for *_, tier in plan):
            for i, _, _, tier in plan:
                if tier == "disk":
                    seq.loaded_from.setdefault(i, "disk")
            if tiers.fetch([h for _, h, missing, _ in plan if missing]):
                return False
            n, plan = self._tier_plan(hashes)
            plan = plan[:next((k for k, p in enumerate(plan) if p[3] == "disk"), len(plan))]  # what did not fit the host
        held = {name: [pool.by_hash[h] for h in hashes[: n + len(plan)] if h in pool.by_hash] for name, pool in self.pools.items()}
        for name, blocks in held.items():  # kept off the free queue while blocks are taken for the rest
            for b in blocks:
                self.pools[name].share(b)
        fits, need = 0, dict.fromkeys(self.paged, 0)
        for _, _, missing, _ in plan:
            for name in missing:
                need[name] += 1
            if any(need[name] > self.pools[name].num_free for name in missing):
                break
            fits += 1
        plan = plan[:fits] if (n + fits) * self.block_size > self.replay_tokens else []
        tiers.keep.update(h for _, h, _, _ in plan)  # the blocks taken next may evict others to the host, never these
        taken = {name: iter(pool.take(sum(name in p[2] for p in plan))) for name, pool in self.pools.items()}
        chain = {name: [pool.by_hash[h] for h in hashes[:n]] for name, pool in self.pools.items()}  # the prefix's blocks, in order
        for i, h, missing, tier in plan:
            for name in self.paged:
                if name in missing:
                    block = next(taken[name])
                    tiers.load(name, h, block, block in self.pools[name].recent)
                    self.pools[name].register(block, h)
                chain[name].append(self.pools[name].by_hash[h])
            if missing:
                seq.loaded_from.setdefault(i, tier)
        for name, pool in self.pools.items():  # back to the free queue: the chain's tail is evicted before its head
            in_chain = set(chain[name])
            pool.release(chain[name] + [b for b in held[name] if b not in in_chain])
        self._join_tiers()
        return True

    def tokens_by_tier(self, seq: Sequence, hit: int, saved: int) -> dict[str, int]:
        """The ``saved`` tokens of a ``hit``-token prefix hit of ``seq`` by the tier each block
        came from, counted at the hit's end (positions [hit - saved, hit)): the bounded replay is
        charged to the head of the hit, so a lower tier's count is what the hit would lack without it."""
        out = dict.fromkeys(TIERS, 0)
        bs = self.block_size
        for i in range((hit - saved) // bs, -(-hit // bs)):
            out[seq.loaded_from.get(i, "gpu")] += min((i + 1) * bs, hit) - max(i * bs, hit - saved)
        return out

    def end_round(self) -> None:
        """A step's allocations are done: the lower tiers' copies queued in it are marked, and
        blocks new to the host tier are written to disk."""
        if self.tiers is not None:
            self.tiers.end_round()

    def cache(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full blocks among the sequence's first ``num_tokens`` (computed and accepted) tokens."""
        if not self.prefix_caching or not self.paged:
            return
        # only the blocks these tokens fill: the sequence's hashes may run ahead (find_cached
        # hashes the whole prompt before a chunk has computed it)
        hashes = self._hashes(seq, num_tokens)
        full = min(num_tokens // self.block_size, len(hashes))
        for name in self.paged:
            table, pool = seq.block_tables[name], self.pools[name]
            for i in range(seq.num_registered_blocks, min(full, len(table))):
                pool.register(table[i], hashes[i])
        seq.num_registered_blocks = max(seq.num_registered_blocks, min(full, len(seq.block_tables[self.paged[0]])))

    def cache_prefix(self, token_ids: list[int], write) -> bool:
        """Put the cache entries of a prefix computed elsewhere (a context-parallel prefill) into
        the prefix cache: blocks for ``token_ids`` (whole blocks) are taken, ``write(blocks per
        paged group)`` fills them, and they are registered under the prefix's hashes and released
        (cached and free: a request with this prefix finds them, and they are evicted like any
        cached block). False, with nothing done, when prefix caching is off or too few blocks are
        free."""
        bs = self.block_size
        if not self.prefix_caching or self.hash_next_token or len(token_ids) % bs or not token_ids:
            return False
        count = len(token_ids) // bs
        if any(pool.num_free < count for pool in self.pools.values()):
            return False
        blocks = {name: pool.take(count) for name, pool in self.pools.items()}
        self._join_tiers()
        try:
            write(blocks)
            hashes = chain_hashes([], count, bs, lambda a, b: token_ids[a:b])
            for name, pool in self.pools.items():
                for block, h in zip(blocks[name], hashes):
                    pool.register(block, h)
        finally:
            for name, pool in self.pools.items():
                pool.release(blocks[name])
        return True

    # ---- allocation -------------------------------------------------------------------------------
    def _needed(self, seq: Sequence, num_tokens: int, cached: dict[str, list[int]]) -> dict[str, int]:
        blocks = -(-num_tokens // self.block_size)
        out = {}
        for name in self.paged:
            have = len(seq.block_tables.get(name, ())) + len(cached.get(name, ()))
            reused_free = sum(1 for b in cached.get(name, ()) if self.pools[name].refs[b] == 0)
            out[name] = max(0, blocks - have) + reused_free
        return out

    def can_allocate(self, seq: Sequence, num_tokens: int, cached: dict[str, list[int]] | None = None) -> bool:
        needed = self._needed(seq, num_tokens, cached or {})
        if any(n > self.pools[name].num_free for name, n in needed.items()):
            return False
        fresh = not seq.block_tables
        return not fresh or (all(len(f) >= self.rings[g] for g, f in self.ring_free.items())
                             and all(self.state_free.values()))

    def allocate(self, seq: Sequence, num_tokens: int, cached: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
        """Make ``seq`` hold its first ``num_tokens`` tokens (taking ``cached`` prefix blocks first,
        on its first allocation); returns the blocks added per group."""
        if not self.can_allocate(seq, num_tokens, cached):
            raise RuntimeError(f"out of KV blocks for sequence {seq.seq_id} ({num_tokens} tokens)")
        added: dict[str, list[int]] = {}
        fresh = not seq.block_tables
        if fresh:
            seq.table_version = next(_table_versions)
            for name, n in self.rings.items():
                free = self.ring_free[name]
                added[name] = [free.pop() for _ in range(n)]
                seq.block_tables[name] = list(added[name])
            for name in self.states:
                added[name] = [self.state_free[name].pop()]
                seq.block_tables[name] = list(added[name])
        blocks = -(-num_tokens // self.block_size)
        for name in self.paged:
            table = seq.block_tables.setdefault(name, [])
            new = []
            for b in (cached or {}).get(name, ()):
                self.pools[name].share(b)
                new.append(b)
            new += self.pools[name].take(max(0, blocks - len(table) - len(new)))
            table.extend(new)
            if new:
                added[name] = new
        if cached:
            seq.num_registered_blocks = len(next(iter(cached.values())))
        self._join_tiers()
        return added

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the paged blocks the first ``num_tokens`` tokens need (after a rollback)."""
        blocks = -(-num_tokens // self.block_size)
        for name in self.paged:
            table = seq.block_tables.get(name, [])
            if len(table) > blocks:
                self.pools[name].release(table[blocks:])
                del table[blocks:]
                seq.table_version = next(_table_versions)
        seq.num_registered_blocks = min(seq.num_registered_blocks, blocks)

    def free(self, seq: Sequence) -> None:
        for name, table in seq.block_tables.items():
            if name in self.pools:
                self.pools[name].release(table)
            elif name in self.ring_free:
                self.ring_free[name].extend(reversed(table))
            else:
                self.state_free[name].extend(table)
        seq.block_tables = {}
        seq.num_registered_blocks = 0
        seq.table_version = next(_table_versions)
