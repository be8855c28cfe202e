"""The ``lightning-dist slurm`` command line: its options, their help and defaults."""

from __future__ import annotations

import argparse
from typing import Any, Optional

from typing_extensions import override

from lightning_dist.launch.slurm_options import (
    ACCELERATORS,
    EXCLUSIVE,
    GPU_CPUS_PER_TASK,
    MAIL_TYPES,
    MPI_LAUNCHES,
    TRAINER_FLAG_MODES,
)

DESCRIPTION = """\
Write (and with --submit, submit) an sbatch script that runs TRAINING_COMMAND (everything after
`--`) with --nodes x --devices ranks of --strategy. --devices is the devices (GPUs, or CPU
processes) of each node, one rank per device: #SBATCH --ntasks-per-node and, with --accelerator gpu,
--gpus-per-node. How the ranks start depends on the strategy: DDP/Compressed: `srun
--ntasks-per-node=DEVICES` (the Trainer has devices=DEVICES, num_nodes=NODES); Horovod/HorovodAdasum:
one MPI job (`srun --mpi=pmix`, else mpirun; the Trainer has devices=1); Elastic: one torchrun per
node with a c10d rendezvous on the first node; FaultTolerant: torchft's Lighthouse on the first node
and one replica group per node (--devices 1).
Say things once (--trainer-flags): when TRAINING_COMMAND runs the package's trainer
(examples/train.py, python -m lightning_dist.workload.train), the --strategy, --devices,
--accelerator and (DDP family) --num-nodes it leaves out are appended from these options, and these
options, when not given, are taken from it; a value given on both sides must agree. Any other
command is run as it is, with a note (printed, and atop the script) of the Trainer arguments its
ranks need. A GPU task gets --cpus-per-task 8 (its DataLoader workers need cores) unless -c says
otherwise.
With requeue (default) SIGUSR1 comes --signal-seconds before --time: Lightning saves an hpc
checkpoint and requeues the job, which resumes from it; Elastic resumes from its commits.
Bad combinations are refused before anything is written."""

EPILOG = """\
examples:
  lightning-dist slurm -N 2 --devices 4 --accelerator gpu -p gpu -t 4:00:00 -A proj \\
      --setup 'module load cuda' --setup 'source .venv/bin/activate' -- python examples/train.py
      # runs: python examples/train.py --strategy ld_ddp --devices 4 --accelerator gpu --num-nodes 2
  lightning-dist slurm --devices 2 --submit -- python examples/train.py --strategy ld_horovod_adasum
  lightning-dist slurm -N 4 --min-nodes 2 --devices 8 --gres gpu:a100:8 --strategy ld_elastic \\
      --sbatch-arg --exclude=n07 --mail-type END,FAIL -- python train.py --devices 8"""


class _SlurmParser(argparse.ArgumentParser):
    """Reads ``--sbatch-arg --x=y`` (and ``--setup -x``) as the option and its value: argparse alone
    takes a separate word that starts with ``-`` for an option of its own ("expected one argument")."""

    @override
    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if args is not None:
            words, args = list(args), []
            while words:
                word = words.pop(0)
                args.append(
                    f"{word}={words.pop(0)}" if word in ("--sbatch-arg", "--setup") and words else word
                )
        return super().parse_known_args(args, namespace)


TEXT_OPTIONS: tuple[tuple[str, str, Optional[str], str], ...] = (
    ("-p", "--partition", None, "#SBATCH --partition; default the cluster's"),
    (
        "-t",
        "--time",
        None,
        "time limit, SLURM format (e.g. 30, 4:00:00, 1-12); default none (the partition's)",
    ),
    ("-J", "--job-name", "lightning-dist", "#SBATCH --job-name; default lightning-dist"),
    ("-A", "--account", None, "#SBATCH --account to charge; default your default account"),
    ("-q", "--qos", None, "#SBATCH --qos; default the account's"),
    (
        "-C",
        "--constraint",
        None,
        "#SBATCH --constraint, node features (e.g. a100, 'a100&ib', '[rack1|rack2]'); default none",
    ),
)
"""The plain one-value options of ``lightning-dist slurm``: short and long flag, default, help."""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    p = sub.add_parser(
        "slurm",
        help="write (and --submit) an sbatch script for a strategy; the training command follows `--`",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="lightning-dist slurm [options] -- TRAINING_COMMAND ...",
    )
    if type(p) is argparse.ArgumentParser:
        p.__class__ = _SlurmParser
    from_command = (
        "default: the training command's {flag} when it has one (see --trainer-flags), else {default}"
    )
    p.add_argument(
        "-N",
        "--nodes",
        type=int,
        help="nodes (#SBATCH --nodes; the Trainer's num_nodes); "
        + from_command.format(flag="--num-nodes", default=1),
    )
    p.add_argument(
        "--devices",
        type=int,
        help="devices per node, GPUs or CPU processes, one rank (SLURM task) each: #SBATCH --ntasks-per-node "
        "(Elastic: one task per node running torchrun --nproc-per-node=DEVICES), with --accelerator gpu "
        "also --gpus-per-node; the Trainer's devices (Horovod: 1 per rank); "
        + from_command.format(flag="--devices", default=1)
        + " (Horovod: not taken, the command's is 1 per rank)",
    )
    p.add_argument(
        "--accelerator",
        choices=ACCELERATORS,
        help="cpu or gpu: with gpu, --gpus-per-node defaults to --devices and the training command gets "
        "--accelerator gpu; default: gpu when --gpus-per-node, a GPU --gres or the training command's "
        "--accelerator ask for GPUs, else cpu",
    )
    p.add_argument(
        "--strategy",
        help="strategy name: ld_ddp, ld_ddp_adasum, ld_compressed_<name>, ld_diloco, ld_sharded, ld_horovod, "
        "ld_horovod_adasum, ld_elastic, ld_fault_tolerant (`lightning-dist strategies` lists them all), a class "
        "name (DDP, Compressed, DiLoCo, Sharded, ShardedDiLoCo, Horovod, HorovodAdasum, Elastic, ElasticDiLoCo, "
        "FaultTolerant, FaultTolerantDiLoCo), "
        "'lightning_dist:Class(kw=...)' or "
        "Lightning's ddp; decides how the ranks start; "
        + from_command.format(flag="--strategy", default="ld_ddp"),
    )
    p.add_argument(
        "--trainer-flags",
        choices=TRAINER_FLAG_MODES,
        default="auto",
        help="the training command's --strategy/--devices/--accelerator/--num-nodes: auto (default): when it "
        "runs the package's trainer (examples/train.py, python -m lightning_dist.workload.train) the ones "
        "it leaves out are appended from the job (--num-nodes for the DDP family only: Horovod and Elastic "
        "take the node count from MPI and the rendezvous), the ones it gives must agree with the job, "
        "and unset options here are taken from them; always: the same for any command (your script takes "
        "these flags as examples/train.py does); never: the command is left as it is",
    )
    for short, option, default, text in TEXT_OPTIONS:
        p.add_argument(short, option, default=default, help=text)
    p.add_argument(
        "--exclusive",
        nargs="?",
        const=True,
        default=False,
        choices=EXCLUSIVE,
        help="#SBATCH --exclusive: whole nodes, shared with no other job; --exclusive=user|mcs|topo: "
        "SLURM's variants; default off (the partition's sharing)",
    )
    p.add_argument(
        "-o",
        "--output",
        default="%x-%j.out",
        help="output file, SLURM patterns, appended across requeues; default %%x-%%j.out",
    )
    p.add_argument(
        "-c",
        "--cpus-per-task",
        type=int,
        help=f"CPUs per rank (Elastic: per worker), for its dataloader workers; default {GPU_CPUS_PER_TASK} per "
        "GPU task (with --accelerator gpu), SLURM's (1) for CPU ranks",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        help="GPUs per node (>= --devices; every task sees all of them); default --devices with "
        "--accelerator gpu, else 0",
    )
    p.add_argument(
        "--gres",
        help="#SBATCH --gres, generic resources (e.g. gpu:4, gpu:a100:4, gpu:2,nvme:1); a GPU count here "
        "replaces --gpus-per-node (then it is not written); default none",
    )
    p.add_argument("--mem", help="memory per node, e.g. 64G; default SLURM's")
    p.add_argument(
        "--mail-type",
        help=f"#SBATCH --mail-type, comma-separated: {', '.join(MAIL_TYPES)}; default none (no mail)",
    )
    p.add_argument(
        "--mail-user",
        help="#SBATCH --mail-user (needs --mail-type); default the submitting user",
    )
    p.add_argument(
        "--setup",
        action="append",
        metavar="LINE",
        help="a shell line the batch script runs before the launch, e.g. 'module load cuda' or "
        "'source .venv/bin/activate' (the ranks inherit its environment); repeat for more lines, run in "
        "order; default none",
    )
    p.add_argument(
        "--sbatch-arg",
        action="append",
        metavar="ARG",
        help="another sbatch option, written as '#SBATCH ARG' (e.g. --sbatch-arg --exclude=n07; a bare "
        "reservation=r1 gets '--'); one option each, repeatable; options written from the ones above are "
        "refused; default none",
    )
    p.add_argument(
        "--signal-seconds",
        type=int,
        default=90,
        help="seconds before the time limit that SIGUSR1 comes (save + requeue); default 90",
    )
    p.add_argument(
        "--requeue",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--requeue (default): requeue on the signal and resume; --no-requeue: neither",
    )
    p.add_argument(
        "--port",
        type=int,
        help="Elastic: rendezvous port (default 30000 + job id mod 10000); DDP: MASTER_PORT (default Lightning's, "
        "from the job id)",
    )
    p.add_argument(
        "--master-addr",
        help="address of the first node when its host name does not resolve (MASTER_ADDR, Elastic's "
        "rendezvous); default the first node's host name",
    )
    p.add_argument(
        "--mpi",
        choices=MPI_LAUNCHES,
        help="Horovod only: auto (default: srun --mpi=pmix when `srun --mpi=list` has it, else mpirun), pmix, pmi2, "
        "mpirun",
    )
    p.add_argument(
        "--min-nodes",
        type=int,
        help="Elastic only: keep training down to this many nodes (torchrun --nnodes=MIN:NODES); default "
        "none (always --nodes)",
    )
    p.add_argument(
        "--max-restarts", type=int, default=3, help="Elastic only: torchrun --max-restarts; default 3"
    )
    p.add_argument(
        "-D",
        "--chdir",
        help="working directory of the job (Lightning's default_root_dir: hpc checkpoints, Elastic commits); "
        "default the submission directory",
    )
    p.add_argument(
        "--script",
        help="where to write the script ('-': print it); default ./<job-name>.sbatch",
    )
    p.add_argument(
        "--submit",
        action="store_true",
        help="submit it with sbatch and print the job id; default: only write",
    )
    return p
