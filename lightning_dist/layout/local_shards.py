"""This rank's part of sharded tensors and of an optimizer's state over them (DTensor or plain)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


def local_shard(param: Tensor) -> Tensor:
    """The tensor this rank holds of ``param``: a DTensor's local shard (an alias under ``no_grad``:
    writing it writes the parameter), any other tensor itself."""
    return param.to_local() if isinstance(param, DTensor) else param


def like_param(local: Tensor, param: Tensor) -> Tensor:
    """``local`` (this rank's part of something shaped and sharded like ``param``) as a DTensor
    placed like ``param``, so the distributed checkpoint saves it as one tensor and can reshard it."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def local_optimizer_state(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> dict[str, Any]:
    """This rank's part of ``optimizer``'s state, by parameter name: local shards on the CPU."""
    out: dict[str, Any] = {}
    for param, state in optimizer.state.items():
        out[names[id(param)]] = {
            k: local_shard(v).detach().cpu().clone() if isinstance(v, Tensor) else v for k, v in state.items()
        }
    return out


def restore_local_optimizer_state(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], saved: Mapping[str, Any]
) -> None:
    """Write ``saved`` (``local_optimizer_state``'s) into ``optimizer``'s state in place: the state must
    exist (the distributed checkpoint's optimizer entry was loaded first) with the same entries."""
    have = {names[id(p)]: s for p, s in optimizer.state.items()}
    if set(have) != set(saved) or any(set(have[n]) != set(saved[n]) for n in saved):
        raise ValueError(
            f"ShardedDiLoCo: this rank's saved inner optimizer state holds {sorted(saved)[:5]}..., the "
            f"optimizer {sorted(have)[:5]}...: resume with the configure_optimizers of the run that saved it"
        )
    with torch.no_grad():
        for name, state in have.items():
            for k, v in state.items():
                if isinstance(v, Tensor):
                    local_shard(v).copy_(saved[name][k])
                else:
                    state[k] = saved[name][k]
