"""benchmarks/all_to_all.py on the CPU (2 gloo ranks, toy sizes): the exchange it times is checked
inside (each token's output is its row times its routing weights' sum), every size gets a time
and a byte count; arguments that cannot run are refused. Speeds are not asserted. DeepEP and
NCCL need the GPUs (tools/gpu_session.sh multi)."""

from __future__ import annotations

import json

import pytest

from benchmarks import all_to_all


def test_quick_cpu_run_times_every_size(tmp_path):
    all_to_all.main(["--ranks", "2", "--cpu", "--quick", "--out", str(tmp_path), "--tokens", "1,16"])
    report = json.loads((tmp_path / "all_to_all.json").read_text())
    assert report["ranks"] == 2 and report["deep_ep"] == "not run on the CPU"
    assert [p["tokens_per_rank"] for p in report["points"]] == [1, 16]
    for p in report["points"]:
        assert p["ours_s"] > 0 and p["a2a_dispatch_s"] > 0 and p["a2a_combine_s"] > 0
        assert 0 <= p["pair_rows_sent_remote"] <= p["tokens_per_rank"] * all_to_all.QUICK["top_k"]
    assert report["points"][1]["pair_rows_sent_remote"] > 0


@pytest.mark.parametrize("argv, why", [(["--ranks", "1", "--cpu"], "at least 2"),
                                       (["--ranks", "3", "--cpu", "--quick"], "multiple of --ranks"),
                                       (["--ranks", "2"], "needs as many GPUs")])
def test_arguments_that_cannot_run_are_refused(argv, why, capsys, monkeypatch):
    monkeypatch.setattr(all_to_all.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        all_to_all.parse_args(argv)
    assert why in capsys.readouterr().err
