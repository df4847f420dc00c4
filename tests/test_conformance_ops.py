"""The op conformance kit: it runs every op, and it catches wrong ops for the right reason.

The reference judged against itself proves only that the kit runs (one cheap smoke test below);
what the kit is for is shown by planting bugs. Each broken implementation below is wrong in one
way a real kernel can be (a forgotten eps, an unwritten row, a modified input, a wrong dtype, a
crash, a wrong expert, a biased sampler, a skipped full last cache block, a block scale 10% off,
a dropped cache prefix, a bug only at shapes the spec does not declare, a race) and must FAIL,
on the declared shapes unless it says otherwise, with a message that says what and where, and
the case it names must replay to the same FAIL. The real backends through the kit:
tests/nvidia/test_conformance_kit.py (the Triton kernels) and tests/test_vendor_plugin.py (the
example vendor backend and its broken twin).
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.cli import main
from deepinfer_core.conformance import jsonsafe, ops_suite
from deepinfer_core.conformance.checks import block_scores, chi_square_pvalue, indexer_scores
from deepinfer_core.conformance.inputs import BUILDERS, CaseTooLarge, make_case, tensors_of
from deepinfer_core.conformance.ops_suite import (OpReport, ReplayCase, SuiteReport, format_report, replay_case, run_op, run_suite, write_json)
from deepinfer_core.conformance.spec import shapes, specs_dir, tolerance
from deepinfer_core.ops import OP_NAMES, REFERENCE_OPS
from deepinfer_core.ops.norm import rms_norm

F32 = torch.float32


def check(op, fn, examples=6, dtype=F32):
    return run_op(op, fn, dtype, "cpu", examples=examples)


def test_every_op_has_a_generator_and_a_spec():
    assert set(BUILDERS) == set(OP_NAMES)
    for op in OP_NAMES:
        assert shapes(op), op
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert set(tolerance(op, dtype)) == {"atol", "rtol"}


# The smoke test's size limit: every op keeps its small, awkward shapes (the real ones only cost
# time here: the kernels judged at them are the backends', tests/nvidia/test_conformance_kit.py).
SMOKE_MAX_ELEMENTS = 1 << 16


@pytest.mark.parametrize("op", OP_NAMES)
def test_the_kit_runs_every_op(op):
    """A smoke test of the kit, not of any op (the reference judged against itself fails on no
    number): each op's declared shapes build, run and pass its checker, so a kit error (a builder
    that breaks, a checker that fails the reference) shows. The one example runs hypothesis' path."""
    report = run_op(op, REFERENCE_OPS[op], F32, "cpu", examples=1, max_elements=SMOKE_MAX_ELEMENTS)
    assert report.result == "PASS", report.detail()
    assert report.cases == len(shapes(op)) - report.skipped + 1 and report.cases > 1


def test_max_elements_leaves_out_only_the_larger_declared_shapes():
    """The limit counts the values a case's inputs hold (or take to draw) and refuses a case
    before its weights are drawn; an op none of whose declared shapes fits is an ERROR, not a PASS
    of nothing."""
    lm_head = max(shapes("linear"), key=lambda d: d["out_features"])  # 7168 x 129280 weights
    with pytest.raises(CaseTooLarge, match="max_elements"):
        make_case("linear", lm_head, F32, "cpu", max_elements=1 << 20)  # at once: nothing drawn
    sizes = [make_case("linear", d, F32, "cpu").elements() for d in shapes("linear") if d["in_features"] == 64]
    report = run_op("linear", REFERENCE_OPS["linear"], F32, "cpu", examples=0, max_elements=max(sizes))
    assert (report.result, report.cases, report.skipped) == ("PASS", len(sizes), len(shapes("linear")) - len(sizes))
    assert report.detail() == f"{report.skipped} declared shapes over max_elements not run"
    assert report.detail() in format_report(SuiteReport("reference", "cpu-reference", "cpu", ops=[report]))
    report = run_op("linear", REFERENCE_OPS["linear"], F32, "cpu", examples=2, max_elements=min(sizes) - 1)
    assert report.result == "ERROR" and report.cases == 0 and "every declared shape of linear" in report.message
    assert report.failing_case is None and report.replay_command("reference") == ""


def test_cli_max_elements(capsys):
    """``deepinfer conformance --max-elements N`` is the same limit (and --replay refuses it)."""
    assert main(["conformance", "--backend", "reference", "--ops", "rms_norm", "--dtype", "fp32", "--examples", "0",
                 "--max-elements", "5000", "--quiet"]) == 0
    assert "declared shapes over max_elements not run" in capsys.readouterr().out
    assert main(["conformance", "--backend", "reference", "--replay", "{}", "--max-elements", "5"]) == 2
    assert "drop --max-elements" in capsys.readouterr().err


def test_cli_checks_the_batch_invariant_table(capsys):
    assert main(["conformance", "--backend", "reference", "--batch-invariant", "--ops", "linear,moe_route", "--dtype", "fp32",
                 "--examples", "0", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "backend 'reference' (its batch-invariant table)" in out and "PASSED" in out
    assert main(["conformance", "--e2e", "--batch-invariant"]) == 2
    assert "do not apply to --e2e" in capsys.readouterr().err


def test_inputs_are_reproducible_and_device_independent():
    a = make_case("mla_decode_attention", shapes("mla_decode_attention")[1], F32, "cpu", seed=5)
    b = make_case("mla_decode_attention", shapes("mla_decode_attention")[1], F32, "cpu", seed=5)
    for x, y in zip(a.args, b.args):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y) and x.stride() == y.stride()
    assert not a.args[3].is_contiguous()  # block tables are a strided view, as the spec promises


@pytest.mark.parametrize("op,index", [("rotary_embedding", 0), ("head_linear", 0)])
def test_per_head_inputs_come_as_the_model_passes_them(op, index):
    """q (rotary_embedding) and q_nope (head_linear) are column slices of the model's stacked
    [q | latent | k_pe] rows: a token's row is wider than its heads, so a kernel that takes
    stride(0) for heads * stride(1) fails here as it would in the model."""
    dims = next(d for d in shapes(op) if d["tokens"] > 1 and d["heads"] > 1)  # size-1 dims have no stride to test
    x = make_case(op, dims, F32, "cpu").args[index]
    assert x.stride(0) != x.shape[1] * x.stride(1) and x.stride(2) == 1


def test_forgotten_eps_fails_with_the_shape():
    report = check("rms_norm", lambda x, w, eps: rms_norm(x, w, 0.0) * 1.01)
    assert report.result == "FAIL"
    assert "outside atol" in report.message and report.failing_shape is not None and report.worst_error > 1


@pytest.mark.parametrize("factor, result", [(0.5, "PASS"), (2.0, "FAIL")])
def test_an_error_is_judged_against_the_spec_bound_itself(factor, result):
    """Every output off by ``factor`` times the spec's bound atol + rtol |ref|: inside it at 0.5,
    outside at 2, and the reported worst error is that factor (the kit is neither laxer nor
    stricter than specs/ops.toml)."""
    tol = tolerance("rms_norm", F32)

    def off(x, w, eps):
        ref = rms_norm(x, w, eps)
        return ref + factor * (tol["atol"] + tol["rtol"] * ref.abs())

    report = check("rms_norm", off, examples=0)
    assert report.result == result and report.worst_error == pytest.approx(factor, rel=0.02), report.detail()


def _unwritten_last_row(x, w, eps):
    out = torch.empty_like(x)
    if x.shape[0] > 1:
        out[:-1] = rms_norm(x[:-1], w, eps)
    return out


def test_unwritten_output_is_caught_by_poisoning():
    report = check("rms_norm", _unwritten_last_row)
    assert report.result == "FAIL" and "NaN" in report.message and "unwritten" in report.message


def test_modified_input_is_caught():
    def in_place(x, w, eps):
        x.mul_(1.0)
        x[..., 0] = 7.0
        return rms_norm(x, w, eps)

    report = check("rms_norm", in_place)
    assert report.result == "FAIL" and "modified its input argument 0" in report.message


def test_wrong_dtype_and_exceptions_are_reported():
    report = check("silu_and_mul", lambda x: REFERENCE_OPS["silu_and_mul"](x).double())
    assert report.result == "FAIL" and "dtype torch.float64" in report.message
    report = check("silu_and_mul", lambda x: 1 / 0)
    assert report.result == "FAIL" and "raised ZeroDivisionError" in report.message


def _wrong_on_even(x, w, eps):
    y = rms_norm(x, w, eps)
    return y * 2 if x.shape[0] % 2 == 0 and x.shape[0] else y


def test_hypothesis_finds_a_bug_the_declared_shapes_miss():
    """Every declared rms_norm token count is odd (or 0); a kernel wrong on even counts passes them
    all, and the search over token counts must find and shrink it to the smallest even count."""
    assert all(s["tokens"] % 2 == 1 or s["tokens"] == 0 for s in shapes("rms_norm"))
    report = check("rms_norm", _wrong_on_even, examples=30)
    assert report.result == "FAIL"
    assert report.failing_shape["tokens"] == 2, report.failing_shape


def _printed_replay(report: OpReport, backend: str = "reference") -> list[str]:
    """The replay command the suite's text report prints for ``report``'s failure, as argv."""
    text = format_report(SuiteReport(backend, "cpu-reference", "cpu", ops=[report]))
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("deepinfer conformance")]
    assert len(lines) == 1, text
    argv = shlex.split(lines[0])
    assert argv[:4] == ["deepinfer", "conformance", "--backend", backend] and argv[4] == "--replay", argv
    return argv[1:]


def _backend_with(op: str, fn):
    """A stand-in for ops_suite.resolve_backend: the reference backend with ``fn`` as its ``op``."""
    from deepinfer_core.ops import OpTable

    real = ops_suite.resolve_backend

    def resolve(backend, batch_invariant=False):
        chosen, platform, table = real(backend, batch_invariant)
        return chosen, platform, OpTable({**REFERENCE_OPS, op: fn}, table.providers)

    return resolve


def test_a_failure_found_by_hypothesis_replays_exactly(tmp_path, capsys, monkeypatch):
    """The case hypothesis shrank to, as the report prints it (text and JSON), run again through
    --replay: the broken op FAILs it again the same way, the reference passes it."""
    report = check("rms_norm", _wrong_on_even, examples=30)
    assert report.result == "FAIL" and report.failing_case is not None
    argv = _printed_replay(report)
    case = ReplayCase.parse(argv[-1])
    assert case == report.failing_case and (case.op, case.dtype, case.dims, case.seed) == (
        "rms_norm", "float32", report.failing_shape, report.failing_seed)
    again = replay_case(case, _wrong_on_even, "cpu")
    assert (again.result, again.cases, again.message) == ("FAIL", 1, report.message)
    assert replay_case(case, REFERENCE_OPS["rms_norm"], "cpu").result == "PASS"

    out = tmp_path / "replay.json"
    assert main([*argv, "--json", str(out)]) == 0  # the printed command, on the reference backend
    text = capsys.readouterr().out
    assert "Replayed one case" in text and "PASSED: all 1 checks (1 cases)" in text
    assert json.loads(out.read_text())["replayed"] == json.loads(case.text())
    monkeypatch.setattr(ops_suite, "resolve_backend", _backend_with("rms_norm", _wrong_on_even))
    assert main(argv) == 1  # the same command on a backend with the broken op
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.split()[:1] == ["rms_norm"])
    assert "FAIL" in row and report.message in row and "Replay a failing case" not in text  # it is one already

    suite_json = tmp_path / "suite.json"  # the JSON report carries the same case
    write_json(SuiteReport("reference", "cpu-reference", "cpu", ops=[report]), suite_json)
    assert ReplayCase.parse(json.dumps(json.loads(suite_json.read_text())["ops"][0]["failing_case"])) == case


def test_the_reported_value_seed_is_the_one_that_built_the_failing_inputs():
    """A bug that depends on the values, not only the shape: hypothesis cannot shrink the value
    seed to 0 (seed 0 never triggers it), and the seed reported must be the one that does."""

    def wrong_on_even_positive(x, w, eps):
        y = rms_norm(x, w, eps)
        return y * 2 if x.shape[0] % 2 == 0 and x.shape[0] and x[0, 0] > 0 else y

    # seed 0 starts every (large enough) draw with the same negative value: it never triggers
    assert all(make_case("rms_norm", {**s, "tokens": 2}, F32, "cpu", 0).args[0][0, 0] < 0 for s in shapes("rms_norm"))
    report = check("rms_norm", wrong_on_even_positive, examples=30)
    assert report.result == "FAIL" and report.failing_seed != 0, report.detail()
    assert f"value seed {report.failing_seed}]" in report.detail()
    case = ReplayCase.parse(_printed_replay(report)[-1])
    assert replay_case(case, wrong_on_even_positive, "cpu").result == "FAIL"
    seed0 = ReplayCase(case.op, case.dtype, case.dims, 0)
    assert replay_case(seed0, wrong_on_even_positive, "cpu").result == "PASS"


def test_an_unbuildable_case_is_an_error_that_names_its_case(capsys):
    case = ReplayCase("write_latent_cache", "float32", {**shapes("write_latent_cache")[0], "tokens": 99}, 3)
    report = replay_case(case, REFERENCE_OPS["write_latent_cache"], "cpu")
    assert report.result == "ERROR" and report.failing_case == case and "could not build inputs" in report.message
    assert main(["conformance", "--backend", "reference", "--replay", case.text()]) == 1  # as an ERROR row of the suite
    assert "ERROR" in capsys.readouterr().out


@pytest.mark.parametrize("args, says", [
    (["--replay", "{not json"], "not JSON"),
    (["--replay", "[1, 2]"], "must be a JSON object"),
    (["--replay", '{"op": "rms_norm", "dtype": "float32", "dims": {"tokens": 2, "hidden": 64}}'], "missing: seed"),
    (["--replay", '{"op": "rms_norm", "dtype": "float32", "dims": {"tokens": 2, "hidden": 64}, "seed": 0, "sed": 1}'], "unknown: sed"),
    (["--replay", '{"op": "rms", "dtype": "float32", "dims": {}, "seed": 0}'], "unknown op 'rms'"),
    (["--replay", '{"op": "rms_norm", "dtype": "float64", "dims": {"tokens": 2, "hidden": 64}, "seed": 0}'], "unknown dtype"),
    (["--replay", '{"op": "rms_norm", "dtype": "float32", "dims": {"tokens": 2}, "seed": 0}'], "missing: hidden"),
    (["--replay", '{"op": "rms_norm", "dtype": "float32", "dims": {"tokens": 2, "hidden": 64}, "seed": -1}'], "seed must be"),
    (["--replay", '{"op": "rms_norm", "dtype": "float32", "dims": {"tokens": 2, "hidden": 64}, "seed": 0}', "--dtype", "bf16"],
     "drop --dtype"),
    (["--replay", '{"op": "rms_norm", "dtype": "float32", "dims": {"tokens": 2, "hidden": 64}, "seed": 0}', "--e2e"],
     "do not apply to --e2e"),
])  # fmt: skip
def test_a_malformed_replay_case_cannot_run(args, says, capsys):
    assert main(["conformance", "--backend", "reference", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err, err


def test_a_flaky_failure_is_a_fail_not_a_crash():
    """An op that fails a case once and passes it on the same inputs (a race, say) trips
    hypothesis' flakiness check: the suite reports a FAIL that says so instead of aborting."""
    calls = []
    declared = sum(1 for s in shapes("rms_norm") if s["tokens"])

    def fails_once(x, w, eps):  # wrong on the first non-empty case hypothesis draws, right ever after
        calls.extend([1] if x.shape[0] else [])
        return rms_norm(x, w, eps) * (2 if len(calls) == declared + 1 else 1)

    report = check("rms_norm", fails_once, examples=6)
    assert report.result == "FAIL" and report.message.startswith("flaky:") and report.failing_case is not None


def test_wrong_expert_choice_fails_and_ties_are_allowed():
    def second_best(x, gate, bias, **kw):
        weights, ids = REFERENCE_OPS["moe_route"](x, gate, bias, **kw)
        return weights, (ids + 1) % gate.shape[0]

    report = check("moe_route", second_best, examples=0)
    assert report.result == "FAIL" and "differ without a tie" in report.message
    report = check("moe_route", lambda *a, **kw: tuple(t.flip(-1) for t in REFERENCE_OPS["moe_route"](*a, **kw)), examples=2)
    assert report.result == "PASS", report.detail()  # slot order is unspecified


PAGED_LENGTHS = {"write_latent_cache": "tokens", "norm_rope_write_latent": "tokens", "gather_latent_cache": "slots",
                 "mla_decode_attention": "seq_lens", "write_cache": "tokens"}


def test_paged_ops_declare_the_block_boundaries():
    """Every op whose inputs are a paged cache declares a length of exactly one block, of several
    blocks (the last one full), of one token, and block_size 1."""
    paged = {op for op, rows in ((op, shapes(op)) for op in BUILDERS) if all("block_size" in s for s in rows)}
    assert paged == set(PAGED_LENGTHS)
    for op, dim in PAGED_LENGTHS.items():
        cases = [(n, s["block_size"]) for s in shapes(op) for n in (s[dim] if isinstance(s[dim], list) else [s[dim]])]
        assert any(n == bs for n, bs in cases if bs > 1), op
        assert any(n % bs == 0 and n >= 2 * bs for n, bs in cases if bs > 1), op
        assert any(n == 1 for n, _ in cases) and any(bs == 1 for _, bs in cases), op


def _skips_a_full_last_block(q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale):
    """The reference, except that a sequence whose length is a multiple of the block size loses
    its last, full block (an off-by-one in the count of blocks to visit)."""
    block_size = kv_cache.shape[1]
    short = torch.where(seq_lens % block_size == 0, seq_lens - block_size, seq_lens)
    return REFERENCE_OPS["mla_decode_attention"](q_latent, q_pe, kv_cache, block_tables, short, query_start_loc, scale)


def test_decode_that_skips_a_full_last_block_fails_on_the_declared_shapes():
    assert check("mla_decode_attention", REFERENCE_OPS["mla_decode_attention"], examples=0).result == "PASS"
    report = check("mla_decode_attention", _skips_a_full_last_block, examples=0)
    assert report.result == "FAIL", report.detail()
    assert any(n % report.failing_shape["block_size"] == 0 for n in report.failing_shape["seq_lens"]), report.failing_shape


def test_decode_that_drops_the_last_token_fails():
    def drop_last(q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale):
        short = (seq_lens - 1).clamp(min=1)
        return REFERENCE_OPS["mla_decode_attention"](q_latent, q_pe, kv_cache, block_tables, short, query_start_loc, scale)

    report = check("mla_decode_attention", drop_last, examples=0)
    assert report.result == "FAIL" and "seq_lens" in report.failing_shape


def _rows(query_start_loc: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, its sequence b, its index i within the sequence) of every query row."""
    starts = query_start_loc.tolist()
    return [(row, b, row - starts[b]) for b in range(len(starts) - 1) for row in range(starts[b], starts[b + 1])]


def _per_row(q_latent, q_pe, kv_cache, block_tables, query_start_loc, scale, length):
    """The reference run once per query row, each as a sequence of one row with ``length(row, b, i)`` entries."""
    out = torch.empty_like(q_latent)
    one_row = torch.tensor([0, 1], dtype=torch.int32)
    for row, b, i in _rows(query_start_loc):
        n = torch.tensor([length(row, b, i)], dtype=torch.int32)
        out[row] = REFERENCE_OPS["mla_decode_attention"](q_latent[row : row + 1], q_pe[row : row + 1], kv_cache,
                                                          block_tables[b : b + 1], n, one_row, scale)[0]
    return out


@pytest.mark.parametrize("bug", ["not_causal", "mirrored", "global_row_index", "newest_row_only"])
def test_decode_that_gets_the_query_rows_wrong_fails_on_the_declared_shapes(bug):
    """Bugs invisible with one query row per sequence: every row attending to the whole sequence,
    the causal mask mirrored (row i sees seq_len - i entries), row i counted from the start of the
    batch instead of its sequence, the newest row's result given to all of a sequence's rows. Each
    must fail on a declared shape with several query rows (and pass the one-row shapes)."""

    def wrong(q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale):
        lens, starts = seq_lens.tolist(), query_start_loc.tolist()

        def length(row, b, i):
            q, n = starts[b + 1] - starts[b], lens[b]
            return {"not_causal": n, "mirrored": n - i, "global_row_index": min(n, n - q + 1 + row),
                    "newest_row_only": n}[bug]

        out = _per_row(q_latent, q_pe, kv_cache, block_tables, query_start_loc, scale, length)
        if bug == "newest_row_only":
            for row, b, i in _rows(query_start_loc):
                out[row] = out[starts[b + 1] - 1]
        return out

    report = check("mla_decode_attention", wrong, examples=0)
    assert report.result == "FAIL", report.detail()
    assert any(q > 1 for q in report.failing_shape.get("query_lens", [])), report.failing_shape
    for dims in shapes("mla_decode_attention"):
        if all(q == 1 for q in dims.get("query_lens", [1])) and dims["heads"] < 128:
            assert replay_case(ReplayCase("mla_decode_attention", "float32", dims, 0), wrong, "cpu").result == "PASS", dims


@pytest.mark.parametrize("which", ["mixed", "q_len_is_seq_len"])
def test_decode_rows_are_the_op_once_per_row_with_a_truncated_seq_len(which):
    """The kit's multi-row cases as the contract defines them: row i of a sequence of q rows and
    seq_len n is the op on that row alone with n - q + 1 + i entries (bit for bit)."""
    declared = [s for s in shapes("mla_decode_attention") if "query_lens" in s]
    dims = declared[0] if which == "mixed" else next(s for s in declared if any(q == n for q, n in zip(s["query_lens"], s["seq_lens"])))
    case = make_case("mla_decode_attention", dims, F32, "cpu", seed=2)
    q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale = case.args
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    assert starts == [0, *torch.tensor(dims["query_lens"]).cumsum(0).tolist()] and q_latent.shape[0] == starts[-1]
    got = REFERENCE_OPS["mla_decode_attention"](*case.args)
    want = _per_row(q_latent, q_pe, kv_cache, block_tables, query_start_loc, scale,
                    lambda row, b, i: lens[b] - (starts[b + 1] - starts[b]) + 1 + i)
    assert torch.equal(got, want)


def test_decode_cases_with_query_rows_vary_and_replay():
    """query_lens is optional in the spec: cases with and without it replay; the hypothesis
    variation keeps 0 <= query_lens <= seq_lens and explores several rows per sequence."""
    from hypothesis import given, settings

    from deepinfer_core.conformance.inputs import shape_strategy

    declared = shapes("mla_decode_attention")
    assert any("query_lens" in s for s in declared) and any("query_lens" not in s for s in declared)
    for dims in (declared[0], next(s for s in declared if "query_lens" in s)):
        case = ReplayCase.parse(ReplayCase("mla_decode_attention", "float32", dims, 1).text())
        assert replay_case(case, REFERENCE_OPS["mla_decode_attention"], "cpu").result == "PASS"
    with pytest.raises(ValueError, match=r"\(optionally query_lens\); unknown: query_len"):
        ReplayCase.parse(json.dumps({"op": "mla_decode_attention", "dtype": "float32", "seed": 0,
                                     "dims": {**declared[0], "query_len": [1]}}))
    with pytest.raises(ValueError, match="missing: seq_lens"):
        ReplayCase.parse(json.dumps({"op": "mla_decode_attention", "dtype": "float32", "seed": 0,
                                     "dims": {k: v for k, v in declared[0].items() if k != "seq_lens"}}))
    with pytest.raises(ValueError, match="one query_lens entry >= 0 per sequence"):
        make_case("mla_decode_attention", {**declared[0], "query_lens": [1, 1]}, F32, "cpu")
    most_rows = []

    @settings(max_examples=60, deadline=None, database=None, derandomize=True)
    @given(dims=shape_strategy("mla_decode_attention", declared))
    def draw(dims):
        q = dims.get("query_lens", [1] * len(dims["seq_lens"]))
        assert len(q) == len(dims["seq_lens"]) and all(0 <= a <= n for a, n in zip(q, dims["seq_lens"])), dims
        most_rows.append(max(q, default=0))

    draw()
    assert max(most_rows) > 1


def test_cache_write_that_ignores_padding_fails():
    def no_padding(kv_cache, latent, k_pe, slots):
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        flat[slots.clamp(min=0)] = torch.cat([latent, k_pe], -1).to(kv_cache.dtype)

    report = check("write_latent_cache", no_padding, examples=0)
    assert report.result == "FAIL" and "in place" in report.message


def test_samplers_greedy_ties_and_distribution():
    def ties_to_highest(logits, temperature, *rest):
        out = REFERENCE_OPS["sample_tokens"](logits, temperature, *rest)
        greedy = temperature <= 0
        flipped = logits.shape[1] - 1 - logits.flip(-1).argmax(-1)
        return torch.where(greedy, flipped, out)

    report = check("sample_tokens", ties_to_highest, examples=0)
    assert report.result == "FAIL" and "greedy row" in report.message

    def ignores_temperature(logits, temperature, top_k, top_p, min_p, seeds, steps):
        ones = torch.where(temperature > 0, torch.ones_like(temperature), temperature)
        return REFERENCE_OPS["sample_tokens"](logits, ones, top_k, top_p, min_p, seeds, steps)

    report = check("sample_tokens", ignores_temperature, examples=0)
    assert report.result == "FAIL" and "chi-square" in report.message


def test_json_report_is_strict_json(tmp_path):
    """A crashed op's worst error is inf: the --json report writes it as "inf", never a bare
    Infinity that strict parsers (jq, JSON.parse) reject."""
    report = SuiteReport("reference", "cpu-reference", "cpu", ops=[
        OpReport("silu_and_mul", "float32", "FAIL", cases=1, worst_error=float("inf"), message="raised ZeroDivisionError")])
    path = tmp_path / "report.json"
    write_json(report, path)

    def bare(constant):
        raise ValueError(f"bare {constant} in the report")

    data = json.loads(path.read_text(), parse_constant=bare)
    assert data["ops"][0]["worst_error"] == "inf" and data["passed"] is False


def test_jsonsafe_names_every_non_finite_float():
    obj = {"b": [1.5, float("nan"), (float("-inf"), 2)], "a": {float("inf"): torch.float32}, "c": None}
    text = jsonsafe.dumps(obj)
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c}")) == {
        "a": {"inf": "torch.float32"}, "b": [1.5, "nan", ["-inf", 2]], "c": None}
    finite = {"z": [1, 2.5, "x"], "a": {"k": True}}  # otherwise exactly json.dumps(indent=2, sort_keys=True)
    assert jsonsafe.dumps(finite) == json.dumps(finite, indent=2, sort_keys=True)
    assert [float(v) for v in ("inf", "-inf")] == [math.inf, -math.inf] and math.isnan(float("nan"))  # what float() reads back


def test_chi_square_pvalue():
    probs = torch.tensor([0.5, 0.25, 0.25])
    assert chi_square_pvalue(torch.tensor([500, 250, 250]), probs) > 0.99
    assert chi_square_pvalue(torch.tensor([700, 150, 150]), probs) < 1e-6
    # small cells are pooled, and a pooled cell still under 5 joins the next one
    assert chi_square_pvalue(torch.tensor([98, 1, 1]), torch.tensor([0.98, 0.01, 0.01])) > 0.5


def test_suite_checks_only_the_backends_own_ops_and_rejects_bad_requests():
    report = run_suite("reference", ops=["silu_and_mul"], dtypes=[F32], examples=1, progress=False)
    assert report.passed and [(r.op, r.dtype) for r in report.ops] == [("silu_and_mul", "float32")]
    with pytest.raises(ValueError, match="unknown ops"):
        run_suite("reference", ops=["silu"], progress=False)


def test_cli_report_and_exit_codes(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["conformance", "--backend", "cpu", "--ops", "rms_norm,gather_latent_cache", "--dtype", "bf16,fp32",
                 "--examples", "2", "--quiet", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "OP" in text and "WORST ERROR" in text and "PASSED: all 4 checks" in text
    data = json.loads(out.read_text())
    assert data["passed"] and data["platform"] == "cpu-reference" and len(data["ops"]) == 4
    assert main(["conformance", "--backend", "cpu", "--dtype", "float64"]) == 2
    assert "unknown dtype 'float64'" in capsys.readouterr().err
    assert main(["conformance", "--backend", "nosuchchip"]) == 2
    assert "nosuchchip" in capsys.readouterr().err
    assert main(["conformance", "--refresh"]) == 2


def test_specs_found_from_a_checkout_and_from_the_environment(tmp_path, monkeypatch):
    assert (specs_dir() / "ops.toml").is_file()
    monkeypatch.setenv("DEEPINFER_SPECS_DIR", str(tmp_path))
    from deepinfer_core.conformance.spec import SpecError

    (tmp_path / "ops.toml").write_text((Path(__file__).parent.parent / "specs" / "ops.toml").read_text())
    assert specs_dir() == tmp_path
    (tmp_path / "ops.toml").unlink()
    with pytest.raises(SpecError, match="DEEPINFER_SPECS_DIR"):
        specs_dir()


def test_pytest_plugin_runs_the_checks(tmp_path):
    """``pytest --deepinfer-backend`` in an empty directory: one item per (op, dtype). Within
    --deepinfer-max-elements 32, silu_and_mul keeps its empty case (0 values) and passes;
    rms_norm keeps none (its weight alone holds 64) and is an error, not an empty pass."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--deepinfer-backend", "reference",
         "--deepinfer-ops", "silu_and_mul,rms_norm", "--deepinfer-dtype", "fp32,bf16", "--deepinfer-examples", "1",
         "--deepinfer-max-elements", "32"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 1 and "2 failed, 2 passed" in run.stdout, run.stdout + run.stderr
    assert "rms_norm (float32) ERROR: could not build inputs: every declared shape of rms_norm holds more" in run.stdout, run.stdout
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--deepinfer-backend", "nosuchchip"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "nosuchchip" in run.stdout + run.stderr


# ---- DeepSeek-V3 ops: the kit catches wrong ones (beside the ones above) -------------------------


def _fp8_first_block_scale_10pct_off(x, weight, scale, block, bias=None):
    """One weight block's scale 10% too large (a mis-converted scale, a wrong block read once)."""
    scale = scale.clone()
    scale[0, 0] *= 1.1
    return REFERENCE_OPS["fp8_block_linear"](x, weight, scale, block, bias)


def _fp8_last_block_scale_10pct_off(x, weight, scale, block, bias=None):
    """The same for the last block: a partial [8, 4] edge block at the small shape."""
    scale = scale.clone()
    scale[-1, -1] *= 1.1
    return REFERENCE_OPS["fp8_block_linear"](x, weight, scale, block, bias)


def _linear_without_bias(x, weight, bias=None):
    return REFERENCE_OPS["linear"](x, weight)


def _rope_always_interleaved(q, k, positions, cos_sin, interleaved):
    return REFERENCE_OPS["rotary_embedding"](q, k, positions, cos_sin, True)


def _rope_positions_off_by_one(q, k, positions, cos_sin, interleaved):
    return REFERENCE_OPS["rotary_embedding"](q, k, positions + 1, cos_sin, interleaved)


def _add_rms_norm_returning_the_old_residual(x, residual, weight, eps):
    y, _ = REFERENCE_OPS["add_rms_norm"](x, residual, weight, eps)
    return y, residual.clone()


def _silu_of_up_times_gate(x):
    gate, up = x.chunk(2, dim=-1)
    return REFERENCE_OPS["silu_and_mul"](torch.cat([up, gate], dim=-1))


def _silu_last_row_unwritten(x):
    out = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=x.dtype, device=x.device)
    out[:-1] = REFERENCE_OPS["silu_and_mul"](x[:-1])
    return out


def _route_never_renormalised(x, gate, bias, **kw):
    return REFERENCE_OPS["moe_route"](x, gate, bias, **{**kw, "norm_topk_prob": False})


def _experts_ignoring_route_weights(x, w13, w2, weights, ids, w13_scale=None, w2_scale=None, block=None):
    return REFERENCE_OPS["moe_experts"](x, w13, w2, torch.ones_like(weights), ids, w13_scale, w2_scale, block)


def _experts_first_block_scale_10pct_off(x, w13, w2, weights, ids, w13_scale=None, w2_scale=None, block=None):
    if w13_scale is not None:
        w13_scale = w13_scale.clone()
        w13_scale[:, 0, 0] *= 1.1
    return REFERENCE_OPS["moe_experts"](x, w13, w2, weights, ids, w13_scale, w2_scale, block)


def _cache_write_without_k_pe(kv_cache, latent, k_pe, slots):
    """Only the latent part of each entry stored (the rope key left as it was)."""
    keep = slots >= 0
    kv_cache.view(-1, kv_cache.shape[-1])[slots[keep], : latent.shape[-1]] = latent[keep].to(kv_cache.dtype)


def _fused_write_of_the_unrotated_key(kv_cache, kv, w, eps, q_pe, positions, cos_sin, interleaved, slots):
    """The latent normed and q rotated, but the cache gets the rope key as projected."""
    q_rot = REFERENCE_OPS["norm_rope_write_latent"](kv_cache, kv, w, eps, q_pe, positions, cos_sin, interleaved, slots)
    keep = slots >= 0
    kv_cache.view(-1, kv_cache.shape[-1])[slots[keep], w.shape[0]:] = kv[keep, w.shape[0]:].to(kv_cache.dtype)
    return q_rot


def _fused_write_returning_q_unrotated(kv_cache, kv, w, eps, q_pe, positions, cos_sin, interleaved, slots):
    REFERENCE_OPS["norm_rope_write_latent"](kv_cache, kv, w, eps, q_pe, positions, cos_sin, interleaved, slots)
    return q_pe.clone()


def _gather_the_next_slot(kv_cache, slots):
    return REFERENCE_OPS["gather_latent_cache"](kv_cache, (slots + 1) % (kv_cache.shape[0] * kv_cache.shape[1]))


def _prefill_without_the_cached_prefix(q, k, v, cu_seqlens_q, cu_seqlens_k, scale):
    """Each sequence's queries attend only to its new tokens' keys (causal from the top left)."""
    starts_q, ends_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()[1:]
    rows = [i for b, end in enumerate(ends_k) for i in range(end - (starts_q[b + 1] - starts_q[b]), end)]
    rows = torch.tensor(rows, dtype=torch.int64)
    return REFERENCE_OPS["mla_prefill_attention"](q, k[rows], v[rows], cu_seqlens_q, cu_seqlens_q.clone(), scale)


# (op, a wrong implementation, what the failure must say): the V3 ops' planted bugs, in float32,
# where fp8_block_linear's contract is the exact path (its bf16 / fp16 tolerance admits W8A8's
# activation rounding, 0.14 worst, which hides a 10% block scale error of 0.04-0.17: specs/ops.toml)
WRONG_V3 = [
    ("fp8_block_linear", _fp8_first_block_scale_10pct_off, "y:"),
    ("fp8_block_linear", _fp8_last_block_scale_10pct_off, "y:"),
    ("linear", _linear_without_bias, "y:"),
    ("rotary_embedding", _rope_always_interleaved, "q:"),
    ("rotary_embedding", _rope_positions_off_by_one, "q:"),
    ("add_rms_norm", _add_rms_norm_returning_the_old_residual, "residual:"),
    ("silu_and_mul", _silu_of_up_times_gate, "y:"),
    ("silu_and_mul", _silu_last_row_unwritten, "NaN"),
    ("moe_route", _route_never_renormalised, "weights:"),
    ("moe_experts", _experts_ignoring_route_weights, "y:"),
    ("moe_experts", _experts_first_block_scale_10pct_off, "y:"),
    ("write_latent_cache", _cache_write_without_k_pe, "in place"),
    ("norm_rope_write_latent", _fused_write_of_the_unrotated_key, "in place"),
    ("norm_rope_write_latent", _fused_write_returning_q_unrotated, "q_pe:"),
    ("gather_latent_cache", _gather_the_next_slot, "rows:"),
    ("mla_prefill_attention", _prefill_without_the_cached_prefix, "o:"),
]  # fmt: skip


# ---- DeepSeek-V4 ops: the kit catches wrong ones ------------------------------------------------


def _route_topk_ignoring_fixed_ids(x, gate, bias, fixed_ids, **kw):
    return REFERENCE_OPS["moe_route_sqrtsoftplus"](x, gate, bias, None, **kw)


def _route_bias_in_weights(x, gate, bias, fixed_ids, **kw):
    weights, ids = REFERENCE_OPS["moe_route_sqrtsoftplus"](x, gate, bias, fixed_ids, **kw)
    return (weights + bias[ids] if bias is not None else weights), ids


def _indexer_second_best(q, weights, keys, candidates, top_k, scale):
    """The reference's picks with its weakest pick swapped for the best candidate it left out."""
    ids = REFERENCE_OPS["indexer_topk"](q, weights, keys, candidates, top_k, scale)
    out = ids.clone()
    for t in range(ids.shape[0]):
        left = sorted(set(candidates[t][candidates[t] >= 0].tolist()) - set(ids[t].tolist()))
        if left and (ids[t] >= 0).any():
            out[t, int((ids[t] >= 0).nonzero()[-1])] = left[0]
    return out


def _indexer_minus_ones_first(q, weights, keys, candidates, top_k, scale):
    """Same rows, other order: the -1s first (the order is free)."""
    ids = REFERENCE_OPS["indexer_topk"](q, weights, keys, candidates, top_k, scale)
    return ids.sort(dim=-1).values


def _indexer_padding_as_row_0(q, weights, keys, candidates, top_k, scale):
    return REFERENCE_OPS["indexer_topk"](q, weights, keys, candidates.clamp(min=0), top_k, scale)


def _indexer_choose(q, weights, keys, candidates, top_k, scale, order, dtype=torch.float32):
    """Top-k by the kit's scores (in ``dtype``), columns ranked by ``order(scores)`` [T, C]."""
    scores = indexer_scores(q.to(dtype), weights.to(dtype), keys.to(dtype), candidates, scale)
    k = min(top_k, candidates.shape[1])
    best = order(scores)[:, :k]
    chosen = candidates.gather(1, best)
    return torch.where(chosen >= 0, chosen, torch.full_like(chosen, -1))


def _indexer_torch_topk(q, weights, keys, candidates, top_k, scale):
    """torch.topk: no tie rule (on the CPU it takes later columns at ties)."""
    return _indexer_choose(q, weights, keys, candidates, top_k, scale, lambda s: s.topk(s.shape[1], dim=1).indices)


def _indexer_ties_to_later(q, weights, keys, candidates, top_k, scale):
    """A stable sort of the columns reversed: exact ties go to the later column."""
    c = candidates.shape[1]
    return _indexer_choose(q, weights, keys, candidates, top_k, scale,
                           lambda s: c - 1 - s.flip(1).sort(dim=1, descending=True, stable=True).indices)


def _indexer_float64_by_column(q, weights, keys, candidates, top_k, scale):
    """A correct other implementation: float64 scores (near ties fall otherwise), ranked by
    (score, column) one query at a time."""
    def order(scores):
        ranked = [sorted(range(scores.shape[1]), key=lambda j: (-float(s[j]), j)) for s in scores]
        return torch.tensor(ranked, dtype=torch.int64).view(scores.shape)

    return _indexer_choose(q, weights, keys, candidates, top_k, scale, order, torch.float64)


def _attention_padding_as_row_0(q, kv, indices, sinks, scale):
    return REFERENCE_OPS["sparse_attention"](q, kv, indices.clamp(min=0), sinks, scale)


def _attention_without_sinks(q, kv, indices, sinks, scale):
    return REFERENCE_OPS["sparse_attention"](q, kv, indices, torch.full_like(sinks, float("-inf")), scale)


def _attention_pools_with_row_stride_d(q, kv, indices, sinks, scale):
    """Key pools read as if each were contiguous (their row strides ignored)."""
    parts = tensors_of(kv)
    dense = [torch.as_strided(p, p.shape, (p.shape[1], 1)) if p.shape[0] else p for p in parts]
    return REFERENCE_OPS["sparse_attention"](q, torch.cat(dense), indices, sinks, scale)


def _attention_pools_last_first(q, kv, indices, sinks, scale):
    return REFERENCE_OPS["sparse_attention"](q, torch.cat(tensors_of(kv)[::-1]), indices, sinks, scale)


def _write_cache_ignoring_padding(cache, values, slot_mapping):
    cache.view(-1, cache.shape[-1])[slot_mapping.clamp(min=0)] = values.to(cache.dtype)


def _mhc_one_sinkhorn_round_short(x, fn, base, scale, *, hc_eps, rms_eps, sinkhorn_iters):
    return REFERENCE_OPS["mhc_pre"](x, fn, base, scale, hc_eps=hc_eps, rms_eps=rms_eps, sinkhorn_iters=max(1, sinkhorn_iters - 1))


def _mhc_post_comb_not_transposed(out, x, post, comb):
    return REFERENCE_OPS["mhc_post"](out, x, post, comb.transpose(-1, -2))


def _pool_empty_slots_as_zero_logits(kv, score, norm_weight, eps):
    return REFERENCE_OPS["compress_pool"](kv, score.nan_to_num(neginf=0.0), norm_weight, eps)


def _entries_written_out(rows, state, windows, positions, norm_weight, eps, cos_sin, overlap, dtype, *,
                         swap_series=False, read_empty=False, neox=False, row_stride_r=False):
    """compress_entries another way: the pools concatenated, each slot's columns picked by a
    mask, the pooling in float32 rounded once (vLLM's and DeepSeek's order, not the reference's
    per-slot roundings). One part switchable to a bug: the two series swapped, empty slots
    weighed as row 0, RoPE on NeoX halves, the pools read as if their rows were R apart."""
    if row_stride_r:
        rows, state = (torch.as_strided(p, p.shape, (p.shape[1], 1)) for p in (rows, state))
    pool = torch.cat([rows, state]).float()
    span, width = windows.shape[1], pool.shape[1] // 2
    slots = pool[windows.clamp(min=0)] if pool.shape[0] else pool.new_zeros((*windows.shape, 2 * width))
    kv, gate = slots[..., :width], slots[..., width:]
    if overlap:
        dim = width // 2
        second = (torch.arange(span, device=windows.device) >= span // 2) ^ swap_series
        kv, gate = (torch.where(second[None, :, None], t[..., dim:], t[..., :dim]) for t in (kv, gate))
    valid = (windows >= 0) | read_empty
    pooled = (torch.softmax(gate.masked_fill(~valid[..., None], float("-inf")), dim=1) * kv.to(dtype).float()).sum(1)
    x = pooled.to(dtype).float()
    y = (norm_weight.float() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).float()
    r = cos_sin.shape[-1]
    cos, sin, pe = cos_sin[positions, : r // 2], cos_sin[positions, r // 2 :], y[:, -r:]
    a, b = (pe[:, : r // 2], pe[:, r // 2 :]) if neox else (pe[:, 0::2], pe[:, 1::2])
    ra, rb = a * cos - b * sin, b * cos + a * sin
    rotated = torch.cat([ra, rb], dim=-1) if neox else torch.stack([ra, rb], dim=-1).flatten(1)
    return torch.cat([y[:, :-r], rotated.to(dtype).float()], dim=-1).to(dtype)


def _entries_series_swapped(*args):
    return _entries_written_out(*args, swap_series=True)


def _entries_reading_empty_slots(*args):
    return _entries_written_out(*args, read_empty=True)


def _entries_rope_neox(*args):
    return _entries_written_out(*args, neox=True)


def _entries_rows_r_apart(*args):
    return _entries_written_out(*args, row_stride_r=True)


def _experts_without_clamp(x, w13, w2, weights, ids, limit, w13_scale=None, w2_scale=None, block=None):
    return REFERENCE_OPS["moe_experts"](x, w13, w2, weights, ids, w13_scale, w2_scale, block)


def _swiglu_clamping_gate_both_ways(x, limit):
    gate, up = x.chunk(2, dim=-1)
    return REFERENCE_OPS["silu_and_mul_clamped"](torch.cat([gate.clamp(min=-limit), up], -1), limit)


# (op, a wrong implementation, what the failure must say): V4 ops here, V4.1 ops below
WRONG_V4 = [
    ("moe_route_sqrtsoftplus", _route_topk_ignoring_fixed_ids, "differ without a tie"),
    ("moe_route_sqrtsoftplus", _route_bias_in_weights, "weights:"),
    ("indexer_topk", _indexer_second_best, "rows differ without a tie"),
    ("indexer_topk", _indexer_padding_as_row_0, "repeats a row"),
    ("indexer_topk", _indexer_torch_topk, "ties go to the earlier candidate"),
    ("indexer_topk", _indexer_ties_to_later, "ties go to the earlier candidate"),
    ("sparse_attention", _attention_padding_as_row_0, "o:"),
    ("sparse_attention", _attention_without_sinks, "o:"),
    ("sparse_attention", _attention_pools_with_row_stride_d, "o:"),
    ("sparse_attention", _attention_pools_last_first, "o:"),
    ("write_cache", _write_cache_ignoring_padding, "in place"),
    ("mhc_pre", _mhc_one_sinkhorn_round_short, "comb:"),
    ("mhc_post", _mhc_post_comb_not_transposed, "streams:"),
    ("compress_pool", _pool_empty_slots_as_zero_logits, "entries:"),
    ("compress_entries", _entries_series_swapped, "entries:"),
    ("compress_entries", _entries_reading_empty_slots, "entries:"),
    ("compress_entries", _entries_rope_neox, "entries:"),
    ("compress_entries", _entries_rows_r_apart, "entries:"),
    ("moe_experts_clamped", _experts_without_clamp, "y:"),
    ("silu_and_mul_clamped", _swiglu_clamping_gate_both_ways, "y:"),
]  # fmt: skip


@pytest.mark.parametrize("op, fn", [
    ("indexer_topk", _indexer_minus_ones_first),
    ("indexer_topk", _indexer_float64_by_column),
    ("moe_route_sqrtsoftplus", lambda *a, **kw: tuple(t.flip(-1) for t in REFERENCE_OPS["moe_route_sqrtsoftplus"](*a, **kw))),
])  # fmt: skip
def test_v4_selections_are_compared_as_sets(op, fn):
    report = check(op, fn, examples=2)
    assert report.result == "PASS", report.detail()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compress_entries_pooled_in_float32_passes(dtype):
    """The spec's bounds admit pooling in float32 with one rounding (vLLM's, DeepSeek's order)
    instead of the reference's rounded weights and products, and the shapes reach its edges."""
    report = check("compress_entries", _entries_written_out, examples=2, dtype=dtype)
    assert report.result == "PASS", report.detail()
    cases = [make_case("compress_entries", d, F32, "cpu", seed=1) for d in shapes("compress_entries")]
    rows, state, windows = zip(*(c.args[:3] for c in cases))
    assert any(not r.is_contiguous() for r in rows) and any(s.shape[0] == 0 for s in state)
    assert any(((w[:, : w.shape[1] // 2] < 0).all(dim=1) & (w[:, -1] >= 0)).any() for w in windows if w.numel())  # first windows
    assert all((w[:, -1] >= 0).all() for w in windows)  # every window has its closing row


def test_indexer_ties_treat_minus_zero_as_zero():
    """The tie rule holds across signed zeros: the checker sees -0.0 and +0.0 as one score, and
    the reference's scores carry no -0.0 (a bit-ordered GPU sort would rank it lower)."""
    from deepinfer_core.conformance.checks import _earlier_tie_dropped
    from deepinfer_core.ops.sparse import _scores

    score = torch.tensor([1.0, -0.0, 0.0, -1.0])
    valid = torch.ones(4, dtype=torch.bool)
    assert "ties go to the earlier candidate" in _earlier_tie_dropped(torch.tensor([0, 2]), score, valid)
    assert _earlier_tie_dropped(torch.tensor([0, 1]), score, valid) is None
    dims = next(d for d in shapes("indexer_topk") if d["heads"] == 1 and d["tied_queries"] > 1)
    case = make_case("indexer_topk", dims, F32, "cpu", seed=3)
    q, weights, keys, candidates = case.args[:4]
    s = _scores(q, weights, keys, candidates, case.args[5])
    zeros = s == 0
    assert zeros.any() and not (zeros & s.signbit()).any()


def test_sparse_attention_key_pools_replay(tmp_path):
    """A case of several key pools (the spec's optional pools / pool_sizes dims) is a tuple of
    views whose concatenation is the one-pool case's pool; its ReplayCase goes through the text
    and the JSON report and rebuilds the same tuple; an op that writes into a pool fails."""
    dims = next(s for s in shapes("sparse_attention") if s.get("pool_sizes") == [3, 0, 47])
    case = make_case("sparse_attention", dims, F32, "cpu", seed=2)
    single = make_case("sparse_attention", {k: v for k, v in dims.items() if k not in ("pools", "pool_sizes")}, F32, "cpu", seed=2)
    pools = case.args[1]
    assert isinstance(pools, tuple) and [p.shape[0] for p in pools] == [3, 0, 47] and pools[2].stride(0) > dims["head_dim"]
    assert torch.equal(torch.cat(pools), single.args[1]) and torch.equal(case.args[2], single.args[2])
    assert case.elements() == single.elements()
    copy = case.clone()
    assert all(torch.equal(a, b) and a.stride() == b.stride() and (a.data_ptr() != b.data_ptr() or not a.numel())
               for a, b in zip(pools, copy.args[1]))

    def scribbles(q, kv, indices, sinks, scale):
        out = REFERENCE_OPS["sparse_attention"](q, kv, indices, sinks, scale)
        if isinstance(kv, tuple) and kv[-1].numel():  # several pools: the last one's first row
            kv[-1][0].zero_()
        return out

    report = check("sparse_attention", scribbles, examples=0)
    assert report.result == "FAIL" and "modified its input argument 1" in report.message
    path = tmp_path / "suite.json"
    write_json(SuiteReport("reference", "cpu-reference", "cpu", ops=[report]), path)
    again = ReplayCase.parse(json.dumps(json.loads(path.read_text())["ops"][0]["failing_case"]))
    assert again == report.failing_case and "pools" in again.dims
    assert replay_case(again, REFERENCE_OPS["sparse_attention"], "cpu").result == "PASS"
    with pytest.raises(ValueError, match="pool_sizes"):
        make_case("sparse_attention", {**dims, "pool_sizes": [3, 1, 47]}, F32, "cpu")


def test_v4_index_inputs_are_valid():
    """The index tensors the kit builds: distinct rows per query, -1 padding mixed in, queries
    with no key (sparse_attention) and with fewer candidates than the output is wide (indexer_topk)."""
    for op, arg in (("sparse_attention", 2), ("indexer_topk", 3)):
        saw_padding = saw_empty = saw_short = False
        for dims in shapes(op):
            case = make_case(op, dims, F32, "cpu", seed=1)
            rows, kv = case.args[arg], case.args[1 if op == "sparse_attention" else 2]
            pool = sum(t.shape[0] for t in tensors_of(kv))  # sparse_attention's pools: their concatenation
            for row in rows:
                valid = row[row >= 0]
                assert valid.unique().numel() == valid.numel() and (valid < pool).all() and ((row >= 0) | (row == -1)).all()
                saw_padding |= bool((row == -1).any() and valid.numel() and (row[: valid.numel()] == -1).any())
                saw_empty |= valid.numel() == 0
                if op == "indexer_topk":
                    saw_short |= 0 < valid.numel() < min(case.args[4], rows.shape[1])
        assert saw_padding and saw_empty and (saw_short or op == "sparse_attention"), op
    # the clamp bites in the clamped cases, and hash routing gets fixed ids
    case = make_case("silu_and_mul_clamped", shapes("silu_and_mul_clamped")[3], F32, "cpu")
    assert (case.args[0].abs() > case.args[1]).float().mean() > 0.2
    hashed = [make_case("moe_route_sqrtsoftplus", d, F32, "cpu") for d in shapes("moe_route_sqrtsoftplus") if d["hash"] and d["tokens"]]
    assert hashed and all(c.args[3] is not None and c.args[3].shape == (c.args[0].shape[0], c.kwargs["top_k"]) for c in hashed)


# ---- DeepSeek-V4.1 ops: the kit catches wrong ones ----------------------------------------------


def _delayed_collapsing_with_own_pre(x, pre_in, fn, base, scale, **kw):
    """V4's same-sublayer collapse: the block input collapsed with this sublayer's pre, not pre_in."""
    pre, post, comb, _ = REFERENCE_OPS["mhc_pre_delayed"](x, pre_in, fn, base, scale, **kw)
    return pre, post, comb, REFERENCE_OPS["mhc_collapse"](x, pre)


def _collapse_normalising_weights(x, weights):
    """A weighted mean instead of the weighted sum."""
    return REFERENCE_OPS["mhc_collapse"](x, weights / weights.sum(dim=-1, keepdim=True))


def _choose_blocks(q, weights, keys, candidates, scale, block_size, top_blocks, *, forced="newest", ties="lower",
                   drop_empty=True, noise=0.0):
    """The block rule written out on the kit's block scores, with one part of it switchable:
    ``forced`` "newest" (the block of the newest valid column), "largest_row" (of the column
    holding the largest key row) or None; ``ties`` to the "lower" or "higher" block; blocks without
    a valid column dropped or not; ``noise``: scores scaled by 1 + noise * U(-1, 1) first (another
    summation order; exact zeros stay zeros)."""
    t, c = candidates.shape
    score = block_scores(q, weights, keys, candidates, scale, block_size)
    nb = score.shape[1]
    if nb <= top_blocks:
        return torch.ones(t, nb, dtype=torch.bool)
    if noise:
        score = score * (1 + noise * (2 * torch.rand(score.shape, generator=torch.Generator().manual_seed(0)) - 1))
    cols = torch.arange(c).expand(t, c)
    if forced == "newest":
        col = torch.where(candidates >= 0, cols, -1).amax(dim=1)
    else:  # the column of the largest row id (columns are entry ordinals, not rows: wrong)
        col = torch.where(candidates.amax(dim=1) >= 0, candidates.argmax(dim=1), -1)
    rank = score.clone()
    if forced:
        has = torch.nonzero(col >= 0).flatten()
        rank[has, col[has] // block_size] = float("inf")
    if ties == "lower":
        order = rank.sort(dim=1, descending=True, stable=True).indices
    else:
        order = nb - 1 - rank.flip(-1).sort(dim=1, descending=True, stable=True).indices
    kept = torch.zeros(t, nb, dtype=torch.bool).scatter_(1, order[:, :top_blocks], True)
    return kept & (score > float("-inf")) if drop_empty else kept


def _blocks_without_the_newest(*args):
    return _choose_blocks(*args, forced=None)


def _blocks_ties_to_higher(*args):
    return _choose_blocks(*args, ties="higher")


def _blocks_newest_by_row_id(*args):
    return _choose_blocks(*args, forced="largest_row")


def _blocks_keeping_empty_blocks(*args):
    return _choose_blocks(*args, drop_empty=False)


def _hash_with_pad_0(ngram_ids, multipliers, primes, offsets, pad_id):
    return REFERENCE_OPS["engram_hash_ids"](ngram_ids, multipliers, primes, offsets, 0)


def _hash_shifts_reversed(ngram_ids, multipliers, primes, offsets, pad_id):
    """The n-gram read oldest token first (column n - 1 as shift 0)."""
    return REFERENCE_OPS["engram_hash_ids"](ngram_ids.flip(-1), multipliers, primes, offsets, pad_id)


def _hash_python(ngram_ids, multipliers, primes, offsets, pad_id):
    """The hash in python integers, one token at a time (a correct other implementation)."""
    mult, pr, offs = multipliers.tolist(), primes.tolist(), offsets.tolist()
    heads = len(pr[0]) if pr else 0
    rows = []
    for ids in ngram_ids.tolist():
        roll, row = 0, []
        for s, v in enumerate(ids):
            roll ^= (pad_id if v < 0 else v) * mult[s]
            row += [roll % pr[s - 1][h] + offs[(s - 1) * heads + h] for h in range(heads)] if s else []
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64).view(ngram_ids.shape[0], (ngram_ids.shape[1] - 1) * heads)


def _gate(x, kv, q_weight, k_weight, eps, squash, dtype=torch.float32):
    """The Engram gate with the squash of dot_k given (the contract's: sign(dot) sqrt(max(|dot|, 1e-6)))."""
    t, hc, d = x.shape
    x32, kv32 = x.to(dtype), kv.to(dtype)
    key, value = kv32[:, : hc * d].view(t, hc, d), kv32[:, hc * d :].view(t, 1, d)
    dot = (x32 * q_weight.to(dtype) * k_weight.to(dtype) * key).sum(-1)
    dot = dot * torch.rsqrt(x32.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps) * d**-0.5
    return (x32 + torch.sigmoid(squash(dot))[..., None] * value).to(x.dtype)


def _gate_without_floor(*args):
    return _gate(*args, squash=lambda dot: dot.sign() * dot.abs().sqrt())


def _gate_sigmoid_of_dot(*args):
    return _gate(*args, squash=lambda dot: dot)


def _gate_sign_of_zero_positive(*args):
    return _gate(*args, squash=lambda dot: torch.where(dot >= 0, 1.0, -1.0) * dot.abs().clamp_min(1e-6).sqrt())


def _gate_float64(*args):
    return _gate(*args, squash=lambda dot: dot.sign() * dot.abs().clamp_min(1e-6).sqrt(), dtype=torch.float64)


WRONG_V41 = [
    ("mhc_pre_delayed", _delayed_collapsing_with_own_pre, "collapsed:"),
    ("mhc_collapse", _collapse_normalising_weights, "y:"),
    ("indexer_block_candidates", _blocks_without_the_newest, "newest valid column (always kept)"),
    ("indexer_block_candidates", _blocks_newest_by_row_id, "newest valid column (always kept)"),
    ("indexer_block_candidates", _blocks_ties_to_higher, "ties go to the lower block"),
    ("indexer_block_candidates", _blocks_keeping_empty_blocks, "has no valid column"),
    ("engram_hash_ids", _hash_with_pad_0, "ids:"),
    ("engram_hash_ids", _hash_shifts_reversed, "ids:"),
    ("engram_gate", _gate_without_floor, "streams:"),
    ("engram_gate", _gate_sigmoid_of_dot, "streams:"),
    ("engram_gate", _gate_sign_of_zero_positive, "streams:"),
]  # fmt: skip


@pytest.mark.parametrize("op, wrong, says", WRONG_V3 + WRONG_V4 + WRONG_V41, ids=lambda v: v.__name__.strip("_") if callable(v) else None)
def test_a_wrong_op_fails_for_the_right_reason(op, wrong, says):
    """On the declared shapes alone (no hypothesis case), in float32."""
    report = check(op, wrong, examples=0)
    assert report.result == "FAIL" and says in report.message, report.detail()
    assert replay_case(report.failing_case, wrong, "cpu").result == "FAIL"
    assert replay_case(report.failing_case, REFERENCE_OPS[op], "cpu").result == "PASS"


@pytest.mark.parametrize("op, fn", [
    ("indexer_block_candidates", _choose_blocks),
    ("indexer_block_candidates", lambda *a: _choose_blocks(*a, noise=1e-5)),  # near ties resolved otherwise
    ("engram_hash_ids", _hash_python),
    ("engram_gate", _gate_float64),
])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_correct_other_v41_implementation_passes(op, fn, dtype):
    report = check(op, fn, examples=2, dtype=dtype)
    assert report.result == "PASS", report.detail()


def test_v41_inputs_are_valid():
    """The inputs the kit builds for V4.1's ops meet their preconditions and reach their edge cases."""
    from deepinfer_core.models.v41 import engram_tables as et

    # Engram ids: below the compressed vocabulary, -1 only as tails, products below 2^63; a dead
    # token and a position-0 token; the real shapes use the model's primes and multipliers
    for dims in shapes("engram_hash_ids"):
        ids, mult, primes, offsets, pad = make_case("engram_hash_ids", dims, F32, "cpu", seed=1).args
        vocab, n = dims["compressed_vocab"], dims["max_ngram"]
        assert ((ids >= -1) & (ids < vocab)).all() and 0 <= pad < vocab
        blocked = ids < 0
        assert not (blocked[:, :-1] & ~blocked[:, 1:]).any(), dims  # once -1, -1 after
        assert all(max(max(row), pad) * m < 2**63 for row in ids.tolist() for m in mult.tolist() if row)
        assert mult.tolist() == et.engram_multipliers(dims["layer"], vocab, n) and all(m % 2 for m in mult.tolist())
        assert primes.tolist() == et.engram_primes(dims["engram_vocab"], dims["layers"], n, dims["heads"])[dims["layer"]]
        depth = (~blocked).sum(1).tolist()
        if dims["blocked_tokens"] >= 2:
            assert 0 in depth and 1 in depth and vocab - 1 in ids.flatten().tolist(), dims
    # block candidates: visible prefixes that differ; blocks dropped; rows of at most top blocks
    # all kept; with one head, ties at the top-block boundary that the lower-block rule decides
    dropped = all_kept = tie_decides = False
    for dims in shapes("indexer_block_candidates"):
        case = make_case("indexer_block_candidates", dims, F32, "cpu", seed=0)
        q, weights, keys, candidates, scale, bs, top = case.args
        valid = candidates >= 0
        lengths = valid.sum(1)
        assert (valid == (torch.arange(candidates.shape[1]) < lengths[:, None])).all()  # prefixes
        assert dims["tokens"] < 3 or lengths.unique().numel() >= 3, dims
        kept = REFERENCE_OPS["indexer_block_candidates"](*case.args)
        nonempty = block_scores(q, weights, keys, candidates, scale, bs) > float("-inf")
        dropped |= bool((nonempty & ~kept).any())
        all_kept |= kept.shape[1] <= top and bool(kept.all()) and bool((~nonempty).any())
        if dims["heads"] == 1:
            tie_decides |= not torch.equal(kept, _blocks_ties_to_higher(*case.args))
    assert dropped and all_kept and tie_decides
    # Engram gate: the tiny streams' dots lie below the floor (or are 0), with both signs
    dots = []
    for dims in shapes("engram_gate"):
        x, kv, qw, kw, eps = make_case("engram_gate", dims, F32, "cpu", seed=0).args
        t, hc, d = x.shape
        key = kv[:, : hc * d].view(t, hc, d)
        dot = (x * qw * kw * key).sum(-1) * torch.rsqrt(x.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps) * d**-0.5
        dots += dot[dot.abs() < 1e-6].tolist()
        assert int((dot.abs() < 1e-6).sum()) == dims["tiny_streams"], dims
    assert min(dots) < 0 < max(dots) and 0.0 in dots
