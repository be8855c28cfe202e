"""Emulate a cluster on one machine (Linux, root): see docs/emulate-cluster.md.

- ``EmulatedCluster`` (``netns.py``): N "nodes", each a network namespace, joined by veth links
  that ``tc tbf`` can cap at a bandwidth; ``run_each`` starts one process per node with
  ``MASTER_ADDR``, ``NODE_RANK`` and ``GLOO_SOCKET_IFNAME`` set, ``mpirun_args`` an mpirun across
  them. What Gloo, NCCL's socket transport, MPI and torchrun see is a real multi-node network.
- ``SlurmNodes`` (``slurm_nodes.py``): a real SLURM cluster on those nodes (``slurmd`` per node,
  ``slurmctld`` on the first), for ``srun``/``sbatch`` across nodes.

    with EmulatedCluster(nodes=2, rate_mbit=1000) as cluster:
        cluster.run_each([sys.executable, "train.py", "--num-nodes", "2"], timeout=600)

    python -m lightning_dist.cluster.netns run --nodes 2 --rate-mbit 1000 -- python train.py

Both tear everything down on leaving the ``with`` block, errors included. Pure Python (iproute2 and,
for ``SlurmNodes``, SLURM and munge on the machine); the pack's tests, benchmarks and the
``lightning-dist demo`` capped-link column use it.
"""

from lightning_dist.cluster.netns import (
    ClusterUnavailable,
    EmulatedCluster,
    Node,
    remove_cluster,
    unavailable_reason,
)
from lightning_dist.cluster.slurm_nodes import SlurmNodes

__all__ = [
    "ClusterUnavailable",
    "EmulatedCluster",
    "Node",
    "SlurmNodes",
    "remove_cluster",
    "unavailable_reason",
]
