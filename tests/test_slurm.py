"""srun launch on a real one-node SLURM cluster (started here by scripts/start-local-slurm.sh as root)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import (
    ROOT,
    SCRIPTS,
    assert_same_weights,
    child_env,
    kill_tree,
    load_rank,
    run_command,
    run_script,
)

START = ROOT / "scripts" / "start-local-slurm.sh"
START_BUDGET = 120
"""Seconds to start the cluster (about 1 s here; more when it installs the packages), in the first
test's setup."""
BUDGET = 90
"""Seconds for one 2-process run (a few seconds here): start + 2 runs stay below TIMEOUT."""
JOB_BUDGET = 150
"""Seconds for one sbatch job to finish (a few seconds of training here; a requeue adds SLURM's kill
wait, up to KillWait=30 s, and a restart)."""
TIMEOUT = START_BUDGET + BUDGET + JOB_BUDGET + 120
"""Each test's timeout: the cluster's start (in whichever test runs first), a reference run, the job
and the cleanup (scancel, the cluster's stop) stay below it, and each budget is at most half of it."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT)]


@pytest.fixture(scope="module")
def slurm_conf() -> Iterator[str]:
    if os.environ.get("SLURM_CONF") and shutil.which("srun"):
        yield os.environ["SLURM_CONF"]
        return
    if os.geteuid() != 0 or shutil.which("srun") is None:
        pytest.skip("needs SLURM (apt-get install slurmctld slurmd slurm-client munge) and root to start it")
    proc = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=START_BUDGET)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    conf = proc.stdout.strip().splitlines()[-1].split("=", 1)[1]
    yield conf
    subprocess.run(["bash", str(START), "stop"], capture_output=True, timeout=60)


def test_srun_launch_matches_popen(tmp_path: Path, slurm_conf: str, shared_popen: dict[str, Path]) -> None:
    popen = shared_popen["ld_ddp_3"]  # the same run, launched by Lightning (tests/shared_runs.py)
    out = tmp_path / "srun"
    cmd = ["srun", "-N", "1", "--ntasks-per-node", "2", "--export", "ALL", "--kill-on-bad-exit=1"]
    proc = run_command(
        [
            *cmd,
            "python",
            str(SCRIPTS / "ddp_run.py"),
            "--strategy",
            "ld_ddp",
            "--max-steps",
            "3",
            "--out",
            str(out),
        ],
        BUDGET,
        SLURM_CONF=slurm_conf,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "SLURM" in proc.stderr, "Lightning should have detected the SLURM environment"
    for rank in (0, 1):
        w, info = load_rank(out, rank)
        assert info["world_size"] == 2 and info["hook_calls"] > 0
        assert_same_weights(w, load_rank(popen, 0)[0], atol=0)


def test_horovod_adasum_under_srun_pmix(
    tmp_path: Path, slurm_conf: str, shared_mpirun: dict[str, Path]
) -> None:
    pytest.importorskip("horovod.torch", reason="horovod not built: run scripts/install-horovod.sh")
    out = tmp_path / "hvd"
    cmd = [
        "srun",
        "--mpi=pmix",
        "-N",
        "1",
        "--ntasks-per-node",
        "2",
        "--export",
        "ALL",
        "--kill-on-bad-exit=1",
    ]
    proc = run_command(
        [*cmd, "python", str(SCRIPTS / "hvd_train.py"), "--strategy", "horovod_adasum", "--max-steps", "6"]
        + ["--out", str(out)],
        BUDGET,
        SLURM_CONF=slurm_conf,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    w0, info0 = load_rank(out, 0)
    w1, info1 = load_rank(out, 1)
    assert info0["world_size"] == 2 and info0["stats"]["adasum.calls"] == 6
    assert_same_weights(w0, w1, atol=0)
    assert_same_weights(w0, load_rank(shared_mpirun["horovod_adasum_6"], 0)[0], atol=0)  # mpirun's run


# -- sbatch jobs written by `lightning-dist slurm` -----------------------------------------------------
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def scontrol(slurm_conf: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["scontrol", *args], capture_output=True, text=True, timeout=30, env=child_env(SLURM_CONF=slurm_conf)
    )


def job_fields(slurm_conf: str, job: str) -> dict[str, str]:
    """`scontrol show job -o JOB` as a dict (JobState, Reason, Restarts, ExitCode, ...); {} once gone."""
    proc = scontrol(slurm_conf, "show", "job", "-o", job)
    return dict(re.findall(r"(\w+)=(\S*)", proc.stdout)) if proc.returncode == 0 else {}


def submit_job(work: Path, slurm_conf: str, options: list[str], command: list[str]) -> tuple[str, Path, Path]:
    """`lightning-dist slurm OPTIONS --script ... --submit -- COMMAND`: the job id, script and output file."""
    work.mkdir(parents=True, exist_ok=True)
    script, output = work / "job.sbatch", work / "slurm.out"
    cli = ["lightning-dist", "slurm", *options, "--job-name", f"ld-{work.name}", "--script", str(script)]
    cli += ["--output", str(output), "--chdir", str(work), "--submit", "--", *command]
    proc = run_command(cli, 60, SLURM_CONF=slurm_conf)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"submitted job (\d+)", proc.stdout)
    assert found, proc.stdout
    return found.group(1), script, output


def submit_slowed(
    work: Path, slurm_conf: str, strategy: str, script: str, *args: str
) -> tuple[str, Path, Path]:
    """``submit_job`` of 1 node x 2 devices of ``strategy`` running ``scripts/<script> --out <work>/out ARGS``
    at 0.4 s a step, so that a test can signal it mid-run."""
    return submit_job(
        work,
        slurm_conf,
        ["--nodes", "1", "--devices", "2", "--strategy", strategy],
        [sys.executable, str(SCRIPTS / script), "--out", str(work / "out"), *args, "--step-sleep", "0.4"],
    )


def wait_for(what: str, check: Callable[[], bool], deadline: float, output: Path, every: float = 0.2) -> None:
    while not check():
        if time.monotonic() > deadline:
            log = output.read_text()[-6000:] if output.exists() else "(no output yet)"
            raise AssertionError(f"timed out waiting for {what}; job output:\n{log}")
        time.sleep(every)


def wait_done(slurm_conf: str, job: str, output: Path, deadline: float, restarts: int = 0) -> dict[str, str]:
    """Poll until the job has finished (after ``restarts`` requeues); a requeued job waits on
    ``BeginTime`` (SLURM holds it 121 s), which is lifted with ``scontrol update StartTime=now``."""
    fields: dict[str, str] = {}

    def finished() -> bool:
        nonlocal fields
        fields = job_fields(slurm_conf, job)
        if fields.get("JobState") == "PENDING" and fields.get("Reason") == "BeginTime":
            scontrol(slurm_conf, "update", f"JobId={job}", "StartTime=now")
        return fields.get("JobState") in DONE and int(fields.get("Restarts", "0")) >= restarts

    wait_for(f"job {job} to finish", finished, deadline, output, every=0.5)
    return fields


@contextlib.contextmanager
def cancelled(slurm_conf: str, jobs: list[str]) -> Iterator[None]:
    """Whatever happens in the test, the jobs end with it."""
    try:
        yield
    finally:
        for job in jobs:
            subprocess.run(
                ["scancel", job], capture_output=True, timeout=30, env=child_env(SLURM_CONF=slurm_conf)
            )


def assert_completed(fields: dict[str, str], output: Path) -> None:
    log = output.read_text()[-6000:] if output.exists() else "(no output)"
    assert fields.get("JobState") == "COMPLETED" and fields.get("ExitCode") == "0:0", f"{fields}\n{log}"


def test_sbatch_ddp_job_matches_popen(tmp_path: Path, slurm_conf: str, shared_popen: dict[str, Path]) -> None:
    popen = shared_popen["ld_ddp_4"]  # the same run, launched by Lightning (tests/shared_runs.py)
    out = tmp_path / "sbatch" / "out"
    deadline = time.monotonic() + JOB_BUDGET
    job, script, output = submit_job(
        tmp_path / "sbatch",
        slurm_conf,
        ["--nodes", "1", "--devices", "2", "--strategy", "DDP"],
        [
            sys.executable,
            str(SCRIPTS / "ddp_run.py"),
            "--strategy",
            "ld_ddp",
            "--max-steps",
            "4",
            "--out",
            str(out),
        ],
    )
    with cancelled(slurm_conf, [job]):
        assert "srun --ntasks-per-node=2 --kill-on-bad-exit=1" in script.read_text()
        assert_completed(wait_done(slurm_conf, job, output, deadline), output)
    assert "SLURM auto-requeueing enabled" in output.read_text(), (
        "Lightning should run on its SLURMEnvironment"
    )
    for rank in (0, 1):
        w, info = load_rank(out, rank)
        assert info["world_size"] == 2 and info["global_step"] == 4 and info["hook_calls"] > 0
        assert_same_weights(w, load_rank(popen, 0)[0], atol=0)


@pytest.mark.parametrize("mpi", ["auto", "mpirun"])
def test_sbatch_horovod_adasum_job_matches_mpirun(
    tmp_path: Path, slurm_conf: str, shared_mpirun: dict[str, Path], mpi: str
) -> None:
    """`auto` picks `srun --mpi=pmix` here (srun lists pmix); `mpirun` is the fallback without it."""
    pytest.importorskip("horovod.torch", reason="horovod not built: run scripts/install-horovod.sh")
    args = ["--strategy", "horovod_adasum", "--max-steps", "6"]
    ref = shared_mpirun["horovod_adasum_6"]  # the same run under mpirun on one host (tests/shared_runs.py)
    out = tmp_path / "sbatch" / "out"
    deadline = time.monotonic() + JOB_BUDGET
    job, script, output = submit_job(
        tmp_path / "sbatch",
        slurm_conf,
        ["--nodes", "1", "--devices", "2", "--strategy", "horovod_adasum", "--mpi", mpi],
        [sys.executable, str(SCRIPTS / "hvd_train.py"), *args, "--out", str(out)],
    )
    with cancelled(slurm_conf, [job]):
        expected = "srun --mpi=pmix --ntasks-per-node=2" if mpi == "auto" else "mpirun -np 2 --host"
        assert expected in script.read_text()
        assert_completed(wait_done(slurm_conf, job, output, deadline), output)
    w_ref = load_rank(ref, 0)[0]
    for rank in (0, 1):
        w, info = load_rank(out, rank)
        assert info["world_size"] == 2 and info["stats"]["adasum.calls"] == 6
        assert_same_weights(w, w_ref, atol=0)


def test_requeued_ddp_job_resumes_from_the_hpc_checkpoint(tmp_path: Path, slurm_conf: str) -> None:
    """SIGUSR1 to every task (what `--signal=SIGUSR1@90` sends before the time limit): Lightning saves
    hpc_ckpt_1.ckpt at step k and requeues the job; the requeued run starts at step k and ends on the
    weights of an uninterrupted run (no SLURM)."""
    ref = tmp_path / "uninterrupted"
    run_script([str(SCRIPTS / "slurm_requeue.py"), "--out", str(ref)], timeout=BUDGET)
    work = tmp_path / "job"
    out = work / "out"
    deadline = time.monotonic() + JOB_BUDGET
    job, _, output = submit_slowed(work, slurm_conf, "ld_ddp", "slurm_requeue.py")
    progress = out / "progress"
    with cancelled(slurm_conf, [job]):
        wait_for(
            "step 4", lambda: progress.exists() and int(progress.read_text() or 0) >= 4, deadline, output
        )
        signal = subprocess.run(["scancel", "--signal=USR1", job], capture_output=True, text=True, timeout=30,
                                env=child_env(SLURM_CONF=slurm_conf))  # fmt: skip
        assert signal.returncode == 0, signal.stderr
        fields = wait_done(slurm_conf, job, output, deadline, restarts=1)
        assert_completed(fields, output)
    log = output.read_text()
    assert "Requeued SLURM job" in log and "run 1 on" in log, log[-4000:]
    checkpoint = torch.load(out / "hpc_ckpt_1.ckpt", weights_only=False, map_location="cpu")
    step = checkpoint["global_step"]
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert runs == [{"restart_count": 0, "start_step": 0}, {"restart_count": 1, "start_step": step}], runs
    assert 4 <= step < 16
    assert f"Restored all states from the checkpoint at {out / 'hpc_ckpt_1.ckpt'}" in log
    for rank in (0, 1):
        w, info = load_rank(out, rank)
        assert info["global_step"] == 16
        assert_same_weights(w, load_rank(ref, rank)[0], atol=0)


def test_elastic_job_requeued_resumes_from_its_commit(
    tmp_path: Path, slurm_conf: str, shared_torchrun: dict[str, Path]
) -> None:
    """One torchrun per node from the generated script; SIGUSR1 to the batch shell (`B:` signal) makes
    it requeue the job, and the requeued run resumes from Elastic's last commit and ends on the weights
    of the same run under `torchrun --standalone` (no SLURM; tests/shared_runs.py's "average")."""
    args = ["--commit-every", "3", "--max-steps", "12"]
    ref = shared_torchrun["average"]
    work = tmp_path / "job"
    out = work / "out"
    deadline = time.monotonic() + JOB_BUDGET
    job, script, output = submit_slowed(work, slurm_conf, "elastic", "elastic_run.py", *args)
    text = script.read_text()
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text and "--rdzv-backend=c10d" in text
    commits = out / "commits"
    with cancelled(slurm_conf, [job]):
        wait_for("Elastic's first commit", lambda: commits.exists() and any(commits.glob("commit-*.pt")),
                 deadline, output)  # fmt: skip
        signal = subprocess.run(["scancel", "--signal=USR1", "--batch", job], capture_output=True, text=True,
                                timeout=30, env=child_env(SLURM_CONF=slurm_conf))  # fmt: skip
        assert signal.returncode == 0, signal.stderr
        fields = wait_done(slurm_conf, job, output, deadline, restarts=1)
        assert_completed(fields, output)
    log = output.read_text()
    assert "requeueing job" in log and "run 1 on" in log, log[-4000:]
    w, info = load_rank(out, 0)
    assert info["global_step"] == 12 and info["world_size"] == 2
    assert info["resumed_from"] is not None and info["resumed_from"] % 3 == 0 and info["resumed_from"] >= 3, (
        info
    )
    assert_same_weights(w, load_rank(ref, 0)[0], atol=0)


# -- the environment check on a real SLURM ---------------------------------------------------------
def test_ddp_in_the_batch_script_itself_fails_fast(tmp_path: Path, slurm_conf: str) -> None:
    """`python train.py` in an sbatch script of 2 tasks without srun: Lightning alone would wait for
    a rank 1 that never starts; the check fails at setup."""
    output = tmp_path / "batch.out"
    cmd = [sys.executable, str(SCRIPTS / "ddp_run.py"), "--strategy", "ld_ddp", "--out", str(tmp_path / "o")]
    proc = run_command(
        [
            "sbatch",
            "--wait",
            "-N",
            "1",
            "--ntasks-per-node",
            "2",
            "-o",
            str(output),
            "--wrap",
            shlex.join(cmd),
        ],
        BUDGET,
        SLURM_CONF=slurm_conf,
    )
    log = output.read_text()
    assert proc.returncode != 0, log
    assert "ValueError: DDP: this SLURM job does not match Trainer(devices=2, num_nodes=1)" in log, log[
        -4000:
    ]
    assert "is the batch script of job" in log and "srun --nodes=1 --ntasks-per-node=2" in log


def test_horovod_under_srun_without_mpi_plugin_fails_on_every_rank(tmp_path: Path, slurm_conf: str) -> None:
    pytest.importorskip("horovod.torch", reason="horovod not built: run scripts/install-horovod.sh")
    cmd = ["srun", "-N", "1", "--ntasks-per-node", "2", "--export", "ALL", sys.executable]
    cmd += [str(SCRIPTS / "hvd_train.py"), "--strategy", "horovod_adasum", "--out", str(tmp_path / "o")]
    proc = run_command(cmd, BUDGET, SLURM_CONF=slurm_conf)
    assert proc.returncode != 0
    reason = "srun started 2 tasks without an MPI plugin (no PMIX_RANK/PMI_RANK)"
    assert proc.stderr.count(reason) == 2, proc.stderr[-5000:]  # both ranks, before MPI starts


def test_a_restarted_cluster_drops_the_jobs_a_killed_run_left(tmp_path: Path, slurm_conf: str) -> None:
    """A run killed mid-job leaves the job RUNNING in slurmctld's saved state; restarting from that
    state would give it the node's CPUs back and queue every later job forever (CI saw exactly that)."""
    if os.environ.get("SLURM_CONF"):
        pytest.skip("the cluster is the caller's (SLURM_CONF set): not ours to kill")
    env = child_env(SLURM_CONF=slurm_conf)
    job = subprocess.run(["sbatch", "--parsable", "-N", "1", "--ntasks-per-node", "2", "-o", str(tmp_path / "o"),
                          "--wrap", "sleep 600"], capture_output=True, text=True, timeout=30, env=env)  # fmt: skip
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip()
    deadline = time.time() + 30
    while "R" not in _squeue_states(env):
        assert time.time() < deadline, f"job {job_id} did not start: {_squeue_states(env)}"
        time.sleep(0.5)
    # this job's processes (the batch shell and its `sleep 600`, then their slurmstepd, which slurmd
    # double-forks, so it is not slurmd's descendant), found while slurmd can still list them
    tasks: list[int] = []
    while not any(_cmdline(p) == "sleep 600" for p in tasks):
        assert time.time() < deadline, f"job {job_id}'s tasks did not start: {tasks}"
        time.sleep(0.5)
        tasks = _job_pids(env, job_id)
    steps = {ppid for ppid in map(_ppid, tasks) if ppid and _comm(ppid) == "slurmstepd"}
    assert steps, f"no slurmstepd above job {job_id}'s tasks {tasks}"
    daemons = [_daemon_pid(Path(slurm_conf).parent, daemon) for daemon in ("slurmctld", "slurmd")]
    for pid in [*daemons, *steps, *tasks]:  # killed as a session's end kills them: no clean shutdown
        kill_tree(pid)  # only what this test's cluster and job started, by PID
    time.sleep(1)
    proc = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=START_BUDGET)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _squeue_states(env) == [], "the restarted controller recovered the killed run's job"
    hostname = run_command(
        ["srun", "-N", "1", "--ntasks-per-node", "2", "hostname"], 30, SLURM_CONF=slurm_conf
    )
    assert hostname.returncode == 0 and len(hostname.stdout.split()) == 2, hostname.stderr[-2000:]


def _job_pids(env: dict[str, str], job: str) -> list[int]:
    """The PIDs of ``job``'s tasks on this node (`scontrol listpids`; [] before they start)."""
    proc = subprocess.run(["scontrol", "listpids", job], capture_output=True, text=True, timeout=30, env=env)
    return [int(line.split()[0]) for line in proc.stdout.splitlines() if line.split()[:1] != ["PID"]]


def _daemon_pid(state: Path, daemon: str) -> int:
    """``daemon``'s PID from its pid file in the cluster's ``state`` folder, checked to be that daemon
    of this cluster (a recycled PID is not)."""
    pid = int((state / f"{daemon}.pid").read_text())
    assert _comm(pid) == daemon and str(state) in _cmdline(pid), f"{daemon}.pid: {pid} is not our {daemon}"
    return pid


def _comm(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().strip()
    return ""


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    return ""


def _ppid(pid: int) -> int:
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return 0


def _squeue_states(env: dict[str, str]) -> list[str]:
    proc = subprocess.run(["squeue", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()
