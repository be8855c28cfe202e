"""Lightning strategies; each registers its names in Lightning's StrategyRegistry on import."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist.strategies.ddp import DDP

DDP.register_strategies(StrategyRegistry)

__all__ = ["DDP"]
