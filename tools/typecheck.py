"""`make lint`: mypy --strict over the package as it is installed (pscluster, .server, .worker, .coordinator, .proto).

The repository keeps the roles in top-level folders that pyproject's package-dir maps into `pscluster`;
mypy cannot follow that mapping (nor setuptools' editable-install finder), so this builds the installed
shape as a tree of symlinks in a temporary directory, checks it, and prints mypy's findings with the
repository's own paths. The mapping is read from pyproject.toml: it is written down there only.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
# pscluster.server -> server, ...: the subpackages that live in folders of their own
SUBPACKAGES = {name.removeprefix("pscluster."): folder for name, folder in PACKAGE_DIR.items() if name != "pscluster"}


def main() -> int:
    """Run mypy; its exit code."""
    with tempfile.TemporaryDirectory(prefix="pscluster-typecheck-") as tmp:
        pkg = pathlib.Path(tmp, "pscluster")
        pkg.mkdir()
        for entry in (ROOT / "pscluster").iterdir():
            if entry.name != "__pycache__":
                (pkg / entry.name).symlink_to(entry)
        for name, folder in SUBPACKAGES.items():
            (pkg / name).symlink_to(ROOT / folder)
        out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                              "-p", "pscluster"], cwd=tmp, capture_output=True, text=True,
                             env={**os.environ, "MYPYPATH": tmp})
        text = out.stdout + out.stderr
        for name, folder in SUBPACKAGES.items():
            text = text.replace(f"pscluster/{name}/", f"{folder}/")
        print(text, end="")
        return out.returncode


if __name__ == "__main__":
    sys.exit(main())
