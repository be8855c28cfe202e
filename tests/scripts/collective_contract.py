"""Every collective a LightningModule or callback reaches through its strategy, recorded per rank.

python tests/scripts/collective_contract.py --strategy ddp --out DIR            # Lightning's reference
python tests/scripts/collective_contract.py --strategy DDP --out DIR            # a pack strategy
torchrun --standalone --nproc-per-node 2 tests/scripts/collective_contract.py --strategy Elastic ...
python -m lightning_dist.launch.fault_tolerant --groups 2 -- tests/scripts/collective_contract.py --strategy FaultTolerant ...
mpirun -np 2 python tests/scripts/collective_contract.py --strategy Horovod --out DIR

Two optimizer steps on a tiny linear model, then at the end of the training epoch: ``all_gather``
(scalars, vectors, integers, a nested collection, ``group=WORLD``, ``sync_grads=True`` with the
gradient that flows back), ``strategy.reduce`` (sum/mean/min/max, ``ReduceOp.SUM``, group None and
WORLD), ``broadcast`` from rank 0 and rank 1, ``barrier``, ``reduce_boolean_decision`` and
``self.log(..., sync_dist=True)`` with and without ``sync_dist_group``; for a pack strategy on
torch.distributed also a group of all ranks (works) and a subgroup (refused: ``pack_*``). Each rank saves what it got to
``DIR/rank{r}.pt`` (a flat dict of tensors), which the test compares with Lightning's ``"ddp"``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import convert_to_tensors
from rank_io import parse
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist
from lightning_dist import collectives
from lightning_dist.workload.trainer import quiet_trainer

STRATEGIES: dict[str, Any] = {
    "ddp": lambda: "ddp",
    "DDP": lambda: lightning_dist.DDP(),
    "Compressed": lambda: lightning_dist.Compressed("int8"),
    "DiLoCo": lambda: lightning_dist.DiLoCo(inner_steps=2),
    "Elastic": lambda: lightning_dist.Elastic(commit_every=1),
    "ElasticDiLoCo": lambda: lightning_dist.ElasticDiLoCo(inner_steps=2, commit_every=1),
    "FaultTolerant": lambda: lightning_dist.FaultTolerant(replica_groups=2, commit_every=0),
    "Horovod": lambda: lightning_dist.Horovod(),
    "HorovodAdasum": lambda: lightning_dist.HorovodAdasum(),
}
"""Every strategy of the pack, by class name, and Lightning's own DDPStrategy as ``ddp``."""


def _place(module: L.LightningModule) -> tuple[int, int]:
    """(rank, world size) of the strategy's collectives: Lightning's, except for ``FaultTolerant``,
    whose Lightning ranks are its replica group's and whose collectives span the quorum's groups."""
    transport = getattr(module.trainer.strategy, "transport", None)
    if transport is not None:
        return transport.communicator.rank, transport.communicator.world_size
    return module.global_rank, module.trainer.strategy.world_size


def _world() -> Any:
    """What Lightning passes for "no group" (``LightningModule.all_gather``): the default group."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class Contract(L.LightningModule):
    def __init__(self, pack: bool) -> None:
        super().__init__()
        self.pack = pack
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 1)
        self.got: dict[str, Tensor] = {}
        self.rank: int | None = None
        """This process's rank in the strategy's collectives (``_place``), seen during fit."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        r = float(_place(self)[0] + 1)
        self.log("log_mean", r * (batch_idx + 1), sync_dist=True)
        self.log("log_sum", r, sync_dist=True, reduce_fx="sum")
        self.log("log_max", r, sync_dist=True, reduce_fx="max")
        self.log("log_world", r * 10, sync_dist=True, sync_dist_group=_world())
        self.log("log_local", r)  # no sync: each rank keeps its own
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(1)
        return DataLoader(
            TensorDataset(torch.randn(8, 3, generator=gen), torch.randn(8, 1, generator=gen)), 2
        )

    def on_train_epoch_end(self) -> None:
        (rank, world_size), got = _place(self), self.got
        self.rank = rank
        strategy = self.trainer.strategy
        r = torch.tensor(float(rank + 1))
        vec = torch.arange(3, dtype=torch.float32) + 10 * rank
        got["gather_scalar"] = self.all_gather(r)
        got["gather_vector"] = self.all_gather(vec)
        got["gather_matrix"] = self.all_gather(vec.reshape(1, 3).repeat(2, 1))
        got["gather_int"] = self.all_gather(torch.tensor([rank, 7], dtype=torch.int64))
        got["gather_world"] = self.all_gather(vec, group=_world())
        nested = self.all_gather({"a": r, "b": [vec, (vec * 2, torch.tensor(rank))]})
        got["nested_a"], got["nested_b0"] = nested["a"], nested["b"][0]
        got["nested_b1_0"], got["nested_b1_1"] = nested["b"][1][0], nested["b"][1][1]
        with torch.enable_grad():
            leaf = (torch.arange(2, dtype=torch.float32) + rank).requires_grad_()
            gathered = self.all_gather(leaf, sync_grads=True)
            weights = torch.arange(2 * world_size, dtype=torch.float32).reshape(-1, 2) * (rank + 1)
            (gathered * weights).sum().backward()
        got["gather_grad_values"], got["gather_grad"] = gathered.detach(), leaf.grad
        for op in ("sum", "mean", "min", "max"):
            got[f"reduce_{op}"] = strategy.reduce(vec.clone(), reduce_op=op)
            got[f"reduce_{op}_world"] = strategy.reduce(vec.clone(), group=_world(), reduce_op=op)
        got["reduce_default"] = strategy.reduce(vec.clone())
        got["reduce_redop_sum"] = strategy.reduce(vec.clone(), reduce_op=dist.ReduceOp.SUM)
        got["reduce_int_sum"] = strategy.reduce(torch.tensor([rank + 1, 5]), reduce_op="sum")
        got["reduce_int_mean"] = strategy.reduce(torch.tensor([rank + 2, 5]), reduce_op="mean")
        source = vec.clone()
        strategy.reduce(source, reduce_op="sum")
        got["reduce_source_after"] = source
        got["reduce_not_tensor"] = torch.tensor(strategy.reduce(rank + 1))
        got["broadcast_0"] = convert_to_tensors(strategy.broadcast(vec.clone(), src=0), "cpu")
        got["broadcast_1"] = torch.tensor(strategy.broadcast({"rank": rank}, src=1)["rank"])
        strategy.barrier("contract")
        got["decision_all"] = torch.tensor(strategy.reduce_boolean_decision(rank == 0, all=True))
        got["decision_any"] = torch.tensor(strategy.reduce_boolean_decision(rank == 0, all=False))
        got["decision_all_true"] = torch.tensor(strategy.reduce_boolean_decision(True, all=True))
        if self.pack and _world() is not None:  # groups of the pack's own choosing (Lightning has none)
            everyone = dist.new_group(list(range(world_size)))
            got["pack_reduce_all_ranks_group"] = strategy.reduce(vec.clone(), group=everyone, reduce_op="sum")
            subgroup = dist.new_group([0])
            try:
                strategy.reduce(vec.clone(), group=subgroup)
            except ValueError as exc:
                got["pack_subgroup_refused"] = torch.tensor("is not supported" in str(exc))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", required=True, choices=sorted(STRATEGIES))
    a = parse(p, argv)
    # one process per mpirun rank; torchrun's processes per node; else Lightning starts 2
    devices = 1 if "OMPI_COMM_WORLD_SIZE" in os.environ else int(os.environ.get("LOCAL_WORLD_SIZE", "2"))
    model = Contract(pack=a.strategy != "ddp")
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=devices,
        strategy=STRATEGIES[a.strategy](),
        max_steps=2,
        limit_val_batches=0,
        default_root_dir=a.out,
    )
    trainer.fit(model)
    rank = trainer.global_rank if model.rank is None else model.rank
    got = dict(model.got)
    for name, value in trainer.callback_metrics.items():
        if name.startswith("log_"):  # the module's own (a strategy may log its counters too)
            got[f"metric_{name}"] = value.detach().cpu()
    os.makedirs(a.out, exist_ok=True)
    torch.save(got, os.path.join(a.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
    collectives.shutdown()
