"""Gradient compressors: pure tensor algorithms with their state; no transport (see ``protocol``).

Modules: ``protocol`` (rounds, exchanges, the ``Compressor`` base and its state), ``wire`` (bytes one
rank sends per collective), ``packing`` (pure tensor helpers), ``sparse`` (gathered (value, index)
pairs), and one module per algorithm family: ``dense`` (none, fp16, bf16), ``int8``, ``topk``,
``powersgd``, ``sign``, ``decoupled_momentum`` (demo), ``int4``, ``sparseloco``.
"""

from __future__ import annotations

from typing import Any

from lightning_dist.compression.decoupled_momentum import DeMo, DeMoConfig
from lightning_dist.compression.dense import BF16Compression, FP16Compression, NoCompression
from lightning_dist.compression.int4 import Int4Config, Int4Quantization
from lightning_dist.compression.int8 import Int8Config, Int8Quantization
from lightning_dist.compression.powersgd import PowerSGD, PowerSGDConfig
from lightning_dist.compression.protocol import Compressor, Exchange, NoOptions, Round, simulate
from lightning_dist.compression.sign import Sign, SignConfig
from lightning_dist.compression.sparseloco import SparseLoCo, SparseLoCoConfig
from lightning_dist.compression.topk import TopK, TopKConfig
from lightning_dist.compression.wire import (
    all_gather_bytes,
    all_to_all_bytes,
    reference_bytes,
    ring_all_reduce_bytes,
)

COMPRESSORS: dict[str, type[Compressor]] = {
    "none": NoCompression,
    "fp16": FP16Compression,
    "bf16": BF16Compression,
    "int8": Int8Quantization,
    "topk": TopK,
    "powersgd": PowerSGD,
    "sign": Sign,
    "demo": DeMo,
    "int4": Int4Quantization,
    "sparseloco": SparseLoCo,
}


def make_compressor(name: str, **options: Any) -> Compressor:
    """Build a compressor by name (``"powersgd"``, ``rank=4``); bad names or options raise ValueError."""
    cls = COMPRESSORS.get(str(name).lower())
    if cls is None:
        raise ValueError(f"compressor={name!r} is not known; accepted: {', '.join(COMPRESSORS)}")
    return cls(**options)


__all__ = [
    "COMPRESSORS",
    "BF16Compression",
    "Compressor",
    "DeMo",
    "DeMoConfig",
    "Exchange",
    "FP16Compression",
    "Int4Config",
    "Int4Quantization",
    "Int8Config",
    "Int8Quantization",
    "NoCompression",
    "NoOptions",
    "PowerSGD",
    "PowerSGDConfig",
    "Round",
    "Sign",
    "SignConfig",
    "SparseLoCo",
    "SparseLoCoConfig",
    "TopK",
    "TopKConfig",
    "all_gather_bytes",
    "all_to_all_bytes",
    "make_compressor",
    "reference_bytes",
    "ring_all_reduce_bytes",
    "simulate",
]
