"""Backend plugins: discovery, probing, strict selection, partial backends, broken plugins, the CLI.

The fake backends in tests/fake_backends are real distributions (pyproject.toml + setuptools).
A session fixture installs them with pip into a temporary ``--target`` directory, never into
the environment running the tests: only the tests here that ask for them put that directory on
``sys.path`` (in-process, undone after each test) or on ``PYTHONPATH`` (subprocesses), so the
rest of the suite never sees them and auto-selection elsewhere is undisturbed. See
tests/fake_backends/README.md.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import torch

from deepinfer_core.cli import main
from deepinfer_core.hookspecs import SPEC_VERSION, StepStats
from deepinfer_core.ops import OP_NAMES, OPTIONAL_OPS, REFERENCE_OPS, V4_OP_NAMES
from deepinfer_core.plugins import BackendError, PluginManager

from .installing import install

REPO = Path(__file__).resolve().parent.parent
FAKES = Path(__file__).resolve().parent / "fake_backends"
FAKE_DISTS = ("good", "broken")
FAKE_OPS = {"rms_norm", "silu_and_mul"}  # what fakegood provides itself
BROKEN = {  # entry-point name -> what its "broken:" status must say
    "fakebroken_probe": ["deepinfer_probe() raised RuntimeError", "fake probe exploded"],
    "fakeversion": ["hookspec versions 0..0", f"speaks version {SPEC_VERSION}"],
    "fakebadhook": ["invalid hook implementation", "deepinfer_ops", "model_cfg"],
    "fakeimporterror": ["importing deepinfer_fake_broken.importerror failed", "ImportError", "fake_vendor_sdk"],
    "fakebadinfo": ["deepinfer_backend(): BackendInfo.priority is 'high', expected an int"],
}
UNAVAIL_REASON = "fake accelerator not present (/dev/fakeaccel0 missing)"
UNAVAIL_FIX = "plug in a fake accelerator, or choose DEEPINFER_ACCELERATOR=cpu"
NVIDIA_NO_DRIVER = "no NVIDIA driver/device found (/dev/nvidiactl missing)"
NVIDIA_CPU_FIX = "run on a machine with an NVIDIA GPU or choose DEEPINFER_ACCELERATOR=cpu"


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


needs_nvidia = pytest.mark.skipif(
    not _installed("deepinfer-nvidia-sm100"),
    reason="deepinfer-nvidia-sm100 is not installed (pip install --no-deps -e plugins/nvidia_sm100)",
)
needs_ascend = pytest.mark.skipif(
    not _installed("deepinfer-ascend-950"),
    reason="deepinfer-ascend-950 is not installed (pip install --no-deps -e plugins/ascend_950)",
)


# ---- installing the fakes ------------------------------------------------------------------
@pytest.fixture(scope="session")
def fake_site(tmp_path_factory) -> Path:
    """A directory holding the installed fake distributions (packages + dist-info), installed by
    tests/installing.py: pip offline from a copy of the sources, or the same layout by hand."""
    scratch = tmp_path_factory.mktemp("fake_backends_src")
    target = tmp_path_factory.mktemp("fake_backends_site")
    try:
        install([FAKES / name for name in FAKE_DISTS], scratch, target)
    except RuntimeError as e:
        pytest.fail(f"installing the fake backends failed: {e}")
    assert sorted(p.name for p in target.glob("*.dist-info")) == [
        "deepinfer_fake_backends-0.0.1.dist-info",
        "deepinfer_fake_broken_backends-0.0.1.dist-info",
    ]
    return target


@pytest.fixture
def with_fakes(fake_site, monkeypatch) -> Path:
    """The fakes visible to this test's process (undone after the test)."""
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    monkeypatch.syspath_prepend(str(fake_site))
    return fake_site


@pytest.fixture
def manager(with_fakes) -> PluginManager:
    m = PluginManager()
    m.discover()
    return m


def _gpu_backends_available(m: PluginManager) -> bool:
    return any(m.backends[n].available for n in ("nvidia", "ascend") if n in m.backends)


def _env(fake_site: Path | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_ACCELERATOR"}
    paths = ([str(fake_site)] if fake_site else []) + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "deepinfer"  # the installed console script, if any
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "deepinfer_core.cli"]
    return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)


def _op_table(stdout: str) -> dict[str, str]:
    """The `OP  PROVIDER` table of `deepinfer backends`, as {op: provider text}."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == ["OP", "PROVIDER", "IMPLEMENTATION"])
    table = {}
    for line in lines[start + 1 :]:
        op, _, rest = line.strip().partition(" ")
        table[op] = rest.strip().split("  ")[0]  # the implementation column follows two spaces
    return table


def _row(stdout: str, name: str) -> str:
    """The status row of one backend in the listing."""
    return next(line for line in stdout.splitlines() if line.split()[:1] == [name])


# ---- isolation -----------------------------------------------------------------------------
def test_fakes_are_invisible_without_their_directory(fake_site):
    """The fakes are installed, but not where the rest of the suite looks."""
    names = set(PluginManager().discover())
    assert "reference" in names
    assert not {n for n in names if n.startswith("fake")}
    assert str(fake_site) not in sys.path


# ---- discovery -----------------------------------------------------------------------------
def test_discovery_lists_every_backend_with_its_status(manager):
    b = manager.backends
    assert {"reference", "fakegood", "fakeunavail", "fakerequired", *BROKEN} <= set(b)
    assert b["reference"].available and b["reference"].info.aliases == ("cpu",)
    assert b["reference"].source.startswith("deepinfer_core.backends.reference (deepinfer ")
    assert b["fakegood"].available
    assert b["fakegood"].status() == "available (fake device, always here)"
    assert b["fakegood"].source == "deepinfer_fake_good.good (deepinfer-fake-backends 0.0.1)"
    assert b["fakegood"].info.priority == 50
    assert b["fakerequired"].available
    assert not b["fakeunavail"].available and b["fakeunavail"].error is None
    assert b["fakeunavail"].status() == f"unavailable: {UNAVAIL_REASON} -- fix: {UNAVAIL_FIX}"
    assert b["fakeimporterror"].source == "deepinfer_fake_broken.importerror (deepinfer-fake-broken-backends 0.0.1)"


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_plugin_is_reported_and_the_others_still_work(manager, name):
    backend = manager.backends[name]
    assert not backend.available
    status = backend.status()
    assert status.startswith("broken: ")
    for needle in BROKEN[name]:
        assert needle in status
    with pytest.raises(BackendError) as err:
        manager.select(name)
    msg = str(err.value)
    assert f"backend {name!r}" in msg and "is broken" in msg and BROKEN[name][0] in msg
    # the others are unaffected: the reference still loads, auto-selection still works
    platform, ops, _, fallback = manager.load(manager.select("cpu"))
    assert platform.name == "cpu-reference" and fallback == []
    assert manager.select().name not in BROKEN


def test_broken_plugins_take_no_part_in_the_engine(manager):
    """A broken plugin's hooks never run: its step observer is not called, a working one is."""
    import deepinfer_fake_broken.broken_probe as broken
    import deepinfer_fake_good.good as good

    notify = manager.step_observer()
    assert notify is not None
    before_good, before_broken = len(good.STEPS), len(broken.STEPS)
    stats = StepStats(step=1, num_prefill_tokens=3, num_decode_tokens=0, num_running=1, num_waiting=0,
                      num_preempted=0, free_kv_blocks=10, seconds=0.01)  # fmt: skip
    notify(stats)
    assert good.STEPS[before_good:] == [stats]
    assert len(broken.STEPS) == before_broken
    assert manager.pm.get_plugin("fakebroken_probe") is None and manager.pm.get_plugin("fakegood") is not None


# ---- selection -----------------------------------------------------------------------------
def test_auto_picks_the_highest_priority_available_backend(manager):
    chosen = manager.select()
    assert manager.select("auto") is chosen and manager.select("") is chosen
    available = [b for b in manager.backends.values() if b.available]
    assert chosen.available and chosen.info.priority == max(b.info.priority for b in available)
    # above the reference; the unavailable (1000) and broken (2000+) fakes are never chosen
    assert chosen.info.priority >= 50 and chosen.name not in {"fakeunavail", *BROKEN}
    if not _gpu_backends_available(manager):
        assert chosen.name == "fakegood"


def test_cpu_alias_selects_the_reference(manager):
    for name in ("cpu", "CPU ", "reference"):
        assert manager.select(name).name == "reference"
    platform, ops, limits, fallback = manager.load(manager.select("cpu"))
    assert (platform.name, platform.device, limits, fallback) == ("cpu-reference", "cpu", None, [])
    assert set(ops.providers.values()) == {"reference"}


def test_unknown_backend_lists_the_installed_ones(manager):
    with pytest.raises(BackendError) as err:
        manager.select("tpu")
    msg = str(err.value)
    assert "'tpu' is not installed" in msg
    assert "reference (alias cpu)" in msg and "fakegood" in msg and "fakebadhook" in msg


def test_requested_unavailable_backend_fails_with_reason_and_fix(manager):
    with pytest.raises(BackendError) as err:
        manager.select("fakeunavail")
    msg = str(err.value)
    assert "'fakeunavail' was requested but cannot run here" in msg
    assert UNAVAIL_REASON in msg and f"Fix: {UNAVAIL_FIX}" in msg
    assert "reference" in msg.split("available:")[1] and "fakegood" in msg.split("available:")[1]


# ---- op tables -----------------------------------------------------------------------------
def test_partial_backend_falls_back_op_by_op(manager, caplog):
    import deepinfer_fake_good.good as good

    with caplog.at_level("WARNING", logger="deepinfer"):
        platform, ops, limits, fallback = manager.load(manager.select("fakegood"))
    warned = next(r.getMessage() for r in caplog.records if "does not provide ops" in r.getMessage())
    assert "rms_norm_f32" in warned and "norm_rope_write_latent" not in warned  # an optional fusion left out never runs
    assert not ops.backend_provides("norm_rope_write_latent") and ops.backend_provides("rms_norm")
    assert (platform.name, platform.backend, limits) == ("fake-good", "fakegood", None)
    assert {op for op, who in ops.providers.items() if who == "fakegood"} == FAKE_OPS
    assert fallback == [op for op in OP_NAMES if op not in FAKE_OPS]
    assert all(ops.providers[op] == "reference" and ops[op] is REFERENCE_OPS[op] for op in fallback)
    assert ops.rms_norm is good.rms_norm and ops.silu_and_mul is good.silu_and_mul
    # the fake's own ops keep the contract: same results as the reference
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(3, 5, 64, generator=g).to(dtype)
        w = torch.randn(64, generator=g).to(dtype)
        y = ops.rms_norm(x, w, 1e-6)
        assert y.dtype == dtype and y.shape == x.shape
        torch.testing.assert_close(y, REFERENCE_OPS["rms_norm"](x, w, 1e-6), atol=tol, rtol=tol)
        z = ops.silu_and_mul(x)
        assert z.dtype == dtype and z.shape == (3, 5, 32)
        torch.testing.assert_close(z, REFERENCE_OPS["silu_and_mul"](x), atol=tol, rtol=tol)


def test_required_op_missing_is_an_error(manager):
    backend = manager.select("fakerequired")  # available: selecting is fine, loading is not
    with pytest.raises(BackendError) as err:
        manager.load(backend)
    msg = str(err.value)
    assert "'fakerequired'" in msg and "mla_decode_attention" in msg and "required" in msg


# ---- the nvidia and ascend plugins ---------------------------------------------------------
def _module_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:  # module level only; imports inside functions are the point
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("plugin", ["nvidia_sm100", "ascend_950"])
def test_vendor_backend_modules_import_nothing_heavy(plugin):
    pkg = REPO / "plugins" / plugin / f"deepinfer_{plugin}"
    for module in ("__init__.py", "backend.py"):
        heavy = _module_level_imports(pkg / module) & {"torch", "torch_npu", "triton", "numpy"}
        assert not heavy, f"{pkg / module} imports {heavy} at module level"
    pyproject = tomllib.loads((REPO / "plugins" / plugin / "pyproject.toml").read_text())
    assert not any("npu" in dep for dep in pyproject["project"]["dependencies"])


@needs_nvidia
def test_nvidia_unavailable_here_with_reason_and_fix(manager):
    nvidia = manager.backends["nvidia"]
    assert nvidia.error is None and nvidia.info.priority == 100
    assert nvidia.source == f"deepinfer_nvidia_sm100.backend (deepinfer-nvidia-sm100 {metadata.version('deepinfer-nvidia-sm100')})"
    if nvidia.available:
        pytest.skip(f"this machine can run the nvidia backend ({nvidia.probe.detail})")
    from deepinfer_nvidia_sm100 import backend

    if not any(os.path.exists(p) for p in backend.DRIVER_FILES):
        assert (nvidia.probe.reason, nvidia.probe.fix) == (NVIDIA_NO_DRIVER, NVIDIA_CPU_FIX)
    with pytest.raises(BackendError) as err:
        manager.select("nvidia")
    msg = str(err.value)
    assert "backend 'nvidia' was requested but cannot run here" in msg
    assert nvidia.probe.reason in msg and f"Fix: {nvidia.probe.fix}" in msg


@needs_nvidia
@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only build of torch")
def test_nvidia_probe_names_a_cpu_only_torch(tmp_path, monkeypatch):
    from deepinfer_nvidia_sm100 import backend

    driver = tmp_path / "nvidiactl"
    driver.touch()
    monkeypatch.setattr(backend, "DRIVER_FILES", (str(driver),))  # a driver, as on a GPU machine
    probe = backend.deepinfer_probe()
    assert not probe.available
    assert probe.reason == f"torch is a CPU-only build (torch {torch.__version__})"
    assert probe.fix == "install a CUDA build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu130)"


@needs_nvidia
@pytest.mark.parametrize(
    "capability, expected",
    [((8, 6), None), ((12, 0), None), ((9, 0), "nvidia-sm90"), ((10, 0), "nvidia-sm100"), ((10, 3), "nvidia-sm100")],
)
def test_nvidia_capability_gate_and_platform(tmp_path, monkeypatch, capability, expected):
    """The probe and platform against a simulated GPU (torch.cuda answers faked; not pluggy)."""
    from deepinfer_nvidia_sm100 import backend

    driver = tmp_path / "nvidiactl"
    driver.touch()
    monkeypatch.setattr(backend, "DRIVER_FILES", (str(driver),))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA Test GPU")
    monkeypatch.setenv("LOCAL_RANK", "1")
    probe = backend.deepinfer_probe()
    if expected is None:
        assert not probe.available
        assert probe.reason == f"found sm_{capability[0]}{capability[1]}; this backend supports sm_90 and sm_100"
        return
    assert probe.available and f"sm_{capability[0]}{capability[1]}" in probe.detail and "cuda:1" in probe.detail
    platform = backend.deepinfer_platform()
    assert (platform.name, platform.device, platform.backend) == (expected, "cuda:1", "nvidia")
    assert set(platform.supported_dtypes) == {torch.bfloat16, torch.float16, torch.float32}
    assert platform.fp8_weights is True and platform.graph_capture is True
    pytest.importorskip("triton", reason="the NVIDIA kernels need triton")
    ops = backend.deepinfer_ops(platform=platform, model_config=None, batch_invariant=False)
    # no V2/V3 op falls back to the reference; of the DeepSeek-V4 ops, those the plugin names
    assert set(ops) == set(OP_NAMES) - backend.LEFT_TO_REFERENCE and backend.LEFT_TO_REFERENCE <= set(V4_OP_NAMES)
    assert all(callable(fn) and fn.impl.startswith(("triton", "cublas", "torch")) for fn in ops.values()), {n: getattr(f, "impl", None) for n, f in ops.items()}
    limits = backend.deepinfer_scheduler_limits(platform=platform, model_config=None)
    assert limits.graph_batch_sizes and list(limits.graph_batch_sizes) == sorted(limits.graph_batch_sizes)
    monkeypatch.setenv("LOCAL_RANK", "2")  # only two devices visible
    assert backend.deepinfer_probe().reason == "LOCAL_RANK=2 but only 2 CUDA device(s) are visible"


@needs_nvidia
@pytest.mark.parametrize("block, kept", [((128, 128), True), ((32, 32), True), ((8, 8), False), ((128, 96), False)])
def test_nvidia_keeps_fp8_weights_only_for_blocks_its_kernels_take(block, kept):
    """Block widths the FP8 kernels cannot step through make the platform dequantise at load."""
    pytest.importorskip("triton", reason="the NVIDIA kernels need triton")
    from types import SimpleNamespace

    from deepinfer_core.platform import Platform
    from deepinfer_nvidia_sm100 import backend

    platform = Platform(name="nvidia-sm90", device="cuda:0", backend="nvidia", fp8_weights=True)
    backend.deepinfer_ops(platform=platform, model_config=SimpleNamespace(fp8_block=block), batch_invariant=False)
    assert platform.fp8_weights is kept


@needs_ascend
def test_ascend_unavailable_here_with_reason_and_fix(manager):
    ascend = manager.backends["ascend"]
    assert ascend.error is None and ascend.info.priority == 100
    if ascend.available:
        pytest.skip(f"this machine can run the ascend backend ({ascend.probe.detail})")
    if importlib.util.find_spec("torch_npu") is None:
        assert ascend.probe.reason == "torch_npu is not installed"
        assert ascend.probe.fix.startswith("install torch_npu matching your torch and CANN: pip install deepinfer[ascend]")
    with pytest.raises(BackendError) as err:
        manager.select("ascend")
    msg = str(err.value)
    assert "backend 'ascend' was requested but cannot run here" in msg
    assert ascend.probe.reason in msg and f"Fix: {ascend.probe.fix}" in msg
    assert "torch_npu" not in sys.modules


@pytest.fixture
def poisoned_torch_npu(tmp_path) -> tuple[Path, Path]:
    """A torch_npu that, like the real one without CANN, must never be imported: importing it
    leaves a marker file and raises."""
    site = tmp_path / "npu_site"
    (site / "torch_npu").mkdir(parents=True)
    marker = tmp_path / "torch_npu_was_imported"
    (site / "torch_npu" / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise ImportError('libascendcl.so: cannot open shared object file')\n"
    )
    return site, marker


@needs_ascend
def test_ascend_probe_never_imports_torch_npu(poisoned_torch_npu, tmp_path, monkeypatch):
    from deepinfer_ascend_950 import backend

    site, marker = poisoned_torch_npu
    monkeypatch.syspath_prepend(str(site))
    for var in backend.CANN_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    locations = (str(tmp_path / "Ascend" / "cann"), str(tmp_path / "Ascend" / "ascend-toolkit"))
    monkeypatch.setattr(backend, "CANN_LOCATIONS", locations)
    probe = backend.deepinfer_probe()
    assert probe.reason == f"CANN toolkit not found (ASCEND_HOME_PATH unset; none of {', '.join(locations)} exists)"
    assert probe.fix.startswith("install CANN 9.2") and "source /usr/local/Ascend/cann/set_env.sh" in probe.fix
    (tmp_path / "Ascend" / "cann").mkdir(parents=True)  # installed (CANN >= 8.5's place), not sourced
    probe = backend.deepinfer_probe()
    assert "environment is not set" in probe.reason and probe.fix == f"source {locations[0]}/set_env.sh before starting deepinfer"
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path / "Ascend" / "cann"))
    monkeypatch.setattr(backend, "DEVICE_GLOB", str(tmp_path / "dev" / "davinci[0-9]*"))
    monkeypatch.delenv(backend.VISIBLE_DEVICES, raising=False)
    probe = backend.deepinfer_probe()
    assert probe.reason.startswith("no Ascend NPU device found (") and "davinci*" in probe.reason
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "davinci0").touch()
    probe = backend.deepinfer_probe()
    assert probe.available and "npu:0" in probe.detail
    assert not marker.exists() and "torch_npu" not in sys.modules


@needs_ascend
def test_ascend_requested_without_torch_npu_or_cann_cli(fake_site, poisoned_torch_npu):
    """End to end in a fresh process: torch_npu present but CANN absent -> a clear error, and
    torch_npu never imported (the process would break)."""
    site, marker = poisoned_torch_npu
    from deepinfer_ascend_950 import backend

    if any(os.path.isdir(os.path.expanduser(p)) for p in backend.CANN_LOCATIONS) or os.environ.get("ASCEND_HOME_PATH"):
        pytest.skip("this machine has CANN")
    env = _env(fake_site, DEEPINFER_ACCELERATOR="ascend")
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    env.pop("ASCEND_TOOLKIT_HOME", None)
    done = _cli("backends", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "error: backend 'ascend' was requested but cannot run here: CANN toolkit not found" in done.stderr
    assert "Fix: install CANN 9.2" in done.stderr and "source /usr/local/Ascend/cann/set_env.sh" in done.stderr
    assert "fakegood" in done.stdout  # the listing still came first
    assert not marker.exists()


# ---- the CLI -------------------------------------------------------------------------------
def test_cli_backends_auto(with_fakes, capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    for name in ("reference (cpu)", "fakegood", "fakeunavail", "fakerequired", *BROKEN):
        assert _row(out, name.split()[0])
    assert f"unavailable: {UNAVAIL_REASON} -- fix: {UNAVAIL_FIX}" in _row(out, "fakeunavail")
    assert "source: deepinfer_fake_good.good (deepinfer-fake-backends 0.0.1)" in out
    for name, needles in BROKEN.items():
        row = _row(out, name)
        assert "broken: " in row and all(n in row for n in needles), row  # one line, pluggy's too
    probe = PluginManager()
    probe.discover()
    if not _gpu_backends_available(probe):
        assert "Selected: fakegood (auto: the highest-priority available backend)" in out
        assert "Platform: fake-good on cpu" in out
        table = _op_table(out)
        assert set(table) == set(OP_NAMES)
        assert {op: who for op, who in table.items() if who == "fakegood"} == dict.fromkeys(FAKE_OPS, "fakegood")
        assert all(table[op] == "reference (fallback)" for op in OP_NAMES if op not in FAKE_OPS | OPTIONAL_OPS)
        assert all(table[op] == "none (optional)" for op in OPTIONAL_OPS)  # a fusion left out is not called at all
        n = len(OPTIONAL_OPS)
        assert (f"Ops: 2 of {len(OP_NAMES)} from fakegood, {len(OP_NAMES) - 2 - n} fall back to the reference, "
                f"{n} optional fusion{'s' * (n > 1)} not provided (not called)") in out
    else:  # a GPU/NPU backend (priority 100) beats fakegood (50)
        assert "(auto: the highest-priority available backend)" in out and "Selected: fakegood" not in out


def test_cli_backends_honours_deepinfer_accelerator(with_fakes, monkeypatch, capsys):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "Selected: reference (requested by DEEPINFER_ACCELERATOR=cpu)" in out
    assert "Platform: cpu-reference on cpu" in out
    table = _op_table(out)
    assert {table[op] for op in OP_NAMES if op not in OPTIONAL_OPS} == {"reference"}
    assert {table[op] for op in OPTIONAL_OPS} == {"none (optional)"}  # the reference model runs the fused ops apart
    # --accelerator wins over the environment
    assert main(["backends", "--accelerator", "fakegood"]) == 0
    out = capsys.readouterr().out
    assert "Selected: fakegood (requested by --accelerator=fakegood)" in out
    # the batch-invariant table, where a backend has one
    assert main(["backends", "--batch-invariant"]) == 0
    out = capsys.readouterr().out
    assert "Platform: cpu-reference on cpu (batch-invariant op table)" in out
    assert "batch-invariant" in _row(out, "linear") and "batch-invariant" not in _row(out, "rms_norm")
    assert main(["backends", "--accelerator", "fakegood", "--batch-invariant"]) == 1
    assert "does not support batch-invariant inference" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, needles",
    [
        ("fakeunavail", [UNAVAIL_REASON, UNAVAIL_FIX]),
        ("fakerequired", ["'fakerequired'", "mla_decode_attention", "required"]),
        ("fakebadhook", ["is broken", "model_cfg"]),
        ("nosuch", ["'nosuch' is not installed", "reference (alias cpu)", "fakegood"]),
        ("fakedictplatform", ["'fakedictplatform'", "deepinfer_platform() broke its contract", "returned a dict"]),
        ("fakebadsignature", ["'fakebadsignature'", "op 'rms_norm' takes (x, weight) but its contract is rms_norm(x, weight, eps)"]),
    ],
)
def test_cli_backends_fails_for_a_backend_that_cannot_load(with_fakes, capsys, name, needles):
    assert main(["backends", "--accelerator", name]) == 1
    captured = capsys.readouterr()
    assert "fakegood" in captured.out and "reference (cpu)" in captured.out  # listed first
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    assert all(n in captured.err for n in needles), captured.err


def test_cli_backends_subprocess(fake_site):
    """The real thing: a fresh process, the installed console script, entry points from disk."""
    done = _cli("backends", env=_env(fake_site))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for name in ("reference", "fakegood", "fakeunavail", "fakerequired", *BROKEN):
        assert _row(out, name)
    assert "broken: importing deepinfer_fake_broken.importerror failed: ImportError" in _row(out, "fakeimporterror")
    if _installed("deepinfer-nvidia-sm100"):
        assert "deepinfer_nvidia_sm100.backend (deepinfer-nvidia-sm100" in out
    if _installed("deepinfer-ascend-950"):
        assert "deepinfer_ascend_950.backend (deepinfer-ascend-950" in out
    table = _op_table(out)
    assert set(table) == set(OP_NAMES)
    selected = out.split("Selected: ")[1].split()[0]
    assert all(table[op].split()[0] in (selected, "reference") or op in OPTIONAL_OPS and table[op] == "none (optional)"
               for op in OP_NAMES)


@needs_nvidia
def test_cli_requested_nvidia_subprocess(fake_site):
    done = _cli("backends", env=_env(fake_site, DEEPINFER_ACCELERATOR="nvidia"))
    if done.returncode == 0:
        pytest.skip("this machine can run the nvidia backend")
    assert done.returncode == 1
    assert _row(done.stdout, "nvidia") and _row(done.stdout, "fakegood")  # listed first
    assert done.stderr.startswith("error: backend 'nvidia' was requested but cannot run here: ")
    assert "Fix: " in done.stderr and "Traceback" not in done.stderr
    if not os.path.exists("/dev/nvidiactl"):
        assert f"{NVIDIA_NO_DRIVER}. Fix: {NVIDIA_CPU_FIX}." in done.stderr


def test_cli_generate_on_the_default_model(monkeypatch, capsys):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    args = ["generate", "--prompt", "Hello", "--prompt", "The sky is", "--max-tokens", "3", "--accelerator", "cpu"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "=== 'Hello'" in out and "=== 'The sky is'" in out


def test_cli_generate_with_an_unusable_backend(with_fakes, capsys):
    assert main(["generate", "--prompt", "Hello", "--accelerator", "fakeunavail"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and UNAVAIL_REASON in err


# ---- the hook contract, as the conformance command sees it ------------------------------------
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_conformance_names_a_broken_plugin_and_why(with_fakes, capsys, name):
    """A wrong hook signature, an unsupported spec version, a raising probe, an import error: the
    conformance run cannot start (exit 2) and says which plugin and what is wrong with it."""
    assert main(["conformance", "--backend", name, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"backend {name!r}" in err and "is broken" in err and BROKEN[name][0] in err, err


def test_conformance_checks_only_a_partial_backends_own_ops(with_fakes, capsys):
    assert main(["conformance", "--backend", "fakegood", "--dtype", "fp32", "--examples", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "rms_norm" in out and "silu_and_mul" in out and "PASSED: all 2 checks" in out
    assert "Not checked (fall back to the reference): add_rms_norm" in out
    assert main(["conformance", "--backend", "fakegood", "--ops", "moe_route"]) == 2
    assert "does not provide ['moe_route']" in capsys.readouterr().err
