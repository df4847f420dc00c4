"""How the Ascend path installs: build.sh refuses it without CANN before touching anything, and
only that path installs torch_npu (CI, which installs the dev extras, never does)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

from deepinfer_ascend_950 import backend

REPO = Path(__file__).resolve().parents[2]


def _build_sh_ascend(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    shutil.copy(REPO / "build.sh", tmp_path / "build.sh")
    base = {k: v for k, v in os.environ.items() if k not in backend.CANN_ENV_VARS}
    return subprocess.run(["bash", str(tmp_path / "build.sh")], env={**base, "DEEPINFER_ACCELERATOR": "ascend", **env},
                          capture_output=True, text=True, timeout=60)


def test_build_sh_ascend_names_torch_npu_cann_and_the_fix_before_touching_anything(tmp_path):
    done = _build_sh_ascend(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    msg = done.stderr
    assert "installs torch_npu, which needs CANN's environment (ASCEND_HOME_PATH: unset)" in msg
    assert "Fix: install CANN 9.2 and source /usr/local/Ascend/cann/set_env.sh" in msg
    assert "DEEPINFER_ACCELERATOR=cpu" in msg and "Nothing was installed." in msg
    assert not (tmp_path / ".venv").exists() and done.stdout == ""
    done = _build_sh_ascend(tmp_path, ASCEND_HOME_PATH=str(tmp_path / "gone"))  # set, but not sourced from a real install
    assert done.returncode == 1 and f"(ASCEND_HOME_PATH: {tmp_path / 'gone'}, not a directory)" in done.stderr
    assert not (tmp_path / ".venv").exists()


def test_only_the_ascend_path_installs_torch_npu():
    script = (REPO / "build.sh").read_text()
    installs = [line for line in script.splitlines() if '"${pip[@]}" install' in line and "npu" in line.lower()]
    assert len(installs) == 1 and "DEEPINFER_TORCH_NPU_SPEC" in installs[0]  # one install of torch_npu ...
    block = script[script.index('if [[ "$accel" == ascend ]] && !'):]
    assert installs[0] in block[:block.index("\nfi\n")]  # ... on the ascend path only
    assert '-e ".[dev,eval,pd]"' in script  # what CI installs: no [ascend] extra
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["ascend"][0] == "deepinfer-ascend-950" and any(r.startswith("torch-npu") for r in extras["ascend"])
    assert not any("npu" in r for name, reqs in extras.items() if name != "ascend" for r in reqs)
    plugin = tomllib.loads((REPO / "plugins/ascend_950/pyproject.toml").read_text())["project"]
    assert not any("npu" in r for r in plugin["dependencies"])  # the plugin itself never pulls torch_npu
