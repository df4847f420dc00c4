"""Prompt-lookup (n-gram) drafts: no model, just the sequence's own tokens.

For a sequence ending in tokens ``x[-n:]``, find the latest earlier occurrence of those n
tokens and propose the k tokens that followed it, trying n = lookup_max down to lookup_min.
Repetitive text (code, quotes of the prompt, lists) is where this pays off.

A proposer (this one, ``mtp.MTPProposer``) is driven by the engine in two calls per step:
``observe(out, step, accepted)`` after verification, before the scheduler appends the accepted
tokens (a draft model catches its cache up there), and ``propose(running)`` after it, which sets
``draft_token_ids`` of every running sequence.
"""

from __future__ import annotations

from array import array

from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.engine.spec_decode.drafting import draft_room


class NgramProposer:
    def __init__(self, num_tokens: int, lookup_max: int, lookup_min: int = 1, max_model_len: int = 2**62):
        self.k = num_tokens
        self.max_model_len = max_model_len
        self.lookup_max = lookup_max
        self.lookup_min = lookup_min

    def lookup(self, tokens: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) draft tokens to follow ``tokens`` (possibly none)."""
        k = min(self.k, limit)
        if k <= 0:
            return []
        data = array("i", tokens).tobytes()
        width = 4  # bytes per token id
        for n in range(min(self.lookup_max, len(tokens) - 1), self.lookup_min - 1, -1):
            pattern = data[-n * width :]
            end = len(data) - width  # the match must end before the last token
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % width == 0:  # aligned on a token, not inside two of them
                    first = at // width + n
                    return tokens[first : first + k]
                end = at + len(pattern) - 1
        return []

    def propose_for(self, seq: Sequence, max_model_len: int) -> list[int]:
        """Drafts for ``seq``, never beyond its max_tokens or the model length."""
        return self.lookup(seq.token_ids(), draft_room(seq, self.k, max_model_len))

    def observe(self, out, step, accepted: dict[int, list[int]]) -> None:
        """Nothing to catch up: drafts come from the tokens alone."""

    def propose(self, running: list[Sequence]) -> None:
        for seq in running:
            decoding = seq.num_computed_tokens == seq.num_tokens - 1
            seq.draft_token_ids = self.propose_for(seq, self.max_model_len) if decoding else []
