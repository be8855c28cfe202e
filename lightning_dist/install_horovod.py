"""``lightning-dist install-horovod``: build and install Horovod 0.28.1 against the installed torch.

Horovod's last release compiles with ``-std=c++14``, which the headers of torch >= 2.1 reject (they need
C++17), so ``pip install horovod`` fails. This builds the PyPI sdist with the current interpreter's pip
through a compiler wrapper, written to a temporary folder, that rewrites ``-std=c++11``/``-std=c++14``
to ``-std=c++17`` (setting CMAKE_CXX_STANDARD or CXXFLAGS does not help: Horovod's CMake files set the
standard themselves). With CUDA it also builds Horovod's NCCL operations. The built wheel is cached,
keyed by the Horovod version, the torch version, CUDA and MPI, so a second run only reinstalls it; when
``horovod.torch`` already imports at the wanted version the command does nothing.

Also ``python -m lightning_dist.install_horovod [options]`` and ``scripts/install-horovod.sh``.

Environment it reads: HOROVOD_VERSION, HOROVOD_SDIST (build from a local sdist, offline),
LIGHTNING_DIST_WHEEL_CACHE (else ``${XDG_CACHE_HOME:-~/.cache}/lightning_dist/wheels``), CXX,
HOROVOD_BUILD_CUDA_CC_LIST, HOROVOD_NCCL_HOME.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional

HOROVOD_VERSION = "0.28.1"
PREFIX = "install-horovod"
HEARTBEAT_S = 20.0
"""Seconds between two "still building" lines while pip builds (the build prints nothing for minutes)."""

BUILD_DEPS = {
    "numpy": "numpy",
    "packaging": "packaging",
    "psutil": "psutil",
    "yaml": "pyyaml",
    "cloudpickle": "cloudpickle",
    "cffi": "cffi",
    "pycparser": "pycparser",
}
"""Horovod's build and run dependencies, module -> pip name (the wheel is installed with --no-deps)."""

APT_COMMAND = "apt-get install -y libopenmpi-dev openmpi-bin g++ cmake"
CONDA_COMMAND = "conda install -c conda-forge openmpi cxx-compiler cmake"
STD_REWRITES = ("-std=c++11", "-std=c++14", "-std=gnu++11", "-std=gnu++14")
CUDA_EXTRA_INCLUDES = ("string", "stdexcept", "cstdint")
"""Headers the wrapper force-includes on CUDA builds: newer g++ no longer pulls them in transitively."""

TEMP_PLACEHOLDER = Path("<temp dir>")
CUDA_CHOICES = ("auto", "on", "off")


class InstallError(Exception):
    """A reason to stop, said to the user without a traceback; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class Progress:
    """Prints ``install-horovod [  12 s] message`` lines, the seconds counted from its creation."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, stream: Optional[IO[str]] = None) -> None:
        self._clock = clock
        self._stream = stream
        self.start = clock()

    def elapsed(self) -> float:
        return self._clock() - self.start

    def line(self, message: str) -> str:
        return f"{PREFIX} [{int(self.elapsed()):4d} s] {message}"

    def __call__(self, message: str) -> None:
        print(self.line(message), file=self._stream or sys.stdout, flush=True)


@dataclass(frozen=True)
class TorchInfo:
    version: str
    cuda_build: bool
    """torch was built with CUDA (``torch.version.cuda`` is set)."""
    cuda_available: bool
    capability: Optional[tuple[int, int]]
    """Compute capability of device 0 when a GPU is visible."""

    @property
    def tag(self) -> str:
        return self.version.replace("+", "_")


def torch_info() -> TorchInfo:
    """The installed torch, imported in this interpreter (the one Horovod is built for)."""
    try:
        import torch
    except Exception as exc:
        raise InstallError(
            f"torch is not importable by {sys.executable} ({exc}); install torch first "
            "(pip install torch==2.13.0)",
            code=1,
        ) from exc
    available = bool(torch.cuda.is_available())
    capability = tuple(torch.cuda.get_device_capability(0)) if available else None
    return TorchInfo(
        version=str(torch.__version__),
        cuda_build=torch.version.cuda is not None,
        cuda_available=available,
        capability=(int(capability[0]), int(capability[1])) if capability else None,
    )


def installed_horovod() -> Optional[str]:
    """Horovod's version when ``horovod.torch`` imports here (its extension loads against this torch)."""
    try:
        import horovod
        import horovod.torch  # noqa: F401
    except Exception:
        return None
    return str(getattr(horovod, "__version__", "unknown"))


def missing_build_deps() -> list[str]:
    return [pip for module, pip in BUILD_DEPS.items() if importlib.util.find_spec(module) is None]


def find_tool(name: str) -> Optional[str]:
    """``name`` on PATH, else next to this interpreter (e.g. cmake from ``pip install cmake`` in a venv)."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


def nccl_package_dir() -> Optional[str]:
    """The folder of the pip ``nvidia-nccl`` wheel (``nvidia/nccl``), if installed."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(list(spec.submodule_search_locations)[0])


def default_cache_dir() -> Path:
    if os.environ.get("LIGHTNING_DIST_WHEEL_CACHE"):
        return Path(os.environ["LIGHTNING_DIST_WHEEL_CACHE"])
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "lightning_dist" / "wheels"


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class Plan:
    """Everything a run decides before it changes anything; ``--dry-run`` prints it."""

    python: str
    horovod_version: str
    source: str
    """What ``pip wheel`` builds: ``horovod==VERSION`` from PyPI, or a local sdist."""
    torch: TorchInfo
    cuda: bool
    cuda_cc_list: Optional[str]
    with_mpi: bool
    jobs: int
    cache_dir: Path
    force: bool
    installed: Optional[str]
    missing_deps: list[str]
    tools: dict[str, Optional[str]]
    """Each tool the build needs -> its path, or None when missing."""
    cxx: str
    nccl_home: Optional[str] = None
    """HOROVOD_NCCL_HOME from the environment; when None on a CUDA build, one is made from ``nccl_pkg``."""
    nccl_pkg: Optional[str] = None
    base_path: str = field(default_factory=lambda: os.environ.get("PATH", ""))

    @property
    def key(self) -> str:
        key = f"horovod-{self.horovod_version}-torch-{self.torch.tag}-cuda{int(self.cuda)}"
        return key if self.with_mpi else key + "-nompi"

    @property
    def wheel_dir(self) -> Path:
        return self.cache_dir / self.key

    @property
    def log_path(self) -> Path:
        return self.cache_dir / "logs" / f"{self.key}.log"

    @property
    def up_to_date(self) -> bool:
        return not self.force and self.installed == self.horovod_version

    @property
    def cached_wheel(self) -> Optional[Path]:
        if self.force:
            return None
        wheels = sorted(self.wheel_dir.glob("horovod-*.whl"))
        return wheels[-1] if wheels else None

    @property
    def missing_tools(self) -> list[str]:
        return [name for name, path in self.tools.items() if path is None]

    def build_env(self, work: Path) -> dict[str, str]:
        """The variables the build adds to the environment (``work``: the temporary folder)."""
        env = {
            "CXX": str(work / "cxx"),
            "HOROVOD_WITH_PYTORCH": "1",
            "HOROVOD_WITHOUT_TENSORFLOW": "1",
            "HOROVOD_WITHOUT_MXNET": "1",
            "HOROVOD_WITH_GLOO": "1",
            ("HOROVOD_WITH_MPI" if self.with_mpi else "HOROVOD_WITHOUT_MPI"): "1",
            "CMAKE_POLICY_VERSION_MINIMUM": "3.5",
            "MAKEFLAGS": f"-j{self.jobs}",
        }
        if self.cuda:
            env["HOROVOD_GPU_OPERATIONS"] = "NCCL"
            if self.cuda_cc_list:
                env["HOROVOD_BUILD_CUDA_CC_LIST"] = self.cuda_cc_list
            if self.nccl_home:
                env["HOROVOD_NCCL_HOME"] = self.nccl_home
            elif self.nccl_pkg:
                env["HOROVOD_NCCL_HOME"] = str(work / "nccl")
        cmake = self.tools.get("cmake")
        if cmake and shutil.which("cmake", path=self.base_path) is None:
            # cmake found next to the interpreter only: Horovod's setup.py runs plain `cmake`
            env["PATH"] = os.pathsep.join(p for p in (str(Path(cmake).parent), self.base_path) if p)
        return env

    def wheel_command(self, out: Path) -> list[str]:
        return [
            self.python,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-build-isolation",
            "--no-deps",
            "--no-binary",
            "horovod",
            self.source,
            "-w",
            str(out),
        ]

    def deps_command(self) -> list[str]:
        return [self.python, "-m", "pip", "install", "-q", *self.missing_deps]

    def install_command(self, wheel: Path) -> list[str]:
        return [self.python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)]

    def verify_command(self) -> list[str]:
        return [self.python, "-c", "import horovod.torch"]


def cxx_wrapper(real_cxx: str, extra_includes: Sequence[str] = ()) -> str:
    """A POSIX sh compiler that runs ``real_cxx`` with -std=c++11/14 (and gnu++) rewritten to c++17."""
    pre = " ".join(f"-include {shlex.quote(h)}" for h in extra_includes)
    return "\n".join(
        [
            "#!/bin/sh",
            f"# written by lightning_dist.install_horovod: {real_cxx} with {'/'.join(STD_REWRITES)} -> -std=c++17",
            "for a do",
            "  shift",
            '  case "$a" in',
            f'    {"|".join(STD_REWRITES)}) set -- "$@" -std=c++17 ;;',
            '    *) set -- "$@" "$a" ;;',
            "  esac",
            "done",
            f'exec {shlex.quote(real_cxx)} {pre + " " if pre else ""}"$@"',
            "",
        ]
    )


def prepare_workdir(plan: Plan, work: Path) -> None:
    """Write the compiler wrapper (and, on CUDA, a HOROVOD_NCCL_HOME over the pip NCCL) into ``work``."""
    real_cxx = plan.tools[plan.cxx]
    assert real_cxx is not None
    wrapper = work / "cxx"
    wrapper.write_text(cxx_wrapper(real_cxx, CUDA_EXTRA_INCLUDES if plan.cuda else ()))
    wrapper.chmod(0o755)
    if plan.cuda and not plan.nccl_home and plan.nccl_pkg:
        nccl = work / "nccl"
        (nccl / "lib").mkdir(parents=True)
        (nccl / "include").symlink_to(Path(plan.nccl_pkg) / "include")
        (nccl / "lib" / "libnccl.so").symlink_to(Path(plan.nccl_pkg) / "lib" / "libnccl.so.2")


def tools_error(plan: Plan) -> str:
    """The one message for missing build tools: what is missing, how to install it, and why."""
    missing = plan.missing_tools
    lines = [
        f"cannot build horovod {plan.horovod_version}: {', '.join(missing)} not found.",
        f"  Debian/Ubuntu: {APT_COMMAND}",
        f"  conda:         {CONDA_COMMAND}",
        f"A C++ compiler ({plan.cxx}; CXX picks another) and cmake build Horovod's C++ core.",
        "MPI (mpicc, mpirun) only matters for Adasum: HorovodAdasum needs Horovod's MPI controller "
        "(under Gloo, hvd.Adasum raises 'No Adasum operation enabled').",
    ]
    if plan.with_mpi:
        lines.append(
            "Without MPI, add --without-mpi to build with Gloo only: Horovod() and Horovod elastic work, "
            "HorovodAdasum does not (DDP(reduce_op='adasum') gives Adasum without Horovod)."
        )
    return "\n".join(lines)


def make_plan(args: argparse.Namespace) -> Plan:
    info = torch_info()
    if args.cuda == "auto":
        cuda = info.cuda_available
    elif args.cuda == "on":
        if not info.cuda_build:
            raise InstallError(f"--cuda on needs a CUDA build of torch; this torch is {info.version}")
        cuda = True
    else:
        cuda = False
    cc_list = None
    if cuda:
        cc_list = args.cuda_cc_list or (
            f"{info.capability[0]}{info.capability[1]}" if info.capability else None
        )
        if cc_list is None:
            raise InstallError(
                "--cuda on without a visible GPU: give the compute capabilities to build for, "
                "e.g. --cuda-cc-list 90 (or HOROVOD_BUILD_CUDA_CC_LIST=90)"
            )
    with_mpi = not args.without_mpi
    tools: dict[str, Optional[str]] = {}
    if with_mpi:
        tools["mpicc"] = find_tool("mpicc")
        tools["mpirun"] = find_tool("mpirun")
    tools[args.cxx] = find_tool(args.cxx)
    tools["cmake"] = find_tool("cmake")
    nccl_home = os.environ.get("HOROVOD_NCCL_HOME") or None
    return Plan(
        python=sys.executable,
        horovod_version=args.horovod_version,
        source=args.sdist or f"horovod=={args.horovod_version}",
        torch=info,
        cuda=cuda,
        cuda_cc_list=cc_list,
        with_mpi=with_mpi,
        jobs=args.jobs,
        cache_dir=Path(args.cache_dir).expanduser(),
        force=args.force,
        installed=installed_horovod(),
        missing_deps=missing_build_deps(),
        tools=tools,
        cxx=args.cxx,
        nccl_home=nccl_home,
        nccl_pkg=nccl_package_dir() if cuda and not nccl_home else None,
    )


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _cmdline(cmd: Sequence[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


def print_plan(plan: Plan, out: Optional[IO[str]] = None) -> None:
    """The plan and the build environment, as ``--dry-run`` shows them."""
    stream = out or sys.stdout

    def say(text: str = "") -> None:
        print(text, file=stream)

    info = plan.torch
    say("plan:")
    say(f"  python       {plan.python}")
    say(
        f"  torch        {info.version} (cuda build: {_yes_no(info.cuda_build)}, GPU visible: "
        f"{_yes_no(info.cuda_available)})"
    )
    say(
        f"  build        horovod {plan.horovod_version} from {plan.source}, cuda: {_yes_no(plan.cuda)}"
        f"{f' (cc {plan.cuda_cc_list})' if plan.cuda else ''}, MPI: {_yes_no(plan.with_mpi)}, Gloo: yes, "
        f"{plan.jobs} jobs"
    )
    if plan.up_to_date:
        say(
            f"  installed    horovod {plan.installed} imports with this torch: a real run stops here "
            "(--force rebuilds)"
        )
    else:
        now = f"horovod {plan.installed}" if plan.installed else "no importable horovod.torch"
        say(f"  installed    {now}{' (--force: rebuild anyway)' if plan.force else ''}")
    say(
        f"  build deps   {'pip install ' + ' '.join(plan.missing_deps) if plan.missing_deps else 'all present'}"
    )
    say(f"  wheel cache  {plan.wheel_dir}")
    cached = plan.cached_wheel
    if cached is not None:
        say(f"  wheel        reuse {cached.name} (no build)")
    else:
        say(f"  wheel        build (none cached{', --force' if plan.force else ''}); log: {plan.log_path}")
    for name, path in plan.tools.items():
        say(f"  {name:<12} {path or 'NOT FOUND'}")
    if plan.tools.get(plan.cxx):
        includes = " + -include " + " ".join(CUDA_EXTRA_INCLUDES) if plan.cuda else ""
        say(
            f"  compiler     {TEMP_PLACEHOLDER / 'cxx'}: {plan.tools[plan.cxx]} with -std=c++11/14 -> "
            f"-std=c++17{includes}"
        )
    if plan.cuda and not plan.nccl_home:
        say(f"  nccl         {plan.nccl_pkg or 'no pip nvidia-nccl: Horovod looks for a system NCCL'}")
    say("build environment (added to the current one):")
    for name, value in plan.build_env(TEMP_PLACEHOLDER).items():
        say(f"  {name}={value}")
    say(
        "commands:"
        if not plan.up_to_date
        else "commands (none run while horovod imports; without it, these):"
    )
    if plan.missing_deps:
        say(f"  {_cmdline(plan.deps_command())}")
    wheel = cached if cached is not None else plan.wheel_dir / f"horovod-{plan.horovod_version}-*.whl"
    if cached is None:
        say(f"  {_cmdline(plan.wheel_command(TEMP_PLACEHOLDER / 'out'))}")
    say(f"  {_cmdline(plan.install_command(wheel))}")


def _last_line(log: Path, limit: int = 120) -> str:
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - 8192))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    if not lines:
        return ""
    last = lines[-1]
    return last if len(last) <= limit else last[: limit - 3] + "..."


def _tail(log: Path, n: int = 40) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


def build_with_heartbeat(
    cmd: Sequence[str],
    env: dict[str, str],
    log: Path,
    progress: Progress,
    what: str,
    interval: float = HEARTBEAT_S,
    popen: Optional[Callable[..., Any]] = None,
) -> int:
    """Run ``cmd`` with its output in ``log``; print a progress line every ``interval`` s until it ends."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = progress.elapsed()
    with log.open("w") as out:
        proc = (popen or subprocess.Popen)(list(cmd), env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            while True:
                try:
                    return int(proc.wait(timeout=interval))
                except subprocess.TimeoutExpired:
                    last = _last_line(log)
                    progress(
                        f"still {what} ({int(progress.elapsed() - started)} s so far)"
                        + (f"; last output: {last}" if last else "")
                    )
        except BaseException:
            proc.kill()
            proc.wait()
            raise


def _check_call(cmd: Sequence[str]) -> None:
    result = subprocess.run(list(cmd), check=False)
    if result.returncode != 0:
        raise InstallError(f"`{_cmdline(cmd)}` failed (exit {result.returncode})", code=1)


def build_wheel(plan: Plan, progress: Progress) -> Path:
    """Build the wheel in a temporary folder, move it into the cache (replacing older ones), return it."""
    with tempfile.TemporaryDirectory(prefix="lightning-dist-horovod-") as tmp:
        work = Path(tmp)
        prepare_workdir(plan, work)
        env = {**os.environ, **plan.build_env(work)}
        out = work / "out"
        what = f"building horovod {plan.horovod_version}"
        progress(
            f"{what} for torch {plan.torch.version} (cuda: {_yes_no(plan.cuda)}, MPI: {_yes_no(plan.with_mpi)}, "
            f"{plan.jobs} jobs); a few minutes, log: {plan.log_path} ..."
        )
        started = progress.elapsed()
        rc = build_with_heartbeat(plan.wheel_command(out), env, plan.log_path, progress, what)
        if rc != 0:
            raise InstallError(
                f"building horovod failed (pip wheel exit {rc}); last lines of {plan.log_path}:\n"
                f"{_tail(plan.log_path)}",
                code=1,
            )
        built = sorted(out.glob("horovod-*.whl"))
        if not built:
            raise InstallError(f"pip wheel made no horovod wheel in {out}; see {plan.log_path}", code=1)
        plan.wheel_dir.mkdir(parents=True, exist_ok=True)
        for old in plan.wheel_dir.glob("horovod-*.whl"):
            old.unlink()
        wheel = plan.wheel_dir / built[-1].name
        shutil.move(str(built[-1]), wheel)
    progress(f"built {wheel.name} in {int(progress.elapsed() - started)} s, cached in {plan.wheel_dir}")
    return wheel


def _install(args: argparse.Namespace, progress: Progress) -> int:
    progress(f"checking torch and horovod in {sys.executable} ...")
    plan = make_plan(args)
    cached = plan.cached_wheel
    needs_build = not plan.up_to_date and cached is None
    if args.dry_run:
        progress("dry run: nothing is built or installed")
        print_plan(plan)
        if needs_build and plan.missing_tools:
            raise InstallError(tools_error(plan))
        return 0
    if plan.up_to_date:
        progress(
            f"horovod {plan.installed} already importable with torch {plan.torch.version}: "
            "nothing to do (--force rebuilds)"
        )
        return 0
    if needs_build and plan.missing_tools:
        raise InstallError(tools_error(plan))
    if plan.missing_deps:
        progress(f"installing build dependencies: {' '.join(plan.missing_deps)} ...")
        _check_call(plan.deps_command())
    if cached is not None:
        progress(f"reusing cached wheel {cached} (no build)")
        wheel = cached
    else:
        wheel = build_wheel(plan, progress)
    progress(f"installing {wheel.name} ...")
    _check_call(plan.install_command(wheel))
    progress("checking that horovod.torch imports ...")
    _check_call(plan.verify_command())
    progress(f"installed horovod {plan.horovod_version} for torch {plan.torch.version} from {wheel}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``install-horovod`` with parsed ``args``; the exit status (2: fix the environment first)."""
    progress = Progress()
    try:
        return _install(args, progress)
    except InstallError as exc:
        print(f"{PREFIX}: {exc}", file=sys.stderr, flush=True)
        return exc.code
    except KeyboardInterrupt:
        print(f"{PREFIX}: interrupted", file=sys.stderr, flush=True)
        return 130


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


ENV_OPTIONS: tuple[tuple[str, str, Optional[str], str, str], ...] = (
    (
        "--cuda-cc-list",
        "HOROVOD_BUILD_CUDA_CC_LIST",
        None,
        "CUDA compute capabilities to build for, e.g. 90 or 80,90 (CUDA builds)",
        "the visible GPU's",
    ),
    ("--horovod-version", "HOROVOD_VERSION", HOROVOD_VERSION, "Horovod release to build", "%(default)s"),
    (
        "--sdist",
        "HOROVOD_SDIST",
        None,
        "build from this local sdist (offline) instead of horovod==VERSION from PyPI",
        "PyPI",
    ),
    ("--cxx", "CXX", "g++", "the C++ compiler the C++17 wrapper calls", "%(default)s"),
)
"""The options whose default is an environment variable when it is set (not empty): option, variable,
default without it, help, and what the help calls that default."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add the ``install-horovod`` subcommand and its options to ``subparsers``."""
    p = subparsers.add_parser(
        "install-horovod",
        help="build and install horovod 0.28.1 against the installed torch (cached wheel)",
        description=(
            "Build Horovod from its sdist with the current interpreter's pip, through a compiler wrapper "
            "that rewrites -std=c++14 to -std=c++17 (torch >= 2.1 needs C++17, so `pip install horovod` "
            "fails), cache the wheel per horovod/torch/cuda/MPI and install it. Does nothing when "
            "horovod.torch already imports at that version."
        ),
        epilog=(
            "Needs a C++ compiler, cmake and, for Adasum, OpenMPI: "
            f"`{APT_COMMAND}` or `{CONDA_COMMAND}`. "
            "Exit status 2: something to install or change first; 1: the build or pip failed."
        ),
    )
    p.add_argument(
        "--cuda",
        choices=CUDA_CHOICES,
        default="auto",
        help="build Horovod's NCCL GPU operations: auto (when torch sees a GPU), on, off; default %(default)s",
    )
    for option, env, fallback, text, otherwise in ENV_OPTIONS:
        p.add_argument(
            option, default=os.environ.get(env) or fallback, help=f"{text}; default ${env}, else {otherwise}"
        )
    p.add_argument(
        "--without-mpi",
        action="store_true",
        help="build with Gloo only, no MPI (no mpicc/mpirun needed); HorovodAdasum then cannot run, "
        "it needs the MPI controller; default: build with MPI and Gloo",
    )
    p.add_argument(
        "--jobs",
        type=_positive_int,
        default=default_jobs(),
        help="parallel compile jobs (MAKEFLAGS=-jN); default: the CPUs available, %(default)s",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="wheel cache, one folder per horovod/torch/cuda/mpi combination; default "
        "$LIGHTNING_DIST_WHEEL_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/lightning_dist/wheels (%(default)s)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan, the build environment (HOROVOD_WITH_PYTORCH=1 ...) and the pip commands, "
        "then stop: nothing is built or installed; exits 2 if a needed build tool is missing; default: off",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="rebuild from source even when horovod already imports or a wheel is cached; "
        "the new wheel replaces the cached one; default: off",
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lightning_dist.install_horovod [options]``, the same as ``lightning-dist install-horovod``."""
    parser = argparse.ArgumentParser(prog="lightning-dist")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["install-horovod", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
