"""`lightning-dist slurm`: the script each strategy family gets, the sbatch options it writes, the
training command's flags that follow from the job, the refused combinations (before anything is
written) and `--help` (fast: in-process, no sbatch; one slow test runs a script under bash with a
stand-in srun; the jobs run in tests/test_slurm.py)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from pathlib import Path

import pytest

from lightning_dist.cli import main
from lightning_dist.launch import slurm
from lightning_dist.launch.slurm import SlurmJob, parse_time, resolve_strategy, write_script

CMD = ["python", "train.py", "--devices", "2"]
TRAIN = ["python", "examples/train.py"]
"""The package's trainer: its --strategy/--devices/--accelerator/--num-nodes follow from the job."""
SHORT_FORMS = {
    "-N": "--nodes=3",
    "-p": "--partition=gpu",
    "-t": "--time=2:00:00",
    "-J": "--job-name=lm",
    "-A": "--account=proj42",
    "-q": "--qos=high",
    "-C": "--constraint=a100",
    "-c": "--cpus-per-task=4",
    "-o": "--output=logs/%j.out",
    "-D": "--chdir=/shared/run",
}
"""sbatch's short forms, which `lightning-dist slurm` takes too: the #SBATCH line each writes (its long
form) for the value after the `=`."""


def sbatch_lines(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def launch_line(script: str) -> str:
    return next(line for line in script.splitlines() if line.startswith(("srun ", "mpirun ")))


@pytest.mark.parametrize(
    "name", ["ld_ddp", "ld_ddp_popen", "ld_ddp_adasum", "DDP", "Compressed", "compressed_powersgd", "ddp"]
)
def test_ddp_family_runs_one_srun_task_per_device(name: str) -> None:
    script = SlurmJob(CMD, nodes=2, devices=4, strategy=name, time="1:00:00").render()
    assert resolve_strategy(name).family == "ddp"
    header = sbatch_lines(script)
    assert "--nodes=2" in header and "--ntasks-per-node=4" in header and "--time=1:00:00" in header
    assert "--signal=SIGUSR1@90" in header and "--requeue" in header and "--open-mode=append" in header
    assert launch_line(script) == "srun --ntasks-per-node=4 --kill-on-bad-exit=1 python train.py --devices 2"
    assert "hpc_ckpt" in script  # says how the requeued run resumes


def test_horovod_runs_one_mpi_job() -> None:
    pmix = SlurmJob(CMD, nodes=2, devices=2, strategy="horovod_adasum", mpi="pmix").render()
    assert launch_line(pmix).startswith(
        "srun --mpi=pmix --ntasks-per-node=2 --kill-on-bad-exit=1 python train.py"
    )
    assert "--signal=SIGUSR1@90" in sbatch_lines(pmix)
    mpirun = SlurmJob(CMD, nodes=2, devices=2, strategy="Horovod", mpi="mpirun").render()
    assert launch_line(mpirun).startswith(
        'mpirun -np 4 --host "$hosts" --map-by ppr:2:node --bind-to none $as_root python train.py'
    )
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in mpirun
    # mpirun's ranks are not a job step: the batch shell takes the signal and forwards it to mpirun
    assert "--signal=B:SIGUSR1@90" in sbatch_lines(mpirun) and 'kill -USR1 "$launcher"' in mpirun


def test_horovod_auto_picks_pmix_when_srun_lists_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm, "pmix_available", lambda: True)
    assert SlurmJob(CMD, devices=2, strategy="horovod").launch == "srun-pmix"
    monkeypatch.setattr(slurm, "pmix_available", lambda: False)
    assert SlurmJob(CMD, devices=2, strategy="horovod").launch == "mpirun"


def test_elastic_runs_one_torchrun_per_node() -> None:
    script = SlurmJob(
        ["python", "train.py", "--x", "a b"],
        nodes=4,
        min_nodes=2,
        devices=8,
        gpus_per_node=8,
        strategy="elastic",
    ).render()
    header = sbatch_lines(script)
    # one torchrun task per node: 8 GPU ranks x GPU_CPUS_PER_TASK (8) CPUs
    assert (
        "--ntasks-per-node=1" in header and "--cpus-per-task=64" in header and "--gpus-per-node=8" in header
    )
    assert "--signal=B:SIGUSR1@90" in header  # the batch shell requeues; Elastic resumes from its commits
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script
    assert 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert "port=$((30000 + SLURM_JOB_ID % 10000))" in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert launch_line(script) == (
        "srun --ntasks-per-node=1 --kill-on-bad-exit=0 python -m torch.distributed.run --nnodes=2:4 "
        '--nproc-per-node=8 --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint="$head:$port" '
        "--rdzv-id=\"$SLURM_JOB_ID\" train.py --x 'a b' &"
    )
    # a command that is not `python script`: torchrun --no-python keeps it as it is
    other = SlurmJob(
        ["./run.sh", "x"], devices=2, strategy="Elastic", port=29400, master_addr="10.0.0.1"
    ).render()
    assert "--no-python ./run.sh x &" in other and "head=10.0.0.1" in other and "port=29400" in other
    module = SlurmJob(["python3", "-m", "pkg.train"], devices=2, strategy="elastic").render()
    assert "python3 -m torch.distributed.run" in module and "-m pkg.train &" in module


def test_no_requeue_and_options() -> None:
    script = SlurmJob(
        CMD,
        devices=2,
        requeue=False,
        partition="gpu",
        mem="64G",
        cpus_per_task=4,
        job_name="lm",
        output="logs/%j.out",
        chdir="/shared/run",
        port=12345,
        master_addr="10.1.0.1",
    ).render()
    header = sbatch_lines(script)
    assert "--no-requeue" in header and not any(h.startswith("--signal") for h in header)
    for line in (
        "--partition=gpu",
        "--mem=64G",
        "--cpus-per-task=4",
        "--job-name=lm",
        "--output=logs/%j.out",
        "--chdir=/shared/run",
    ):
        assert line in header
    assert "export MASTER_PORT=12345" in script and "export MASTER_ADDR=10.1.0.1" in script


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (
            dict(strategy="horovod_adasum", nodes=1, devices=3, mpi="pmix"),
            r"power-of-two number of ranks, got .* = 3",
        ),
        (
            dict(strategy="HorovodAdasum", nodes=3, devices=2, mpi="pmix"),
            r"power-of-two number of ranks, got .* = 6",
        ),
        (
            dict(strategy="lightning_dist:HorovodAdasum()", nodes=1, devices=6, mpi="pmix"),
            r"power-of-two number of ranks",
        ),
        (
            dict(strategy="lightning_dist:Horovod(op='adasum')", nodes=1, devices=4, mpi="pmix"),
            r"Horovod\(op='adasum'\) is not a strategy; use 'lightning_dist:HorovodAdasum\(\)'",
        ),
        (
            dict(strategy="horovod_adasum", nodes=3, devices=4, gpus_per_node=4, mpi="pmix"),
            r"on GPUs needs a power-of-two number of nodes .* --nodes=3",
        ),
        (dict(devices=0), r"--devices=0 must be an integer >= 1"),
        (dict(nodes=0), r"--nodes=0 must be an integer >= 1"),
        (
            dict(strategy="nope"),
            r"--strategy 'nope' is not a strategy .* accepted: .*ld_ddp.*horovod_adasum.*elastic",
        ),
        (dict(strategy="fsdp"), r"is not a strategy lightning-dist can launch"),
        (
            dict(strategy="ld_ddp_spawn"),
            r"refused under SLURM: it starts its own processes \(start_method='spawn'\)",
        ),
        (
            dict(strategy="lightning_dist:DDP(start_method='fork')"),
            r"start_method='fork' starts its own processes",
        ),
        (dict(time="1", signal_seconds=90), r"--signal-seconds=90 is not below --time=1 \(60 s\)"),
        (dict(time="soon"), r"--time='soon' is not a SLURM time"),
        (dict(signal_seconds=0), r"--signal-seconds=0 must be an integer >= 1"),
        (dict(gpus_per_node=2, devices=4), r"--gpus-per-node=2 is fewer than --devices=4"),
        (dict(port=70000), r"--port=70000 must be <= 65535"),
        (dict(mpi="pmix"), r"--mpi=pmix applies to the Horovod strategies only"),
        (dict(min_nodes=1), r"--min-nodes applies to Elastic only"),
        (dict(strategy="elastic", nodes=2, min_nodes=3), r"--min-nodes=3 must be <= 2"),
        (dict(cpus_per_task=0), r"--cpus-per-task=0 must be an integer >= 1"),
        (dict(mem="lots"), r"--mem='lots' is not accepted"),
        (dict(job_name="a b"), r"--job-name='a b' is not accepted"),
        (dict(command=[]), r"no training command: put it after `--`"),
        (dict(gres="gpu 4"), r"--gres='gpu 4' is not accepted \(allowed: "),
        (dict(account="a b"), r"--account='a b' is not accepted"),
        (dict(qos="x;y"), r"--qos='x;y' is not accepted"),
        (dict(constraint="a100 ib"), r"--constraint='a100 ib' is not accepted"),
        (
            dict(exclusive="nodes"),
            r"--exclusive='nodes'; accepted: --exclusive \(whole nodes\) or --exclusive=user\|mcs\|topo",
        ),
        (
            dict(mail_type="END,SOMETIMES"),
            r"--mail-type='END,SOMETIMES': 'SOMETIMES' not accepted; accepted \(comma-separated\): NONE, BEGIN, END",
        ),
        (
            dict(mail_user="me@example.org"),
            r"--mail-user=me@example.org alone sends no mail: add --mail-type",
        ),
        (dict(mail_type="END", mail_user="a b"), r"--mail-user='a b' is not accepted"),
        (dict(setup=["module load cuda\nrm -rf /"]), r"--setup .*: one non-empty shell line each"),
        (dict(setup=["  "]), r"--setup '  ': one non-empty shell line each"),
        (dict(accelerator="tpu"), r"--accelerator='tpu'; accepted: cpu, gpu"),
        (
            dict(accelerator="cpu", gpus_per_node=2, devices=2),
            r"--accelerator cpu but --gpus-per-node=2 asks for GPUs: use --accelerator gpu",
        ),
        (dict(accelerator="cpu", gres="gpu:1"), r"--accelerator cpu but --gres=gpu:1 asks for GPUs"),
        (
            dict(gres="gpu:2", gpus_per_node=2, devices=2),
            r"--gres=gpu:2 and --gpus-per-node=2 both ask for GPUs: give one of them",
        ),
        (dict(gres="gpu:a100:2", devices=4), r"--gres=gpu:a100:2 is fewer than --devices=4"),
        (dict(accelerator="gpu", gpus_per_node=2, devices=4), r"--gpus-per-node=2 is fewer than --devices=4"),
        (dict(trainer_flags="sometimes"), r"--trainer-flags='sometimes'; accepted: auto, always, never"),
        (
            dict(sbatch_args=["--nodes=3"]),
            r"sets #SBATCH --nodes, which lightning-dist writes itself: use -N/--nodes",
        ),
    ],
)
def test_bad_combinations_are_refused(kwargs: dict, reason: str) -> None:
    kwargs = {"command": CMD, **kwargs}
    with pytest.raises(ValueError, match=reason):
        SlurmJob(**kwargs)


def test_powers_of_two_are_accepted_for_adasum() -> None:
    for nodes, devices in ((1, 1), (1, 2), (2, 2), (1, 8), (4, 4)):
        SlurmJob(CMD, nodes=nodes, devices=devices, strategy="horovod_adasum", mpi="pmix")
    SlurmJob(
        CMD, nodes=2, devices=3, gpus_per_node=3, strategy="horovod_adasum", mpi="pmix"
    )  # GPUs: nodes count


def test_parse_time() -> None:
    assert parse_time("30") == 1800
    assert parse_time("5:30") == 330
    assert parse_time("4:00:00") == 14400
    assert parse_time("1-12") == 129600
    assert parse_time("1-00:30") == 86400 + 1800
    assert parse_time("2-01:02:03") == 2 * 86400 + 3723


def test_cli_writes_prints_and_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sub" / "job.sbatch"
    argv = ["slurm", "--nodes", "1", "--devices", "2", "--script", str(path), "--"]
    assert main([*argv, "python", "train.py", "--strategy", "ld_ddp", "--devices", "2"]) == 0
    assert f"wrote {path} (srun, 1 x 2 = 2 ranks)" in capsys.readouterr().out
    text = path.read_text()
    assert text.startswith("#!/bin/bash\n") and path.stat().st_mode & 0o111
    # the training command's own flags (after --) are not lightning-dist's
    assert launch_line(text).endswith("python train.py --strategy ld_ddp --devices 2")
    assert main(["slurm", "--devices", "2", "--script", "-", "--", "python", "t.py"]) == 0
    assert launch_line(capsys.readouterr().out).endswith("python t.py")
    bad = tmp_path / "bad.sbatch"
    assert (
        main(
            ["slurm", "--strategy", "horovod_adasum", "--mpi", "pmix", "--devices", "3", "--script", str(bad)]
            + ["--", "python", "t.py"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith(
        "lightning-dist slurm: --strategy horovod_adasum needs a power-of-two number of ranks"
    )
    assert not bad.exists()


def test_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["slurm", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    # option lines: "  --devices DEVICES  ..." or "  -N NODES, --nodes NODES"
    documented = set(re.findall(r"^  (?:-[A-Za-z] [A-Z_]+, )?(--[a-z-]+)", text, flags=re.M))
    expected = {
        "--nodes",
        "--devices",
        "--strategy",
        "--partition",
        "--time",
        "--job-name",
        "--output",
        "--cpus-per-task",
        "--gpus-per-node",
        "--mem",
        "--signal-seconds",
        "--requeue",
        "--port",
        "--master-addr",
        "--mpi",
        "--min-nodes",
        "--max-restarts",
        "--chdir",
        "--script",
        "--submit",
        "--accelerator",
        "--trainer-flags",
        "--gres",
        "--account",
        "--qos",
        "--constraint",
        "--exclusive",
        "--mail-type",
        "--mail-user",
        "--setup",
        "--sbatch-arg",
    }
    assert expected <= documented, expected - documented
    for short, line in SHORT_FORMS.items():
        long = line.split("=")[0]
        assert re.search(rf"^  {short} [A-Z_]+, {long} ", text, flags=re.M), (short, long)
    assert "--no-requeue" in text and "TRAINING_COMMAND" in text


# -- sbatch options ---------------------------------------------------------------------------------
def cli_script(
    capsys: pytest.CaptureFixture[str], *options: str, command: tuple[str, ...] = ("python", "t.py")
) -> str:
    """The script `lightning-dist slurm OPTIONS --script - -- COMMAND` prints."""
    assert main(["slurm", *options, "--script", "-", "--", *command]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


@pytest.mark.parametrize(
    ("options", "line"),
    [
        pytest.param(["--gres", "gpu:a100:2"], "--gres=gpu:a100:2", id="gres"),
        pytest.param(["--gres", "gpu:2,nvme:1"], "--gres=gpu:2,nvme:1", id="gres-list"),
        pytest.param(["--account", "proj42"], "--account=proj42", id="account"),
        pytest.param(["--qos", "high"], "--qos=high", id="qos"),
        pytest.param(["--constraint", "a100&ib"], "--constraint=a100&ib", id="constraint"),
        pytest.param(["--constraint", "[rack1|rack2]"], "--constraint=[rack1|rack2]", id="constraint-or"),
        pytest.param(["--exclusive"], "--exclusive", id="exclusive"),
        pytest.param(["--exclusive=user"], "--exclusive=user", id="exclusive-user"),
        pytest.param(["--exclusive", "mcs"], "--exclusive=mcs", id="exclusive-mcs"),
        pytest.param(["--mail-type", "end,fail"], "--mail-type=END,FAIL", id="mail-type"),
        pytest.param(
            ["--mail-type", "ALL", "--mail-user", "me@example.org"],
            "--mail-user=me@example.org",
            id="mail-user",
        ),
        pytest.param(["--sbatch-arg", "--exclude=n07"], "--exclude=n07", id="sbatch-arg"),
        pytest.param(["--sbatch-arg=--exclude=n07"], "--exclude=n07", id="sbatch-arg-equals"),
        pytest.param(["--sbatch-arg", "reservation=r1"], "--reservation=r1", id="sbatch-arg-bare"),
        pytest.param(["--sbatch-arg", "-w n3"], "-w n3", id="sbatch-arg-short"),
        pytest.param(
            ["--sbatch-arg", '--comment="two words"'], '--comment="two words"', id="sbatch-arg-quoted"
        ),
        pytest.param(["--sbatch-arg", "--mem-per-gpu=8G"], "--mem-per-gpu=8G", id="sbatch-arg-not-a-prefix"),
        # each short form writes its long form's line
        *(
            pytest.param([short, line.split("=", 1)[1]], line, id=short[1:])
            for short, line in SHORT_FORMS.items()
        ),
    ],
)
def test_cli_option_writes_its_sbatch_line(
    options: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    header = sbatch_lines(cli_script(capsys, *options))
    assert line in header, header
    name = line.split("=")[0]
    assert sum(h.split("=")[0] == name for h in header) == 1, header  # written once, not twice


def test_options_left_out_write_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    header = sbatch_lines(cli_script(capsys))
    for name in ("--gres", "--account", "--qos", "--constraint", "--exclusive", "--mail-type", "--mail-user"):
        assert not any(h.startswith(name) for h in header), (name, header)
    assert "set +u" not in cli_script(capsys)


def test_sbatch_args_come_last_in_their_order(capsys: pytest.CaptureFixture[str]) -> None:
    header = sbatch_lines(
        cli_script(capsys, "--sbatch-arg", "--exclude=n07", "--sbatch-arg", "reservation=r1", "-N", "2")
    )
    assert header[-2:] == ["--exclude=n07", "--reservation=r1"] and "--nodes=2" in header


@pytest.mark.parametrize(
    ("arg", "owned", "use"),
    [
        ("--nodes=3", "--nodes", "-N/--nodes"),
        ("nodes=3", "--nodes", "-N/--nodes"),
        ("-N 3", "--nodes", "-N/--nodes"),
        ("--nod=3", "--nodes", "-N/--nodes"),  # sbatch takes an unambiguous prefix
        ("--ntasks=8", "--ntasks", "-N/--nodes and --devices"),
        ("-n 8", "--ntasks", "-N/--nodes and --devices"),
        ("--ntasks-per-node=2", "--ntasks-per-node", "--devices"),
        ("--gpus-per-task=1", "--gpus-per-task", "--gpus-per-node"),
        ("-t 10", "--time", "-t/--time"),
        ("--signal=USR1@60", "--signal", "--signal-seconds"),
        ("--open-mode=truncate", "--open-mode", "--requeue"),
        ("--job-name=x", "--job-name", "-J/--job-name"),
        ("--exclusive", "--exclusive", "--exclusive"),
    ],
)
def test_sbatch_args_that_this_script_writes_are_refused(arg: str, owned: str, use: str) -> None:
    with pytest.raises(
        ValueError,
        match=rf"--sbatch-arg {re.escape(repr(arg))} sets #SBATCH {owned}, which .* use {re.escape(use)}",
    ):
        SlurmJob(CMD, sbatch_args=[arg])


@pytest.mark.parametrize("arg", ["", "=x", "-5", "--a\n#SBATCH --nodes=9"])
def test_sbatch_args_that_are_not_options_are_refused(arg: str) -> None:
    with pytest.raises(ValueError, match=r"is not an sbatch option; accepted: one option per --sbatch-arg"):
        SlurmJob(CMD, sbatch_args=[arg])


def test_setup_lines_run_in_order_before_the_launch(capsys: pytest.CaptureFixture[str]) -> None:
    lines = cli_script(
        capsys,
        "--setup",
        "module load cuda",
        "--setup",
        "source .venv/bin/activate",
        "--setup",
        "export NCCL_DEBUG=INFO",
    ).splitlines()
    order = [
        "set -euo pipefail",
        "set +u",  # module/conda/venv scripts may read unset variables
        "module load cuda",
        "source .venv/bin/activate",
        "export NCCL_DEBUG=INFO",
        "set -u",
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1 python t.py",
    ]
    assert [lines.index(line) for line in order] == sorted(lines.index(line) for line in order), lines


# -- --devices: one rank per device ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "tasks", "gpus", "launch"),
    [
        (dict(devices=4), "4", None, "srun --ntasks-per-node=4 "),
        (dict(devices=4, accelerator="gpu"), "4", "4", "srun --ntasks-per-node=4 "),
        (dict(devices=4, gpus_per_node=8), "4", "8", "srun --ntasks-per-node=4 "),
        (
            dict(devices=2, accelerator="gpu", strategy="horovod", mpi="pmix"),
            "2",
            "2",
            "srun --mpi=pmix --ntasks-per-node=2 ",
        ),
        (dict(devices=8, accelerator="gpu", strategy="elastic"), "1", "8", "srun --ntasks-per-node=1 "),
        (dict(devices=4, gres="gpu:a100:4"), "4", None, "srun --ntasks-per-node=4 "),
    ],
)
def test_devices_drive_tasks_per_node_and_gpus_per_node(
    kwargs: dict, tasks: str, gpus: str | None, launch: str
) -> None:
    job = SlurmJob(CMD, nodes=2, **kwargs)
    header = sbatch_lines(job.render())
    assert f"--ntasks-per-node={tasks}" in header
    assert [h for h in header if h.startswith("--gpus-per-node")] == (
        [f"--gpus-per-node={gpus}"] if gpus else []
    )
    assert launch_line(job.render()).startswith(launch)
    assert job.accelerator == ("gpu" if gpus or "gres" in kwargs else "cpu")
    if kwargs.get("strategy") == "elastic":
        assert "--nproc-per-node=8" in launch_line(job.render())


def test_cli_devices_with_accelerator_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    header = sbatch_lines(cli_script(capsys, "-N", "2", "--devices", "4", "--accelerator", "gpu"))
    assert {"--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4"} <= set(header)


# -- the training command's flags follow from the job -------------------------------------------
@pytest.mark.parametrize(
    ("command", "kwargs", "tail"),
    [
        (
            [*TRAIN, "--max-steps", "5"],
            dict(nodes=2, devices=4, gpus_per_node=4),
            "examples/train.py --max-steps 5 --strategy ld_ddp --devices 4 --accelerator gpu --num-nodes 2",
        ),
        (
            ["python3", "-u", "-m", "lightning_dist.workload.train"],
            dict(devices=2, strategy="DDP"),
            "-m lightning_dist.workload.train --strategy lightning_dist:DDP --devices 2 --accelerator cpu --num-nodes 1",
        ),
        (
            ["/opt/venv/bin/python", "/home/me/lightning-dist/examples/train.py"],
            dict(devices=2, strategy="compressed_powersgd"),
            "examples/train.py --strategy compressed_powersgd --devices 2 --accelerator cpu --num-nodes 1",
        ),
        # Horovod: every rank is one process (devices 1); MPI decides the node count
        (
            TRAIN,
            dict(nodes=2, devices=4, strategy="horovod_adasum", mpi="pmix"),
            "examples/train.py --strategy horovod_adasum --devices 1 --accelerator cpu",
        ),
        # Elastic: torchrun's --nproc-per-node workers per node; the rendezvous decides the node count
        (
            TRAIN,
            dict(nodes=2, devices=8, accelerator="gpu", strategy="elastic"),
            "examples/train.py --strategy elastic --devices 8 --accelerator gpu &",
        ),
        # what the command gives and agrees with the job stays as it is
        (
            [*TRAIN, "--strategy=ld_ddp", "--devices", "4", "--accelerator", "cuda", "--num-nodes", "2"],
            dict(nodes=2, devices=4, accelerator="gpu"),
            "examples/train.py --strategy=ld_ddp --devices 4 --accelerator cuda --num-nodes 2",
        ),
        (
            [*TRAIN, "--accelerator", "auto", "--strategy", "DDP"],
            dict(strategy="lightning_dist:DDP()"),
            "--accelerator auto --strategy DDP --devices 1 --num-nodes 1",
        ),
        # another script: its flags are not known, it is left as it is
        (CMD, dict(devices=4), "python train.py --devices 2"),
    ],
    ids=[
        "ddp-gpu",
        "module-class-name",
        "absolute-path",
        "horovod",
        "elastic",
        "agreeing",
        "auto",
        "other-script",
    ],
)
def test_trainer_flags_are_filled_in_from_the_job(command: list[str], kwargs: dict, tail: str) -> None:
    job = SlurmJob(command, **kwargs)
    assert launch_line(job.render()).endswith(tail), launch_line(job.render())


def test_trainer_flags_always_and_never() -> None:
    always = SlurmJob(["./run.sh", "--devices", "2"], devices=2, trainer_flags="always")
    assert always.command == [
        "./run.sh",
        "--devices",
        "2",
        "--strategy",
        "ld_ddp",
        "--accelerator",
        "cpu",
        "--num-nodes",
        "1",
    ]
    with pytest.raises(ValueError, match=r"has --devices 2 but --devices=4"):
        SlurmJob(["./run.sh", "--devices", "2"], devices=4, trainer_flags="always")
    assert SlurmJob(TRAIN, devices=4, trainer_flags="never").command == TRAIN


@pytest.mark.parametrize(
    ("flags", "kwargs", "reason"),
    [
        (
            ["--devices", "2"],
            dict(devices=4),
            r"the training command has --devices 2 but --devices=4: the Trainer's devices are the ranks",
        ),
        (["--num-nodes", "1"], dict(nodes=2), r"the training command has --num-nodes 1 but --nodes=2"),
        (["--num-nodes=3"], dict(nodes=2, strategy="elastic"), r"--num-nodes 3 but --nodes=2"),
        (
            ["--strategy", "elastic"],
            dict(strategy="ld_ddp"),
            r"has --strategy elastic but the job's --strategy is ld_ddp",
        ),
        (
            ["--accelerator", "gpu"],
            dict(),
            r"has --accelerator gpu but the job's --accelerator is cpu \(no GPUs asked for\)",
        ),
        (
            ["--accelerator", "cpu"],
            dict(devices=4, gpus_per_node=4),
            r"has --accelerator cpu but the job's --accelerator is gpu \(--gpus-per-node=4\)",
        ),
        (
            ["--accelerator", "tpu"],
            dict(),
            r"--accelerator tpu but .*the command may say cpu, gpu, cuda or auto",
        ),
        (
            ["--devices", "4"],
            dict(devices=4, strategy="horovod", mpi="pmix"),
            r"has --devices 4 but horovod \(Horovod\) runs one process per device: --devices=4 ranks per node",
        ),
        (["--devices"], dict(), r"the training command ends with --devices and no value"),
    ],
    ids=[
        "devices",
        "num-nodes",
        "num-nodes-elastic",
        "strategy",
        "accelerator-gpu",
        "accelerator-cpu",
        "accelerator-unknown",
        "devices-horovod",
        "no-value",
    ],
)
def test_trainer_flags_that_contradict_the_job_are_refused(
    flags: list[str], kwargs: dict, reason: str
) -> None:
    with pytest.raises(ValueError, match=reason):
        SlurmJob([*TRAIN, *flags], **kwargs)


def test_cli_takes_unset_options_from_the_training_command(capsys: pytest.CaptureFixture[str]) -> None:
    script = cli_script(
        capsys, "--devices", "2", "--mpi", "pmix", command=(*TRAIN, "--strategy", "horovod_adasum")
    )
    assert launch_line(script) == (
        "srun --mpi=pmix --ntasks-per-node=2 --kill-on-bad-exit=1 python examples/train.py "
        "--strategy horovod_adasum --devices 1 --accelerator cpu"
    )
    script = cli_script(
        capsys, command=(*TRAIN, "--devices", "4", "--num-nodes", "2", "--accelerator", "gpu")
    )
    assert {"--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4"} <= set(sbatch_lines(script))
    assert launch_line(script).endswith("--devices 4 --num-nodes 2 --accelerator gpu --strategy ld_ddp")
    # a script whose flags are not known: nothing is taken from it
    assert "--ntasks-per-node=1" in sbatch_lines(
        cli_script(capsys, command=("python", "train.py", "--devices", "4"))
    )
    argv = [
        "slurm",
        "--gpus-per-node",
        "4",
        "--devices",
        "4",
        "--script",
        "-",
        "--",
        *TRAIN,
        "--accelerator",
        "cpu",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--accelerator cpu but --gpus-per-node=4 asks for GPUs" in err
    assert err.rstrip().endswith("(taken from the training command: --accelerator cpu)")


def test_cli_prints_the_filled_in_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.sbatch"
    assert main(["slurm", "--devices", "2", "--script", str(path), "--", *TRAIN]) == 0
    assert (
        "training command, flags filled in from the job: python examples/train.py --strategy ld_ddp "
        "--devices 2 --accelerator cpu --num-nodes 1"
    ) in capsys.readouterr().out


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--exclusive", "nodes"],
            r"argument --exclusive: invalid choice: 'nodes' \(choose from 'user', 'mcs', 'topo'\)",
        ),
        (
            ["--accelerator", "tpu"],
            r"argument --accelerator: invalid choice: 'tpu' \(choose from 'cpu', 'gpu'\)",
        ),
        (["--trainer-flags", "some"], r"argument --trainer-flags: invalid choice: 'some'"),
        (["-N", "two"], r"argument -N/--nodes: invalid int value: 'two'"),
        (["-c", "many"], r"argument -c/--cpus-per-task: invalid int value: 'many'"),
        (["--sbatch-arg"], r"argument --sbatch-arg: expected one argument"),
    ],
)
def test_cli_refuses_bad_option_values(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["slurm", "--script", "-", *options, "--", "python", "t.py"])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_every_option_has_help_with_its_default() -> None:
    parser = slurm.add_parser(argparse.ArgumentParser().add_subparsers())
    for action in parser._actions:
        if action.dest != "help":
            assert action.help and "default" in action.help, action.option_strings


@pytest.mark.slow
def test_setup_runs_in_the_batch_shell_and_the_ranks_inherit_it(tmp_path: Path) -> None:
    """bash runs the script (a stand-in srun on PATH): setup lines may read unset variables, what they
    export reaches the launch, and the whole script parses."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "srun"
    fake.write_text('#!/bin/sh\necho "srun $*"\necho "FROM_SETUP=$FROM_SETUP"\n')
    fake.chmod(0o755)
    job = SlurmJob(
        TRAIN,
        devices=2,
        requeue=False,
        setup=["export FROM_SETUP=yes", 'echo "unset: ${NOT_SET_ANYWHERE}"'],
        sbatch_args=["--exclude=n07"],
        exclusive=True,
        mail_type="END",
        mail_user="me@example.org",
    )
    path = write_script(job, tmp_path / "job.sbatch")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n1",
    }
    env.pop("NOT_SET_ANYWHERE", None)
    proc = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 0, proc.stderr
    assert (
        "srun --ntasks-per-node=2 --kill-on-bad-exit=1 python examples/train.py --strategy ld_ddp"
        in proc.stdout
    )
    assert "FROM_SETUP=yes" in proc.stdout


# -- every strategy class, by name or as lightning_dist:Class(...) --------------------------------
@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("lightning_dist:DiLoCo(inner_steps=8)", "ld_diloco"),
        ("DiLoCo", "ld_diloco"),
        ("lightning_dist:ShardedDiLoCo(inner_steps=4, replicas=2)", "ld_sharded_diloco"),
        ("lightning_dist:ElasticDiLoCo(inner_steps=4)", "ld_elastic_diloco"),
        ("lightning_dist:FaultTolerantDiLoCo(inner_steps=4)", "ld_fault_tolerant_diloco"),
        ("FaultTolerantDiLoCo", "ld_fault_tolerant_diloco"),
        ("lightning_dist:Sharded(compression='int8')", "ld_sharded_int8"),
        ("lightning_dist:FaultTolerant(compressor='int8')", "ld_fault_tolerant_int8"),
    ],
)
def test_a_class_launches_as_its_registered_name(spec: str, name: str) -> None:
    """``lightning_dist:Class(...)`` starts its ranks as the class's ``ld_`` names do (the DiLoCo
    family's classes were refused: the class table missed them)."""
    by_class, by_name = resolve_strategy(spec), resolve_strategy(name)
    assert (by_class.family, by_class.adasum, by_class.one_process) == (
        by_name.family,
        by_name.adasum,
        by_name.one_process,
    )
    devices = 1 if by_name.one_process else 2
    ours, theirs = (SlurmJob(TRAIN, nodes=2, devices=devices, strategy=s) for s in (spec, name))
    assert ours.launch == theirs.launch
    tail = f"--strategy {spec if ':' in spec else 'lightning_dist:' + spec}"
    assert tail in " ".join(ours.command), ours.command  # the package's trainer gets the class spec


def test_every_strategy_class_is_launched_or_refused_with_the_reason() -> None:
    """Each of the pack's strategy classes is accepted, or refused saying why (never "not a strategy
    lightning-dist can launch"), the same as its registered names."""
    from lightning_dist.strategies import STRATEGIES

    for cls in STRATEGIES:
        try:
            resolve_strategy(f"lightning_dist:{cls}()")
        except ValueError as err:
            assert "is refused under SLURM" in str(err), (cls, err)
    accepted = slurm.accepted_strategies()
    assert {"DiLoCo", "ShardedDiLoCo", "ElasticDiLoCo", "FaultTolerantDiLoCo"} <= set(accepted)


@pytest.mark.parametrize("spec", ["ld_horovod_elastic", "HorovodElastic", "lightning_dist:HorovodElastic()"])
def test_horovod_elastic_is_refused_with_how_to_run_it(spec: str) -> None:
    """HorovodElastic needs horovodrun's elastic driver: under the torchrun script its name used to
    get, every process was Horovod's rank 0 of 1 and trained alone."""
    with pytest.raises(ValueError, match=r"is refused under SLURM: .*horovodrun.*ld_elastic"):
        SlurmJob(TRAIN, nodes=2, devices=2, strategy=spec)


# -- a training command of the user's own --------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "trainer"),
    [
        (
            dict(nodes=2, devices=4, accelerator="gpu"),
            "strategy='ld_ddp', devices=4, num_nodes=2, accelerator='gpu'",
        ),
        (
            dict(nodes=2, devices=4, strategy="ld_horovod", mpi="mpirun"),
            "strategy='ld_horovod', devices=1, accelerator='cpu'",
        ),
        (
            dict(devices=2, strategy="lightning_dist:DiLoCo(inner_steps=8)"),
            "strategy=DiLoCo(inner_steps=8), devices=2, num_nodes=1, accelerator='cpu'",
        ),
        (dict(devices=2, strategy="Elastic"), "strategy=Elastic(), devices=2, accelerator='cpu'"),
    ],
)
def test_a_command_of_ones_own_is_told_what_its_trainer_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kwargs: dict, trainer: str
) -> None:
    """A training command that is not the package's trainer is run as it is: the script (a comment)
    and the command's output say so and what its Trainer must be given; the package's trainer gets no
    such note (its flags are filled in)."""
    job = SlurmJob(["python", "my_train.py"], **kwargs)
    assert job.command == ["python", "my_train.py"]
    note = f"its Trainer needs {trainer}"
    script = job.render()
    comments = " ".join(line.removeprefix("# ") for line in script.splitlines() if line.startswith("# "))
    assert "not the package's trainer" in comments and note in comments, script
    assert "--trainer-flags always" in comments
    assert note not in SlurmJob(TRAIN, **kwargs).render()
    options = [f"--{k.replace('_', '-')}={v}" for k, v in kwargs.items()]
    path = tmp_path / "job.sbatch"
    assert main(["slurm", *options, "--script", str(path), "--", "python", "my_train.py"]) == 0
    out = capsys.readouterr().out
    assert "not the package's trainer" in out and note in out, out
    assert main(["slurm", *options, "--script", str(path), "--", *TRAIN]) == 0
    assert note not in capsys.readouterr().out


def test_never_leaves_the_command_and_says_so() -> None:
    script = SlurmJob(TRAIN, devices=2, trainer_flags="never").render()
    comments = " ".join(line.removeprefix("# ") for line in script.splitlines() if line.startswith("# "))
    assert "left as it is (--trainer-flags never)" in comments
    assert "its Trainer needs strategy='ld_ddp', devices=2, num_nodes=1, accelerator='cpu'" in comments


@pytest.mark.parametrize(
    ("kwargs", "cpus", "srun_cpus"),
    [
        (dict(devices=4, accelerator="gpu"), "8", "8"),  # the default for a GPU task
        (dict(devices=4, accelerator="gpu", cpus_per_task=16), "16", "16"),
        (dict(devices=4, gres="gpu:a100:4", cpus_per_task=2), "2", "2"),
        (dict(devices=4, accelerator="gpu", strategy="ld_elastic"), "32", "32"),  # one torchrun: 4 x 8
        (dict(devices=2, cpus_per_task=3), "3", "3"),
        (dict(devices=2), None, None),  # CPU ranks: SLURM's default, as before
        (dict(devices=4, accelerator="gpu", strategy="ld_horovod", mpi="mpirun"), "8", None),
    ],
)
def test_gpu_tasks_get_cpus_for_their_dataloader_workers(
    kwargs: dict, cpus: str | None, srun_cpus: str | None
) -> None:
    """A GPU task gets 8 CPUs unless -c/--cpus-per-task says otherwise, and srun is told too (since
    SLURM 22.05 srun does not inherit sbatch's --cpus-per-task: SRUN_CPUS_PER_TASK)."""
    script = SlurmJob(CMD, nodes=2, **kwargs).render()
    assert [h for h in sbatch_lines(script) if h.startswith("--cpus-per-task")] == (
        [f"--cpus-per-task={cpus}"] if cpus else []
    )
    exported = [line for line in script.splitlines() if line.startswith("export SRUN_CPUS_PER_TASK=")]
    assert exported == ([f"export SRUN_CPUS_PER_TASK={srun_cpus}"] if srun_cpus else [])


def test_cli_cpus_per_task_help_names_the_gpu_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["slurm", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "-c CPUS_PER_TASK, --cpus-per-task CPUS_PER_TASK" in text
    assert "default 8 per GPU task" in text
