"""The plugin contract's edges: names and aliases that collide, hooks that return the wrong
things, op callables whose signatures break their contract, observers that raise.

The colliding backends are a real distribution (tests/fake_backends/clashing), installed with
the well-behaved fakes (good/) into a private directory, as tests/test_plugins.py does with its
fakes; see tests/fake_backends/README.md.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from deepinfer_core import hook_checks
from deepinfer_core.hookspecs import SPEC_VERSION, BackendInfo, OpPlan, ProbeResult, SchedulerLimits, StepStats, hookimpl
from deepinfer_core.ops import REFERENCE_OPS
from deepinfer_core.platform import Platform
from deepinfer_core.plugins import BackendError, PluginManager

from .installing import install

FAKES = Path(__file__).resolve().parent / "fake_backends"
CORE_REFERENCE = "deepinfer_core.backends.reference (deepinfer "
CLASHING = "(deepinfer-fake-clashing-backends 0.0.1)"
GOOD = "(deepinfer-fake-backends 0.0.1)"


@pytest.fixture(scope="module")
def clash_site(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("clashing_site")
    install([FAKES / "good", FAKES / "clashing"], tmp_path_factory.mktemp("clashing_src"), target)
    return target


@pytest.fixture
def clashing(clash_site, monkeypatch) -> PluginManager:
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    monkeypatch.syspath_prepend(str(clash_site))
    manager = PluginManager()
    manager.discover()
    return manager


# ---- names and aliases -----------------------------------------------------------------------
def test_the_alias_cpu_stays_with_the_reference(clashing):
    """A third-party backend declaring the alias 'cpu' (priority -1) must not take it."""
    chosen = clashing.select("cpu")
    assert chosen.name == "reference" and chosen.source.startswith(CORE_REFERENCE)
    fake = clashing.backends["fakecpu"]
    assert not fake.available
    assert "claims the name 'cpu', which is reserved for the built-in reference backend" in fake.error
    assert "rename it or drop the alias" in fake.error
    with pytest.raises(BackendError, match="'fakecpu'.*is broken.*reserved"):
        clashing.select("fakecpu")
    named_cpu = clashing.backends["cpu"]  # an entry point named 'cpu' (whose import fails) takes nothing either
    assert not named_cpu.available and named_cpu.source.endswith(CLASHING)
    assert clashing.select("CPU").name == "reference"


def test_a_second_reference_is_rejected_and_the_real_one_keeps_its_alias(clashing):
    reference = clashing.backends["reference"]
    assert reference.source.startswith(CORE_REFERENCE) and reference.available and reference.info.aliases == ("cpu",)
    (impostor,) = [b for b in clashing.rejected if b.name == "reference"]
    assert impostor.source == f"deepinfer_fake_clashing.impostor {CLASHING}"
    assert "the name 'reference' is reserved for the built-in reference backend (deepinfer_core.backends.reference" in impostor.error
    assert impostor.error.endswith("rename this backend")
    platform, _, _, fallback = clashing.load(clashing.select("reference"))
    assert platform.name == "cpu-reference" and fallback == []


def test_an_alias_two_backends_declare_breaks_both_naming_both(clashing):
    a, b = clashing.backends["fakealias_a"], clashing.backends["fakealias_b"]
    for mine, other in ((a, b), (b, a)):
        assert not mine.available
        assert "'fakeaccel' is claimed by" in mine.error and mine.source in mine.error and other.source in mine.error
    with pytest.raises(BackendError, match="is broken.*fakeaccel"):
        clashing.select("fakeaccel")


def test_a_name_two_distributions_register_breaks_both(clashing):
    holder = clashing.backends["fakegood"]
    (second,) = [b for b in clashing.rejected if b.name == "fakegood"]
    assert {holder.source.split(" (")[1], second.source.split(" (")[1]} == {GOOD[1:], CLASHING[1:]}
    for b in (holder, second):
        assert not b.available and "fakegood" in b.error
    assert holder.source in holder.error and second.source in holder.error
    assert clashing.select().name not in {"fakegood", "fakealias_a", "fakealias_b", "fakecpu"}
    assert clashing.pm.get_plugin("fakegood") is None  # its step observer never runs


def test_cli_lists_every_claimant_and_cpu_selects_the_reference(clash_site):
    env = {**os.environ, "DEEPINFER_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(clash_site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    done = subprocess.run([sys.executable, "-m", "deepinfer_core.cli", "backends"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Selected: reference (requested by DEEPINFER_ACCELERATOR=cpu)" in done.stdout
    assert f"source: deepinfer_fake_clashing.impostor {CLASHING}" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.split()[:1] == ["reference"]]
    assert len(rows) == 2 and sum("broken: the name 'reference' is reserved" in r for r in rows) == 1


# ---- what the hooks return -------------------------------------------------------------------
def _backend(name: str, **hooks) -> SimpleNamespace:
    """An in-process backend module whose hooks are the given functions."""
    module = SimpleNamespace(
        deepinfer_backend=hookimpl(lambda: BackendInfo(name=name, priority=-10, min_spec_version=SPEC_VERSION,
                                                       max_spec_version=SPEC_VERSION)),
        deepinfer_probe=hookimpl(lambda: ProbeResult(True)),
        deepinfer_platform=hookimpl(lambda: Platform(name="fake-inline", backend=name)),
    )
    for hook, fn in hooks.items():
        setattr(module, hook, hookimpl(fn))
    return module


def _load(module: SimpleNamespace, name: str):
    manager = PluginManager()
    backend = manager.add(name, module)
    assert backend.error is None, backend.error
    return manager.load(backend, model_config=SimpleNamespace())


@pytest.mark.parametrize(
    "hooks, needles",
    [
        ({"deepinfer_platform": lambda: {"name": "x"}}, ["deepinfer_platform() broke its contract", "returned a dict"]),
        ({"deepinfer_platform": lambda: Platform(name="p", device="gpu!", backend="inline")}, ["Platform.device is 'gpu!'"]),
        ({"deepinfer_platform": lambda: Platform(name="p", backend="someone-else")}, ["Platform.backend is 'someone-else'"]),
        ({"deepinfer_platform": lambda: Platform(name="p", backend="inline", supported_dtypes=())}, ["supported_dtypes"]),
        ({"deepinfer_ops": lambda platform, model_config: [REFERENCE_OPS["rms_norm"]]}, ["deepinfer_ops() returned a list"]),
        ({"deepinfer_ops": lambda platform, model_config: {"rms_norm": lambda x, w: x}},
         ["op 'rms_norm' takes (x, w) but its contract is rms_norm(x, weight, eps): too many positional arguments"]),
        ({"deepinfer_ops": lambda platform, model_config: {"moe_route": lambda x, gate_weight, correction_bias, **kw: None,
                                                           "linear": lambda x, weight: None}},
         ["op 'linear' takes (x, weight)", "too many positional arguments"]),
        ({"deepinfer_ops": lambda platform, model_config: {  # hookspec version 1's decode: no query_start_loc
            "mla_decode_attention": lambda q_latent, q_pe, kv_cache, block_tables, seq_lens, scale: q_latent}},
         ["op 'mla_decode_attention' takes (q_latent, q_pe, kv_cache, block_tables, seq_lens, scale) but its contract is "
          "mla_decode_attention(q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale): "
          "too many positional arguments"]),
        ({"deepinfer_scheduler_limits": lambda platform, model_config: {"max_num_seqs": 4}}, ["returned a dict"]),
        ({"deepinfer_scheduler_limits": lambda platform, model_config: SchedulerLimits(graph_batch_sizes=(8, 1))},
         ["graph_batch_sizes is (8, 1)", "ascending"]),
        ({"deepinfer_scheduler_limits": lambda platform, model_config: SchedulerLimits(block_size=0)},
         ["block_size is 0", "positive int"]),
    ],
    ids=["platform-dict", "platform-device", "platform-backend", "platform-dtypes", "ops-list", "op-missing-arg",
         "op-extra-positional", "op-spec-v1-decode", "limits-dict", "limits-order", "limits-block-size"],
)
def test_a_hook_returning_the_wrong_thing_is_named_at_start_up(hooks, needles):
    with pytest.raises(BackendError) as err:
        _load(_backend("inline", **hooks), "inline")
    msg = str(err.value)
    assert msg.startswith("backend 'inline'"), msg
    for needle in needles:
        assert needle in msg, msg


@pytest.mark.parametrize(
    "plan, needle",
    [
        (None, "has no deepinfer_op_plan hook"),
        ({"rms_norm": "x"}, "returned a dict"),
        (OpPlan(provides={"flash": "kernel"}), "OpPlan names unknown ops ['flash']"),
        (OpPlan(provides={"rms_norm": "a"}, left_out={"rms_norm": "b"}), "both provides and leaves out ['rms_norm']"),
        (OpPlan(left_out={"linear": ""}), "OpPlan.left_out is"),
    ],
    ids=["missing", "dict", "unknown-op", "both", "empty-reason"],
)
def test_a_bad_op_plan_is_named(plan, needle):
    hooks = {} if plan is None else {"deepinfer_op_plan": lambda: plan}
    manager = PluginManager()
    backend = manager.add("inline", _backend("inline", **hooks))
    with pytest.raises(BackendError) as err:
        manager.op_plan(backend)
    assert str(err.value).startswith("backend 'inline'") and needle in str(err.value), str(err.value)


def test_an_op_plan_is_shown_for_a_backend_that_cannot_run_here(capsys, monkeypatch):
    from deepinfer_core import cli

    plan = OpPlan(provides={"rms_norm": "vendor kernel"}, left_out={"linear": "the vendor BLAS is what torch calls"})
    module = _backend("inline", deepinfer_op_plan=lambda: plan)
    module.deepinfer_probe = hookimpl(lambda: ProbeResult(False, reason="no such chip here", fix="buy one"))
    manager = PluginManager()
    manager.add("inline", module)
    assert cli._plan(manager, "inline") == 0
    out = capsys.readouterr().out
    assert "Plan: inline (unavailable here: no such chip here)" in out
    rows = {line.split()[0]: line for line in out.splitlines()[3:]}
    assert rows["rms_norm"].split()[1] == "inline" and rows["rms_norm"].endswith("vendor kernel")
    assert "reference (fallback)  why not: the vendor BLAS is what torch calls" in rows["linear"]
    assert rows["sample_tokens"].endswith("why not: no reason given")
    assert "none (optional)" in rows["norm_rope_write_latent"]


def test_op_signatures_that_keep_the_contract_are_accepted():
    loose = {
        "rms_norm": lambda x, w, eps=1e-6: x,  # own names and an extra default are fine
        "linear": lambda x, weight, bias: x,  # the model always passes bias (None or a tensor)
        "fp8_block_linear": lambda *args: None,  # so is taking anything positionally
        "moe_route": lambda x, gate_weight, correction_bias, **kwargs: None,
        "moe_experts": lambda x, w13, w2, weights, ids, w1_scale=None, w2_scale=None, block=None: x,
        "mla_decode_attention": lambda q, q_pe, cache, tables, lens, starts, scale, *extra: q,  # own names, extras
        "sample_tokens": max,  # a builtin without an inspectable signature: not checked
    }
    _, ops, _, _ = _load(_backend("inline", deepinfer_ops=lambda platform, model_config: loose), "inline")
    assert ops.providers["rms_norm"] == "inline"
    for name, fn in REFERENCE_OPS.items():  # the reference keeps its own contract
        assert hook_checks.signature_problem(fn, fn) is None, name


@pytest.mark.parametrize(
    "info, needle",
    [
        (BackendInfo(name="x", priority="high"), "BackendInfo.priority is 'high', expected an int"),
        (BackendInfo(name="x", priority=1, aliases="cpu"), "BackendInfo.aliases is 'cpu'"),
        (BackendInfo(name="x", priority=1, required_ops=frozenset({"flash"})), "unknown ops ['flash']"),
        ({"name": "x"}, "returned a dict"),
    ],
)
def test_a_bad_backend_info_is_a_broken_plugin(info, needle):
    backend = PluginManager().add("x", _backend("x", deepinfer_backend=lambda: info))
    assert not backend.available and needle in backend.error, backend.error


def test_a_backend_that_declares_no_spec_version_is_refused():
    """BackendInfo's default range (1..1) is the first contract's, which this core no longer speaks
    (version 2 changed mla_decode_attention's signature): such a backend is broken, not loaded."""
    assert SPEC_VERSION == 3 and (BackendInfo("x", 1).min_spec_version, BackendInfo("x", 1).max_spec_version) == (1, 1)
    backend = PluginManager().add("x", _backend("x", deepinfer_backend=lambda: BackendInfo(name="x", priority=1)))
    assert not backend.available
    assert "supports hookspec versions 1..1, but this deepinfer core speaks version 3" in backend.error, backend.error


def test_a_bad_probe_result_is_a_broken_plugin():
    backend = PluginManager().add("x", _backend("x", deepinfer_probe=lambda: ProbeResult("yes")))
    assert "ProbeResult.available is 'yes', expected a bool" in backend.error


# ---- step observers ---------------------------------------------------------------------------
def test_hooks_may_take_a_subset_of_the_spec_arguments():
    """pluggy allows it: an observer without ``stats``, ops without ``model_config``."""
    calls = []
    module = _backend("subset", deepinfer_ops=lambda platform: {}, deepinfer_step_observer=lambda: calls.append(1))
    manager = PluginManager()
    manager.add("subset", module)
    platform, ops, _, _ = manager.load(manager.backends["subset"], model_config=SimpleNamespace())
    assert set(ops.providers.values()) == {"reference"}
    manager.step_observer()(StepStats(step=1, num_prefill_tokens=0, num_decode_tokens=0, num_running=0, num_waiting=0,
                                      num_preempted=0, free_kv_blocks=0, seconds=0.0))
    assert calls == [1]


def test_a_raising_observer_is_named_once_and_the_others_keep_observing(caplog):
    seen = []

    def explode(stats):
        raise ValueError("observer bug")

    manager = PluginManager()
    manager.add("loud", _backend("loud", deepinfer_step_observer=explode))
    manager.add("quiet", _backend("quiet", deepinfer_step_observer=lambda stats: seen.append(stats)))
    notify = manager.step_observer()
    stats = [StepStats(step=i, num_prefill_tokens=0, num_decode_tokens=1, num_running=1, num_waiting=0, num_preempted=0,
                       free_kv_blocks=1, seconds=0.0) for i in (1, 2, 3)]
    with caplog.at_level(logging.ERROR, logger="deepinfer"):
        for s in stats:
            notify(s)
    assert seen == stats
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    message = errors[0].getMessage()
    assert "backend 'loud' (registered in-process) raised at step 1; it is not called again" in message
    assert "observer bug" in caplog.text  # the traceback, once


@pytest.mark.parametrize("suggested, expected", [(64, 64), (48, 48), (24, 16), (None, 16)])
def test_the_backends_block_size_is_taken_where_the_models_layout_allows(suggested, expected):
    """SchedulerLimits.block_size replaces the model's default block size (16 here) when it is a
    multiple of it (a user's block_size comes before both, in engine/startup.py)."""
    from deepinfer_core.engine.startup import default_block_size

    model = SimpleNamespace(default_block_size=16)
    assert default_block_size(model, SchedulerLimits(block_size=suggested)) == expected
    assert default_block_size(model, None) == 16
