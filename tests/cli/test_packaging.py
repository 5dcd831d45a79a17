"""A non-editable install carries every module and the shipped recipes (issue 26 item 19).

The wheel is built from a copy of the sources with the environment's setuptools (no download), installed
into a folder of its own, and run from a folder that is not the checkout: ``--recipe NAME`` must resolve
to the recipes inside the installed package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_ships_every_module_and_recipe(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pfctl", "recipes"):
        shutil.copytree(REPO / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(src)], check=True
    )
    (wheel,) = tmp_path.glob("pfctl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "pfctl").rglob("*.py")}
    recipes = {f"pfctl/recipes/{p.name}" for p in (REPO / "recipes").glob("*.yaml")}
    assert recipes and modules <= names and recipes <= names, sorted((modules | recipes) - names)

    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = (
        "import pfctl, sys; from pfctl.cli.app import main; print(pfctl.__file__, file=sys.stderr);"
        "sys.argv = ['pfctl', 'train', '--recipe', 'debug-tiny', '--print-config']; main()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.strip().startswith(str(site)), proc.stderr
    assert "video_sync_group: 1" in proc.stdout and "output_dir: outputs/debug-tiny" in proc.stdout
