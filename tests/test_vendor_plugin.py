"""The example vendor backend (examples/vendor_plugin), installed as its users would install it.

A session fixture installs the distribution into a temporary ``--target`` directory with
tests/installing.py (as tests/test_plugins.py installs its fakes), so the rest of the suite never
sees it. In-process tests put that directory on ``sys.path``; subprocess tests run the real
``deepinfer`` console script with it on ``PYTHONPATH``. Both of its entry points are opt-in
(``DEEPINFER_VENDOR_EXAMPLE=1``): ``vendor_example`` must pass op conformance,
``vendor_example_broken`` (an off-by-one in mla_decode_attention) must fail it on that op alone.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from deepinfer_core.conformance.spec import tolerance
from deepinfer_core.ops import OP_NAMES, OPTIONAL_OPS, REFERENCE_OPS
from deepinfer_core.plugins import PluginManager

from .installing import install

REPO = Path(__file__).resolve().parent.parent
VENDOR_SRC = REPO / "examples" / "vendor_plugin"
ENABLE_VAR = "DEEPINFER_VENDOR_EXAMPLE"
VENDOR_OPS = {
    "rms_norm", "add_rms_norm", "silu_and_mul", "moe_route",
    "write_latent_cache", "gather_latent_cache", "mla_decode_attention",
}  # fmt: skip
BROKEN_OP = "mla_decode_attention"
UNAVAILABLE_REASON = "DEEPINFER_VENDOR_EXAMPLE is not set to 1 (this example backend is opt-in)"
UNAVAILABLE_FIX = "export DEEPINFER_VENDOR_EXAMPLE=1 to use it, or `pip uninstall deepinfer-vendor-example`"
# Conformance in the subprocess tests: float32, the spec's declared shapes alone (no hypothesis
# cases): what they catch is what every port is judged on first.
CONFORMANCE_ARGS = ("--dtype", "float32", "--examples", "0", "--quiet")


# ---- installing ----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def vendor_site(tmp_path_factory) -> Path:
    try:
        installed = metadata.distribution("deepinfer-vendor-example")
    except metadata.PackageNotFoundError:
        installed = None
    if installed is not None:  # its entry points would be registered twice, by two sources
        pytest.skip(f"deepinfer-vendor-example is installed in this environment ({installed.locate_file('')}); "
                    "these tests install their own copy: pip uninstall deepinfer-vendor-example")
    scratch = tmp_path_factory.mktemp("vendor_plugin_src")
    target = tmp_path_factory.mktemp("vendor_plugin_site")
    try:
        install([VENDOR_SRC], scratch, target)
    except RuntimeError as e:
        pytest.fail(f"installing examples/vendor_plugin failed: {e}")
    assert [p.name for p in target.glob("*.dist-info")] == ["deepinfer_vendor_example-0.1.0.dist-info"]
    return target


@pytest.fixture
def vendor(vendor_site, monkeypatch):
    """The installed package importable in this test (undone after it); its ops module."""
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    monkeypatch.delenv(ENABLE_VAR, raising=False)
    monkeypatch.syspath_prepend(str(vendor_site))
    from deepinfer_vendor_example import ops

    return ops


def _env(site: Path, enabled: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DEEPINFER_ACCELERATOR", ENABLE_VAR)}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)])
    if enabled:
        env[ENABLE_VAR] = "1"
    return env


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "deepinfer"  # the installed console script, if any
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "deepinfer_core.cli"]
    return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)


def _conformance_results(stdout: str) -> dict[tuple[str, str], str]:
    """{(op, dtype): RESULT} from the rows of `deepinfer conformance`'s table."""
    results = {}
    for line in stdout.splitlines():
        cells = line.split()
        if len(cells) >= 3 and cells[0] in OP_NAMES and cells[1] in ("float32", "bfloat16", "float16"):
            results[cells[0], cells[1]] = cells[2]
    return results


# ---- the package follows the plugin rules ----------------------------------------------------
def test_entry_modules_import_nothing_heavy():
    """The core imports every backend module to probe it: torch only inside the hooks."""
    pkg = VENDOR_SRC / "deepinfer_vendor_example"
    for module in ("__init__.py", "backend.py", "broken.py"):
        tree = ast.parse((pkg / module).read_text())
        imported = set()
        for node in tree.body:
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
        assert not imported & {"torch", "numpy", "deepinfer_vendor_example.ops"}, f"{module} imports {imported}"


def test_opt_in_and_never_auto_selected_over_the_reference_unless_enabled(vendor, monkeypatch):
    manager = PluginManager()
    manager.discover()
    for name in ("vendor_example", "vendor_example_broken"):
        backend = manager.backends[name]
        assert backend.error is None and not backend.available
        assert (backend.probe.reason, backend.probe.fix) == (UNAVAILABLE_REASON, UNAVAILABLE_FIX)
    assert manager.select().name not in ("vendor_example", "vendor_example_broken")

    monkeypatch.setenv(ENABLE_VAR, "1")
    manager = PluginManager()
    manager.discover()
    assert manager.backends["vendor_example"].available and manager.backends["vendor_example_broken"].available
    assert manager.backends["vendor_example_broken"].info.priority < manager.backends["reference"].info.priority
    chosen = manager.select()
    assert chosen.name != "vendor_example_broken"
    if not any(manager.backends[n].available for n in ("nvidia", "ascend") if n in manager.backends):
        assert chosen.name == "vendor_example"
    platform, ops, _, fallback = manager.load(manager.select("vendor_example"))
    assert (platform.name, platform.device, platform.backend) == ("vendor-example-cpu", "cpu", "vendor_example")
    assert {op for op, who in ops.providers.items() if who == "vendor_example"} == VENDOR_OPS
    assert fallback == [op for op in OP_NAMES if op not in VENDOR_OPS]
    platform, ops, _, _ = manager.load(manager.select("vendor_example_broken"))
    assert platform.name == "vendor-example-cpu"
    assert {op for op, who in ops.providers.items() if who == "vendor_example_broken"} == VENDOR_OPS
    assert ops.rms_norm is vendor.rms_norm and ops[BROKEN_OP] is not vendor.mla_decode_attention


# ---- each vendor op against the reference, in-process ---------------------------------------
GEN = torch.Generator().manual_seed(0)
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN).to(dtype)


def _close(out: torch.Tensor, ref: torch.Tensor, op: str, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(op, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(0, 64), (1, 64), (7, 512)])
def test_norms(vendor, dtype, tokens, hidden):
    x, residual = _randn(tokens, hidden, dtype=dtype), _randn(tokens, hidden, dtype=dtype)
    weight = (1 + 0.1 * _randn(hidden)).to(dtype)
    _close(vendor.rms_norm(x, weight, 1e-6), REFERENCE_OPS["rms_norm"](x, weight, 1e-6), "rms_norm", dtype)
    strided = _randn(tokens, hidden + 8, dtype=dtype)[:, :hidden]  # the model normalises a slice of kv_a_proj
    _close(vendor.rms_norm(strided, weight, 1e-6), REFERENCE_OPS["rms_norm"](strided, weight, 1e-6), "rms_norm", dtype)
    x_before, residual_before = x.clone(), residual.clone()
    y, summed = vendor.add_rms_norm(x, residual, weight, 1e-6)
    ref_y, ref_summed = REFERENCE_OPS["add_rms_norm"](x, residual, weight, 1e-6)
    _close(y, ref_y, "add_rms_norm", dtype)
    assert summed.dtype == dtype and torch.equal(summed, ref_summed)  # exact, as the spec says
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, intermediate", [(0, 32), (1, 32), (9, 1408)])
def test_silu_and_mul(vendor, dtype, tokens, intermediate):
    x = _randn(tokens, 2 * intermediate, dtype=dtype)
    _close(vendor.silu_and_mul(x), REFERENCE_OPS["silu_and_mul"](x), "silu_and_mul", dtype)


ROUTES = [  # the gates of V3 (noaux_tc), V2-Lite (greedy) and V2 (group_limited_greedy), small
    dict(tokens=19, experts=16, top_k=4, n_group=4, topk_group=2, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=2.5),
    dict(tokens=1, experts=8, top_k=2, n_group=1, topk_group=1, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=False, routed_scaling_factor=1.0),
    dict(tokens=0, experts=8, top_k=2, n_group=1, topk_group=1, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=2.5),
    dict(tokens=17, experts=64, top_k=6, n_group=1, topk_group=1, scoring_func="softmax", topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0),
    dict(tokens=9, experts=40, top_k=6, n_group=8, topk_group=3, scoring_func="softmax", topk_method="group_limited_greedy", norm_topk_prob=False, routed_scaling_factor=16.0),
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r['topk_method']}-{r['tokens']}")
def test_moe_route(vendor, dtype, route):
    route = dict(route)
    tokens, experts, hidden = route.pop("tokens"), route.pop("experts"), 64
    x = _randn(tokens, hidden, dtype=dtype)
    gate = _randn(experts, hidden) / hidden**0.5
    bias = 0.1 * _randn(experts)
    weights, ids = vendor.moe_route(x, gate, bias, **route)
    ref_weights, ref_ids = REFERENCE_OPS["moe_route"](x, gate, bias, **route)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (tokens, route["top_k"])
    # the order of the k slots is unspecified: compare per token as sets (no near-ties at seed 0)
    ids_sorted, order = ids.sort(dim=-1)
    ref_sorted, ref_order = ref_ids.sort(dim=-1)
    assert torch.equal(ids_sorted, ref_sorted)
    _close(weights.gather(1, order), ref_weights.gather(1, ref_order), "moe_route", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, padding", [(0, 0), (1, 0), (13, 3)])
def test_latent_cache_write_and_gather(vendor, dtype, tokens, padding):
    num_blocks, block_size, d_c, d_r = 8, 4, 32, 8
    cache = _randn(num_blocks, block_size, d_c + d_r, dtype=dtype)
    ref_cache = cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=GEN)[:tokens]
    slots[:padding] = -1
    latent, k_pe = _randn(tokens, d_c), _randn(tokens, d_r)  # float32 into a `dtype` cache: cast on store
    assert vendor.write_latent_cache(cache, latent, k_pe, slots) is None  # in place
    REFERENCE_OPS["write_latent_cache"](ref_cache, latent, k_pe, slots)
    assert torch.equal(cache, ref_cache)  # the stored rows, and every other row untouched
    wanted = torch.randint(0, num_blocks * block_size, (tokens + 5,), generator=GEN)
    rows = vendor.gather_latent_cache(cache, wanted)
    assert torch.equal(rows, REFERENCE_OPS["gather_latent_cache"](cache, wanted))
    rows.zero_()  # a new tensor, not a view of the cache
    assert torch.equal(cache, ref_cache)


def _decode_inputs(seq_lens: list[int], dtype: torch.dtype, query_lens: list[int] | None = None, heads: int = 4,
                   d_c: int = 32, d_r: int = 8, block_size: int = 4):
    """Non-contiguous block tables over a pool with spare blocks; unused table entries are -1.
    ``query_lens``: query rows per sequence (default one each)."""
    query_lens = [1] * len(seq_lens) if query_lens is None else query_lens
    max_blocks = max((-(-n // block_size) for n in seq_lens), default=1) or 1
    num_blocks = len(seq_lens) * max_blocks + 3
    pool = torch.randperm(num_blocks, generator=GEN).tolist()
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        for i in range(-(-n // block_size)):
            tables[b, i] = pool.pop()
    rows = sum(query_lens)
    return (
        _randn(rows, heads, d_c, dtype=dtype),
        _randn(rows, heads, d_r + 3, dtype=dtype)[..., :d_r],  # strided, as the model passes it
        _randn(num_blocks, block_size, d_c + d_r, dtype=dtype),
        tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor([0, *torch.tensor(query_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32),
        (d_c + d_r) ** -0.5,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens, query_lens", [
    ([], None), ([1], None), ([1, 7, 13], None), ([33, 5], None),
    ([7, 1, 13], [4, 1, 3]),   # several query rows per sequence (speculative decoding's 1 + k)
    ([3, 9, 4], [3, 0, 4]),    # q_len == seq_len, a sequence without rows
    ([0, 2, 6], [1, 3, 2]),    # rows with nothing to attend to (zeros)
])  # fmt: skip
def test_mla_decode_attention(vendor, dtype, seq_lens, query_lens):
    args = _decode_inputs(seq_lens, dtype, query_lens)
    _close(vendor.mla_decode_attention(*args), REFERENCE_OPS["mla_decode_attention"](*args), "mla_decode_attention", dtype)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [4, 1, 3]])
def test_the_broken_variant_differs_only_in_its_broken_op(vendor, query_lens):
    from deepinfer_vendor_example import broken

    ops = broken.deepinfer_ops(platform=None, model_config=None)
    assert set(ops) == VENDOR_OPS
    assert all(ops[op] is getattr(vendor, op) for op in VENDOR_OPS - {BROKEN_OP})
    args = _decode_inputs([7, 1, 13], torch.float32, query_lens)
    q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale = args
    out, ref = ops[BROKEN_OP](*args), REFERENCE_OPS[BROKEN_OP](*args)
    assert torch.isfinite(out).all()  # plausible numbers, wrong ones
    with pytest.raises(AssertionError):
        _close(out, ref, BROKEN_OP, torch.float32)
    # the bug, exactly: every query row attends to one entry fewer than the contract says
    short = REFERENCE_OPS[BROKEN_OP](q_latent, q_pe, kv_cache, block_tables, seq_lens - 1, query_start_loc, scale)
    _close(out, short, BROKEN_OP, torch.float32)


def test_a_model_runs_on_it(vendor, monkeypatch):
    """Greedy tokens of the embedded default model: the same as the reference's on vendor_example,
    different on vendor_example_broken (which still generates without any error)."""
    from deepinfer_core import LLM, SamplingParams

    monkeypatch.setenv(ENABLE_VAR, "1")
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    params = SamplingParams(max_tokens=8, temperature=0)
    tokens = {}
    for backend in ("cpu", "vendor_example", "vendor_example_broken"):
        llm = LLM(accelerator=backend, dtype="float32", num_kv_blocks=32, max_model_len=256, progress=False)
        assert llm.engine.backend.name == ("reference" if backend == "cpu" else backend)
        outs = llm.generate(["def f(x):", "import os\n"], params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
    assert tokens["vendor_example"] == tokens["cpu"]
    assert tokens["vendor_example_broken"] != tokens["cpu"]


# ---- the command line, in fresh processes ----------------------------------------------------
def test_cli_backends_lists_the_vendor_ops(vendor_site):
    done = _cli("backends", "--accelerator", "vendor_example", env=_env(vendor_site, enabled=True))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "Selected: vendor_example (requested by --accelerator=vendor_example)" in out
    assert "Platform: vendor-example-cpu on cpu" in out
    assert f"Ops: {len(VENDOR_OPS)} of {len(OP_NAMES)} from vendor_example" in out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == ["OP", "PROVIDER", "IMPLEMENTATION"])
    providers = {line.split()[0]: " ".join(line.split()[1:3]) for line in lines[start + 1 :]}
    assert set(providers) == set(OP_NAMES)
    for op in OP_NAMES:
        if op in VENDOR_OPS:
            assert providers[op].startswith("vendor_example torch"), providers[op]
        else:
            assert providers[op] == ("none (optional)" if op in OPTIONAL_OPS else "reference (fallback)"), (op, providers[op])


def test_cli_without_the_opt_in_says_why_and_how(vendor_site):
    done = _cli("backends", "--accelerator", "vendor_example", env=_env(vendor_site, enabled=False))
    assert done.returncode == 1
    row = next(line for line in done.stdout.splitlines() if line.split()[:1] == ["vendor_example"])
    assert f"unavailable: {UNAVAILABLE_REASON} -- fix: {UNAVAILABLE_FIX}" in row
    assert done.stderr.startswith("error: backend 'vendor_example' was requested but cannot run here: ")
    assert UNAVAILABLE_REASON in done.stderr and f"Fix: {UNAVAILABLE_FIX}" in done.stderr


def test_cli_conformance_passes(vendor_site):
    done = _cli("conformance", "--backend", "vendor_example", *CONFORMANCE_ARGS, env=_env(vendor_site, enabled=True))
    assert done.returncode == 0, done.stdout + done.stderr
    results = _conformance_results(done.stdout)
    assert results == {(op, "float32"): "PASS" for op in VENDOR_OPS}, done.stdout  # its own ops only


def test_cli_conformance_catches_the_broken_op(vendor_site):
    """The twin fails on its buggy op alone, on a declared shape (value seed 0), by its output."""
    done = _cli("conformance", "--backend", "vendor_example_broken", *CONFORMANCE_ARGS, env=_env(vendor_site, enabled=True))
    assert done.returncode == 1, done.stdout + done.stderr
    results = _conformance_results(done.stdout)
    assert results == {(op, "float32"): "FAIL" if op == BROKEN_OP else "PASS" for op in VENDOR_OPS}, done.stdout
    row = next(line for line in done.stdout.splitlines() if line.split()[:1] == [BROKEN_OP])
    assert "value seed 0] u: " in row and "outside atol" in row, row
    assert f"FAILED: 1 of {len(VENDOR_OPS)} checks: {BROKEN_OP} (float32)" in done.stdout


def test_e2e_catches_the_decode_only_bug_that_keeps_perplexities(vendor, monkeypatch, tmp_path, capsys):
    """With a baseline recorded by vendor_example, the broken twin (its decode attention never sees
    the newest token) fails end to end: not on perplexity (teacher-forced, the prefill path) but
    on the decode steps' greedy logprobs, on samples whose greedy tokens survive the bug too."""
    import json
    import shutil

    from deepinfer_core.conformance import e2e
    from deepinfer_core.conformance.spec import specs_dir

    monkeypatch.setenv(ENABLE_VAR, "1")
    specs = tmp_path / "specs"
    shutil.copytree(specs_dir(), specs)
    monkeypatch.setenv("DEEPINFER_SPECS_DIR", str(specs))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert e2e.main("vendor_example", workloads=["default"], refresh=True) == 0
    assert e2e.main("vendor_example", workloads=["default"]) == 0
    capsys.readouterr()
    report = tmp_path / "broken.json"
    assert e2e.main("vendor_example_broken", workloads=["default"], json_out=str(report)) == 1
    rows = json.loads(report.read_text())["rows"]
    assert all(r["rel_diff"] <= 5e-3 for r in rows)  # the perplexities hold: the bug is decode-only
    failed = [r for r in rows if not r["passed"]]
    # every sample fails on its decode steps, except where the twin's greedy token parted from the
    # baseline's within greedy_tie_margin (a tie: the judge cannot follow two different sequences);
    # how many tie depends on the random checkpoint's numerics (torch, transformers versions)
    assert all(r["greedy_tie"] for r in rows if r["passed"]) and len(failed) > len(rows) / 2, [r["reason"] for r in rows]
    assert all("greedy" in r["reason"] and "decode step" in r["reason"] or "agree on" in r["reason"] for r in failed)
    assert all(r["greedy_agreement"] > 0 for r in failed)  # the first token (the prefill's) agreed everywhere
    on_logprobs = [r for r in failed if "greedy logprob of token" in r["reason"]]
    assert any(r["greedy_agreement"] == 1.0 for r in on_logprobs)  # tokens survived the bug; its logprobs did not
