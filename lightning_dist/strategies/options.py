"""The strategies' options, declared once, as the compressors' configs are: each group is a dataclass
(``options_training``: launch, DDP, DiLoCo, Horovod, Sharded; ``options_resilience``: Elastic,
FaultTolerant) whose fields are the options (default and docstring each) and whose ``__post_init__``
checks them, raising a ``ValueError`` that names the argument and what is accepted. This module holds
what they share: the vocabularies and the helpers that build and list the groups.

A strategy's constructor keeps its explicit keyword arguments (what IDEs and LightningCLI read),
builds the groups it takes from them (``options_from(DDPOptions, locals())``), and accepts exactly
their fields: ``option_names`` lists them and ``reject_unknown_options`` refuses anything else,
naming every accepted one. Reduction ops have
one vocabulary, ``lightning_dist.collectives.ops`` (``"avg"``/``"mean"``/``"average"``,
``"sum"``/``"add"``, torch's ``ReduceOp``, ``"adasum"``). No Lightning import here: the package root
reads the vocabularies below to register the strategy names before Lightning is loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any, TypeVar

from lightning_dist.checks import check_choice, reject_unknown_options
from lightning_dist.collectives.ops import normalize_op, op_name

__all__ = [
    "COMPRESSED_REDUCE_OPS",
    "DILOCO_COMPRESSIONS",
    "DILOCO_LOWBIT_COMPRESSIONS",
    "FAULT_TOLERANT_REDUCE_OPS",
    "GRADIENT_REDUCE_OPS",
    "HOROVOD_COMPRESSIONS",
    "HOROVOD_OPS",
    "PROCESS_GROUP_BACKENDS",
    "SHARDED_COMPRESSIONS",
    "SHARDED_REDUCE_OPS",
    "START_METHODS",
    "check_choice",
    "normalize_op",
    "op_name",
    "option_names",
    "options_from",
    "reject_unknown_options",
]

PROCESS_GROUP_BACKENDS = (None, "gloo", "nccl", "mpi")
START_METHODS = ("auto", "popen", "spawn", "fork", "forkserver")
GRADIENT_REDUCE_OPS = ("avg", "sum", "adasum")
"""How ``DDP`` combines gradients."""
COMPRESSED_REDUCE_OPS = ("avg", "adasum")
"""How ``Compressed`` (and ``Elastic``) combine gradients."""
FAULT_TOLERANT_REDUCE_OPS = ("avg", "adasum")
"""How ``FaultTolerant`` combines the quorum's groups' gradients (the mean over the step's samples, or
Adasum of each group's mean)."""
HOROVOD_OPS = ("avg", "sum")
"""How ``Horovod`` combines gradients (Adasum of the updates is ``HorovodAdasum``)."""
HOROVOD_COMPRESSIONS = (None, "none", "fp16", "bf16")
DILOCO_COMPRESSIONS = ("none", "fp16", "bf16", "int8")
"""Compressors whose exchange returns the average over ranks (what the pseudo-gradient needs), each
with registered ``ld_diloco_<name>`` strategy names."""
DILOCO_LOWBIT_COMPRESSIONS = ("int4", "sparseloco")
"""The low-bit pseudo-gradient formats DiLoCo also takes (``docs/wire-formats-lowbit.md``)."""
SHARDED_COMPRESSIONS = (None, "bf16", "fp16", "int8")
"""How ``Sharded`` reduce-scatters gradients inside a shard group (None: fp32, uncompressed)."""
SHARDED_REDUCE_OPS = ("avg", "adasum")
"""How ``Sharded`` combines the replica groups' shard gradients (HSDP)."""

T = TypeVar("T")


def options_from(group: type[T], arguments: Mapping[str, Any]) -> T:
    """``group`` built (and so checked) from the same-named entries of ``arguments``, a constructor's
    ``locals()``: the options are named once, as the dataclass's fields."""
    return group(**{f.name: arguments[f.name] for f in fields(group) if f.init})  # type: ignore[arg-type]


def option_names(*groups: type, without: Iterable[str] = ()) -> list[str]:
    """The fields of the option dataclasses ``groups``, in order, each once, less ``without``."""
    names = dict.fromkeys(f.name for group in groups for f in fields(group) if f.init)
    return [name for name in names if name not in set(without)]
