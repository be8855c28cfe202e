"""Train the embedded workload (a byte-level transformer LM on the stdlib sources) with any strategy.

    python examples/train.py --strategy ld_ddp --devices 2                    # 2 CPU processes
    python examples/train.py --strategy "lightning_dist:DDP(reduce_op='adasum')"
    python examples/train.py --strategy ddp                                   # Lightning's own DDP
    torchrun --nproc_per_node 2 examples/train.py --strategy ld_ddp --devices 2
    srun -N 1 --ntasks-per-node 2 python examples/train.py --strategy ld_ddp --devices 2
    mpirun -np 2 python examples/train.py --strategy ld_horovod_adasum --devices 1
    python examples/train.py --accelerator gpu --devices 8 --precision bf16-mixed

Prints rank 0's summary as JSON (final validation loss, median step time, bytes sent per step).
"""

from lightning_dist.workload.train import main

if __name__ == "__main__":
    main()
