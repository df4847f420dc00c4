"""Install plugin distributions for tests into a private ``--target``-style directory.

Used by tests/test_plugins.py (the fakes in tests/fake_backends) and tests/test_vendor_plugin.py
(examples/vendor_plugin). Nothing is installed into the environment running the tests: the
result is a plain directory of packages plus ``*.dist-info`` that a test puts on ``sys.path``
(in-process) or ``PYTHONPATH`` (subprocesses). See tests/fake_backends/README.md.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path


def install_by_hand(src: Path, target: Path) -> None:
    """What installing a pure-Python wheel does: copy the packages, write a dist-info."""
    pyproject = tomllib.loads((src / "pyproject.toml").read_text())
    project = pyproject["project"]
    for package in pyproject["tool"]["setuptools"]["packages"]:
        shutil.copytree(src / package, target / package)
    info = target / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    lines = []
    for group, eps in project["entry-points"].items():
        lines += [f"[{group}]", *(f"{name} = {value}" for name, value in eps.items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))


def install(sources: list[Path], scratch: Path, target: Path) -> None:
    """Install the distributions at ``sources`` into ``target``; raise RuntimeError on failure.

    The sources are copied into ``scratch`` first, so a build leaves nothing (``build/``,
    ``*.egg-info``) in the repository. pip builds them with the environment's setuptools,
    offline (``--no-index``, ``--no-deps``, ``--no-build-isolation``, ``--no-cache-dir``).
    Without pip or setuptools (e.g. a Python >= 3.12 venv made without setuptools) the same
    layout is written by hand. FAKE_BACKENDS_INSTALLER=pip|manual forces one way.
    """
    copies = [scratch / src.name for src in sources]
    for src, dst in zip(sources, copies):
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    how = os.environ.get("FAKE_BACKENDS_INSTALLER", "auto")
    have_pip = all(importlib.util.find_spec(m) is not None for m in ("pip", "setuptools"))
    if how == "pip" or (how == "auto" and have_pip):
        env = {**os.environ, "PIP_USER": "0", "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        env.pop("PIP_REQUIRE_VIRTUALENV", None)
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
               "--no-cache-dir", "--quiet", "--target", str(target), *map(str, copies)]  # fmt: skip
        done = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"installing failed:\n$ {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    else:
        for src in copies:
            install_by_hand(src, target)
