"""DSpark drafts for DeepSeek-V4.1 (models/dspark.py; deepseek_architectures.md §4.6).

Nothing to catch up: every target forward writes each stage's context (the target layers'
taps) into the stages' window rings for the positions it computes, rejected drafts included;
those are never read, as the next block's context ends before them. After each step, every
decoding sequence drafts one block: rows [y, noise x (N - 1)] at positions P .. P + N - 1 (y, its
newest token, at P), non-causal inside the block, nothing written; row i drafts position
P + 1 + i through the sequential Markov head, each draft sampled as its verification will judge
it (``drafting.sample_drafts``: coupled or rejection), and the confidence head estimates each
draft's acceptance. With ``adaptive`` the drafts each request has verified are chosen by
``adaptive`` from those confidences and the cost curves measured at start-up (``profile``);
otherwise every request verifies min(k, room) drafts.
"""

from __future__ import annotations

import logging
import time

import torch

from deepinfer_core.engine.kv_cache import KVCache, KVCacheManager
from deepinfer_core.engine.scheduler import ScheduledSeq, SchedulerOutput
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import SampleRow, launch, needs_history
from deepinfer_core.engine.spec_decode import adaptive
from deepinfer_core.engine.spec_decode.drafting import BlockReserve, draft_room, sample_drafts
from deepinfer_core.engine.spec_decode.rejection import uses_rejection

log = logging.getLogger("deepinfer")


class DSparkProposer:
    def __init__(self, model, runner, num_tokens: int, ops, eos_ids: tuple[int, ...], max_model_len: int, copy_to_host,
                 acceptance: str = "auto", adaptive_verification: bool = False, step_tokens: int = 2048):
        c = model.config
        self.model, self.runner, self.kv = model, runner, runner.kv
        self.block = c.dspark_block_size
        self.noise = c.dspark_noise_token_id
        self.k = num_tokens
        self.ops, self.eos_ids, self.max_model_len, self.copy_to_host = ops, eos_ids, max_model_len, copy_to_host
        self.acceptance = acceptance
        self.adaptive = adaptive_verification
        self.step_tokens = step_tokens  # the scheduler's token budget: caps the prefill tokens a step adds
        self.draft_cost: adaptive.CostCurve | None = None  # seconds by requests (profile)
        self.verify_cost: adaptive.CostCurve | None = None  # seconds by tokens (profile)
        self.last_budget: int | None = None  # draft tokens the last adaptive choice admitted

    def observe(self, out, step, accepted) -> None:
        """Nothing: the target forward wrote the stages' context."""

    # ---- drafting ------------------------------------------------------------------------------
    def propose(self, running: list[Sequence]) -> None:
        reserve = BlockReserve(self.kv, running)
        chosen: list[tuple[Sequence, int]] = []
        for seq in running:
            seq.draft_token_ids = []
            if seq.num_computed_tokens != seq.num_tokens - 1:
                continue
            room = draft_room(seq, self.k, self.max_model_len)
            # the block's rows sit at positions P .. P + N - 1: their slots must exist (nothing is written)
            if room > 0 and reserve.take(seq, seq.num_tokens - 1 + self.block):
                chosen.append((seq, room))
        if not chosen:
            return
        drafted, confidence = self._draft([seq for seq, _ in chosen])
        lengths = [room for _, room in chosen]
        if self.adaptive:
            lengths = self._admit(chosen, confidence, running)
        for (seq, _), tokens, n in zip(chosen, drafted, lengths):
            seq.draft_token_ids = tokens[:n]
            del seq.draft_probs[n:]

    def _draft(self, seqs: list[Sequence]) -> tuple[list[list[int]], list[list[float]]]:
        """Every sequence's block: (its N drafts, their confidences)."""
        for seq in seqs:
            seq.draft_token_ids = [self.noise] * (self.block - 1)  # the block's ids: [y, noise, ...]
            seq.draft_probs = []
        runner = self.runner
        rows = [ScheduledSeq(seq, seq.num_tokens - 1, self.block, is_decode=True) for seq in seqs]
        _, positions, meta = runner._meta(runner.prepare(SchedulerOutput(decodes=rows)))
        anchors = torch.tensor([seq.token_at(seq.num_tokens - 1) for seq in seqs], dtype=torch.int64).to(positions.device)
        drafted: list[list[int]] = [[] for _ in seqs]
        # rows without penalties or rejection sampling need only counts on the host: their picks
        # feed the Markov head from the device, and the host waits once, after the block
        on_device = not any(needs_history(seq.params) or uses_rejection(seq.params, self.acceptance) for seq in seqs)
        launched = []

        def choose(i: int, logits: torch.Tensor) -> torch.Tensor:
            if on_device:
                rows = [SampleRow(seq, drafts=[0] * i) for seq in seqs]
                launched.append(launch(self.ops, logits, rows, self.eos_ids, self.copy_to_host))
                return launched[-1].tokens
            picks = sample_drafts(self.ops, logits, [SampleRow(seq, drafts=d) for seq, d in zip(seqs, drafted)],
                                  self.eos_ids, self.copy_to_host, self.acceptance)
            for d, t in zip(drafted, picks):
                d.append(t)
            return torch.tensor(picks, dtype=torch.int64).to(logits.device)

        with torch.inference_mode():
            block = self.model.forward_dspark(anchors, positions, meta, runner.kv_cache.tensors, choose)
        for batch in launched:
            for d, (token, _, _) in zip(drafted, batch.resolve()):
                d.append(token)
        return drafted, block.confidence.tolist()

    def _admit(self, chosen: list[tuple[Sequence, int]], confidence: list[list[float]], running: list[Sequence]) -> list[int]:
        surv = adaptive.survivals([conf[:room] for (_, room), conf in zip(chosen, confidence)])
        prefill = sum(s.num_tokens - s.num_computed_tokens for s in running if s.num_computed_tokens < s.num_tokens - 1)
        other = len(chosen) + min(prefill, self.step_tokens)
        budget = adaptive.choose_budget(surv, other, self.draft_cost(len(chosen)), self.verify_cost)
        self.last_budget = budget
        return adaptive.admit(surv, budget)

    # ---- start-up profile ------------------------------------------------------------------------
    def profile(self, groups, max_requests: int, device: torch.device, synchronize, context: int = 32) -> None:
        """Measure the two cost curves adaptive verification weighs, on a throw-away cache:
        a target step of decode rows (1 token, and 1 + k tokens, per sequence) by tokens, and a
        block draft by requests, at 1, 2, 4 .. ``max_requests`` sequences of ``context`` tokens."""
        t0 = time.perf_counter()
        bs, lookahead = self.kv.block_size, self.k
        per_seq = -(-(context + self.block + lookahead) // bs)
        cache = KVCache(groups, per_seq * max_requests, bs, max_requests, lookahead, device)
        kv = KVCacheManager(groups, per_seq * max_requests, bs, max_requests, lookahead, prefix_caching=False)
        seqs = []
        for i in range(max_requests):
            seq = Sequence(-1 - i, "profile", 0, [1 + i % 7] * context, SamplingParams(max_tokens=1), 0)
            kv.allocate(seq, context + self.block + lookahead)
            seq.num_computed_tokens = context - 1
            seqs.append(seq)
        from deepinfer_core.engine.runner import ModelRunner

        runner = ModelRunner(self.model, cache, kv, device)
        mine, self.runner = self.runner, runner  # _draft runs on the throw-away cache

        def best(fn) -> float:
            fn()  # warm
            times = []
            for _ in range(2):
                synchronize()
                t = time.perf_counter()
                fn()
                synchronize()
                times.append(time.perf_counter() - t)
            return min(times)

        verify, draft = [], []
        counts = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n < max_requests] + [max_requests]
        try:
            runner.run(SchedulerOutput(prefills=[ScheduledSeq(s, 0, context - 1) for s in seqs]))  # their context
            for n in counts:
                for rows in sorted({1, 1 + self.k}):
                    for s in seqs[:n]:
                        s.draft_token_ids = [1] * (rows - 1)
                    step = SchedulerOutput(decodes=[ScheduledSeq(s, context - 1, rows, rows - 1, is_decode=True, samples=True)
                                                    for s in seqs[:n]])
                    verify.append((n * rows, best(lambda step=step: runner.run(step))))
                draft.append((n, best(lambda n=n: self._draft(seqs[:n]))))
        finally:
            self.runner = mine
            for s in seqs:
                s.draft_token_ids, s.draft_probs = [], []
        self.verify_cost, self.draft_cost = adaptive.CostCurve(verify), adaptive.CostCurve(draft)
        log.info("adaptive verification: profiled %d step and %d draft costs in %.1f s (verify %s; draft %s)",
                 len(verify), len(draft), time.perf_counter() - t0,
                 ", ".join(f"{t} tok {s * 1e3:.2f} ms" for t, s in sorted(verify)),
                 ", ".join(f"{r} req {s * 1e3:.2f} ms" for r, s in draft))
