"""What a user of the installed package meets: one naming scheme in Lightning's StrategyRegistry
(deprecated bare names, no overwriting another package's name), `lightning-dist strategies` and
`--version`, the tested versions in one place, and the package metadata."""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import lightning
import pytest
import tomllib
import torch
from helpers import ROOT, child_env
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import StrategyRegistry

import lightning_dist
from lightning_dist import compat
from lightning_dist.cli import main
from lightning_dist.import_hook import when_imported
from lightning_dist.strategies import DDP, Compressed, DiLoCo, Elastic, ElasticDiLoCo, Horovod, HorovodAdasum
from lightning_dist.strategies.registry import DeprecatedName, pack_names

CLASSES = (DDP, Compressed, DiLoCo, Elastic, ElasticDiLoCo, Horovod, HorovodAdasum)
OLD_NAMES = {
    "horovod": "ld_horovod",
    "horovod_adasum": "ld_horovod_adasum",
    "horovod_fp16": "ld_horovod_fp16",
    "elastic": "ld_elastic",
    "elastic_diloco": "ld_elastic_diloco",
    "diloco": "ld_diloco",
    "diloco_int8": "ld_diloco_int8",
    "compressed_int8": "ld_compressed_int8",
    "compressed_powersgd": "ld_compressed_powersgd",
}


def test_every_registered_name_starts_with_ld() -> None:
    names = pack_names(StrategyRegistry)
    current = [n for n in names if not isinstance(StrategyRegistry[n]["strategy"], DeprecatedName)]
    assert len(current) >= 25 and all(n.startswith("ld_") for n in current), current
    assert all(names[n] for n in names), "every name has a description"
    for cls in CLASSES:
        assert cls.strategy_name.startswith("ld_"), cls


@pytest.mark.parametrize(("old", "new"), sorted(OLD_NAMES.items()))
def test_old_bare_names_still_build_the_strategy_and_warn(old: str, new: str) -> None:
    StrategyRegistry[old]["strategy"].warned = False
    with pytest.warns(FutureWarning, match=rf'strategy="{old}" is deprecated .* use strategy="{new}"'):
        built = StrategyRegistry.get(old)
    expected = StrategyRegistry.get(new)
    assert type(built) is type(expected)
    for option in ("compressor", "compression", "inner_steps", "commit_every", "op"):
        assert repr(getattr(built, option, None)) == repr(getattr(expected, option, None)), option


def test_a_name_another_package_holds_is_left_to_it() -> None:
    registry = _StrategyRegistry()

    class OtherHorovod:  # what the lightning-horovod plugin registers as "horovod"
        pass

    registry.register("horovod", OtherHorovod, description="another package's Horovod")
    with pytest.warns(UserWarning, match=r"'horovod' is already registered by .*OtherHorovod"):
        Horovod.register_strategies(registry)
    assert registry["horovod"]["strategy"] is OtherHorovod, "the other package keeps its name"
    assert registry["ld_horovod"]["strategy"] is Horovod
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Horovod.register_strategies(registry)  # registering again (a reload) replaces the pack's own entries
    assert registry["ld_horovod"]["strategy"] is Horovod and registry["horovod"]["strategy"] is OtherHorovod


def test_when_imported_runs_after_the_module_and_at_once_when_it_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ld_hook_probe.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ld_hook_probe", raising=False)
    seen: list[int] = []
    when_imported("ld_hook_probe", lambda module: seen.append(module.VALUE))
    assert seen == [], "nothing runs before the module is imported"
    import ld_hook_probe  # type: ignore[import-not-found]

    assert seen == [42], "the callback ran once, after the module's code"
    when_imported("ld_hook_probe", lambda module: seen.append(-module.VALUE))
    assert seen == [42, -42] and ld_hook_probe.VALUE == 42, "an imported module: at once"


REGISTERED = """
import warnings
from lightning.pytorch.strategies import StrategyRegistry
from lightning_dist.strategies.registry import LazyStrategy, resolve
import lightning as L

entry = StrategyRegistry["ld_compressed_int8"]
assert isinstance(entry["strategy"], LazyStrategy), entry
assert "lightning_dist.strategies.compressed" not in sys.modules, "no strategy imported to register it"
assert resolve(StrategyRegistry, "compressed_int8")[0].__name__ == "Compressed"
strategy = L.Trainer(strategy="ld_compressed_int8", accelerator="cpu", devices=1, logger=False).strategy
assert type(strategy).__name__ == "Compressed" and strategy.compressor.name == "int8", strategy
assert StrategyRegistry["ld_compressed_int8"]["strategy"] is type(strategy), "the class took its place"
import lightning_dist
horovod = lightning_dist.Horovod  # imports it
assert StrategyRegistry["ld_horovod"]["strategy"] is horovod
print("versions:", sum("tested with lightning 2.6.x; this is lightning 2.9.1" in str(w.message) for w in caught))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "first",
    [
        # Lightning first (an untested version): the names at `import lightning_dist`, with the warning
        "import lightning\nlightning.__version__ = '2.9.1'\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import lightning_dist\n",
        # the pack first: the names once Lightning's strategies module is loaded, not before
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import lightning_dist\n"
        "    assert 'lightning' not in sys.modules\n"
        "    from lightning.pytorch.strategies import StrategyRegistry\n",
    ],
    ids=["lightning_first", "lightning_dist_first"],
)
def test_names_are_registered_whichever_is_imported_first(first: str) -> None:
    code = "import sys, warnings\n" + first + REGISTERED
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=child_env(), cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = 1 if "2.9.1" in first else 0
    assert proc.stdout.strip() == f"versions: {warned}", "an untested Lightning warns once, naming the range"


def test_cli_lists_the_strategies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out.splitlines()
    listed = {line.split()[0]: line.split(maxsplit=1)[1] for line in out[1:]}
    assert listed.keys() == pack_names(StrategyRegistry).keys()
    assert "Adasum" in listed["ld_horovod_adasum"] and "deprecated" in listed["horovod_adasum"]


def test_cli_version_names_the_tested_versions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"lightning-dist {lightning_dist.__version__} (tested with ")
    assert "lightning 2.6.x" in out and "torch 2.11.x, 2.13.x" in out
    installed = out.splitlines()[1]
    assert installed.startswith("installed: "), out
    assert f"torch {torch.__version__}" in installed and f"lightning {lightning.__version__}" in installed
    assert "untested" not in installed, "the suite runs on the tested versions"


def test_cli_version_marks_an_untested_installed_version(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda n: "2.9.0" if n == "lightning" else real(n))
    assert main(["--version"]) == 0
    assert "lightning 2.9.0 (untested)" in capsys.readouterr().out.splitlines()[1]


def test_untested_lightning_minor_warns_naming_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    assert compat.check_versions(warn=False) == [], "the suite runs on a tested version"
    monkeypatch.setattr(lightning, "__version__", "2.9.1")
    (problem,) = compat.check_versions(warn=False)
    assert "tested with lightning 2.6.x; this is lightning 2.9.1" in problem
    assert "pip install 'lightning==2.6.*'" in problem


def _private_lightning_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning":
            private_module = any(part.startswith("_") for part in (node.module or "").split("."))
            found += [a.name for a in node.names if private_module or a.name.startswith("_")]
    return found


def test_private_lightning_apis_come_only_from_compat() -> None:
    package = ROOT / "lightning_dist"
    outside = {
        str(p.relative_to(ROOT)): names
        for p in package.rglob("*.py")
        if p.name != "compat.py" and (names := _private_lightning_imports(p))
    }
    assert outside == {}, "import Lightning's private names through lightning_dist.compat"
    assert set(_private_lightning_imports(package / "compat.py")) <= set(compat.__all__)


def test_pins_match_the_tested_versions() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {d.split(">")[0].split("<")[0].split("=")[0]: d for d in project["dependencies"]}
    assert deps["lightning"] == f"lightning>={compat.TESTED['lightning'][0]},<2.7"
    assert deps["torch"] == f"torch>={compat.TESTED['torch'][0]}"
    assert deps["torchmetrics"] == f"torchmetrics>={compat.TESTED['torchmetrics'][0]}"
    assert project["requires-python"] == f">={compat.TESTED['python'][0]}"
    assert "horovod" not in project["optional-dependencies"], "no extra that looks as if it installs Horovod"


def test_package_metadata_and_files() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert "Typing :: Typed" in project["classifiers"] and project["urls"]
    assert (ROOT / "lightning_dist" / "py.typed").exists()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {lightning_dist.__version__}" in changelog


def test_every_private_lightning_attribute_the_pack_uses_still_exists() -> None:
    """compat.PRIVATE_ATTRIBUTES against the installed Lightning: fails when one of them is gone."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy

    strategy = DDPStrategy(accelerator=None)
    trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    module = lightning.LightningModule()
    objects = {
        "DDPStrategy": strategy,
        "ModelParallelStrategy": ModelParallelStrategy(),
        "Strategy": strategy,
        "_MultiProcessingLauncher": compat._MultiProcessingLauncher(strategy, start_method="fork"),
        "LightningModule": module,
        "Trainer": trainer,
    }
    missing = []
    for entry in compat.PRIVATE_ATTRIBUTES:
        owner, *path = entry.split(".")
        obj = objects[owner]
        for attribute in path:  # a path: each attribute on what the one before holds
            if not hasattr(obj, attribute):
                missing.append(entry)
                break
            obj = getattr(obj, attribute)
    assert missing == [], (
        f"Lightning {lightning.__version__} no longer has {missing}: update lightning_dist.compat"
    )
    assert isinstance(strategy, Strategy)
