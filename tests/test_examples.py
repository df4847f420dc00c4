"""The V4.1 examples run (on the CPU, small arguments) and print what they promise: DSpark's
acceptance by position and tokens/s against plain decoding; bounded replay's prefill times and
the outputs' difference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_dspark_example_prints_acceptance_by_position_and_tokens_per_second():
    out = _run("dspark.py", "--prompts", "1", "--max-tokens", "6", "--k", "2")
    assert "plain decoding" in out and "tokens/s" in out
    assert "acceptance by draft position: 1: " in out and " 2: " in out
    assert "greedy tokens equal to plain decoding's: 1/1" in out


def test_swa_replay_example_prints_times_and_the_outputs_difference():
    out = _run("swa_replay.py", "--prompt-tokens", "96", "--max-tokens", "3")
    assert "bounded replay on : prefill" in out and "bounded replay off: prefill" in out
    assert "greedy tokens agreeing: " in out and "/3" in out
