"""The Ascend backend's probe on a machine without Ascend (it never imports torch_npu), and the
error when the backend is asked for anyway.

A poisoned ``torch_npu`` (it leaves a marker file and raises, as the real one does without CANN)
stands in where a test needs the package to exist; nothing here installs or imports the real one.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from deepinfer_ascend_950 import backend
from deepinfer_core.plugins import BackendError, PluginManager


@pytest.fixture
def npu_machine(tmp_path, monkeypatch):
    """A poisoned torch_npu on sys.path, CANN and /dev/davinci* under tmp_path, nothing set yet.
    Returns (tmp_path, the fake site directory, the marker file importing torch_npu would create)."""
    site = tmp_path / "site"
    (site / "torch_npu").mkdir(parents=True)
    marker = tmp_path / "torch_npu_was_imported"
    (site / "torch_npu" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise ImportError('libascendcl.so')\n")
    monkeypatch.syspath_prepend(str(site))
    for var in (*backend.CANN_ENV_VARS, backend.VISIBLE_DEVICES, "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(backend, "CANN_LOCATIONS", (str(tmp_path / "Ascend" / "cann"), str(tmp_path / "Ascend" / "ascend-toolkit")))
    monkeypatch.setattr(backend, "DEVICE_GLOB", str(tmp_path / "dev" / "davinci[0-9]*"))
    (tmp_path / "dev").mkdir()
    yield tmp_path, site, marker
    assert not marker.exists() and "torch_npu" not in sys.modules, "the probe imported torch_npu"


def _dist_info(site: Path, name: str, version: str) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_cann_9_is_found_under_cann_and_asked_to_be_sourced(npu_machine, monkeypatch):
    tmp, _, _ = npu_machine
    (tmp / "Ascend" / "ascend-toolkit").mkdir(parents=True)  # an old install beside a new one: the new one is named
    (tmp / "Ascend" / "cann").mkdir()
    probe = backend.deepinfer_probe()
    assert probe.reason == f"CANN toolkit found at {tmp / 'Ascend' / 'cann'} but its environment is not set (ASCEND_HOME_PATH unset)"
    assert probe.fix == f"source {tmp / 'Ascend' / 'cann'}/set_env.sh before starting deepinfer"
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp / "Ascend" / "gone"))
    assert backend.deepinfer_probe().reason == f"CANN toolkit not found (ASCEND_HOME_PATH={tmp / 'Ascend' / 'gone'} does not exist)"


def test_a_users_own_cann_install_counts(npu_machine, monkeypatch):
    tmp, _, _ = npu_machine
    monkeypatch.setattr(backend, "CANN_LOCATIONS", ("~/Ascend/cann",))
    monkeypatch.setenv("HOME", str(tmp / "home"))
    (tmp / "home" / "Ascend" / "cann").mkdir(parents=True)
    assert backend.deepinfer_probe().fix == f"source {tmp / 'home' / 'Ascend' / 'cann'}/set_env.sh before starting deepinfer"


def test_visible_devices_follow_ascend_rt_visible_devices(npu_machine, monkeypatch):
    tmp, _, _ = npu_machine
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp))
    assert backend.deepinfer_probe().reason == "no Ascend NPU device found (/dev/davinci* missing)".replace(
        "/dev/davinci*", str(tmp / "dev" / "davinci*"))
    for i in (0, 1, 2, 3, 10):
        (tmp / "dev" / f"davinci{i}").touch()
    (tmp / "dev" / "davinci_manager").touch()  # not an NPU
    probe = backend.deepinfer_probe()
    assert probe.available and probe.detail.startswith("5 NPU device(s) visible, npu:0 (") and "davinci0)" in probe.detail
    monkeypatch.setenv(backend.VISIBLE_DEVICES, "3,10")
    monkeypatch.setenv("LOCAL_RANK", "1")
    probe = backend.deepinfer_probe()
    assert probe.available and probe.detail.startswith("2 NPU device(s) visible, npu:1 (") and "davinci10)" in probe.detail
    monkeypatch.setenv("LOCAL_RANK", "2")
    probe = backend.deepinfer_probe()
    assert probe.reason == "LOCAL_RANK=2 but only 2 NPU device(s) are visible" and backend.VISIBLE_DEVICES in probe.fix
    monkeypatch.setenv(backend.VISIBLE_DEVICES, "1,7")
    assert backend.deepinfer_probe().reason == (f"{backend.VISIBLE_DEVICES}='1,7' names NPUs this machine does not have "
                                                f"(7; present: 0, 1, 2, 3, 10)")
    monkeypatch.setenv(backend.VISIBLE_DEVICES, "")
    assert backend.deepinfer_probe().reason == f"no NPU visible ({backend.VISIBLE_DEVICES}='')"


def test_a_torch_npu_built_for_another_torch_is_refused_from_its_metadata(npu_machine):
    _, site, _ = npu_machine
    _dist_info(site, "torch_npu", "2.10.0.post4")
    from importlib.metadata import version

    torch_version = version("torch")
    probe = backend.deepinfer_probe()
    assert probe.reason == f"torch_npu 2.10.0.post4 is built for torch 2.10, but torch {torch_version} is installed"
    major_minor = ".".join(torch_version.split(".")[:2])
    assert f"'torch-npu=={major_minor}.*'" in probe.fix and "CANN 9.2" in probe.fix


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_asking_for_ascend_here_names_torch_npu_cann_and_the_fix(monkeypatch):
    manager = PluginManager()
    manager.discover()
    with pytest.raises(BackendError) as err:
        manager.select("ascend")
    msg = str(err.value)
    assert "backend 'ascend' was requested but cannot run here: torch_npu is not installed" in msg
    assert "Fix: install torch_npu matching your torch and CANN: pip install deepinfer[ascend] 'torch-npu==" in msg
    assert "CANN 9.2" in msg and "DEEPINFER_ACCELERATOR=ascend ./build.sh" in msg
    from deepinfer_core import LLM

    with pytest.raises(BackendError, match="torch_npu is not installed.*Fix: install torch_npu"):
        LLM(accelerator="ascend")  # before any weight is read
    assert "torch_npu" not in sys.modules
