"""`lightning-dist install-horovod` (lightning_dist/install_horovod.py).

The fast tests start no process: torch and horovod detection, ``shutil.which``, pip calls and the pip
build are replaced by fakes, so they check the decisions (tool check, plan, cache reuse, environment,
progress lines). The slow ones run the compiler wrapper and the shell script for real.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import helpers
import pytest

from lightning_dist import install_horovod as ih

CPU_TORCH = ih.TorchInfo(version="2.13.0+cpu", cuda_build=False, cuda_available=False, capability=None)
GPU_TORCH = ih.TorchInfo(version="2.11.0+cu130", cuda_build=True, cuda_available=True, capability=(9, 0))
ALL_TOOLS = {
    "mpicc": "/usr/bin/mpicc",
    "mpirun": "/usr/bin/mpirun",
    "g++": "/usr/bin/g++",
    "cmake": "/usr/bin/cmake",
}
WHEEL = "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
CPU_KEY = "horovod-0.28.1-torch-2.13.0_cpu-cuda0"
LINE = re.compile(r"^install-horovod \[ *\d+ s\] ")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lightning-dist")
    ih.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["install-horovod", *argv])


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> SimpleNamespace:
    """A machine as the module sees it; every pip call and the build are recorded, not run."""
    for name in (
        "CXX",
        "HOROVOD_VERSION",
        "HOROVOD_SDIST",
        "HOROVOD_NCCL_HOME",
        "HOROVOD_BUILD_CUDA_CC_LIST",
        "LIGHTNING_DIST_WHEEL_CACHE",
    ):
        monkeypatch.delenv(name, raising=False)
    state = SimpleNamespace(
        torch=CPU_TORCH,
        installed=None,
        missing_deps=[],
        tools=dict(ALL_TOOLS),
        nccl_pkg=None,
        checked=[],
        builds=[],
        build_rc=0,
        cache=tmp_path / "cache",
    )
    monkeypatch.setattr(ih, "torch_info", lambda: state.torch)
    monkeypatch.setattr(ih, "installed_horovod", lambda: state.installed)
    monkeypatch.setattr(ih, "missing_build_deps", lambda: list(state.missing_deps))
    monkeypatch.setattr(ih, "nccl_package_dir", lambda: state.nccl_pkg)
    monkeypatch.setattr(ih.shutil, "which", lambda name, path=None: state.tools.get(name))
    monkeypatch.setattr(ih, "_check_call", lambda cmd: state.checked.append(list(cmd)))

    def fake_build(
        cmd: list[str], env: dict[str, str], log: Path, progress: Any, what: str, **kw: Any
    ) -> int:
        wrapper = Path(env["CXX"])
        state.builds.append(
            {
                "cmd": list(cmd),
                "env": dict(env),
                "wrapper": wrapper.read_text(),
                "exe": os.access(wrapper, os.X_OK),
            }
        )
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("[ 99%] Linking CXX shared library\nerror: the linker said no\n")
        if state.build_rc == 0:
            out = Path(cmd[cmd.index("-w") + 1])
            out.mkdir(parents=True)
            (out / WHEEL).write_text("new wheel")
        return state.build_rc

    monkeypatch.setattr(ih, "build_with_heartbeat", fake_build)
    return state


def cached_wheel(state: SimpleNamespace, key: str = CPU_KEY, content: str = "cached wheel") -> Path:
    wheel = state.cache / key / WHEEL
    wheel.parent.mkdir(parents=True)
    wheel.write_text(content)
    return wheel


# -- progress lines -------------------------------------------------------------------------------
def test_progress_line_format() -> None:
    clock = iter([100.0, 112.4, 1334.9])
    progress = ih.Progress(clock=lambda: next(clock))
    assert (
        progress.line("building horovod 0.28.1 for torch 2.13.0 (cuda: no) ...")
        == "install-horovod [  12 s] building horovod 0.28.1 for torch 2.13.0 (cuda: no) ..."
    )
    assert progress.line("done") == "install-horovod [1234 s] done"


class _SlowBuild:
    """A pip build that is still running for ``waits`` waits, then exits with 0."""

    def __init__(self, clock: list[float], waits: int, log: Path) -> None:
        self.clock, self.waits, self.log = clock, waits, log
        self.timeouts: list[Optional[float]] = []
        self.killed = False

    def __call__(self, cmd: list[str], **kwargs: Any) -> _SlowBuild:
        self.cmd, self.kwargs = cmd, kwargs
        return self

    def wait(self, timeout: Optional[float] = None) -> int:
        self.timeouts.append(timeout)
        if len(self.timeouts) <= self.waits:
            self.clock[0] += timeout or 0.0
            with self.log.open("a") as f:
                f.write(f"[ {len(self.timeouts) * 20}%] Building CXX object horovod/common/x.cc.o\n")
            raise subprocess.TimeoutExpired(self.cmd, timeout or 0.0)
        return 0

    def kill(self) -> None:
        self.killed = True


def test_heartbeat_every_interval_while_pip_builds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ih.HEARTBEAT_S <= 30
    clock = [0.0]
    log = tmp_path / "logs" / "build.log"
    proc = _SlowBuild(clock, waits=3, log=log)
    progress = ih.Progress(clock=lambda: clock[0])
    rc = ih.build_with_heartbeat(["pip", "wheel"], {}, log, progress, "building horovod 0.28.1", popen=proc)
    assert rc == 0
    assert proc.timeouts == [ih.HEARTBEAT_S] * 4
    assert proc.kwargs["stdout"].name == str(log)  # the build's output goes to the log
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    interval = int(ih.HEARTBEAT_S)
    for i, line in enumerate(lines, 1):
        assert line.startswith(f"install-horovod [{i * interval:4d} s] still building horovod 0.28.1 ")
        assert f"({i * interval} s so far); last output: [ {i * 20}%] Building CXX object" in line


def test_heartbeat_kills_the_build_on_interrupt(tmp_path: Path) -> None:
    proc = _SlowBuild([0.0], waits=0, log=tmp_path / "build.log")

    def interrupted(timeout: Optional[float] = None) -> int:
        if not proc.killed:
            raise KeyboardInterrupt
        return -9

    proc.wait = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        ih.build_with_heartbeat(["pip"], {}, tmp_path / "build.log", ih.Progress(), "building", popen=proc)
    assert proc.killed


# -- missing build tools --------------------------------------------------------------------------
def test_missing_tools_is_one_error_naming_the_packages(
    fake: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    for tool in ("mpicc", "mpirun", "cmake"):
        fake.tools.pop(tool)
    fake.missing_deps = ["cffi"]
    assert ih.run(parse("--cache-dir", str(fake.cache))) == 2
    err = capsys.readouterr().err
    assert "mpicc, mpirun, cmake not found" in err
    assert "apt-get install -y libopenmpi-dev openmpi-bin g++ cmake" in err
    assert "conda install -c conda-forge openmpi cxx-compiler cmake" in err
    assert "HorovodAdasum needs Horovod's MPI controller" in err
    assert "add --without-mpi to build with Gloo only" in err
    assert err.count("install-horovod:") == 1 and "Traceback" not in err
    assert fake.checked == [] and fake.builds == []  # checked before anything is installed


def test_without_mpi_needs_no_mpi_and_builds_gloo_only(fake: SimpleNamespace) -> None:
    fake.tools.pop("mpicc")
    fake.tools.pop("mpirun")
    assert ih.run(parse("--cache-dir", str(fake.cache), "--without-mpi")) == 0
    (build,) = fake.builds
    assert build["env"]["HOROVOD_WITHOUT_MPI"] == "1" and "HOROVOD_WITH_MPI" not in build["env"]
    assert build["env"]["HOROVOD_WITH_GLOO"] == "1"
    assert (fake.cache / f"{CPU_KEY}-nompi" / WHEEL).exists()  # not mistaken for an MPI build later


def test_missing_compiler_errors_even_without_mpi(
    fake: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.tools.pop("g++")
    assert ih.run(parse("--cache-dir", str(fake.cache), "--without-mpi")) == 2
    err = capsys.readouterr().err
    assert "g++ not found" in err and "apt-get install -y libopenmpi-dev openmpi-bin g++ cmake" in err
    assert fake.builds == []


# -- dry run --------------------------------------------------------------------------------------
def test_dry_run_prints_plan_and_environment_and_builds_nothing(
    fake: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.missing_deps = ["pyyaml"]
    assert ih.run(parse("--cache-dir", str(fake.cache), "--jobs", "3", "--dry-run")) == 0
    out = capsys.readouterr().out
    assert "dry run: nothing is built or installed" in out
    assert "plan:" in out and "build environment" in out
    for var in (
        "CXX=<temp dir>/cxx",
        "HOROVOD_WITH_PYTORCH=1",
        "HOROVOD_WITHOUT_TENSORFLOW=1",
        "HOROVOD_WITHOUT_MXNET=1",
        "HOROVOD_WITH_GLOO=1",
        "HOROVOD_WITH_MPI=1",
        "CMAKE_POLICY_VERSION_MINIMUM=3.5",
        "MAKEFLAGS=-j3",
    ):
        assert f"  {var}\n" in out, var
    assert "HOROVOD_GPU_OPERATIONS" not in out
    assert str(fake.cache / CPU_KEY) in out
    assert f"{sys.executable} -m pip install -q pyyaml" in out
    assert "-m pip wheel -v --no-build-isolation --no-deps --no-binary horovod horovod==0.28.1" in out
    assert "/usr/bin/g++ with -std=c++11/14 -> -std=c++17" in out
    assert fake.checked == [] and fake.builds == [] and not fake.cache.exists()


def test_dry_run_gpu_build_extras(fake: SimpleNamespace, capsys: pytest.CaptureFixture[str]) -> None:
    fake.torch = GPU_TORCH
    fake.nccl_pkg = "/venv/site-packages/nvidia/nccl"
    assert ih.run(parse("--cache-dir", str(fake.cache), "--dry-run")) == 0
    out = capsys.readouterr().out
    for var in (
        "HOROVOD_GPU_OPERATIONS=NCCL",
        "HOROVOD_BUILD_CUDA_CC_LIST=90",
        "HOROVOD_NCCL_HOME=<temp dir>/nccl",
        "CMAKE_POLICY_VERSION_MINIMUM=3.5",
    ):
        assert f"  {var}\n" in out, var
    assert "-include string stdexcept cstdint" in out
    assert "horovod-0.28.1-torch-2.11.0_cu130-cuda1" in out
    capsys.readouterr()
    assert ih.run(parse("--cache-dir", str(fake.cache), "--dry-run", "--cuda", "off")) == 0
    out = capsys.readouterr().out
    assert "HOROVOD_GPU_OPERATIONS" not in out and "horovod-0.28.1-torch-2.11.0_cu130-cuda0" in out


def test_dry_run_with_a_missing_tool_says_so(
    fake: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.tools.pop("cmake")
    assert ih.run(parse("--cache-dir", str(fake.cache), "--dry-run")) == 2
    captured = capsys.readouterr()
    assert "cmake        NOT FOUND" in captured.out
    assert "apt-get install -y libopenmpi-dev openmpi-bin g++ cmake" in captured.err


def test_cuda_on_needs_a_cuda_torch(fake: SimpleNamespace, capsys: pytest.CaptureFixture[str]) -> None:
    assert ih.run(parse("--cache-dir", str(fake.cache), "--cuda", "on")) == 2
    assert "--cuda on needs a CUDA build of torch; this torch is 2.13.0+cpu" in capsys.readouterr().err


# -- cache and fast paths -------------------------------------------------------------------------
def test_cached_wheel_is_reused_without_tools_or_build(
    fake: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = cached_wheel(fake)
    fake.tools.clear()  # reinstalling a cached wheel needs no compiler, cmake or MPI
    assert ih.run(parse("--cache-dir", str(fake.cache))) == 0
    assert fake.builds == []
    assert fake.checked == [
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
        [sys.executable, "-c", "import horovod.torch"],
    ]
    assert f"reusing cached wheel {wheel}" in capsys.readouterr().out


def test_already_installed_is_a_no_op(fake: SimpleNamespace, capsys: pytest.CaptureFixture[str]) -> None:
    fake.installed = "0.28.1"
    fake.missing_deps = ["cffi"]
    assert ih.run(parse("--cache-dir", str(fake.cache))) == 0
    assert fake.checked == [] and fake.builds == []
    (line,) = capsys.readouterr().out.splitlines()[1:]
    assert LINE.match(line) and "horovod 0.28.1 already importable with torch 2.13.0+cpu" in line


def test_other_installed_version_is_replaced(fake: SimpleNamespace) -> None:
    fake.installed = "0.27.0"
    assert ih.run(parse("--cache-dir", str(fake.cache))) == 0
    assert len(fake.builds) == 1


def test_force_rebuilds_and_replaces_the_cached_wheel(fake: SimpleNamespace) -> None:
    fake.installed = "0.28.1"
    old = cached_wheel(fake, content="old wheel")
    assert ih.run(parse("--cache-dir", str(fake.cache), "--force")) == 0
    assert len(fake.builds) == 1
    assert old.read_text() == "new wheel"


def test_build_caches_the_wheel_and_installs_it(
    fake: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.missing_deps = ["pyyaml", "cffi"]
    assert ih.run(parse("--cache-dir", str(fake.cache), "--jobs", "5")) == 0
    wheel = fake.cache / CPU_KEY / WHEEL
    assert wheel.read_text() == "new wheel"
    assert fake.checked == [
        [sys.executable, "-m", "pip", "install", "-q", "pyyaml", "cffi"],
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
        [sys.executable, "-c", "import horovod.torch"],
    ]
    (build,) = fake.builds
    assert build["cmd"][:4] == [sys.executable, "-m", "pip", "wheel"]
    assert "--no-build-isolation" in build["cmd"] and "horovod==0.28.1" in build["cmd"]
    env = build["env"]
    assert env["HOROVOD_WITH_PYTORCH"] == env["HOROVOD_WITH_MPI"] == env["HOROVOD_WITH_GLOO"] == "1"
    assert env["MAKEFLAGS"] == "-j5" and env["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5"
    assert build["exe"] and "-std=c++17" in build["wrapper"] and 'exec /usr/bin/g++ "$@"' in build["wrapper"]
    assert "-include" not in build["wrapper"]  # CPU build: no forced includes
    out = capsys.readouterr().out.splitlines()
    assert all(LINE.match(line) for line in out)
    assert any(
        re.match(
            r"install-horovod \[ *\d+ s\] building horovod 0\.28\.1 for torch 2\.13\.0\+cpu \(cuda: no", line
        )
        for line in out
    )


def test_sdist_and_version_from_the_environment(
    fake: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOROVOD_SDIST", "/src/horovod-0.28.1.tar.gz")
    monkeypatch.setenv("LIGHTNING_DIST_WHEEL_CACHE", str(fake.cache))
    assert ih.run(parse()) == 0
    assert fake.builds[0]["cmd"][-3] == "/src/horovod-0.28.1.tar.gz"
    assert (fake.cache / CPU_KEY / WHEEL).exists()


def test_failed_build_shows_the_log_tail(fake: SimpleNamespace, capsys: pytest.CaptureFixture[str]) -> None:
    fake.build_rc = 1
    assert ih.run(parse("--cache-dir", str(fake.cache))) == 1
    err = capsys.readouterr().err
    assert "building horovod failed (pip wheel exit 1)" in err and "error: the linker said no" in err
    assert fake.checked == []  # nothing installed
    assert not list(fake.cache.glob(f"{CPU_KEY}/*.whl"))  # nothing cached


def test_gpu_build_makes_nccl_home_and_wrapper_includes(
    fake: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.torch = GPU_TORCH
    nccl = tmp_path / "nvidia" / "nccl"
    (nccl / "include").mkdir(parents=True)
    (nccl / "lib").mkdir()
    (nccl / "lib" / "libnccl.so.2").write_text("")
    fake.nccl_pkg = str(nccl)
    seen: dict[str, Any] = {}
    real_prepare = ih.prepare_workdir

    def prepare(plan: ih.Plan, work: Path) -> None:
        real_prepare(plan, work)
        seen["lib"] = os.path.realpath(work / "nccl" / "lib" / "libnccl.so")
        seen["include"] = os.path.realpath(work / "nccl" / "include")

    monkeypatch.setattr(ih, "prepare_workdir", prepare)
    assert ih.run(parse("--cache-dir", str(fake.cache))) == 0
    env = fake.builds[0]["env"]
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL" and env["HOROVOD_BUILD_CUDA_CC_LIST"] == "90"
    assert seen == {"lib": str(nccl / "lib" / "libnccl.so.2"), "include": str(nccl / "include")}
    assert "-include string -include stdexcept -include cstdint" in fake.builds[0]["wrapper"]


def test_missing_torch_says_install_it_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ih.InstallError, match=r"install torch first") as info:
        ih.torch_info()
    assert info.value.code == 1


# -- options and entry points ---------------------------------------------------------------------
def test_options_have_help_and_defaults(fake: SimpleNamespace) -> None:
    parser = argparse.ArgumentParser()
    sub = ih.add_parser(parser.add_subparsers())
    options = {a.dest: a for a in sub._actions if a.dest != "help"}
    assert set(options) >= {"cuda", "jobs", "cache_dir", "dry_run", "force", "without_mpi"}
    assert all(a.help and "default" in a.help for a in options.values())
    args = parse()
    assert (args.cuda, args.dry_run, args.force, args.without_mpi) == ("auto", False, False, False)
    assert args.jobs >= 1 and args.horovod_version == "0.28.1" and args.cxx == "g++"
    assert args.cache_dir == ih.default_cache_dir()
    with pytest.raises(SystemExit):
        parse("--jobs", "0")
    with pytest.raises(SystemExit):
        parse("--cuda", "maybe")


def test_cache_dir_default_follows_the_script(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LIGHTNING_DIST_WHEEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ih.default_cache_dir() == tmp_path / "lightning_dist" / "wheels"
    monkeypatch.setenv("LIGHTNING_DIST_WHEEL_CACHE", str(tmp_path / "w"))
    assert ih.default_cache_dir() == tmp_path / "w"


def test_module_main_runs_the_subcommand(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(ih, "run", lambda args: seen.append(args) or 7)
    assert ih.main(["--cuda", "off", "--jobs", "3", "--dry-run"]) == 7
    (args,) = seen
    assert (args.command, args.cuda, args.jobs, args.dry_run) == ("install-horovod", "off", 3, True)


def test_shell_script_is_a_thin_wrapper() -> None:
    script = (helpers.ROOT / "scripts" / "install-horovod.sh").read_text()
    assert 'exec "${PYTHON:-python3}" -m lightning_dist.install_horovod "$@"' in script
    assert "pip wheel" not in script and "c++17" not in script


def test_cxx_wrapper_text() -> None:
    text = ih.cxx_wrapper("/opt/my g++", ("string",))
    assert text.startswith("#!/bin/sh\n")
    assert '-std=c++11|-std=c++14|-std=gnu++11|-std=gnu++14) set -- "$@" -std=c++17' in text
    assert text.rstrip().endswith("""exec '/opt/my g++' -include string "$@\"""")


@pytest.mark.slow
def test_cxx_wrapper_rewrites_the_standard(tmp_path: Path) -> None:
    echo = tmp_path / "echo-cxx"
    echo.write_text('#!/bin/sh\nfor a do printf "<%s>" "$a"; done\n')
    echo.chmod(0o755)
    wrapper = tmp_path / "cxx"
    wrapper.write_text(ih.cxx_wrapper(str(echo), ("string", "cstdint")))
    wrapper.chmod(0o755)
    out = subprocess.run(
        [str(wrapper), "-std=c++14", "-O2", "-std=gnu++11", "a b", "-std=c++20"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    assert out == "<-include><string><-include><cstdint><-std=c++17><-O2><-std=c++17><a b><-std=c++20>"


@pytest.mark.slow
def test_shell_script_dry_run(tmp_path: Path) -> None:
    result = helpers.run_command(
        [str(helpers.ROOT / "scripts" / "install-horovod.sh"), "--dry-run", "--force"],
        timeout=120,
        PYTHON=sys.executable,
        LIGHTNING_DIST_WHEEL_CACHE=str(tmp_path),
    )
    assert result.returncode in (0, 2), result.stderr  # 2: a build tool is missing on this machine
    assert "plan:" in result.stdout and "HOROVOD_WITH_PYTORCH=1" in result.stdout
    assert str(tmp_path) in result.stdout and not list(tmp_path.iterdir())
