"""Engram (DeepSeek-V4.1 n-gram memory, deepseek_architectures.md §4.5): static tables and ops,
each against an independent formulation."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer_core.models.v41 import engram_tables as et
from deepinfer_core.ops.engram import engram_gate, engram_hash_ids

# The official V4.1-Flash Engram config (§4.5).
VOCAB, LAYERS, NGRAM, HEADS, CVOCAB, PAD = 16_000_000, [1, 14], 4, 8, 99_092, 2
NUM_EMBEDDINGS = [384_006_168, 384_016_682]


def _trial_prime(n: int) -> bool:
    return n >= 2 and all(n % k for k in range(2, math.isqrt(n) + 1))


@pytest.fixture(scope="module")
def primes() -> dict[int, list[list[int]]]:
    return et.engram_primes(VOCAB, LAYERS, NGRAM, HEADS)


# --------------------------------------------------------------------------- primes / offsets


def test_table_rows_match_official_num_embeddings(primes):
    assert [et.engram_table_rows(primes[layer]) for layer in LAYERS] == NUM_EMBEDDINGS


def test_primes_are_consecutive_primes_from_vocab_size(primes):
    start = time.perf_counter()
    et.engram_primes(VOCAB, LAYERS, NGRAM, HEADS)
    assert time.perf_counter() - start < 1.0
    assert list(primes) == LAYERS
    flat = [p for layer in LAYERS for row in primes[layer] for p in row]
    assert all(len(primes[layer]) == NGRAM - 1 and all(len(r) == HEADS for r in primes[layer]) for layer in LAYERS)
    assert len(flat) == len(set(flat)) == len(LAYERS) * (NGRAM - 1) * HEADS
    assert all(a < b for a, b in zip(flat, flat[1:]))
    # every one prime, and no prime skipped between VOCAB - 1 and the last one
    assert all(_trial_prime(p) for p in flat)
    assert [n for n in range(VOCAB, flat[-1] + 1) if _trial_prime(n)] == flat
    assert not set(sum(primes[1], [])) & set(sum(primes[14], []))


def test_miller_rabin_agrees_with_trial_division():
    assert [n for n in range(3000) if et._is_prime(n)] == [n for n in range(3000) if _trial_prime(n)]
    assert et._is_prime(2**61 - 1) and not et._is_prime(3215031751)  # a strong pseudoprime to 2,3,5,7


def test_search_starts_at_vocab_size_minus_one():
    # a prime vocab size is itself the first prime
    assert et.engram_primes(11, [0], 2, 1) == {0: [[11]]}
    assert et.engram_primes(12, [3, 5], 3, 2) == {3: [[13, 17], [19, 23]], 5: [[29, 31], [37, 41]]}


def test_offsets_are_running_sums(primes):
    for layer in LAYERS:
        flat = [p for row in primes[layer] for p in row]
        offs = et.engram_offsets(primes[layer])
        assert offs == [sum(flat[:i]) for i in range(len(flat))]
        assert offs[-1] + flat[-1] == et.engram_table_rows(primes[layer])


# --------------------------------------------------------------------------- multipliers


@pytest.mark.parametrize("layer", LAYERS)
def test_multipliers(layer):
    mult = et.engram_multipliers(layer, CVOCAB, NGRAM)
    rng = np.random.default_rng(seed=10007 * layer)
    expected = [2 * int(r) + 1 for r in rng.integers(low=0, high=(2**63 - 1) // CVOCAB // 2, size=NGRAM)]
    assert mult == expected
    assert all(type(m) is int and m > 0 and m % 2 == 1 for m in mult)
    assert all((CVOCAB - 1) * m < 2**63 for m in mult)
    assert len(set(mult)) == NGRAM


# --------------------------------------------------------------------------- hash ids


def _ngram_columns(seq: list[int | None], n: int) -> torch.Tensor:
    """[T, n] lookback ids of a compressed-id sequence; None marks a dead token."""
    rows = []
    for p in range(len(seq)):
        row, blocked = [], False
        for s in range(n):
            blocked = blocked or p - s < 0 or seq[p - s] is None
            row.append(-1 if blocked else seq[p - s])
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


def _python_hash(seq: list[int | None], mult: list[int], primes: list[list[int]], pad: int) -> list[list[int]]:
    """The hash with python ints, one position at a time."""
    offs = et.engram_offsets(primes)
    heads = len(primes[0])
    out = []
    for p in range(len(seq)):
        ids, roll, blocked = [], 0, False
        for s in range(len(mult)):
            if p - s < 0 or seq[p - s] is None:
                blocked = True
            v = pad if blocked else seq[p - s]
            roll = v * mult[0] if s == 0 else roll ^ (v * mult[s])
            assert 0 <= roll < 2**63
            if s >= 1:
                ids += [roll % primes[s - 1][h] + offs[(s - 1) * heads + h] for h in range(heads)]
        out.append(ids)
    return out


def _op_inputs(layer: int, primes):
    mult = et.engram_multipliers(layer, CVOCAB, NGRAM)
    return (
        torch.tensor(mult, dtype=torch.int64),
        torch.tensor(primes[layer], dtype=torch.int64),
        torch.tensor(et.engram_offsets(primes[layer]), dtype=torch.int64),
    )


@pytest.mark.parametrize("layer", LAYERS)
def test_hash_ids_known_values(layer, primes):
    # positions 0..2 have blocked lookbacks; position 5 is dead (blocks itself and 6..8's tails)
    seq = [17, 5, CVOCAB - 1, 0, 42, None, 99_000, 3, 3, 3, 12345]
    cols = _ngram_columns(seq, NGRAM)
    assert cols[0].tolist() == [17, -1, -1, -1] and cols[2].tolist() == [CVOCAB - 1, 5, 17, -1]
    assert cols[7].tolist() == [3, 99_000, -1, -1]
    got = engram_hash_ids(cols, *_op_inputs(layer, primes), PAD)
    assert got.dtype == torch.int64 and got.shape == (len(seq), (NGRAM - 1) * HEADS)
    expected = _python_hash(seq, et.engram_multipliers(layer, CVOCAB, NGRAM), primes[layer], PAD)
    assert got.tolist() == expected
    # a dead position (every lookback blocked) hashes the all-pad n-grams
    assert got[5].tolist() == _python_hash([PAD, PAD, PAD, PAD], et.engram_multipliers(layer, CVOCAB, NGRAM), primes[layer], PAD)[3]


@pytest.mark.parametrize("layer", LAYERS)
def test_hash_ids_inside_their_segments(layer, primes):
    gen = torch.Generator().manual_seed(layer)
    t = 4096
    ids = torch.randint(0, CVOCAB, (t, NGRAM), generator=gen)
    ids[:64] = CVOCAB - 1  # the largest products
    depth = torch.randint(1, NGRAM + 1, (t,), generator=gen)  # columns >= depth blocked
    ids[torch.arange(NGRAM)[None] >= depth[:, None]] = -1
    mult, pr, offs = _op_inputs(layer, primes)
    got = engram_hash_ids(ids, mult, pr, offs, PAD)
    lo, hi = offs[None], (offs + pr.flatten())[None]
    assert bool((got >= lo).all()) and bool((got < hi).all())
    assert int(got.min()) >= 0 and int(got.max()) < et.engram_table_rows(primes[layer])
    sample = torch.randint(0, t, (32,), generator=gen)
    for i in sample.tolist():
        seq = [v for v in reversed(ids[i].tolist()) if v >= 0]  # oldest first, then pad-blocked
        want = _python_hash([None] * (NGRAM - len(seq)) + seq, mult.tolist(), primes[layer], PAD)[-1]
        assert got[i].tolist() == want


# --------------------------------------------------------------------------- gate


def _gate_reference(x, kv, qw, kw, eps):
    """Per stream, per token, in float64 from the (already rounded) inputs."""
    t, hc, d = x.shape
    x, kv, qw, kw = x.double(), kv.double(), qw.double(), kw.double()
    out = torch.empty(t, hc, d, dtype=torch.float64)
    value = kv[:, hc * d :]
    for i in range(t):
        for k in range(hc):
            xk, key = x[i, k], kv[i, k * d : (k + 1) * d]
            dot = float((xk * qw[k] * kw[k] * key).sum())
            dot /= math.sqrt(float(xk.pow(2).mean()) + eps) * math.sqrt(float(key.pow(2).mean()) + eps) * math.sqrt(d)
            z = math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot) if dot != 0 else 0.0
            g = 1 / (1 + math.exp(-z))
            out[i, k] = xk + g * value[i]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_matches_per_stream_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    t, hc, d = 5, 4, 64
    x = torch.randn(t, hc, d, generator=gen).to(dtype)
    kv = (torch.randn(t, (hc + 1) * d, generator=gen) * 3).to(dtype)
    qw = (torch.randn(hc, d, generator=gen) * 0.5 + 1).to(dtype)
    kw = (torch.randn(hc, d, generator=gen) * 0.5 + 1).to(dtype)
    got = engram_gate(x, kv, qw, kw, 1e-20)
    assert got.dtype == dtype and got.shape == x.shape
    want = _gate_reference(x, kv, qw, kw, 1e-20)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:  # one rounding of the float32 result: within half a bf16 ulp (plus float32 noise)
        torch.testing.assert_close(got.double(), want, rtol=2**-8 + 1e-5, atol=1e-5)
        assert (got == want.to(dtype)).float().mean() > 0.95


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_sign_and_floor(dtype):
    # x_k = key_k = 1 and q_weight * k_weight = c give dot_k = c * D * D^-0.5 = 2c for D = 4
    d, hc = 4, 5
    c = torch.tensor([-0.5, 0.5, 1e-9, -1e-9, 0.0])
    x = torch.ones(1, hc, d, dtype=dtype)
    value = torch.tensor([1.0, -2.0, 0.5, 4.0])
    kv = torch.cat([torch.ones(hc * d), value])[None].to(dtype)
    qw = c[:, None].expand(hc, d).contiguous()
    kw = torch.ones(hc, d)
    got = engram_gate(x, kv, qw.to(dtype), kw.to(dtype), 1e-20)
    gates = torch.tensor([
        1 / (1 + math.exp(math.sqrt(1.0))),  # negative dot: gate below one half
        1 / (1 + math.exp(-math.sqrt(1.0))),
        1 / (1 + math.exp(-1e-3)),  # |dot| = 2e-9 is floored to 1e-6 -> +-sqrt(1e-6)
        1 / (1 + math.exp(1e-3)),
        0.5,  # sign(0) = 0
    ])
    want = (1 + gates[:, None] * value[None])[None]
    torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=0, atol=0 if dtype == torch.bfloat16 else 1e-6)
    assert gates[0] < 0.5 < gates[1] and gates[3] < 0.5 < gates[2]


# --------------------------------------------------------------------------- compressed token ids


def _byte_level_tokenizer(texts: list[str]):
    """A byte-level BPE ``tokenizers.Tokenizer`` (GPT-2's byte alphabet, as DeepSeek's
    tokenizers) whose token i is the UTF-8 bytes of texts[i] (a str) or the bytes themselves."""
    from tokenizers import Tokenizer, decoders, models

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    raw = [t.encode() if isinstance(t, str) else t for t in texts]
    tok = Tokenizer(models.BPE(vocab={"".join(alphabet[b] for b in r): i for i, r in enumerate(raw)}, merges=[]))
    tok.decoder = decoders.ByteLevel()
    return tok


# (token text or bytes, its compressed id by DeepSeek's rule: tokenizers' NFKC -> NFD ->
# StripAccents -> Lowercase -> [ \t\r\n]+ to " " -> strip (a lone space kept); the decode itself
# where that leaves nothing; the raw token string where the decode holds U+FFFD)
_TOKENS = [
    ("<s>", 0),
    ("e", 1),
    ("\u00e9", 1),  # precomposed é
    ("E\u0301", 1),  # decomposed É
    ("\uff25", 1),  # full-width E (NFKC)
    ("\x0b", 2),  # vertical tab: stripped to nothing, so keyed by itself (not " ")
    ("\x0c", 3),  # form feed: likewise
    ("\x1c", 4),  # not whitespace to tokenizers: kept
    ("\x1f", 5),
    (" ", 6),  # a lone space is kept
    ("  ", 6),
    ("\t\n", 6),
    ("\u3000", 6),  # ideographic space: NFKC " "
    ("\u00a0", 6),  # no-break space: NFKC " "
    ("\u2009", 6),  # thin space: NFKC " "
    (" \x0b", 7),  # " \x0b" strips to nothing: keyed by itself
    ("\x0b\x0b", 8),
    ("\u0301", 9),  # a lone combining mark: nothing left, keyed by itself
    ("\ufb01", 10),  # the fi ligature: NFKC "fi"
    ("FI", 10),
    (b"\xe2", 11),  # a byte piece: decodes to U+FFFD, keyed by its raw token string "\u00e2"
    ("\u00e2", 12),  # the text "â" normalises to "a"
    (b"\xa0", 13),  # a byte piece whose raw token string is "\u0142" ...
    ("\u0142", 13),  # ... the same key as the text "ł": one key space
    ("\u0141", 13),
]


def test_compressed_ids_follow_deepseeks_rule():
    """Each token's compressed id as DeepSeek's build_compressed_token_map gives it: whitespace
    other than space / tab / CR / LF is no space, accents and widths fold, byte pieces key by
    their raw token string in the same key space as texts."""
    tok = _byte_level_tokenizer([t for t, _ in _TOKENS])
    assert tok.decode([20]) == "\ufffd" and tok.id_to_token(20) == "\u00e2" and tok.id_to_token(22) == "\u0142"
    ids, n = et.compressed_token_ids(tok)
    assert ids.dtype == torch.int64
    assert ids.tolist() == [c for _, c in _TOKENS] and n == 14


def test_compressed_ids_of_a_transformers_tokenizer_are_its_backends():
    """A transformers fast tokenizer is read through its Rust backend (DeepSeek decodes with that,
    without transformers' space clean-up); special tokens are decoded, not skipped."""
    transformers = pytest.importorskip("transformers")
    tok = _byte_level_tokenizer([t for t, _ in _TOKENS])
    tok.add_special_tokens(["<|pad|>"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=True)
    ids, n = et.compressed_token_ids(fast)
    assert ids.tolist() == [c for _, c in _TOKENS] + [14] and n == 15
    with pytest.raises(TypeError, match="fast tokenizer"):
        et.compressed_token_ids(object())


def _first_appearance(ids: list[int]) -> bool:
    seen = -1
    for i in ids:
        if i > seen + 1:
            return False
        seen = max(seen, i)
    return True


_TOKENIZER_DIRS = [
    Path(__file__).resolve().parents[1] / "deepinfer_core" / "default_model",
    Path(__file__).resolve().parents[1] / "deepinfer_core" / "conformance" / "tokenizer",
]


@pytest.mark.parametrize("path", [p for p in _TOKENIZER_DIRS if (p / "tokenizer.json").exists()], ids=lambda p: p.name)
def test_compressed_ids_real_tokenizer(path):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    ids, n = et.compressed_token_ids(tok)
    again, n2 = et.compressed_token_ids(transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    assert torch.equal(ids, again) and n == n2
    assert ids.shape == (len(tok),) and int(ids.min()) == 0 and int(ids.max()) == n - 1
    assert _first_appearance(ids.tolist())
    assert n < len(tok)  # case / space variants fold together
    # the special tokens 0..2 are distinct, so the pad token's compressed id is its token id
    assert ids[:3].tolist() == [0, 1, 2]
    # the control bytes that are no space to DeepSeek's normaliser keep ids of their own
    byte_ids = [tok.convert_tokens_to_ids(chr(256 + b)) for b in (0x0B, 0x0C, 0x1C, 0x1D, 0x1E, 0x1F)]
    space = int(ids[tok.convert_tokens_to_ids("\u0120")])  # the byte-level " "
    assert len({int(ids[i]) for i in byte_ids} | {space}) == 7


def test_compressed_vocabulary_of_the_conformance_tokenizer():
    """The count the tiny V4.1 checkpoints declare (engram_compressed_vocab_size): 1426 by
    DeepSeek's rule (a normaliser that treats \\x0b, \\x0c and \\x1c-\\x1f as spaces counts 1420)."""
    transformers = pytest.importorskip("transformers")
    from tests.v41_checkpoints import COMPRESSED_VOCAB, TOKENIZER

    assert et.compressed_token_ids(transformers.AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True))[1] == COMPRESSED_VOCAB == 1426
