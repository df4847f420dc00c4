"""benchmarks/generate.py in its --quick mode on the CPU: the JSON it writes has every part, with
positive times and the ratios computed. Speeds are not asserted."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import generate

CPU_QUICK = ["--quick", "--accelerator", "cpu", "--dtype", "float32"]


def test_quick_defaults_and_overrides(tmp_path):
    args = generate.parse_args([*CPU_QUICK, "--out", str(tmp_path), "--batches", "2,3", "--context", "40"])
    assert (args.model, args.layers, args.batches, args.context, args.max_tokens) == ("tiny", 2, [2, 3], 40, 8)
    assert args.max_model_len >= args.context + args.max_tokens and args.max_model_len % 64 == 0
    full = generate.parse_args(["--model", "v2-lite", "--layers", "27"])
    assert (full.batches, full.context, full.max_tokens, full.budgets) == ([1, 8, 32, 64, 128], 1024, 64, [2048, 4096, 8192, 16384])
    with pytest.raises(SystemExit):
        generate.parse_args([*CPU_QUICK, "--max-tokens", "1"])


def test_write_model_sets_the_layers(tmp_path):
    config = json.loads((generate.write_model("v2-lite", 3, tmp_path) / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["hidden_size"] == 2048
    assert json.loads((generate.write_model("v2-lite", None, tmp_path) / "config.json").read_text())["num_hidden_layers"] == 27


def test_covered_counts_overlap_once():
    assert generate.covered([(0, 2), (1, 3), (5, 6)], 0, 10) == 4
    assert generate.covered([(0, 2), (1, 3), (5, 6)], 1.5, 5.5) == 2
    assert generate.covered([], 0, 1) == 0


def test_quick_run_writes_every_part(tmp_path):
    args = generate.parse_args([*CPU_QUICK, "--out", str(tmp_path)])
    generate.run(args)
    report = json.loads((tmp_path / "generate_tiny.json").read_text())
    assert {"meta", "args", "config", "decode", "gpu_busy", "prefill", "prefill_best_budget", "prefix_caching"} <= set(report)
    assert report["meta"]["torch"] and report["meta"]["started"] <= report["meta"]["finished"]
    assert report["config"]["num_hidden_layers"] == 2
    assert [p["batch"] for p in report["decode"]] == [1, 4]
    for p in report["decode"]:
        assert "error" not in p, p["error"]
        assert min(p["startup_s"], p["first_s"], p["prefill_s"], p["repeat_s"]) > 0
        assert p["output_tokens"] == p["batch"] * p["max_tokens"]
        assert p["first_over_repeat"] == pytest.approx(p["first_s"] / p["repeat_s"])
        assert p["decode_step_s"] == pytest.approx((p["repeat_s"] - p["prefill_s"]) / (p["max_tokens"] - 1))
        assert 0 < p["decode_cadence_s"] < p["repeat_s"] and len(p["decode_cadence_runs_s"]) == args.repeats
        assert p["engine"]["device"] == "cpu"
    assert report["decode"][0]["first_in_process"] and not report["decode"][1]["first_in_process"]
    assert "skipped" in report["gpu_busy"]  # CPU: no profile
    assert [p["budget"] for p in report["prefill"]] == [64, 256]
    assert all(p["tokens_per_s"] > 0 and p["engine_budget"] == p["budget"] for p in report["prefill"])
    assert report["prefill_best_budget"] in (64, 256)
    pc = report["prefix_caching"]
    assert "error" not in pc, pc.get("error")
    assert pc["off"]["wall_s"] > 0 and pc["off"]["prompt_tokens"] == 4 * (48 + 16)
    if pc["on"] == "unsupported":
        assert "speedup" not in pc
    else:
        assert pc["speedup"] > 0 and isinstance(pc["identical_tokens"], bool)
        assert pc["on"]["hit_rate"] is None or 0 <= pc["on"]["hit_rate"] <= 1


@pytest.mark.slow
def test_profile_bookkeeping_on_cpu(tmp_path):
    """The profiler part runs only on CUDA; on the CPU its step marks and windows still work."""
    args = generate.parse_args([*CPU_QUICK, "--out", str(tmp_path)])
    args.model_dir = generate.write_model(args.model, args.layers, tmp_path)
    llm, startup = generate.build(args, max_num_seqs=args.profile_batch)
    assert startup > 0
    assert "skipped" in generate.busy_profile(llm, args)
    busy = generate.busy_profile(llm, args, cpu=True)
    assert busy["steps"]["decode"] >= args.profile_tokens - 1 and busy["steps"]["prefill"] >= 1
    assert 0 < busy["decode_wall_s"] < busy["call_wall_s"] and 0 < busy["decode_wall_unprofiled_s"] < busy["call_wall_unprofiled_s"]
    assert busy["call_busy_share"] == 0 and busy["top_kernels"] == []  # no CUDA events on a CPU
    assert "step" not in vars(llm.engine)  # the wrapper is gone


def test_kernel_times_keep_kernels_with_a_long_common_prefix_apart():
    """benchmarks.profile_step.kernel_ms (also profile_prefill's): GPU events summed by whole
    name, CPU events left out; two template instances that share 95 characters stay two rows."""
    import types

    import torch

    from benchmarks.profile_step import kernel_ms

    def event(name, us, cuda=True):
        kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        return types.SimpleNamespace(name=name, device_time_total=us, device_type=kind)

    stem = "void at::native::unrolled_elementwise_kernel<" + "x" * 50
    prof = types.SimpleNamespace(events=lambda: [event(stem + "A", 1000.0), event(stem + "B", 2000.0),
                                                 event(stem + "A", 500.0), event("aten::copy_", 9.0, cuda=False)])
    assert dict(kernel_ms(prof)) == {stem + "A": 1.5, stem + "B": 2.0}


def _stats(step: int, prefill: int, decode: int):
    from deepinfer_core.hookspecs import StepStats

    return StepStats(step=step, num_prefill_tokens=prefill, num_decode_tokens=decode, num_running=1, num_waiting=0,
                     num_preempted=0, free_kv_blocks=1, seconds=0.0)


def test_decode_cadence_takes_consecutive_decode_only_steps():
    clock = generate.StepClock(engine=None)
    # a prefill step, three decode steps, a step with a prompt chunk, one decode step, then a
    # decode step that is not the next step number (an idle gap): only 2-3 and 3-4 count
    for t, step, prefill, decode in ((0.0, 1, 64, 0), (1.0, 2, 0, 4), (1.5, 3, 0, 4), (2.5, 4, 0, 4), (9.0, 5, 16, 4),
                                     (10.0, 6, 0, 4), (20.0, 8, 0, 4)):
        clock.marks.append((t, _stats(step, prefill, decode)))
    assert clock.decode_cadence() == pytest.approx(0.75)
    clock.marks = clock.marks[:2]
    assert clock.decode_cadence() is None


def test_decode_cadence_leaves_out_the_steps_after_sequences_finish():
    """Sequences that finish in waves leave smaller, faster steps at the end of a call: only the
    steps at the call's full batch count."""
    clock = generate.StepClock(engine=None)
    for t, step, decode in ((0.0, 1, 8), (1.0, 2, 8), (2.0, 3, 8), (2.2, 4, 3), (2.4, 5, 3), (2.5, 6, 1)):
        clock.marks.append((t, _stats(step, 0, decode)))
    assert clock.decode_cadence() == pytest.approx(1.0)


def test_step_clock_and_side_by_side_points_on_cpu(tmp_path):
    """StepClock chains before the engine's observer and puts it back; decode_peers.points gives every
    LLM a decode step and cadence, variant_points their ratios (two CPU LLMs, tiny model)."""
    from benchmarks import decode_peers

    args = generate.parse_args([*CPU_QUICK, "--out", str(tmp_path)])
    args.model_dir = generate.write_model(args.model, args.layers, tmp_path)
    llms = {label: generate.build(args, max_num_seqs=2)[0] for label in ("a", "b")}
    seen = []
    llms["a"].engine.observer = seen.append  # a plugin's observer
    seconds, outputs, cadence = generate.timed_decode(llms["a"], [[1, 2, 3]], generate.params(6))
    assert llms["a"].engine.observer == seen.append and len(seen) >= 5  # still called, and restored
    assert seconds > 0 and cadence is not None and 0 < cadence < seconds
    llms["a"].engine.observer = None
    side = argparse.Namespace(contexts=[8], batches=[2], max_tokens=5, repeats=1)
    report = {"points": [], "ratios": []}
    decode_peers.variant_points("t", "tiny", llms, ("a", "b"), side, 1e11, report, tmp_path / "r.json")
    assert [p["variant"] for p in report["points"]] == ["a", "b"]
    for p in report["points"]:
        assert p["decode_step_s"] == pytest.approx(generate.decode_step(p["repeat_s"], p["prefill_s"], 5))
        assert 0 < p["decode_cadence_s"] < p["repeat_s"] and p["cadence_over_floor"] > 0
    (row,) = report["ratios"]
    assert row["a_over_b_step"] > 0 and row["a_over_b_cadence"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["ratios"] == report["ratios"]
