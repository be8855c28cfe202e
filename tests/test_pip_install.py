"""The package as a user installs it: the wheel `python -m build` makes, installed with plain pip into
a fresh virtualenv (no root, no system packages, no Horovod), trains a user's module from a script
outside the repository."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from helpers import ROOT, SCRIPTS, run_command, run_script

import lightning_dist

PIP_BUDGET = 400
"""Seconds for `pip install` of the wheel into the fresh venv, the test's largest budget."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * PIP_BUDGET)]


def link_torch(into: Path) -> list[str]:
    """A folder of links to this interpreter's torch and everything it requires, so a new venv reuses
    the project's torch (pip then sees torch installed and installs only the pack's own dependencies)."""
    into.mkdir(parents=True)
    todo, seen = ["torch"], []
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.append(key)
        dist = metadata.distribution(name)
        todo += [
            re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in dist.requires or [] if "extra ==" not in r
        ]
        for top in {
            f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "__pycache__")
        }:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (into / top).exists():
                os.symlink(source, into / top)
    return seen


def test_wheel_installs_with_pip_and_trains_a_users_module(tmp_path: Path) -> None:
    run_script(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(ROOT)], timeout=300
    )
    (wheel,) = (tmp_path / "dist").glob("lightning_dist-*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    for shipped in (
        "lightning_dist/py.typed",
        "lightning_dist/compat.py",
        "lightning_dist/install_horovod.py",
    ):
        assert shipped in files, f"{shipped} missing from the wheel"
    assert any(f.endswith("licenses/LICENSE") for f in files)
    assert not any(f.startswith(("tests/", "benchmarks/", "examples/")) for f in files)

    venv = tmp_path / "venv"
    run_script([sys.executable, "-m", "venv", str(venv)], timeout=120)

    def in_venv(*args: str, timeout: float = 120) -> str:
        # outside the repository and without its PYTHONPATH: only what is installed in the venv
        proc = run_command([python, *args], timeout, cwd=tmp_path, PYTHONPATH="")
        assert proc.returncode == 0, f"{' '.join(args)}: {proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        return proc.stdout

    python = str(venv / "bin" / "python")
    purelib = in_venv("-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    assert purelib != sysconfig.get_paths()["purelib"], "a venv of its own, not the project's"
    linked = link_torch(tmp_path / "project-torch")
    Path(purelib, "project_torch.pth").write_text(str(tmp_path / "project-torch") + "\n")
    in_venv("-m", "pip", "install", "-q", str(wheel), timeout=PIP_BUDGET)
    names = {p["name"].lower() for p in json.loads(in_venv("-m", "pip", "list", "--format=json"))}
    assert {"lightning-dist", "lightning", "torchmetrics"} <= names and "horovod" not in names
    console = run_command(
        [str(venv / "bin" / "lightning-dist"), "--version"], 60, cwd=tmp_path, PYTHONPATH=""
    )
    assert console.stdout.startswith(f"lightning-dist {lightning_dist.__version__} (tested with"), console

    user = tmp_path / "user"
    user.mkdir()
    shutil.copy(SCRIPTS / "user_fit.py", user / "fit.py")
    proc = run_command([python, "fit.py"], timeout=240, cwd=user, PYTHONPATH="")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["package"].startswith(str(venv)), f"imported from {result['package']}, not the venv"
    assert result["version"] == lightning_dist.__version__ and result["world_size"] == 2
    losses = result["losses"]
    assert losses[-1] < 0.5 * losses[0], f"the loss did not fall: {losses}"
    assert "torch" in linked
