"""``Sharded``'s device mesh, and which meshes a module it trains may be sharded over.

The mesh is ``(replicate, shard)`` of shape ``(replicas, world_size / replicas)``, with both
dimensions flattened as ``"data_parallel"`` (every rank reads different data, the name
``ModelParallelStrategy`` gives its data-parallel dimension). The flattened mesh is kept here, so the
strategy reads it without slicing it from the root mesh (torch deprecates that).

A module is accepted when FSDP2 shards it over this rank's shard group and leaves the replica groups
to ``Sharded``: over ``device_mesh["shard"]``, or over a mesh of the same ranks (with one replica
group, ``device_mesh["data_parallel"]``, and the 2-D ``device_mesh`` itself, whose replicate
dimension then has one rank: code written for ``ModelParallelStrategy`` runs unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("replicate", "shard")
DATA_PARALLEL = "data_parallel"


@dataclass
class ShardedMesh:
    """The root ``(replicate, shard)`` mesh and its flattened ``data_parallel`` mesh."""

    root: DeviceMesh
    data_parallel: DeviceMesh

    @classmethod
    def build(cls, device_type: str, replicas: int, shards: int) -> ShardedMesh:
        root = init_device_mesh(device_type, (replicas, shards), mesh_dim_names=MESH_DIMS)
        return cls(root, root[MESH_DIMS]._flatten(DATA_PARALLEL))


def _ranks(mesh: DeviceMesh) -> list[int]:
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def mesh_refusal(mesh: DeviceMesh, shard_mesh: DeviceMesh, replicas: int, module: str) -> Optional[str]:
    """Why ``Sharded(replicas=replicas)`` cannot train ``module`` (a class name) sharded over ``mesh``,
    or None when it can (``mesh`` holds this rank's shard group, ``shard_mesh``, and no other rank)."""
    shards = shard_mesh.size()
    ranks, shard_ranks = _ranks(mesh), _ranks(shard_mesh)
    if ranks == shard_ranks and (mesh.ndim == 1 or mesh.shape[0] == 1):
        return None
    where = f"Sharded: {module} is sharded over {mesh}"
    fix = f"shard every module over the {shards}-rank shard mesh: fully_shard(module, mesh=self.device_mesh['shard'])"
    if replicas > 1 and len(ranks) == replicas * shards:
        if mesh.ndim == 1:
            what = (
                f"every one of the {len(ranks)} ranks (FSDP over all of them), but Sharded(replicas={replicas}) "
                f"shards inside each replica group and syncs the {replicas} groups itself"
            )
        else:
            what = (
                f"a 2-D mesh: FSDP2 would all-reduce across the {replicas} replica groups itself, outside "
                "replica_sync and the strategy's counters"
            )
        return (
            f"{where}, {what}; {fix}, or train it with Sharded() (replicas=1, one shard group of every rank)"
        )
    return f"{where}; Sharded does the replica sync itself, so {fix}"
