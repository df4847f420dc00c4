"""tools/ascend_session.sh, the one command of an Ascend machine, where the backend cannot run: it
stops at once with the probe's reason in its log, before any test or baseline is touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_ascend_950 import backend

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(backend.deepinfer_probe().available, reason="this machine can run the Ascend backend")
def test_the_session_stops_with_the_probes_reason(tmp_path):
    baselines = (REPO / "specs/baselines/offline_decode_ppl.json").read_bytes()
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(["bash", str(REPO / "tools/ascend_session.sh"), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    log = (tmp_path / "out" / "session.log").read_text()
    assert f"error: backend 'ascend' was requested but cannot run here: {backend.deepinfer_probe().reason}" in log
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["session.log"]  # no tests, no reports
    assert (REPO / "specs/baselines/offline_decode_ppl.json").read_bytes() == baselines
