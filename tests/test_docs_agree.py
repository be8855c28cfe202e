"""The front page, the docs and the changelog say what the code does (fast, no child process)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import ROOT

from lightning_dist import DiLoCo

README = (ROOT / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
PACKAGE_SOURCES = {
    str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "lightning_dist").rglob("*.py"))
}


def _pages() -> dict[str, str]:
    return {"README.md": README, **{f"docs/{k}": v for k, v in DOCS.items()}}


def test_changelog_has_each_heading_once_per_release() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    for release in re.split(r"^## ", text, flags=re.M)[1:]:
        headings = re.findall(r"^### (.+)$", release, flags=re.M)
        doubled = sorted({h for h in headings if headings.count(h) > 1})
        assert not doubled, f"CHANGELOG {release.splitlines()[0]}: {doubled} appear more than once"


def test_lightning_cli_commands_name_a_subcommand() -> None:
    """LightningCLI needs `fit` (or validate/test/predict) before its flags."""
    for page, text in _pages().items():
        for args in re.findall(
            r"(?:python3?|torchrun|srun) [^`\n]*?examples/lightning_cli\.py([^`\n]*)", text
        ):
            rest = args.split()
            assert rest and rest[0] in {"fit", "validate", "test", "predict"}, (
                f"{page}: `lightning_cli.py{args}`"
            )


def test_no_install_from_an_index_the_pack_is_not_on() -> None:
    """The README says the pack is not on PyPI yet: extras install from a checkout (`'.[ft]'`)."""
    assert "not on PyPI yet" in README
    for where, text in {**_pages(), **PACKAGE_SOURCES}.items():
        assert not re.search(r"pip install '?\"?lightning-dist\[", text), f"{where} installs from an index"


def test_readme_says_how_a_machine_without_a_gpu_gets_torch_for_cpu() -> None:
    assert "--index-url https://download.pytorch.org/whl/cpu" in README


def _low_comm_row(label: str) -> list[str]:
    for line in DOCS["low-communication.md"].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == label:
            return cells
    raise AssertionError(f"docs/low-communication.md has no row {label!r}")


def test_readme_diloco_row_quotes_the_defaults_figure_and_names_the_tuned_settings() -> None:
    """The DiLoCo row's loss figure for the default outer settings is the docs' row for them."""
    defaults = DiLoCo(inner_steps=32)
    assert (defaults.outer_lr, defaults.outer_momentum) == (0.7, 0.9), "update the docs' row labels"
    default_ratio = float(_low_comm_row("DiLoCo(H=32, int8, outer_lr=0.7, momentum=0.9)")[4])
    tuned_ratio = float(_low_comm_row("DiLoCo(H=32, int8)")[4])  # the table's outer_lr=1.0, momentum 0.5
    assert "DiLoCo rows use `outer_lr=1.0, outer_momentum=0.5` unless named" in DOCS["low-communication.md"]
    (row,) = [line for line in DOCS["strategies.md"].splitlines() if line.startswith("| very slow links")]
    assert f"+{(default_ratio - 1) * 100:.1f}% with the default" in row, row
    assert f"+{(tuned_ratio - 1) * 100:.1f}% with `outer_lr=1.0, outer_momentum=0.5`" in row, row


def test_readme_and_gpu_checks_agree_on_what_ran_on_a_gpu() -> None:
    """docs/gpu-checks.md records a GPU run with a timed DDP() step: the README may not deny it, and
    the notebooks' GPU failure is described the same way on both pages."""
    assert "ms/step" in DOCS["gpu-checks.md"]
    assert "No figure here was measured on a GPU" not in README
    assert "under investigation" not in README and "not found yet" not in DOCS["gpu-checks.md"]
    for text in (README, DOCS["gpu-checks.md"]):
        assert "fork_rng" in text and "not been re-run on a GPU" in text


@pytest.mark.parametrize("stem", ["00_which_strategy", "02_horovod_adasum"])
def test_readme_notebook_rows_say_what_the_notebook_shows_and_needs(stem: str) -> None:
    (row,) = [line for line in README.splitlines() if line.startswith(f"| [{stem}]")]
    cells = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())["cells"]
    code = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    if "step time" in row or "every strategy" in row:
        assert "time.perf_counter" in code and "DiLoCo" in code, (
            f"{stem} shows no step time / not every strategy"
        )
    if "this notebook needs Horovod" in code:
        assert "MPI" in row and "lightning-dist install-horovod" in row, row


def test_notebook_00_says_which_strategies_it_trains() -> None:
    cells = json.loads((ROOT / "notebooks" / "00_which_strategy.ipynb").read_text())["cells"]
    title = "".join(cells[0]["source"]).splitlines()[0]
    code = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    if "every strategy" in title:
        assert all(name in code for name in ("DiLoCo", "Sharded", "FaultTolerant")), title


def test_readme_notebooks_section_names_where_figures_go() -> None:
    assert "LD_FIGURES_DIR" in README.split("## Notebooks", 1)[1].split("\n## ", 1)[0]


def test_docs_exist_for_every_link_in_the_readme() -> None:
    for target in re.findall(r"\]\(((?:docs|notebooks|examples|benchmarks)/[^)#]+)", README):
        assert Path(ROOT, target).exists(), target
