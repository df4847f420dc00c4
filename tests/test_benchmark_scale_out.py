"""benchmarks/scale_out.py in its --quick mode on the CPU (gloo ranks): every size is measured
with the tokens it emitted counted, the random-weight model is the same at every EP size (the
2-rank run's greedy tokens are one process's). Speeds are not asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks import scale_out

CPU_QUICK = ["--quick", "--accelerator", "cpu", "--dtype", "float32"]
pytestmark = pytest.mark.usefixtures("one_thread")


def test_arguments_need_one_gpu_to_compare_with(tmp_path):
    args = scale_out.parse_args([*CPU_QUICK, "--out", str(tmp_path), "--ep", "2,1,2"])
    assert args.ep == [1, 2] and args.models == ["tiny"] and args.max_model_len % 64 == 0
    full = scale_out.parse_args([])
    assert (full.models, full.ep, full.per_gpu_batch) == (["v2-lite", "v3-slice"], [1, 2, 4, 8], 32)
    for bad in (["--ep", "2,4"], ["--ep", "0,1"], ["--max-tokens", "1"]):
        with pytest.raises(SystemExit):
            scale_out.parse_args([*CPU_QUICK, *bad])


def test_quick_run_measures_every_size(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_DIST_TIMEOUT", "60")
    args = scale_out.parse_args([*CPU_QUICK, "--out", str(tmp_path), "--ep", "1,2"])
    scale_out.run(args)
    report = json.loads((tmp_path / "scale_out.json").read_text())
    points = report["models"]["tiny"]
    assert [(p["size"], p["eager"]) for p in points] == [(1, False), (1, True), (2, True)]
    for p in points:
        assert "error" not in p, p
        assert p["output_tokens"] == p["expected_output_tokens"] == p["batch"] * args.max_tokens
        assert p["decode_step_s"] > 0 and p["tokens_per_s_per_gpu"] > 0 and p["first_s"] > 0
    two = points[-1]
    assert two["batch"] == 2 * args.per_gpu_batch and two["same_tokens"] == f"{args.per_gpu_batch}/{args.per_gpu_batch}"
    assert two["efficiency"] > 0 and two["efficiency_vs_eager"] > 0

