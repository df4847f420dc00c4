"""End-to-end conformance (deepinfer_core.conformance.e2e) on the reference backend, and the
checkpoints it runs on (deepinfer_core.conformance.checkpoints)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers / huggingface_hub are imported

import pytest
import torch
from safetensors import safe_open

from deepinfer_core.conformance import checkpoints, e2e
from deepinfer_core.conformance.spec import specs_dir


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    """Generated checkpoints go to a temporary cache, shared by this module's tests."""
    path = tmp_path_factory.mktemp("conformance-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(path))
        yield path


def reference_plan(names: list[str] | None = None) -> list[e2e.Workload]:
    """The workloads in the dtypes the reference's baseline was recorded in (float32)."""
    return e2e.plan(e2e.load_workloads(names), e2e.read_baselines(), e2e.REFERENCE_PLATFORM, ("float32", "bfloat16", "float16"),
                    refresh=False)


@pytest.fixture(scope="module")
def measured(cache_dir) -> e2e.Measurement:
    """Every workload measured once on the reference backend, as `deepinfer conformance --e2e` runs it."""
    return e2e.measure("cpu", reference_plan(), log=lambda line: None)


@pytest.fixture
def specs_copy(tmp_path, monkeypatch, measured) -> Path:
    """A private copy of specs/ that the code under test reads (DEEPINFER_SPECS_DIR), its
    cpu-reference values replaced by this machine's (the recorded values are checked by the
    first tests; these tests check what the comparison does with them)."""
    copy_dir = tmp_path / "specs"
    shutil.copytree(specs_dir(), copy_dir)
    monkeypatch.setenv("DEEPINFER_SPECS_DIR", str(copy_dir))
    path = baseline_file(copy_dir)
    data = json.loads(path.read_text())
    for workload, results in measured.results.items():
        data["cpu-reference"][workload] = {s: {"ppl": r.ppl, "greedy_tokens": r.greedy_tokens, "greedy_logprobs": r.greedy_logprobs}
                                           for s, r in results.items()}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return copy_dir


@pytest.fixture
def replay(monkeypatch, measured):
    """main() reuses the module's measurement (only the workloads asked for) instead of running
    the models again; ``replay(platform=...)`` pretends it came from another platform."""

    def install(**changes):
        def fake_measure(backend, workloads, cache_dir=None, log=print):
            names = [w.name for w in workloads]
            ran_in = {w.name: "bfloat16" if w.dtype == "auto" else w.dtype for w in workloads}  # what measure() would run
            return dataclasses.replace(
                measured,
                results={n: measured.results[n] for n in names},
                workload_info={n: {**measured.workload_info[n], "dtype": ran_in[n]} for n in names},
                **changes,
            )

        monkeypatch.setattr(e2e, "measure", fake_measure)
        platform = changes.get("platform", measured.platform)
        monkeypatch.setattr(e2e, "platform_of", lambda backend: (platform, supported))

    supported = ("float32", "bfloat16", "float16")
    install()
    return install


def baseline_file(specs: Path) -> Path:
    return specs / "baselines" / "offline_decode_ppl.json"


# ---- the recorded reference baseline -------------------------------------------------------------
def test_reference_matches_its_recorded_baseline(measured):
    entry = e2e.read_baselines()[e2e.REFERENCE_PLATFORM]
    assert measured.platform == e2e.REFERENCE_PLATFORM
    assert set(measured.results) == set(e2e.workload_names()) == {"default", "tiny-v2-lite", "tiny-v3-fp8"}
    rows = e2e.compare(measured.results, entry, entry["_meta"]["tolerance"])
    assert len(rows) == 24
    assert all(r.passed for r in rows), "\n".join(f"{r.workload}/{r.sample}: {r.reason}" for r in rows if not r.passed)
    for w, info in measured.workload_info.items():  # the baseline was recorded on these very checkpoints
        assert entry["_meta"]["workloads"][w] == info


def test_main_passes_on_the_reference(capsys, tmp_path):
    out = tmp_path / "report.json"
    code = e2e.main("cpu", workloads=["tiny-v2-lite"], json_out=str(out))
    text = capsys.readouterr().out
    assert code == 0, text
    assert "8/8 samples passed on cpu-reference: PASS" in text
    assert "[1/1] tiny-v2-lite: 8 samples on cpu-reference" in text
    report = json.loads(out.read_text())
    assert report["status"] == "pass" and report["exit_code"] == 0 and report["platform"] == "cpu-reference"
    assert report["workloads"]["tiny-v2-lite"]["dtype"] == "float32"
    assert set(report["results"]["tiny-v2-lite"]["fibonacci"]) == {"ppl", "greedy_tokens", "greedy_logprobs"}
    assert len(report["rows"]) == 8 and all(r["passed"] for r in report["rows"])


def test_teacher_forced_ppl_matches_prompt_logprobs(measured):
    """ppl is exp(-mean logprob) of the continuation only: recompute one sample by hand."""
    from deepinfer_core.api import LLM
    from deepinfer_core.sampling.params import SamplingParams

    workload = e2e.load_workloads(["tiny-v3-fp8"])[0]
    sample = workload.samples[0]
    llm = LLM(model=checkpoints.materialize("tiny-v3-fp8"), accelerator="cpu", dtype="float32", max_model_len=512,
              max_num_seqs=16, progress=False)
    prompt = llm.tokenizer(sample.prompt).input_ids
    cont = llm.tokenizer(sample.continuation, add_special_tokens=False).input_ids
    out = llm.generate([prompt + cont], SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0), use_tqdm=False)[0]
    lps = [out.prompt_logprobs[len(prompt) + i][t] for i, t in enumerate(cont)]
    ppl = float(torch.tensor(lps, dtype=torch.float64).mean().neg().exp())
    # batched with other requests in the measurement, alone here: equal up to batch-dependent rounding
    assert ppl == pytest.approx(measured.results["tiny-v3-fp8"][sample.id].ppl, rel=1e-3)


# ---- failures are reported sample by sample ------------------------------------------------------
def test_perturbed_baseline_fails_naming_the_sample(specs_copy, replay, measured, capsys, tmp_path):
    path = baseline_file(specs_copy)
    data = json.loads(path.read_text())
    entry = data["cpu-reference"]
    entry["tiny-v2-lite"]["class_stack"]["ppl"] *= 1.1
    top = measured.results["default"]["try_except"].greedy_top_logprobs[0]
    # a first token outside this run's top logprobs: a real divergence, not a near-tie
    entry["default"]["try_except"]["greedy_tokens"][0] = next(t for t in range(2048) if t not in top)
    path.write_text(json.dumps(data))
    out = tmp_path / "report.json"
    code = e2e.main("cpu", json_out=str(out))
    text = capsys.readouterr().out
    assert code == 1
    assert "FAIL tiny-v2-lite/class_stack: ppl" in text and "> ppl_rtol 0.0001" in text
    assert "FAIL default/try_except: greedy tokens agree on 0/16 leading tokens" in text
    assert "22/24 samples passed on cpu-reference: FAIL" in text
    failed = [(r["workload"], r["sample"]) for r in json.loads(out.read_text())["rows"] if not r["passed"]]
    assert sorted(failed) == [("default", "try_except"), ("tiny-v2-lite", "class_stack")]


def test_a_divergence_at_a_near_tie_is_excused(measured):
    """Change a baseline token to the runner-up of this run's choice: a tie within the margin passes."""
    result = measured.results["default"]["fibonacci"]
    step = 3
    ranked = sorted(result.greedy_top_logprobs[step].items(), key=lambda kv: -kv[1])
    (best, lp_best), (second, lp_second) = ranked[0], ranked[1]
    assert best == result.greedy_tokens[step]
    # a platform that chose the runner-up recorded (about) this run's logprob of it at that step
    logprobs = result.greedy_logprobs[:step] + [lp_second] + [0.0] * 12
    baseline = {"default": {"fibonacci": {"ppl": result.ppl, "greedy_tokens": result.greedy_tokens[:step] + [second] + [0] * 12,
                                          "greedy_logprobs": logprobs}}}
    results = {"default": {"fibonacci": result}}
    gap = lp_best - lp_second
    tol = {"ppl_rtol": 0, "min_greedy_agreement": 1.0, "greedy_logprob_atol": 1e-6}
    within = e2e.compare(results, baseline, {**tol, "greedy_tie_margin": gap + 1e-6})[0]
    outside = e2e.compare(results, baseline, {**tol, "greedy_tie_margin": gap / 2})[0]
    assert within.passed and within.greedy_tie and within.greedy_agreement == step / 16 and within.logprob_diff == 0
    assert not outside.passed and "token 3" in outside.reason and "nats below its own" in outside.reason
    # the diverging step is still teacher-forced: its logprob of the baseline's token is compared too
    baseline["default"]["fibonacci"]["greedy_logprobs"] = result.greedy_logprobs[:step] + [lp_second + 0.01] + [0.0] * 12
    moved = e2e.compare(results, baseline, {**tol, "greedy_tie_margin": gap + 1e-6})[0]
    assert not moved.passed and "greedy logprob of token 3 (decode step)" in moved.reason


def test_a_decode_only_change_fails_on_the_greedy_logprobs(specs_copy, replay, capsys):
    """Same perplexity, same greedy tokens, one decode step's logprob moved: a decode-path bug."""
    path = baseline_file(specs_copy)
    data = json.loads(path.read_text())
    data["cpu-reference"]["tiny-v3-fp8"]["read_lines"]["greedy_logprobs"][5] += 2e-3
    path.write_text(json.dumps(data))
    assert e2e.main("cpu", workloads=["tiny-v3-fp8"]) == 1
    text = capsys.readouterr().out
    assert "FAIL tiny-v3-fp8/read_lines: greedy logprob of token 5 (decode step)" in text
    assert "> greedy_logprob_atol 0.0005" in text and "7/8 samples passed" in text


def test_a_baseline_without_greedy_logprobs_asks_for_a_refresh(measured):
    r = measured.results["default"]["fibonacci"]
    old = {"default": {"fibonacci": {"ppl": r.ppl, "greedy_tokens": r.greedy_tokens}}}
    (row,) = e2e.compare({"default": {"fibonacci": r}}, old, e2e.DEFAULT_TOLERANCE, hint="; refresh it")
    assert not row.passed and "the baseline has no greedy_logprobs" in row.reason and "refresh it" in row.reason


def test_the_reference_baseline_holds_on_another_cpu_isa(cache_dir):
    """The failure this baseline was re-recorded for: on a CPU whose kernels differ (here: the same
    machine limited to AVX2, as on an AMD EPYC without AVX-512), a bf16 run moves perplexities by
    percents (one MoE routing flip); the float32 baseline holds."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
           "XDG_CACHE_HOME": str(cache_dir)}
    done = subprocess.run([sys.executable, "-m", "deepinfer_core.cli", "conformance", "--e2e", "--backend", "cpu",
                           "--workloads", "default"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "8/8 samples passed on cpu-reference: PASS" in done.stdout and "(float32, checkpoint default)" in done.stdout


@pytest.mark.parametrize(
    "platform, supported, entry_dtype, refresh, dtype, expected",
    [
        ("cpu-reference", ("float32", "bfloat16"), "float32", False, None, "float32"),  # its entry's dtype
        ("cpu-reference", ("float32", "bfloat16"), None, True, None, "float32"),  # the reference's new workloads: float32
        ("acme-x1", ("float32", "bfloat16"), None, False, None, "float32"),  # no entry: the reference's dtype
        ("acme-x1", ("bfloat16",), None, False, None, "auto"),  # ... unless it cannot: the workload's own
        ("acme-x1", ("float32", "bfloat16"), None, True, None, "auto"),  # recording a new entry: the workload's own
        ("acme-x1", ("float32", "bfloat16"), "bfloat16", False, None, "bfloat16"),
        ("acme-x1", ("float32", "bfloat16"), "bfloat16", True, "float16", "float16"),  # --refresh --dtype
    ],
)
def test_each_workload_runs_in_the_dtype_its_baseline_was_recorded_in(platform, supported, entry_dtype, refresh, dtype, expected):
    baselines = {"cpu-reference": {"_meta": {"workloads": {"default": {"dtype": "float32"}}}}}
    if entry_dtype is None and platform == "cpu-reference":
        baselines = {}
    if entry_dtype and platform != "cpu-reference":
        baselines[platform] = {"_meta": {"workloads": {"default": {"dtype": entry_dtype}}}}
    (planned,) = e2e.plan(e2e.load_workloads(["default"]), baselines, platform, supported, refresh, dtype)
    assert planned.dtype == expected


def test_dtype_applies_to_refresh_only(capsys):
    assert e2e.main("cpu", workloads=["default"], dtype="bf16") == 2
    assert "--dtype bf16 applies to --refresh only" in capsys.readouterr().err
    assert e2e.main("cpu", workloads=["default"], refresh=True, dtype="int8") == 2
    assert "unknown dtype 'int8'" in capsys.readouterr().err


def test_a_non_finite_run_is_never_recorded(specs_copy, replay, measured, monkeypatch, capsys, tmp_path):
    broken = dataclasses.replace(measured.results["tiny-v2-lite"]["fibonacci"], ppl=math.inf)
    run = dataclasses.replace(measured, results={"tiny-v2-lite": {**measured.results["tiny-v2-lite"], "fibonacci": broken}},
                              workload_info={"tiny-v2-lite": measured.workload_info["tiny-v2-lite"]})
    monkeypatch.setattr(e2e, "measure", lambda backend, workloads, cache_dir=None, log=print: run)
    before = baseline_file(specs_copy).read_text()
    out = tmp_path / "report.json"
    assert e2e.main("cpu", workloads=["tiny-v2-lite"], refresh=True, json_out=str(out)) == 1
    assert "not recording a baseline for cpu-reference: samples tiny-v2-lite/fibonacci measured non-finite" in capsys.readouterr().err
    assert baseline_file(specs_copy).read_text() == before
    report = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON report"))
    assert report["results"]["tiny-v2-lite"]["fibonacci"]["ppl"] == "inf"


def test_missing_sample_fails_with_how_to_record(specs_copy, replay, capsys):
    path = baseline_file(specs_copy)
    data = json.loads(path.read_text())
    del data["cpu-reference"]["tiny-v3-fp8"]["dict_counter"]
    path.write_text(json.dumps(data))
    assert e2e.main("cpu", workloads=["tiny-v3-fp8"]) == 1
    text = capsys.readouterr().out
    assert "FAIL tiny-v3-fp8/dict_counter: no baseline for this sample on cpu-reference" in text
    assert "deepinfer conformance --e2e --refresh --backend cpu --dtype float32" in text


# ---- refresh -------------------------------------------------------------------------------------
def test_refresh_rewrites_only_the_chosen_platform_and_workloads(specs_copy, replay, capsys):
    path = baseline_file(specs_copy)
    data = json.loads(path.read_text())
    other = {"_meta": {"tolerance": {"ppl_rtol": 0.02, "min_greedy_agreement": 0.5}}, "default": {"x": {"ppl": 1.0, "greedy_tokens": [1]}}}
    data["acme-x1"] = copy.deepcopy(other)
    entry = data["cpu-reference"]
    entry["default"]["fibonacci"]["ppl"] = 1234.5
    entry["default"]["read_lines"]["greedy_tokens"][5] += 1
    entry["default"]["gone"] = {"ppl": 1.0, "greedy_tokens": [0]}
    stale_v2 = copy.deepcopy(entry["tiny-v2-lite"])
    stale_v2["fibonacci"]["ppl"] = 99.0  # not refreshed: only "default" is asked for
    entry["tiny-v2-lite"] = stale_v2
    entry["_meta"]["note"] = "kept"
    tolerance = entry["_meta"]["tolerance"]
    path.write_text(json.dumps(data))

    assert e2e.main("cpu", workloads=["default"], refresh=True) == 0
    text = capsys.readouterr().out
    assert "~ default/fibonacci: ppl 1234.5 ->" in text
    assert "~ default/read_lines: greedy tokens" in text and "(agreement 0.31)" in text
    assert "- default/gone: removed" in text
    assert "6 sample(s) unchanged" in text

    raw = path.read_text()
    new = json.loads(raw)
    assert raw == json.dumps(new, indent=2, sort_keys=True) + "\n"  # the file's one format
    assert new["acme-x1"] == other
    assert new["cpu-reference"]["tiny-v2-lite"] == stale_v2
    assert sorted(new["cpu-reference"]["default"]) == sorted(s.id for s in e2e.load_workloads(["default"])[0].samples)
    meta = new["cpu-reference"]["_meta"]
    assert meta["tolerance"] == tolerance and meta["note"] == "kept"
    assert meta["command"] == "deepinfer conformance --e2e --refresh --backend cpu --workloads default"
    assert meta["torch"] == torch.__version__
    # and the refreshed entry validates
    assert e2e.main("cpu", workloads=["default"]) == 0


def test_refresh_is_a_no_op_when_nothing_changed(specs_copy, replay, capsys):
    before = json.loads(baseline_file(specs_copy).read_text())
    assert e2e.main("cpu", refresh=True) == 0
    assert "24 sample(s) unchanged" in capsys.readouterr().out
    after = json.loads(baseline_file(specs_copy).read_text())
    for entry in (before, after):  # what says when and where it was recorded changes; nothing else may
        for key in ("date", "command", "device", "python", "torch", "deepinfer"):
            entry["cpu-reference"]["_meta"].pop(key)
    assert after == before


# ---- a platform without a baseline ---------------------------------------------------------------
def test_a_platform_without_float32_is_not_compared_with_the_reference(specs_copy, replay, monkeypatch, capsys):
    replay(platform="acme-x1", backend="acme")
    monkeypatch.setattr(e2e, "platform_of", lambda backend: ("acme-x1", ("bfloat16",)))
    assert e2e.main(None, workloads=["default"]) == 1
    text = capsys.readouterr().out
    assert "not compared: workload default ran in" in text and "which platform acme-x1 does not support" in text


def test_platform_without_baseline_is_told_how_to_record_one(specs_copy, replay, capsys, tmp_path):
    replay(platform="acme-x1", backend="acme")
    out = tmp_path / "report.json"
    assert e2e.main(None, json_out=str(out)) == 1
    text = capsys.readouterr().out
    assert "no baseline for platform 'acme-x1'" in text
    assert "deepinfer conformance --e2e --refresh --backend acme" in text
    assert "for information only, against cpu-reference with the cross-platform tolerance" in text
    assert "24/24 samples within the cross-platform tolerance of cpu-reference; NOT VALIDATED" in text
    assert "PASS" not in text
    report = json.loads(out.read_text())
    assert report["status"] == "no-baseline" and report["compared_with"] == "cpu-reference"
    assert "acme-x1" not in json.loads(baseline_file(specs_copy).read_text())  # nothing recorded by accident


def test_usage_errors(capsys):
    assert e2e.main("cpu", workloads=["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown workload(s) 'nope'" in err and "default, tiny-v2-lite, tiny-v3-fp8" in err
    assert e2e.main("cpu", workloads=["nope"], structured=True) == 2  # a run that cannot start checks nothing more
    assert "unknown workload(s) 'nope'" in capsys.readouterr().err
    assert e2e.main("no-such-backend", workloads=["default"]) == 2
    assert "cannot run the workloads" in capsys.readouterr().err


# ---- checkpoints ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(checkpoints.GENERATED))
def test_materialize_is_deterministic(name, tmp_path):
    a = checkpoints.materialize(name, tmp_path / "a")
    b = checkpoints.materialize(name, tmp_path / "b")
    assert a.name == b.name == f"{name}-{checkpoints.fingerprint(name)}"
    for file in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (a / file).read_bytes() == (b / file).read_bytes(), file
    assert checkpoints.materialize(name, tmp_path / "a") == a  # cached: not written again
    with safe_open(a / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert checkpoints.tensors_digest(tensors) == checkpoints.GENERATED[name].weights_digest
    config = json.loads((a / "config.json").read_text())
    assert config["vocab_size"] == 2048 and config["hidden_size"] <= 128
    if checkpoints.GENERATED[name].fp8_block:
        assert config["quantization_config"] == {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]
        }
        kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
        assert tensors[kv_a].dtype == torch.float8_e4m3fn
        assert tensors[kv_a + "_scale_inv"].shape == (2, 4)  # 48 rows: a partial block of 16
        assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
        assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16


def test_a_platform_drawing_other_weights_is_refused(tmp_path, monkeypatch):
    spec = dataclasses.replace(checkpoints.GENERATED["tiny-v2-lite"], weights_digest="0" * 16)
    monkeypatch.setitem(checkpoints.GENERATED, "tiny-v2-lite", spec)
    with pytest.raises(checkpoints.CheckpointMismatch, match="update weights_digest"):
        checkpoints.materialize("tiny-v2-lite", tmp_path)
    assert list(tmp_path.iterdir()) == []  # no half-written checkpoint left behind


def test_transformers_loads_a_generated_checkpoint():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = checkpoints.materialize("tiny-v2-lite")
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with safe_open(path / "model.safetensors", framework="pt") as f:
        expert = f.get_tensor("model.layers.2.mlp.experts.5.down_proj.weight")
        attn = f.get_tensor("model.layers.1.self_attn.kv_b_proj.weight")
    state = model.state_dict()
    assert torch.equal(state["model.layers.2.mlp.experts.down_proj"][5].to(expert.dtype), expert)
    assert torch.equal(state["model.layers.1.self_attn.kv_b_proj.weight"].to(attn.dtype), attn)
    ids = AutoTokenizer.from_pretrained(path)("def f(x):\n    return x\n", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model.float()(ids).logits
    assert torch.isfinite(logits).all() and 0.5 < logits.std() < 2.0  # about N(0, 1), as designed
