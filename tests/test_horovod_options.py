"""Horovod strategy argument checks and the missing-horovod error (no processes needed)."""

from __future__ import annotations

import sys

import pytest

from lightning_dist import Horovod, HorovodAdasum


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"op": "mean"}, r"op='mean' is not supported; accepted: 'average', 'sum', 'adasum'"),
        ({"compression": "int4"}, r"compression='int4'.*accepted: None, 'none', 'fp16', 'bf16'"),
        ({"lr_scale": 0}, r"lr_scale=0; accepted: 'auto' or a number > 0"),
        ({"fusion_mb": 64}, r"unknown option\(s\) fusion_mb; accepted: op, compression, lr_scale"),
        ({"op": "adasum", "compression": "fp16"}, r"compression='fp16' is not supported with op='adasum'"),
        ({"op": "adasum", "compression": "bf16"}, r"compression='bf16' is not supported with op='adasum'"),
    ],
)
def test_bad_horovod_arguments(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        Horovod(**kwargs)


def test_compression_takes_allreduce_compressors_only() -> None:
    from lightning_dist.compression import BF16Compression, TopK

    assert isinstance(Horovod(compression="bf16").compressor, BF16Compression)
    assert Horovod(compression="none").compressor is None
    instance = BF16Compression()
    assert Horovod(compression=instance).compressor is instance
    with pytest.raises(
        ValueError, match=r"Horovod needs an all-reduce compressor; accepted: none, fp16, bf16"
    ):
        Horovod(compression=TopK(ratio=0.1))


def test_horovod_adasum_rejects_other_ops() -> None:
    with pytest.raises(ValueError, match="HorovodAdasum always uses 'adasum'"):
        HorovodAdasum(op="average")


def test_missing_horovod_points_to_install_script(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "horovod", None)
    monkeypatch.setitem(sys.modules, "horovod.torch", None)
    strategy = Horovod()
    with pytest.raises(ImportError, match=r"scripts/install-horovod.sh"):
        _ = strategy.world_size


def test_registered_names() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["horovod"]["strategy"] is Horovod
    assert StrategyRegistry["horovod_adasum"]["strategy"] is HorovodAdasum
    assert StrategyRegistry["horovod_fp16"]["init_params"] == {"compression": "fp16"}
    assert StrategyRegistry["horovod_bf16"]["init_params"] == {"compression": "bf16"}
