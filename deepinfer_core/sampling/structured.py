"""Structured outputs: ``SamplingParams.so_args`` compiled by xgrammar, one matcher per sequence,
and the token bitmask of every sample row.

A constraint (``params.StructuredOutputs``) is compiled once per distinct text: the
compiled grammars are cached by (kind, text). JSON (a schema, or any object for
``json_object``) is generated compact, without free whitespace: a small model can loop on
whitespace a grammar leaves free. Each sequence gets its own ``xgrammar.GrammarMatcher``
(``Sequence.grammar``), which accepts the sequence's output tokens as the output processor
appends them. A preempted sequence keeps its outputs, and so its matcher state, through the
recompute. Before a step samples, ``bitmask`` fills one row of 32-bit words per sample row on
the host (one by one, or by xgrammar's batch matcher for large batches, on a thread pool sized
to the CPUs this process may use): bit t set means token t may come next. The backend's ``apply_token_bitmask``
op then sets the forbidden logits to -inf on the device. Free rows get -1 words (everything
allowed), and a batch without constrained rows gets no mask at all.

The matcher's stop tokens are the model's EOS ids, so EOS is allowed exactly when the grammar
accepts the output so far. Once the matcher has accepted EOS (or the grammar can take nothing
more) the sequence is finished (``OutputProcessor``), whatever ``ignore_eos`` says.

Speculative decoding: a verification row at draft position j comes after drafts 0..j-1, so
its mask is filled with the matcher advanced through those drafts, and rolled back afterwards.
If the matcher rejects a draft, the rows after it cannot be reached: the target's token at
that draft's position is sampled from a mask that forbids the draft, so verification stops
there. Those rows keep an all-ones mask.
"""

from __future__ import annotations

import functools
import math
import os
import re
from pathlib import Path

import torch

from deepinfer_core.sampling.params import StructuredOutputs

CACHE_ENTRIES = 512  # compiled grammars kept (least recently used dropped)
# From this many rows on, masks are filled by xgrammar's batch matcher (its thread pool); fewer
# are filled one by one. On the H200 machine's 16-core host (benchmarks/results/issue15_2026-12-02,
# with xgrammar's default pool: half the host's hardware threads, more than the 16 cores) a batch fill cost 0.22-0.37 ms even for one row
# (thread wake-ups; 2 us on a 2-core machine), against 1-10 us for a plain call; with a
# DeepSeek-size vocabulary in an expensive state (inside a number) one row takes ~120 us, and the
# pool won from 8 rows on (0.50 against 1.19 ms at 8, 1.23 against 3.87 ms at 32).
BATCH_FILL_MIN_ROWS = 8
# The batch matcher's threads: the usable CPUs but one (the engine's own thread), at most this
# many. A fill splits its rows (at most max_num_seqs) over the threads and every thread woken
# costs the call its wake-up, while the cores are shared with torch's CPU threads and the device
# driver's; 8 is a cap chosen, not measured (benchmarks/structured.py's mask part times it).
BATCH_FILL_MAX_THREADS = 8
CGROUP = Path("/sys/fs/cgroup")  # cgroup v2's cpu.max, or v1's cpu/cpu.cfs_quota_us and cpu.cfs_period_us
_XGRAMMAR_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+\.cc:\d+: ")  # its C++ log position: no use to a user
DESCRIPTION = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regular expression",
               "grammar": "EBNF grammar", "choice": "list of choices"}


class Grammars:
    """The engine's grammar compiler for one tokenizer and vocabulary, and its matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids))
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # the cache is ours, bounded
        self._cache: dict[tuple[str, str], object] = {}

    # ---- compiling ------------------------------------------------------------------------------
    def compile(self, so: StructuredOutputs):
        """The compiled grammar of ``so``; ValueError naming what is wrong with an invalid one."""
        kind, text = so.kind, so.text()
        key = (kind, text)
        if key in self._cache:
            self._cache[key] = self._cache.pop(key)  # most recently used last
            return self._cache[key]
        try:
            if kind == "json":
                compiled = self.compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":  # any JSON object, compact (free whitespace lets a model loop on it)
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            else:  # grammar, and choice as a grammar of its alternatives
                compiled = self.compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
            reason = _XGRAMMAR_PREFIX.sub("", " ".join(str(e).split())).replace("Check failed: (error.empty()) is false: ", "")
            raise ValueError(f"so_args[{kind!r}] is not a valid {DESCRIPTION[kind]}: {reason[:500] or type(e).__name__}") from None
        self._cache[key] = compiled
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.pop(next(iter(self._cache)))
        return compiled

    def matcher(self, compiled):
        """A fresh matcher of ``compiled`` (one per sequence: each of a request's n samples)."""
        return self.xgr.GrammarMatcher(compiled)  # rollback is unbounded in xgrammar 0.2


def bitmask(rows, vocab_size: int, pin: bool = False) -> torch.Tensor | None:
    """int32 [len(rows), ceil(vocab_size / 32)] on the host for ``rows`` (sampler.SampleRow), or
    None when no row's sequence is constrained; in pinned memory with ``pin`` (bound for a
    device: no copy to pinned memory afterwards). The -1 words are written by numpy: a torch
    fill (or copy) of a mask this large runs on torch's CPU threads, which keep spinning after it
    and starve xgrammar's pool: on this project's 2-core machine, 32 rows inside a JSON string
    (102 400-token vocabulary, 2 pool threads) took 4.06 ms after a torch fill, 2.45 ms after
    numpy's; on the H200 host, B=32 JSON decoding ran at 0.5x the free tokens/s with torch's.
    Rows without drafts are filled together (BATCH_FILL_MIN_ROWS); a verification row's drafts
    are advanced through and rolled back. A row may not have tokens still on the device
    (``pending``): the host needs them."""
    if not any(r.seq.grammar is not None for r in rows):
        return None
    mask = torch.empty((len(rows), (vocab_size + 31) // 32), dtype=torch.int32, pin_memory=pin)
    mask.numpy().fill(-1)
    together: tuple[list, list[int]] = ([], [])  # (matchers, rows) filled by one batch call
    advanced: dict[int, tuple[object, int]] = {}  # seq_id -> (matcher, drafts accepted so far)
    for i, row in enumerate(rows):
        matcher = row.seq.grammar
        if matcher is None or row.seq.is_finished:
            continue
        if row.pending:
            raise AssertionError(f"grammar mask of sequence {row.seq.seq_id} with {row.pending} tokens still on the device")
        if not row.drafts:
            if not matcher.is_terminated():
                together[0].append(matcher)
                together[1].append(i)
            continue
        _, n = advanced.get(row.seq.seq_id, (matcher, 0))
        while n < len(row.drafts) and matcher.accept_token(row.drafts[n]):
            n += 1
        advanced[row.seq.seq_id] = (matcher, n)
        if n == len(row.drafts) and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(mask, i)
    for matcher, n in advanced.values():
        if n:
            matcher.rollback(n)
    matchers, indices = together
    if len(matchers) >= BATCH_FILL_MIN_ROWS:
        _batch_matcher().batch_fill_next_token_bitmask(matchers, mask, indices)
    else:
        for matcher, i in zip(matchers, indices):
            matcher.fill_next_token_bitmask(mask, i)
    return mask


def usable_cpus() -> int:
    """CPUs this process may run on at once: its affinity mask, lowered by a cgroup CPU quota
    (v2 ``cpu.max``; v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``), a fraction rounded up."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        if (CGROUP / "cpu.max").exists():
            quota, period = (CGROUP / "cpu.max").read_text().split()[:2]  # "max 100000": no quota
        else:  # cgroup v1; a quota of -1: none
            quota, period = ((CGROUP / "cpu" / f"cpu.cfs_{name}_us").read_text().strip() for name in ("quota", "period"))
        if quota != "max" and int(quota) > 0 and int(period) > 0:
            cpus = min(cpus, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):  # no cgroup CPU controller here, or a file we cannot read
        pass
    return max(1, cpus)


@functools.cache
def _batch_matcher():
    """xgrammar's batch mask filler (its own thread pool), made once per process."""
    import xgrammar

    return xgrammar.BatchGrammarMatcher(max_threads=min(BATCH_FILL_MAX_THREADS, max(1, usable_cpus() - 1)))
