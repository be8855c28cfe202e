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
from typing import Any

import pytest
from background import BackgroundJobs, Command, python_call
from helpers import ROOT, SCRIPTS, run_command, run_script

import lightning_dist

PIP_BUDGET = 400
"""Seconds for `pip install` of the wheel into the fresh venv, the test's largest budget."""
BACKGROUND_BUDGET = 500
"""Seconds for ``user_install`` as a whole (the build, the install, the user's fit: about 40 s here)."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * BACKGROUND_BUDGET)]


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


def user_install(tmp_path: Path) -> dict[str, Any]:
    """As a user would: build the wheel, make a fresh venv (reusing the project's torch), pip install
    the wheel, run its console script and a user's fit script from a folder outside the repository.
    Returns what the test checks; a step that fails raises with its output. Runs in the background
    (tests/background.py): it mostly waits on pip."""
    run_script(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(ROOT)], timeout=300
    )
    (wheel,) = (tmp_path / "dist").glob("lightning_dist-*.whl")
    venv = tmp_path / "venv"
    run_script([sys.executable, "-m", "venv", str(venv)], timeout=120)

    def in_venv(*args: str, timeout: float = 120) -> str:
        # outside the repository and without its PYTHONPATH: only what is installed in the venv
        proc = run_command([python, *args], timeout, cwd=tmp_path, PYTHONPATH="")
        assert proc.returncode == 0, f"{' '.join(args)}: {proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        return proc.stdout

    python = str(venv / "bin" / "python")
    purelib = in_venv("-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    linked = link_torch(tmp_path / "project-torch")
    Path(purelib, "project_torch.pth").write_text(str(tmp_path / "project-torch") + "\n")
    in_venv("-m", "pip", "install", "-q", str(wheel), timeout=PIP_BUDGET)
    installed = [p["name"].lower() for p in json.loads(in_venv("-m", "pip", "list", "--format=json"))]
    console = run_command(
        [str(venv / "bin" / "lightning-dist"), "--version"], 60, cwd=tmp_path, PYTHONPATH=""
    )
    user = tmp_path / "user"
    user.mkdir()
    shutil.copy(SCRIPTS / "user_fit.py", user / "fit.py")
    fit = run_command([python, "fit.py"], timeout=240, cwd=user, PYTHONPATH="")
    return {
        "wheel_files": zipfile.ZipFile(wheel).namelist(),
        "venv": str(venv),
        "purelib": purelib,
        "linked": linked,
        "installed": installed,
        "console": [console.returncode, console.stdout, console.stderr],
        "fit": [fit.returncode, fit.stdout, fit.stderr],
    }


def installed_by_a_user(out: Path) -> Command:
    """``user_install`` in a Python of its own, beside the session's other tests."""
    return python_call(user_install, out, BACKGROUND_BUDGET)


@pytest.mark.background(make=installed_by_a_user)
def test_wheel_installs_with_pip_and_trains_a_users_module(background_jobs: BackgroundJobs) -> None:
    got = background_jobs.result(installed_by_a_user).value()
    files = got["wheel_files"]
    for shipped in (
        "lightning_dist/py.typed",
        "lightning_dist/compat.py",
        "lightning_dist/install_horovod.py",
    ):
        assert shipped in files, f"{shipped} missing from the wheel"
    assert any(f.endswith("licenses/LICENSE") for f in files)
    assert not any(f.startswith(("tests/", "benchmarks/", "examples/")) for f in files)
    assert got["purelib"] != sysconfig.get_paths()["purelib"], "a venv of its own, not the project's"
    names = set(got["installed"])
    assert {"lightning-dist", "lightning", "torchmetrics"} <= names and "horovod" not in names
    console = got["console"]
    assert console[1].startswith(f"lightning-dist {lightning_dist.__version__} (tested with"), console
    code, stdout, stderr = got["fit"]
    assert code == 0, f"{stdout[-3000:]}\n{stderr[-5000:]}"
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["package"].startswith(got["venv"]), f"imported from {result['package']}, not the venv"
    assert result["version"] == lightning_dist.__version__ and result["world_size"] == 2
    losses = result["losses"]
    assert losses[-1] < 0.5 * losses[0], f"the loss did not fall: {losses}"
    assert "torch" in got["linked"]
