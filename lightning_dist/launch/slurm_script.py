"""The sbatch script of a job, from its options and its strategy's launch needs; writing and submitting it."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from lightning_dist.launch.slurm_command import is_python, unfilled_note
from lightning_dist.launch.slurm_options import SlurmOptions


class _Raw(str):
    """A word of the script that the batch shell expands (``"$hosts"``): written unquoted."""


def header(job: SlurmOptions) -> list[str]:
    """The ``#SBATCH`` lines."""
    lines = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        f"--ntasks-per-node={1 if job.needs.agent_per_node else job.devices}",
    ]
    if job.task_cpus is not None:
        lines.append(f"--cpus-per-task={job.task_cpus}")
    if job.gpus_per_node:
        lines.append(f"--gpus-per-node={job.gpus_per_node}")
    for name in ("gres", "partition", "account", "qos", "constraint", "time", "mem", "chdir"):
        value = getattr(job, name)
        if value is not None:
            lines.append(f"--{name}={value}")
    if job.exclusive:
        lines.append("--exclusive" if job.exclusive is True else f"--exclusive={job.exclusive}")
    lines.append(f"--output={job.output}")
    for name in ("mail_type", "mail_user"):
        value = getattr(job, name)
        if value is not None:
            lines.append(f"--{name.replace('_', '-')}={value}")
    if job.requeue:
        prefix = "B:" if job.batch_signal else ""
        lines += ["--open-mode=append", f"--signal={prefix}SIGUSR1@{job.signal_seconds}", "--requeue"]
    else:
        lines.append("--no-requeue")
    return [f"#SBATCH {line}" for line in [*lines, *job.sbatch_args]]


def launch_command(job: SlurmOptions) -> list[str]:
    """The line that starts the ranks (shell words; ``$...`` expanded by the batch shell)."""
    g = str(job.devices)
    if job.launch == "srun":
        return ["srun", f"--ntasks-per-node={g}", "--kill-on-bad-exit=1", *job.command]
    if job.launch.startswith("srun-"):
        mpi = job.launch.split("-", 1)[1]
        return ["srun", f"--mpi={mpi}", f"--ntasks-per-node={g}", "--kill-on-bad-exit=1", *job.command]
    if job.launch == "mpirun":
        return [
            "mpirun",
            "-np",
            str(job.ranks),
            "--host",
            _Raw('"$hosts"'),
            "--map-by",
            f"ppr:{g}:node",
            "--bind-to",
            "none",
            _Raw("$as_root"),
            *job.command,
        ]
    if job.launch == "fault_tolerant":
        return _fault_tolerant_command(job)
    nnodes = f"{job.min_nodes}:{job.nodes}" if job.min_nodes is not None else str(job.nodes)
    options = [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={g}",
        f"--max-restarts={job.max_restarts}",
        "--rdzv-backend=c10d",
        _Raw('--rdzv-endpoint="$head:$port"'),
        _Raw('--rdzv-id="$SLURM_JOB_ID"'),
    ]
    cmd = job.command
    if is_python(cmd[0]) and len(cmd) > 1 and (cmd[1] == "-m" or not cmd[1].startswith("-")):
        runner = [cmd[0], "-m", "torch.distributed.run", *options, *cmd[1:]]
    else:
        runner = ["torchrun", *options, "--no-python", *cmd]
    return ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=0", *runner]


def _lighthouse_lines(job: SlurmOptions) -> list[str]:
    """FaultTolerant: torchft's Lighthouse in the batch shell (it runs on the first node), bound
    to the first node's address only, ended when the script exits."""
    addr = job.master_addr or "$(getent ahostsv4 \"$head\" | awk '{print $1; exit}')"
    port = str(job.port) if job.port is not None else "$((30000 + SLURM_JOB_ID % 10000))"
    return [
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"lighthouse_addr={addr}",
        f"port={port}",
        "# torchft's Lighthouse (quorum of the replica groups), on the first node's address only; it and the",
        "# groups' servers are not authenticated: run on a trusted network (docs/live-recovery.md).",
        "# torchft's logs (the Lighthouse's, the groups' servers') are warnings only unless LD_FT_VERBOSE=1",
        "# (or your own RUST_LOG) is set.",
        'export RUST_LOG="${RUST_LOG:-$([ "${LD_FT_VERBOSE:-0}" = 1 ] && echo info || echo warn)}"',
        'torchft_lighthouse --bind "$lighthouse_addr:$port" --min_replicas 1 --join_timeout_ms 1000 '
        "--heartbeat_timeout_ms 5000 &",
        "lighthouse=$!",
        "trap 'kill \"$lighthouse\" 2>/dev/null || true' EXIT",
        "# FaultTolerant's commits (default <default_root_dir>/ft_commits) must be on a filesystem every",
        "# node sees; a requeued run resumes from the newest one by itself.",
    ]


def _fault_tolerant_command(job: SlurmOptions) -> list[str]:
    """One replica group of ``devices`` processes per node: its id is the node's
    (``$SLURM_NODEID``, expanded in the task), its address the one that reaches the Lighthouse
    (``--host auto``)."""
    cmd, python = job.command, "python"
    if is_python(cmd[0]):
        python, cmd = cmd[0], cmd[1:]
    if not cmd or (cmd[0].startswith("-") and cmd[0] != "-m"):
        raise ValueError(
            f"the training command {shlex.join(job.command)!r}: {job.strategy} runs a Python script "
            "in each replica group's standby; accepted: python script.py [args] or python -m module [args]"
        )
    per_group = f"--nproc-per-group {job.devices} " if job.devices != 1 else ""
    group = (
        f'exec {shlex.quote(python)} -m lightning_dist.launch.fault_tolerant --group "$SLURM_NODEID" '
        f'--lighthouse "$0" --host auto {per_group}--max-restarts {job.max_restarts} -- "$@"'
    )
    return ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=0", "bash", "-c", group,
            _Raw('"http://$lighthouse_addr:$port"'), *cmd]  # fmt: skip


def render(job: SlurmOptions) -> str:
    """The whole script."""
    from lightning_dist import __version__

    def words(cmd: Sequence[str]) -> str:
        return " ".join(w if isinstance(w, _Raw) else shlex.quote(w) for w in cmd)

    needs = job.needs
    how = {
        "srun": f"srun starts {job.devices} task(s) per node, one per device; Lightning's SLURMEnvironment reads the ranks",
        "srun-pmix": "srun --mpi=pmix starts one MPI job of all ranks (Horovod)",
        "srun-pmi2": "srun --mpi=pmi2 starts one MPI job of all ranks (Horovod)",
        "mpirun": "mpirun starts one MPI job of all ranks over the job's nodes (Horovod; no PMIx in srun)",
        "torchrun": "one torchrun per node; c10d rendezvous on the first node (Elastic)",
        "fault_tolerant": f"torchft's Lighthouse on the first node, one replica group of {job.devices} "
        "process(es) per node (FaultTolerant)",
    }[job.launch]
    lines = [
        "#!/bin/bash",
        f"# Written by `lightning-dist slurm` (lightning_dist {__version__}): strategy {job.strategy} "
        f"({needs.family} family), {job.nodes} node(s) x {job.devices} device(s) = {job.ranks} rank(s).",
        f"# {how}.",
        "# Submit: sbatch <this file>",
        *(f"# Note: {line}" if i == 0 else f"# {line}" for i, line in enumerate(_wrap(unfilled_note(job)))),
        *header(job),
        "set -euo pipefail",
        'echo "lightning-dist: job ${SLURM_JOB_ID} run ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST}"',
    ]
    if job.setup:
        # environment scripts (module, conda, venv's activate) may read unset variables: no `set -u`
        lines += [
            "# --setup: run here before the launch; the ranks inherit the environment",
            "set +u",
            *job.setup,
            "set -u",
        ]
    if job.requeue and not needs.resumes_from_commits:
        who = (
            "the batch shell gets SIGUSR1 and forwards it to mpirun, which passes it to every rank"
            if job.launch == "mpirun"
            else "every rank gets SIGUSR1"
        )
        lines += [
            f"# {job.signal_seconds} s before the time limit {who}: Lightning's SLURMEnvironment",
            "# (auto_requeue=True) saves <default_root_dir>/hpc_ckpt_<n>.ckpt and runs `scontrol requeue`;",
            "# the requeued run's Trainer.fit() resumes from the newest hpc_ckpt_*.ckpt by itself, so keep",
            "# default_root_dir (default: the working directory) the same across runs.",
        ]
    if job.master_addr is not None and not needs.agent_per_node:  # else the agent's rendezvous
        lines.append(f"export MASTER_ADDR={job.master_addr}")
    if job.port is not None and needs.engine == "lightning":
        lines.append(f"export MASTER_PORT={job.port}")
    for name, value, why in needs.exports:
        lines += [f"# {why}", f"export {name}={value}"]
    if job.launch == "mpirun":
        lines += [
            f'hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\\$/:{job.devices}/" | paste -sd, -)',
            'as_root=$([ "$(id -u)" = 0 ] && echo --allow-run-as-root || true)',
        ]
    if job.launch == "torchrun":
        head = job.master_addr or '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
        port = str(job.port) if job.port is not None else "$((30000 + SLURM_JOB_ID % 10000))"
        lines += [
            f"head={head}",
            f"port={port}",
            "# Elastic's commits (default <default_root_dir>/elastic_commits) must be on a filesystem every",
            "# node sees; a requeued run resumes from the newest one by itself.",
        ]
    if job.launch == "fault_tolerant":
        lines += _lighthouse_lines(job)
    if job.task_cpus is not None and job.launch != "mpirun":
        lines += [
            "# srun (SLURM >= 22.05) does not inherit sbatch's --cpus-per-task: give it to each task",
            f"export SRUN_CPUS_PER_TASK={job.task_cpus}",
        ]
    launch = words(launch_command(job))
    if not (job.requeue and job.batch_signal):
        lines.append(launch)
        return "\n".join(lines) + "\n"
    if needs.resumes_from_commits:
        lines += [
            "on_signal() {",
            f'  echo "lightning-dist: SIGUSR1 (time limit near): requeueing job $SLURM_JOB_ID; {job.strategy} resumes from its last commit"',
            '  scontrol requeue "$SLURM_JOB_ID"',
            "}",
        ]
    else:
        lines += [
            "on_signal() {",
            '  echo "lightning-dist: SIGUSR1 (time limit near): forwarded to mpirun, Lightning saves and requeues"',
            '  kill -USR1 "$launcher" 2>/dev/null || true',
            "}",
        ]
    lines += [
        "trap on_signal USR1",
        f"{launch} &",
        "launcher=$!",
        "# wait returns early when the trap runs: wait again until the launcher has exited",
        "while true; do",
        '  rc=0; wait "$launcher" || rc=$?',
        '  if [ "$rc" -gt 128 ] && kill -0 "$launcher" 2>/dev/null; then continue; fi',
        "  break",
        "done",
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def _wrap(text: Optional[str], width: int = 98) -> list[str]:
    """``text`` as comment lines of at most ``width`` characters (none for None)."""
    import textwrap

    return textwrap.wrap(text, width) if text else []


def write_script(job: SlurmOptions, path: str | os.PathLike[str]) -> Path:
    """Write ``job``'s script (executable) to ``path``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(job))
    out.chmod(0o755)
    return out


def submit(path: str | os.PathLike[str]) -> str:
    """``sbatch --parsable path``: the job id (a ``RuntimeError`` with sbatch's message otherwise)."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise RuntimeError(
            "sbatch not found: install SLURM's client (slurm-client) or submit the script elsewhere"
        )
    proc = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(
            f"sbatch {path} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc.stdout.strip().split(";")[0]
