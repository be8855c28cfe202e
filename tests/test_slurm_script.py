"""`lightning-dist slurm`: the script each strategy family gets, the refused combinations (before
anything is written) and `--help` (fast: in-process, no sbatch; the jobs run in tests/test_slurm.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_dist.cli import main
from lightning_dist.launch import slurm
from lightning_dist.launch.slurm import SlurmJob, parse_time, resolve_strategy

CMD = ["python", "train.py", "--devices", "2"]


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
    assert "--ntasks-per-node=1" in header and "--cpus-per-task=8" in header and "--gpus-per-node=8" in header
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
            dict(strategy="lightning_dist:Horovod(op='adasum')", nodes=1, devices=6, mpi="pmix"),
            r"power-of-two number of ranks",
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
        (
            dict(strategy="ld_ddp_spawn"),
            r"refused under SLURM: it starts its own processes \(start_method='spawn'\)",
        ),
        (
            dict(strategy="lightning_dist:DDP(start_method='fork')"),
            r"start_method='fork' starts its own processes",
        ),
        (dict(strategy="fsdp"), r"is not a strategy lightning-dist can launch"),
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
    documented = set(re.findall(r"^\s+(--[a-z-]+)", text, flags=re.M))
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
    }
    assert expected <= documented, expected - documented
    assert "--no-requeue" in text and "TRAINING_COMMAND" in text
