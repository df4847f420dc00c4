"""Static tables of DeepSeek-V4.1's Engram n-gram memory (deepseek_architectures.md §4.5).

Everything here is derived from the config and the tokenizer alone (no weights):

* **Primes.** Each engram layer has one embedding-table segment per (n-gram size, head); the
  segment sizes are primes. Over all engram layers in config order, then n-gram sizes 2..N,
  then heads, each prime is the smallest prime strictly above the previous one, the search
  starting from ``engram_vocab_size - 1`` (so the first prime is the smallest prime
  >= ``engram_vocab_size``). No prime is shared between layers. A layer's table has
  ``sum(primes)`` rows and each segment starts at the running sum of the primes before it
  (for V4.1-Flash: 16 000 000, layers [1, 14], N = 4, 8 heads -> 384 006 168 and
  384 016 682 rows, the official ``engram_num_embeddings``).
* **Multipliers.** Per layer, ``N`` odd multipliers ``2 r + 1`` with
  ``r ~ numpy.random.default_rng(10007 * layer_id).integers(0, ((2**63 - 1) // C) // 2)``
  where ``C`` is the compressed vocabulary size, so that ``id * mult < 2**63`` for any id < C.
* **Compressed token ids.** Token ids are folded onto a smaller space by normalising each
  token's decoded text with the ``tokenizers`` normalisers DeepSeek's code runs (NFKC, NFD,
  strip accents, lowercase, runs of space / tab / CR / LF to one space, strip, a lone space
  kept) and numbering the distinct keys by first appearance in token-id order.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic for n < 3.3e24


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin primality test (exact for every n < 3.3e24)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _next_prime(n: int) -> int:
    """The smallest prime strictly greater than n."""
    n += 1
    while not _is_prime(n):
        n += 1
    return n


def engram_primes(vocab_size: int, layer_ids: Sequence[int], max_ngram: int, n_heads: int) -> dict[int, list[list[int]]]:
    """layer_id -> primes[max_ngram - 1][n_heads] (n-gram sizes 2..max_ngram, then heads).

    One global increasing sequence over ``layer_ids`` in the given order: each prime is the
    next prime strictly above the previous one, the first one the next prime above
    ``vocab_size - 1``.
    """
    out: dict[int, list[list[int]]] = {}
    p = vocab_size - 1
    for layer in layer_ids:
        sizes = []
        for _ in range(max_ngram - 1):
            heads = []
            for _ in range(n_heads):
                p = _next_prime(p)
                heads.append(p)
            sizes.append(heads)
        out[layer] = sizes
    return out


def engram_offsets(primes: list[list[int]]) -> list[int]:
    """Start row of each (size, head) segment in one layer's table, flattened in (size, head)
    order: ``offset[(s - 1) * H + h]`` = sum of the layer's primes before that one (first 0)."""
    offsets, total = [], 0
    for p in (p for row in primes for p in row):
        offsets.append(total)
        total += p
    return offsets


def engram_table_rows(primes: list[list[int]]) -> int:
    """Rows of one layer's Engram table: the sum of its primes."""
    return sum(p for row in primes for p in row)


def engram_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram: int) -> list[int]:
    """The layer's ``max_ngram`` odd hash multipliers ``2 r + 1`` (python ints), r drawn with
    ``numpy.random.default_rng(10007 * layer_id)``; ``id * mult < 2**63`` for every
    ``0 <= id < compressed_vocab_size``."""
    high = ((2**63 - 1) // compressed_vocab_size) // 2
    r = np.random.default_rng(10007 * layer_id).integers(0, high, size=max_ngram)
    return [2 * int(x) + 1 for x in r]


def _deepseek_normalizer():
    """The normaliser DeepSeek's ``build_compressed_token_map`` runs, built from the ``tokenizers``
    library's own normalisers (not re-implemented: their whitespace and accent rules are the
    contract). A private-use sentinel keeps a text that is exactly one space from being stripped
    to nothing."""
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])


def compressed_token_ids(tokenizer: Any) -> tuple[torch.Tensor, int]:
    """Map every token id of ``tokenizer`` to its compressed id, as DeepSeek's
    ``build_compressed_token_map`` does; returns (int64 [vocab], compressed vocabulary size).

    ``tokenizer``: a ``tokenizers.Tokenizer`` or a transformers fast tokenizer (its
    ``backend_tokenizer``: DeepSeek decodes with the Rust tokenizer, without transformers'
    clean-up of spaces). Every id, added and special tokens included, is decoded alone
    (``skip_special_tokens=False``). The key of a decode holding U+FFFD (a byte piece that is no
    UTF-8 text alone) is the raw token string; otherwise the decode normalised
    (``_deepseek_normalizer``), or the decode itself where that leaves nothing. Keys are one
    space: a raw token string and a text that are equal share an id. Compressed ids number the
    distinct keys 0, 1, 2, ... by first appearance in token-id order.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "decode_batch"):
        raise TypeError(f"Engram's compressed vocabulary needs a fast tokenizer (tokenizer.json), got {type(tokenizer).__name__}")
    n = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    normalizer = _deepseek_normalizer()
    table: dict[str, int] = {}
    out: list[int] = []
    for i, text in enumerate(texts):
        if "\ufffd" in text:
            key = backend.id_to_token(i)
        else:
            key = normalizer.normalize_str(text) or text
        out.append(table.setdefault(key, len(table)))
    return torch.tensor(out, dtype=torch.int64), len(table)
