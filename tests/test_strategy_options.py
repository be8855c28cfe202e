"""Strategy argument checks and registered names: every error is raised before any process starts,
so nothing here needs one (DDP, Compressed, Horovod and HorovodAdasum, and the missing-horovod error)."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist import DDP, Compressed, Elastic, ElasticDiLoCo, Horovod, HorovodAdasum
from lightning_dist.compression import COMPRESSORS, PowerSGD


# -- DDP ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"process_group_backend": "tcp"},
            r"process_group_backend='tcp'.*accepted: None, 'gloo', 'nccl', 'mpi'",
        ),
        ({"bucket_cap_mb": 0}, r"bucket_cap_mb=0 must be a number > 0"),
        ({"bucket_cap_mb": -5.0}, r"bucket_cap_mb=-5.0 must be a number > 0"),
        ({"bucket_size": 25}, r"unknown option\(s\) bucket_size; accepted: .*bucket_cap_mb"),
        ({"reduce_op": "median"}, r"reduce_op='median'.*accepted: 'avg', 'sum', 'adasum'"),
        ({"start_method": "thread"}, r"start_method='thread'.*accepted: 'auto', 'popen'"),
    ],
)
def test_bad_arguments_raise_before_any_process_starts(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        DDP(**kwargs)


def test_registered_names_resolve_to_ddp() -> None:
    for name in ("ld_ddp", "ld_ddp_spawn", "ld_ddp_fork", "ld_ddp_notebook", "ld_ddp_adasum"):
        assert StrategyRegistry[name]["strategy"] is DDP
    assert StrategyRegistry["ld_ddp_adasum"]["init_params"]["reduce_op"] == "adasum"


# -- Compressed -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "kwargs", "pattern"),
    [
        (
            ("bogus",),
            {},
            r"compressor='bogus' is not known; accepted: none, fp16, bf16, int8, topk, powersgd",
        ),
        (("powersgd",), {"rank": 0}, r"powersgd: rank=0 must be an integer >= 1"),
        (("topk",), {"ratio": 1.5}, r"topk: ratio=1.5 must be in \(0, 1\]"),
        (("topk",), {"ratio": 0.0}, r"topk: ratio=0.0 must be in \(0, 1\]"),
        (("powersgd",), {"rnk": 4}, r"unknown option 'rnk'; accepted: rank, .*; strategy options: reduce_op"),
        (
            ("topk",),
            {"reduce_op": "adasum"},
            r"reduce_op='adasum' .* compressors that allow it: none, fp16, bf16",
        ),
        (("fp16",), {"reduce_op": "max"}, r"reduce_op='max' is not supported; accepted: 'avg', 'adasum'"),
        ((PowerSGD(),), {"rank": 2}, r"unknown option\(s\) rank; a Compressor instance takes its options"),
        (("fp16",), {"bucket_cap_mb": 0}, r"bucket_cap_mb=0 must be a number > 0"),
        (("fp16",), {"log_stats": "yes"}, r"log_stats='yes' is not supported; accepted: True, False"),
    ],
)
def test_bad_options_raise_before_any_process(args: tuple, kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        Compressed(*args, **kwargs)


def test_names_instances_and_registry() -> None:
    by_name = Compressed("powersgd", rank=4, bucket_cap_mb=2)
    instance = PowerSGD(rank=4)
    by_object = Compressed(instance)
    assert by_name.compressor.config == by_object.compressor.config and by_object.compressor is instance
    assert by_name.reduce_op == "avg" and Compressed("bf16", reduce_op="adasum").reduce_op == "adasum"
    for name in COMPRESSORS:
        entry = StrategyRegistry[f"ld_compressed_{name}"]
        assert entry["strategy"] is Compressed and entry["init_params"] == {"compressor": name}


# -- Horovod --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cls", "kwargs", "pattern"),
    [
        (
            Horovod,
            {"op": "median"},
            r"op='median' is not supported; accepted: 'avg', 'sum' \(also 'mean' or 'average' for 'avg'; "
            r"'add' for 'sum'; torch.distributed.ReduceOp.AVG/SUM\)$",
        ),
        (Horovod, {"compression": "int4"}, r"compression='int4'.*accepted: None, 'none', 'fp16', 'bf16'"),
        (Horovod, {"lr_scale": 0}, r"lr_scale=0; accepted: 'auto' or a number > 0"),
        (Horovod, {"fusion_mb": 64}, r"unknown option\(s\) fusion_mb; accepted: op, compression, lr_scale"),
        (HorovodAdasum, {"compression": "fp16"}, r"compression='fp16' is not supported with op='adasum'"),
        (HorovodAdasum, {"compression": "bf16"}, r"compression='bf16' is not supported with op='adasum'"),
        (HorovodAdasum, {"lr_scale": 0}, r"lr_scale=0; accepted: 'auto' or a number > 0"),
        (
            HorovodAdasum,
            {"fusion_mb": 64},
            r"HorovodAdasum got unknown option\(s\) fusion_mb; accepted: op, compression",
        ),
    ],
)
def test_bad_horovod_arguments(cls: type, kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        cls(**kwargs)


@pytest.mark.parametrize("kwargs", [{"op": "adasum"}, {"op": "adasum", "compression": "fp16"}])
def test_horovod_op_adasum_points_to_horovod_adasum(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=r"op='adasum' is not supported by Horovod .* use HorovodAdasum\(\)"):
        Horovod(**kwargs)
    with pytest.raises(ValueError, match=r"op='adasum'"):
        Horovod("adasum")


def test_one_op_vocabulary_for_ddp_and_horovod() -> None:
    """Every spelling of an op (collectives.ops) means the same op for DDP, Compressed and Horovod."""
    from torch.distributed import ReduceOp

    for average in ("avg", "average", "mean", "AVG", "Mean", ReduceOp.AVG, None):
        assert (
            DDP(reduce_op=average).reduce_op == "avg"
            and Compressed("fp16", reduce_op=average).reduce_op == "avg"
        )
        if average is not None:
            assert Horovod(op=average).op == "average", "Horovod keeps its own word for it"
    for total in ("sum", "add", "SUM", ReduceOp.SUM):
        assert DDP(reduce_op=total).reduce_op == "sum" and Horovod(op=total).op == "sum"
    assert DDP(reduce_op="Adasum").reduce_op == "adasum" and HorovodAdasum(op="ADASUM").op == "adasum"
    with pytest.raises(ValueError, match=r"op='Adasum' is not supported by Horovod .* use HorovodAdasum\(\)"):
        Horovod(op="Adasum")
    with pytest.raises(
        ValueError, match=r"reduce_op=<RedOpType.MAX: 4> is not supported; accepted: 'avg', 'sum'"
    ):
        DDP(reduce_op=ReduceOp.MAX)


def test_each_constructor_takes_its_option_dataclasses_fields_with_their_defaults() -> None:
    """The option dataclasses (strategies/options_training.py and options_resilience.py) and the
    constructors' keyword arguments (what IDEs and LightningCLI read) name the same options with the
    same defaults."""
    import dataclasses
    import inspect

    from lightning_dist import DiLoCo
    from lightning_dist.strategies import options_resilience, options_training

    def params(init: Any) -> dict[str, Any]:
        return {
            n: p.default
            for n, p in inspect.signature(init).parameters.items()
            if n not in ("self", "unknown")
        }

    def defaults(*groups: type) -> dict[str, Any]:
        return {f.name: f.default for g in groups for f in dataclasses.fields(g)}

    assert params(DDP.__init__) == defaults(
        options_training.LaunchOptions, options_training.DDPOptions, options_training.SharesOptions
    )
    assert list(params(DDP.__init__)) == DDP._accepted_options()
    assert params(DiLoCo.__init__) == defaults(
        options_training.DiLoCoOptions, options_training.LaunchOptions, options_training.SharesOptions
    )
    assert list(params(DiLoCo.__init__)) == DiLoCo._accepted_options()
    assert params(Horovod.__init__) == defaults(options_training.HorovodOptions)
    assert params(HorovodAdasum.__init__) == {**defaults(options_training.HorovodOptions), "op": "adasum"}
    # the elastic options reach ElasticMixin as one ElasticOptions (``_init_elastic``), built from these
    for elastic in (Elastic, ElasticDiLoCo):
        for name, field in defaults(options_resilience.ElasticOptions).items():
            assert inspect.signature(elastic.__init__).parameters[name].default == field, (elastic, name)


def test_horovod_strategies_are_siblings_on_one_base() -> None:
    from lightning_dist.strategies.horovod_base import HorovodBase

    adasum, average = HorovodAdasum(), Horovod()
    assert isinstance(adasum, HorovodBase) and isinstance(average, HorovodBase)
    assert not isinstance(adasum, Horovod) and not issubclass(Horovod, HorovodAdasum)
    assert "__new__" not in vars(Horovod) and "__new__" not in vars(HorovodAdasum)
    assert (adasum.op, average.op, Horovod(op="sum").op) == ("adasum", "average", "sum")
    assert (
        HorovodAdasum(lr_scale=2.0).lr_scale_factor() == 2.0
        and Horovod(lr_scale=0.5).lr_scale_factor() == 0.5
    )


def test_compression_takes_allreduce_compressors_only() -> None:
    from lightning_dist.compression import BF16Compression, TopK

    assert isinstance(Horovod(compression="bf16").compressor, BF16Compression)
    assert Horovod(compression="none").compressor is None
    instance = BF16Compression()
    assert Horovod(compression=instance).compressor is instance
    with pytest.raises(
        ValueError,
        match=r"Horovod needs an all-reduce compressor; accepted: None, 'none', 'fp16', 'bf16', 'powersgd'",
    ):
        Horovod(compression=TopK(ratio=0.1))


def test_horovod_adasum_rejects_other_ops() -> None:
    with pytest.raises(ValueError, match="HorovodAdasum always uses 'adasum'"):
        HorovodAdasum(op="average")


def test_missing_horovod_points_to_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "horovod", None)
    monkeypatch.setitem(sys.modules, "horovod.torch", None)
    strategy = Horovod()
    with pytest.raises(
        ImportError,
        match=r"`lightning-dist install-horovod`.*needs a C\+\+ compiler and cmake, plus MPI for Adasum",
    ):
        _ = strategy.world_size


def test_registered_horovod_names() -> None:
    assert StrategyRegistry["ld_horovod"]["strategy"] is Horovod
    assert StrategyRegistry["ld_horovod_adasum"]["strategy"] is HorovodAdasum
    assert StrategyRegistry["ld_horovod_fp16"]["init_params"] == {"compression": "fp16"}
    assert StrategyRegistry["ld_horovod_bf16"]["init_params"] == {"compression": "bf16"}


@pytest.mark.parametrize("method", ["reduce", "all_gather"])
def test_collectives_refuse_a_process_group_they_cannot_honour(method: str) -> None:
    for strategy in (DDP(), Horovod()):
        with pytest.raises(
            ValueError, match=rf"{method}\(group=.*\) is not supported: .*accepted: group=None"
        ):
            getattr(strategy, method)(torch.ones(2), group=object())


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"commit_every": 0}, r"commit_every=0 must be an integer >= 1"),
        ({"keep": 0}, r"keep=0 must be an integer >= 1"),
        ({"on_indivisible": "guess"}, r"on_indivisible='guess' is not supported; accepted: 'keep_per_rank'"),
        ({"dirpath": 3}, r"dirpath=3 is not supported; accepted: None, a str or a path"),
        ({"compression": "zip"}, r"compressor='zip' is not known; accepted: none, fp16"),
        ({"reduce_op": "max"}, r"reduce_op='max' is not supported; accepted: 'avg', 'adasum'"),
        ({"commit_evry": 5}, r"unknown option.*commit_evry"),
    ],
)
def test_bad_elastic_arguments(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        Elastic(**kwargs)


def test_elastic_defaults_and_registered_name() -> None:
    strategy = Elastic()
    assert strategy.compressor.name == "none" and strategy.nonfinite is not None, (
        "skip_nonfinite on by default"
    )
    assert StrategyRegistry["ld_elastic"]["strategy"] is Elastic
