"""AcceptanceStats: drafts verified and accepted, by draft position."""

from __future__ import annotations

import pytest

from deepinfer_core.engine.spec_decode.stats import AcceptanceStats


def test_counts_by_position_and_what_they_imply():
    s = AcceptanceStats()
    assert s.acceptance_rate is None and s.mean_accepted_length is None and s.acceptance_by_position == []
    s.add(3, 2)  # drafts 0 and 1 accepted, 2 rejected
    s.add(1, 0)
    s.add(0, 0)  # no drafts: not a verification
    s.add(4, 4)
    assert (s.proposed, s.accepted, s.num_verify_steps) == ([3, 2, 2, 1], [2, 2, 1, 1], 3)
    assert (s.num_draft_tokens, s.num_accepted_tokens) == (8, 6)
    assert s.acceptance_rate == 6 / 8 and s.acceptance_by_position == [2 / 3, 1.0, 0.5, 1.0]
    assert s.mean_accepted_length == 1 + 6 / 3  # tokens emitted per verification step


def test_merge_pads_the_shorter_and_leaves_both_alone():
    a, b = AcceptanceStats(), AcceptanceStats()
    a.add(1, 1)
    b.add(3, 1)
    m = a.merge(b)
    assert (m.proposed, m.accepted, m.num_verify_steps) == ([2, 1, 1], [2, 0, 0], 2)
    assert (a.proposed, b.proposed) == ([1], [1, 1, 1])


@pytest.mark.parametrize("drafts,accepted", [(2, 3), (1, -1)])
def test_impossible_counts_are_refused(drafts, accepted):
    with pytest.raises(ValueError, match="accepted of"):
        AcceptanceStats().add(drafts, accepted)
