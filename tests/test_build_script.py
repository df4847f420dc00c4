"""tools/venv_is_current.py: when ./build.sh may skip pip (it reinstalled on every run before)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("venv_is_current", REPO / "tools" / "venv_is_current.py")
venv_is_current = importlib.util.module_from_spec(spec)
spec.loader.exec_module(venv_is_current)

installed_here = all(venv_is_current._from(m, REPO) for m in venv_is_current.PACKAGES)
needs_this_checkout = pytest.mark.skipif(not installed_here, reason="deepinfer is not installed from this checkout (./build.sh does that)")


def copy_pyprojects(dest: Path) -> Path:
    """A checkout-shaped directory holding only this one's pyproject files."""
    for rel in ("pyproject.toml", "plugins/nvidia_sm100/pyproject.toml", "plugins/ascend_950/pyproject.toml"):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, dest / rel)
    return dest


def test_the_digest_follows_the_pyproject_files_only(tmp_path):
    copy_pyprojects(tmp_path)
    before = venv_is_current.digest(tmp_path)
    assert before == venv_is_current.digest(REPO)
    (tmp_path / "README.md").write_text("code and docs change nothing pip installs")
    assert venv_is_current.digest(tmp_path) == before
    with open(tmp_path / "plugins/ascend_950/pyproject.toml", "a") as f:
        f.write("\n# a new dependency would go here\n")
    assert venv_is_current.digest(tmp_path) != before


@needs_this_checkout
def test_current_only_with_the_right_stamp(tmp_path, monkeypatch):
    stamp = tmp_path / "stamp"
    assert not venv_is_current.current(REPO, stamp)  # never installed by build.sh
    assert venv_is_current.main([str(REPO), str(stamp), "--write"]) == 0
    assert venv_is_current.current(REPO, stamp)
    stamp.write_text("0" * 64)  # a pyproject changed since
    assert not venv_is_current.current(REPO, stamp)
    venv_is_current.main([str(REPO), str(stamp), "--write"])
    real = venv_is_current.md.requires
    monkeypatch.setattr(venv_is_current.md, "requires", lambda name: [*real(name), 'no-such-distribution>=1; extra == "dev"'])
    assert not venv_is_current.current(REPO, stamp)  # a dev requirement went missing
    monkeypatch.setattr(venv_is_current.md, "requires", lambda name: [*real(name), 'no-such-distribution>=1; extra == "eval"'])
    assert not venv_is_current.current(REPO, stamp)  # so did lm-eval's extra, which build.sh installs too
    monkeypatch.setattr(venv_is_current.md, "requires", lambda name: [*real(name), 'no-such-distribution>=1; extra == "pd"'])
    assert not venv_is_current.current(REPO, stamp)  # and the prefill/decode extra (NIXL, vllm-router)
    monkeypatch.setattr(venv_is_current.md, "requires", lambda name: [*real(name), 'no-such-distribution>=1; extra == "tilelang"'])
    assert not venv_is_current.current(REPO, stamp)  # the Ascend plugin's tilelang extra, which build.sh installs, went missing
    monkeypatch.setattr(venv_is_current.md, "requires", lambda name: [*real(name), 'no-such-distribution>=1; extra == "bench"'])
    assert venv_is_current.current(REPO, stamp)  # build.sh does not install the bench extra


@needs_this_checkout
def test_another_checkout_is_not_current(tmp_path):
    other = copy_pyprojects(tmp_path / "other-checkout")
    stamp = tmp_path / "stamp"
    venv_is_current.main([str(other), str(stamp), "--write"])  # same pyproject files, other place
    assert not venv_is_current.current(other, stamp)  # this venv's packages import from REPO, not from it


def test_build_sh_installs_the_extras_it_checks():
    """build.sh's pip line installs exactly the extras venv_is_current checks: deepinfer's and the
    Ascend plugin's tilelang (whose tests lower the TileLang kernels in CI)."""
    script = (REPO / "build.sh").read_text()
    assert f'-e ".[{",".join(venv_is_current.EXTRAS)}]"' in script
    for distribution, extras in venv_is_current.PLUGIN_EXTRAS.items():
        folder = {"deepinfer-ascend-950": "plugins/ascend_950"}[distribution]
        assert f'-e "{folder}[{",".join(extras)}]"' in script
    pyproject = (REPO / "plugins/ascend_950/pyproject.toml").read_text()
    assert 'tilelang = ["tilelang==0.1.15"]' in pyproject  # pinned: the version the kernels lower with


@needs_this_checkout
def test_the_command_line_as_build_sh_calls_it(tmp_path):
    stamp = tmp_path / "stamp"
    run = lambda *extra: subprocess.run([sys.executable, "-P", str(REPO / "tools" / "venv_is_current.py"), str(REPO), str(stamp), *extra],
                                        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run().returncode == 1
    assert run("--write").returncode == 0 and run().returncode == 0
