"""Measured acceptance of speculative decoding: what was proposed and what verification kept.

Counted by draft position: position 0 is the first draft after a sequence's last accepted token.
A verification of k drafts of which a were accepted (verification keeps a prefix) adds one to
``proposed[0..k-1]`` and to ``accepted[0..a-1]``. Nothing here is assumed or modelled: the
counts come from ``sampler.verify`` on real steps (a draft is accepted only when it is the token
plain decoding would have produced there).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    proposed: list[int] = field(default_factory=list)  # drafts verified, by draft position
    accepted: list[int] = field(default_factory=list)  # of those, accepted
    num_verify_steps: int = 0  # verifications of at least one draft

    def add(self, num_drafts: int, num_accepted: int) -> None:
        """One verification of ``num_drafts`` drafts, the first ``num_accepted`` of them accepted."""
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"{num_accepted} accepted of {num_drafts} drafts")
        if num_drafts == 0:
            return
        grow = num_drafts - len(self.proposed)
        if grow > 0:
            self.proposed += [0] * grow
            self.accepted += [0] * grow
        for i in range(num_drafts):
            self.proposed[i] += 1
        for i in range(num_accepted):
            self.accepted[i] += 1
        self.num_verify_steps += 1

    def merge(self, other: AcceptanceStats) -> AcceptanceStats:
        """A new AcceptanceStats with both counts (e.g. a request's samples together)."""
        width = max(len(self.proposed), len(other.proposed))

        def pad(v: list[int]) -> list[int]:
            return v + [0] * (width - len(v))

        return AcceptanceStats([a + b for a, b in zip(pad(self.proposed), pad(other.proposed))],
                               [a + b for a, b in zip(pad(self.accepted), pad(other.accepted))],
                               self.num_verify_steps + other.num_verify_steps)

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.proposed)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.accepted)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts / verified drafts (None before any verification)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def acceptance_by_position(self) -> list[float]:
        """Per draft position: accepted / verified there."""
        return [a / p for a, p in zip(self.accepted, self.proposed)]

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verification step emits on average: accepted drafts + the one token sampled
        after them (None before any verification). A stop inside the accepted drafts still
        counts them: this measures the drafts, not the output."""
        return 1 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else None
