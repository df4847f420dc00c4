"""tools/mutate.py, the pre-release mutation check: every planted bug still applies to the code
as it is (a drifted mutant would plant nothing), and one mutant really runs end to end."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import mutate  # noqa: E402


def test_every_mutant_applies_exactly_once_and_names_existing_tests():
    mutants = mutate.load()
    assert len({m.name for m in mutants}) == len(mutants)
    for m in mutants:
        assert mutate.check_applies(m, mutate.ROOT) is None, (m.name, mutate.check_applies(m, mutate.ROOT))
        for test in m.tests:
            assert (mutate.ROOT / test.split("::")[0]).is_file(), (m.name, test)


def test_a_mutant_is_killed_and_a_harmless_change_survives():
    [mutant] = [m for m in mutate.load() if m.name == "sampler-presence-penalty-sign"]
    mutant = replace(mutant, tests=["tests/test_sampler.py::test_penalties_follow_their_definitions"])
    harmless = replace(mutant, name="harmless", old="def apply_penalties(", new="def apply_penalties(  ")
    results = mutate.mutate([mutant, harmless], timeout=300, progress=lambda _: None)
    assert [(r.name, r.outcome) for r in results] == [(mutant.name, "killed"), ("harmless", "survived")]
    assert "test_penalties_follow_their_definitions" in results[0].failed


def test_a_mutant_that_no_longer_applies_is_refused():
    [mutant] = mutate.load()[:1]
    with pytest.raises(SystemExit, match="occurs 0 times"):
        mutate.mutate([replace(mutant, old="no such text anywhere")], timeout=10, progress=lambda _: None)
