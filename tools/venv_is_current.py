"""Whether .venv already holds what ./build.sh would install, so that it can skip pip.

    python -P tools/venv_is_current.py ROOT STAMP          exit 0: current, 1: pip must run
    python -P tools/venv_is_current.py ROOT STAMP --write  record ROOT's pyproject files as installed

Current means: STAMP holds the hash of ROOT's pyproject files (the installs are editable, so
only what those declare can change what pip installs), the core and both plugin packages import
from ROOT (not from another checkout), the reference backend's entry point is registered, and
every requirement of deepinfer[dev] and deepinfer[eval] and of deepinfer-ascend-950[tilelang] (the
extras build.sh installs) is installed. Run it with -P so that the working directory does not shadow the installed packages.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import re
import sys
from pathlib import Path

PACKAGES = ("deepinfer_core", "deepinfer_nvidia_sm100", "deepinfer_ascend_950")
EXTRAS = ("dev", "eval", "pd")  # what ./build.sh installs: pip install -e ".[dev,eval,pd]"
PLUGIN_EXTRAS = {"deepinfer-ascend-950": ("tilelang",)}  # ... and -e "plugins/ascend_950[tilelang]"


def digest(root: Path) -> str:
    files = [root / "pyproject.toml", *sorted(root.glob("plugins/*/pyproject.toml"))]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def _from(module: str, root: Path) -> bool:
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().is_relative_to(root)


def _installed(requirement: str) -> bool:
    """Whether the distribution a requirement names is installed (versions are pip's business)."""
    name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]
    try:
        md.version(name)
    except md.PackageNotFoundError:
        return False
    return True


def _wanted(distribution: str, extras: tuple[str, ...]) -> list[str] | None:
    """The requirements of ``distribution`` and of its ``extras`` (None: it is not installed)."""
    try:
        requires = md.requires(distribution) or []
    except md.PackageNotFoundError:
        return None
    return [r for r in requires if "extra ==" not in r or any(re.search(rf"extra == ['\"]{e}['\"]", r) for e in extras)]


def current(root: Path, stamp: Path) -> bool:
    if not stamp.is_file() or stamp.read_text().strip() != digest(root):
        return False
    if not all(_from(m, root) for m in PACKAGES) or not md.entry_points(group="deepinfer.backends", name="reference"):
        return False
    for distribution, extras in {"deepinfer": EXTRAS, **PLUGIN_EXTRAS}.items():
        wanted = _wanted(distribution, extras)
        if wanted is None or not all(_installed(r) for r in wanted):
            return False
    return True


def main(argv: list[str]) -> int:
    root, stamp = Path(argv[0]).resolve(), Path(argv[1])
    if argv[2:] == ["--write"]:
        stamp.write_text(digest(root) + "\n")
        return 0
    return 0 if current(root, stamp) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
