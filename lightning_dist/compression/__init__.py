"""Gradient compressors: pure tensor algorithms with their state; no transport (see ``base``)."""

from __future__ import annotations

from typing import Any

from lightning_dist.compression.base import (
    Compressor,
    Exchange,
    Round,
    all_to_all_bytes,
    allgather_bytes,
    reference_bytes,
    ring_allreduce_bytes,
    simulate,
)
from lightning_dist.compression.cast import BF16Compression, FP16Compression
from lightning_dist.compression.demo import DeMo, DeMoConfig
from lightning_dist.compression.int8 import Int8Config, Int8Quantization
from lightning_dist.compression.none import NoCompression
from lightning_dist.compression.powersgd import PowerSGD, PowerSGDConfig
from lightning_dist.compression.sign import Sign, SignConfig
from lightning_dist.compression.topk import TopK, TopKConfig

COMPRESSORS: dict[str, type[Compressor]] = {
    "none": NoCompression,
    "fp16": FP16Compression,
    "bf16": BF16Compression,
    "int8": Int8Quantization,
    "topk": TopK,
    "powersgd": PowerSGD,
    "sign": Sign,
    "demo": DeMo,
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
    "Int8Config",
    "Int8Quantization",
    "NoCompression",
    "PowerSGD",
    "PowerSGDConfig",
    "Round",
    "Sign",
    "SignConfig",
    "TopK",
    "TopKConfig",
    "all_to_all_bytes",
    "allgather_bytes",
    "make_compressor",
    "reference_bytes",
    "ring_allreduce_bytes",
    "simulate",
]
